"""multilock.opentelemetry: OpenTelemetry metrics for every leader election of the process.

    import multilock.opentelemetry

    multilock.opentelemetry.instrument()    # the global MeterProvider; idempotent

Meter ``multilock``: ``multilock.leader`` (an UpDownCounter, 1 while this process leads
the group), ``multilock.terms``, ``multilock.renew.failures``,
``multilock.campaign.failures``, and the histograms ``multilock.renew.duration`` and
``multilock.failover.duration`` in seconds; every measurement carries ``multilock.group``.
"""

from ._observer import OpenTelemetryObserver, instrument

__all__ = ["OpenTelemetryObserver", "instrument"]
