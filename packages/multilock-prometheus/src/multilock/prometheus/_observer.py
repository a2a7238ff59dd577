"""`PrometheusObserver`: every election of the process, as Prometheus metrics per group.

The observer is registered process-wide with `multilock.core.add_observer`, so every
election reports to it without being wired one by one. Its methods run on the
elections' event loops (possibly several, in several threads with the sync facade):
they only touch prometheus_client's in-memory, lock-protected values, and never block.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from multilock.core import ElectionObserver, add_observer, remove_observer

if TYPE_CHECKING:
    from multilock.core import LeaderElection, Leadership

__all__ = ["PrometheusObserver", "instrument"]

log = logging.getLogger(__name__)

#: Renew latency: a store on the same host answers in well under a millisecond, and a
#: renew is bounded by the renew interval (a few seconds with the default lease).
RENEW_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Failover, from noticing the group vacant to winning it: a store round trip or two,
#: seconds while the store fails and campaign rounds are retried.
FAILOVER_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 45.0, 60.0,
)  # fmt: skip

# One observer per (registry, namespace): registering the same metric names twice in one
# registry is prometheus_client's "Duplicated timeseries" error.
_lock = threading.Lock()
_instrumented: dict[tuple[CollectorRegistry, str], PrometheusObserver] = {}


def instrument(
    registry: CollectorRegistry | None = None, *, namespace: str = "multilock"
) -> PrometheusObserver:
    """Report every election of this process to *registry* (default: the global one).

    Idempotent: another call with the same registry and namespace returns the observer
    already in place. ``observer.close()`` undoes it.
    """
    registry = REGISTRY if registry is None else registry
    with _lock:
        observer = _instrumented.get((registry, namespace))
        if observer is None:
            observer = PrometheusObserver(registry, namespace)
            _instrumented[(registry, namespace)] = observer
            add_observer(observer)
            log.debug("multilock metrics registered as %s_*", namespace)
    return observer


class PrometheusObserver(ElectionObserver):
    """Keeps the ``<namespace>_*`` metrics of every election, labelled by group only.

    Made by `instrument`, which also registers it; ``close()`` removes it. Participant
    ids are not a label: each process start makes a new one, so they would grow the
    series without bound.
    """

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self._registry, self._namespace = registry, namespace
        self._closed = False
        # Elections of this process leading each group. Two elections of one group in
        # one process hand over between themselves: the gauge is 1 while either leads.
        self._leaders: dict[str, set[LeaderElection]] = {}
        self._leaders_lock = threading.Lock()
        labels = ("group",)
        self._is_leader = Gauge(
            "is_leader",
            "1 while an election of this process leads the group, else 0.",
            labels,
            namespace=namespace,
            registry=registry,
        )
        self._terms_won = Counter(
            "terms_won",
            "Terms won by this process's elections.",
            labels,
            namespace=namespace,
            registry=registry,
        )
        self._renew_failures = Counter(
            "renew_failures",
            "Renews that raised, timed out or were refused.",
            labels,
            namespace=namespace,
            registry=registry,
        )
        self._campaign_failures = Counter(
            "campaign_failures",
            "Campaign rounds that could not reach the store.",
            labels,
            namespace=namespace,
            registry=registry,
        )
        self._renew_latency = Histogram(
            "renew_latency_seconds",
            "Seconds taken by successful renews.",
            labels,
            namespace=namespace,
            registry=registry,
            buckets=RENEW_BUCKETS,
        )
        self._failover = Histogram(
            "failover_seconds",
            "Seconds from seeing the group without a live leader to winning it.",
            labels,
            namespace=namespace,
            registry=registry,
            buckets=FAILOVER_BUCKETS,
        )
        self._metrics = (
            self._is_leader,
            self._terms_won,
            self._renew_failures,
            self._campaign_failures,
            self._renew_latency,
            self._failover,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<PrometheusObserver namespace={self._namespace!r} {state}>"

    def close(self) -> None:
        """Stop observing and unregister the metrics from the registry. Idempotent.

        A later `instrument` with the same registry makes a new observer, counting from 0.
        """
        remove_observer(self)
        with _lock:
            if self._closed:
                return
            self._closed = True
            if _instrumented.get((self._registry, self._namespace)) is self:
                del _instrumented[(self._registry, self._namespace)]
            for metric in self._metrics:
                self._registry.unregister(metric)

    # ------------------------------------------------------------------ the hook
    def started(self, election: LeaderElection) -> None:
        group = election.group
        for metric in self._metrics:
            metric.labels(group)  # every series exists, at 0, from the start
        self._set_leading(election, False)

    def stopped(self, election: LeaderElection) -> None:
        self._set_leading(election, False)

    def acquired(
        self, election: LeaderElection, leadership: Leadership, failover: float | None
    ) -> None:
        self._terms_won.labels(election.group).inc()
        if failover is not None:
            self._failover.labels(election.group).observe(failover)
        self._set_leading(election, True)

    def lost(self, election: LeaderElection, token: int, reason: str) -> None:
        self._set_leading(election, False)

    def renewed(self, election: LeaderElection, latency: float) -> None:
        self._renew_latency.labels(election.group).observe(latency)
        # Only a leader renews: this also counts a term that began before instrument().
        self._set_leading(election, True)

    def renew_failed(self, election: LeaderElection, error: BaseException | None) -> None:
        self._renew_failures.labels(election.group).inc()

    def campaign_failed(self, election: LeaderElection, error: BaseException) -> None:
        self._campaign_failures.labels(election.group).inc()

    def _set_leading(self, election: LeaderElection, leading: bool) -> None:
        group = election.group
        with self._leaders_lock:  # the count and the gauge change together
            leaders = self._leaders.setdefault(group, set())
            if leading:
                leaders.add(election)
            else:
                leaders.discard(election)
            self._is_leader.labels(group).set(1 if leaders else 0)
