"""`OpenTelemetryObserver`: every election of the process, as OpenTelemetry metrics.

Only the OpenTelemetry *API* is used: the application chooses the SDK, its readers and
exporters (or none, and every call is a no-op). The observer is registered process-wide
with `multilock.core.add_observer`; its methods run on the elections' event loops and
only record into the SDK's in-memory aggregations, which never block.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opentelemetry import metrics

from multilock.core import ElectionObserver, add_observer, remove_observer

if TYPE_CHECKING:
    from multilock.core import LeaderElection, Leadership

__all__ = ["OpenTelemetryObserver", "instrument"]

log = logging.getLogger(__name__)

#: The attribute naming the group on every measurement. Participant ids are not an
#: attribute: each process start makes a new one, so they would grow the series unbounded.
GROUP = "multilock.group"
#: Advised bucket boundaries, in seconds (the SDK's default buckets suit milliseconds).
RENEW_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FAILOVER_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 45.0, 60.0,
)  # fmt: skip

# One observer per meter provider: a second one would count everything twice.
_lock = threading.Lock()
_instrumented: dict[metrics.MeterProvider, OpenTelemetryObserver] = {}


def instrument(meter_provider: metrics.MeterProvider | None = None) -> OpenTelemetryObserver:
    """Report every election of this process to *meter_provider* (default: the global one).

    Idempotent: another call with the same provider returns the observer already in
    place. ``observer.close()`` undoes it.
    """
    provider = metrics.get_meter_provider() if meter_provider is None else meter_provider
    with _lock:
        observer = _instrumented.get(provider)
        if observer is None:
            observer = OpenTelemetryObserver(provider)
            _instrumented[provider] = observer
            add_observer(observer)
            log.debug("multilock metrics reported to %r", provider)
    return observer


def _version() -> str:
    try:
        return importlib.metadata.version("multilock-opentelemetry")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0.0.0"


def _histogram(
    meter: metrics.Meter, name: str, description: str, buckets: Sequence[float]
) -> metrics.Histogram:
    try:
        return meter.create_histogram(
            name, unit="s", description=description, explicit_bucket_boundaries_advisory=buckets
        )
    except TypeError:  # opentelemetry-api < 1.30 takes no advice: configure a View instead
        return meter.create_histogram(name, unit="s", description=description)


class OpenTelemetryObserver(ElectionObserver):
    """Records the ``multilock.*`` instruments of every election, by ``multilock.group``.

    Made by `instrument`, which also registers it; ``close()`` removes it.
    """

    def __init__(self, meter_provider: metrics.MeterProvider) -> None:
        self._provider = meter_provider
        self._closed = False
        # Elections of this process counted in multilock.leader, so that every -1 matches
        # a +1 even when instrument() came in the middle of a term.
        self._leaders: set[LeaderElection] = set()
        self._leaders_lock = threading.Lock()
        meter = meter_provider.get_meter("multilock", _version())
        self._leader = meter.create_up_down_counter(
            "multilock.leader",
            unit="{leader}",
            description="Elections of this process leading the group: 1 while one leads, else 0.",
        )
        self._terms = meter.create_counter(
            "multilock.terms", unit="{term}", description="Terms won by this process's elections."
        )
        self._renew_failures = meter.create_counter(
            "multilock.renew.failures",
            unit="{renew}",
            description="Renews that raised, timed out or were refused.",
        )
        self._campaign_failures = meter.create_counter(
            "multilock.campaign.failures",
            unit="{round}",
            description="Campaign rounds that could not reach the store.",
        )
        self._renew_duration = _histogram(
            meter, "multilock.renew.duration", "Duration of successful renews.", RENEW_BUCKETS
        )
        self._failover_duration = _histogram(
            meter,
            "multilock.failover.duration",
            "Time from seeing the group without a live leader to winning it.",
            FAILOVER_BUCKETS,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<OpenTelemetryObserver {state}>"

    def close(self) -> None:
        """Stop recording. Idempotent.

        OpenTelemetry cannot remove instruments: the last values stay with the meter
        provider. A later `instrument` with the same provider makes a new observer.
        """
        remove_observer(self)
        with _lock:
            self._closed = True
            if _instrumented.get(self._provider) is self:
                del _instrumented[self._provider]

    # ------------------------------------------------------------------ the hook
    def started(self, election: LeaderElection) -> None:
        attributes = {GROUP: election.group}
        for counter in (self._leader, self._terms, self._renew_failures, self._campaign_failures):
            counter.add(0, attributes)  # every series exists, at 0, from the start

    def stopped(self, election: LeaderElection) -> None:
        self._set_leading(election, False)

    def acquired(
        self, election: LeaderElection, leadership: Leadership, failover: float | None
    ) -> None:
        attributes = {GROUP: election.group}
        self._terms.add(1, attributes)
        if failover is not None:
            self._failover_duration.record(failover, attributes)
        self._set_leading(election, True)

    def lost(self, election: LeaderElection, token: int, reason: str) -> None:
        self._set_leading(election, False)

    def renewed(self, election: LeaderElection, latency: float) -> None:
        self._renew_duration.record(latency, {GROUP: election.group})
        # Only a leader renews: this also counts a term that began before instrument().
        self._set_leading(election, True)

    def renew_failed(self, election: LeaderElection, error: BaseException | None) -> None:
        self._renew_failures.add(1, {GROUP: election.group})

    def campaign_failed(self, election: LeaderElection, error: BaseException) -> None:
        self._campaign_failures.add(1, {GROUP: election.group})

    def _set_leading(self, election: LeaderElection, leading: bool) -> None:
        with self._leaders_lock:
            if leading == (election in self._leaders):
                return
            if leading:
                self._leaders.add(election)
            else:
                self._leaders.discard(election)
        self._leader.add(1 if leading else -1, {GROUP: election.group})
