"""multilock.prometheus: Prometheus metrics for every leader election of the process.

    import prometheus_client
    import multilock.prometheus

    multilock.prometheus.instrument()       # the global registry; idempotent
    prometheus_client.start_http_server(9100)

``multilock_is_leader{group}`` is 1 while this process leads the group (like client-go's
``leader_election_master_status``); counters and histograms count terms, renew and
campaign failures, renew latency and failover time.
"""

from ._observer import PrometheusObserver, instrument

__all__ = ["PrometheusObserver", "instrument"]
