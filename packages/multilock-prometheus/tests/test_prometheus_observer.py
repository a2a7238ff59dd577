"""The Prometheus observer over real elections on the in-memory store, in virtual time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Histogram

import multilock.prometheus
from multilock.core import (
    ElectionObserver,
    InMemoryProvider,
    LeaderElection,
    ProviderError,
    add_observer,
    remove_observer,
)
from multilock.core.testing import FakeClock

LEASE = 10.0


class FlakyProvider(InMemoryProvider):
    """An in-memory store whose renews and acquires fail or take time when told to."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock=clock.monotonic)
        self.fail_renew = False
        self.fail_acquire = False
        self.renew_delay = 0.0

    async def renew(self, *args: Any, **kwargs: Any) -> bool:
        if self.fail_renew:
            raise ProviderError("renew fails in this test")
        await asyncio.sleep(self.renew_delay)
        return await super().renew(*args, **kwargs)

    async def try_acquire(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail_acquire:
            raise ProviderError("acquire fails in this test")
        return await super().try_acquire(*args, **kwargs)


class GaugeChecker(ElectionObserver):
    """Added after the metrics observer, so it sees the gauge right after each change."""

    def __init__(self, registry: CollectorRegistry, elections: list[LeaderElection]) -> None:
        self.registry, self.elections = registry, elections
        self.seen: list[tuple[str, float | None, int]] = []

    def _check(self, what: str, election: LeaderElection) -> None:
        expected = int(any(e.is_leader for e in self.elections if e.group == election.group))
        gauge = self.registry.get_sample_value("multilock_is_leader", {"group": election.group})
        self.seen.append((f"{what} {election.participant_id}", gauge, expected))

    def started(self, election: LeaderElection) -> None:
        self._check("started", election)

    def acquired(self, election: LeaderElection, leadership: Any, failover: Any) -> None:
        self._check("acquired", election)

    def lost(self, election: LeaderElection, token: int, reason: str) -> None:
        self._check("lost", election)

    def stopped(self, election: LeaderElection) -> None:
        self._check("stopped", election)

    def assert_ok(self) -> None:
        assert self.seen, "no transition was observed"
        wrong = [s for s in self.seen if s[1] != s[2]]
        assert not wrong, f"gauge != expected at {wrong} (all: {self.seen})"


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A fresh registry, instrumented; the observer is removed afterwards."""
    registry = CollectorRegistry()
    observer = multilock.prometheus.instrument(registry)
    yield registry
    observer.close()


def value(registry: CollectorRegistry, name: str, group: str = "g", **labels: str) -> float | None:
    return registry.get_sample_value(name, {"group": group, **labels})


def values(registry: CollectorRegistry, group: str = "g") -> Mapping[str, float | None]:
    names = (
        "is_leader",
        "terms_won_total",
        "renew_failures_total",
        "campaign_failures_total",
        "renew_latency_seconds_count",
        "failover_seconds_count",
    )
    return {name: value(registry, f"multilock_{name}", group) for name in names}


def election(store: InMemoryProvider, name: str, group: str = "g") -> LeaderElection:
    return LeaderElection(store, group=group, participant_id=name, lease_duration=LEASE)


def test_gauge_follows_the_term_through_handoffs(registry: CollectorRegistry) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        a, b = election(store, "a"), election(store, "b")
        checker = GaugeChecker(registry, [a, b])
        add_observer(checker)
        try:
            await a.start()
            assert values(registry)["is_leader"] == 0  # set on started, before any term
            await a.wait_until_leader()
            await b.start()
            assert values(registry)["is_leader"] == 1  # b's start does not hide a's term
            await asyncio.sleep(LEASE)
            assert values(registry) == {
                "is_leader": 1,
                "terms_won_total": 1,
                "renew_failures_total": 0,
                "campaign_failures_total": 0,
                "renew_latency_seconds_count": a.statistics().renewals,
                "failover_seconds_count": 0,  # a's first term: it never saw the group vacant
            }

            await a.resign()  # b was told of the release: a failover
            await b.wait_until_leader()
            assert values(registry)["terms_won_total"] == 2
            assert values(registry)["failover_seconds_count"] == 1
            assert (value(registry, "multilock_failover_seconds_sum") or 1.0) < 0.1

            await b.stop()  # the release hands the group back to a
            await a.wait_until_leader()
            assert values(registry)["terms_won_total"] == 3
            assert values(registry)["failover_seconds_count"] == 2
            assert values(registry)["is_leader"] == 1

            await a.stop()
            assert values(registry)["is_leader"] == 0
        finally:
            remove_observer(checker)
            await a.stop()
            await b.stop()
        checker.assert_ok()
        kinds = [s[0] for s in checker.seen]
        assert kinds[:5] == ["started a", "acquired a", "started b", "lost a", "acquired b"], kinds

    clock.run(main())


def test_groups_are_apart(registry: CollectorRegistry) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        async with election(store, "a", "one") as a, election(store, "b", "two") as b:
            await a.wait_until_leader()
            await b.wait_until_leader()
            await a.stop()
            assert value(registry, "multilock_is_leader", "one") == 0
            assert value(registry, "multilock_is_leader", "two") == 1

    clock.run(main())


def test_renew_latency_is_observed(registry: CollectorRegistry) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        store.renew_delay = 0.003
        async with election(store, "a") as a:
            await a.wait_until_leader()
            await asyncio.sleep(LEASE * 3)
            renewals = a.statistics().renewals
            assert renewals >= 8
            name = "multilock_renew_latency_seconds"
            assert value(registry, f"{name}_count") == renewals
            assert value(registry, f"{name}_sum") == pytest.approx(0.003 * renewals)
            assert value(registry, f"{name}_bucket", le="0.0025") == 0
            assert value(registry, f"{name}_bucket", le="0.005") == renewals

    clock.run(main())


def test_renew_failures_are_counted_and_end_the_gauge(registry: CollectorRegistry) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        async with election(store, "a") as a:
            await a.wait_until_leader()
            store.fail_renew = True
            while a.is_leader:
                await asyncio.sleep(0.05)
            failures = a.statistics().renew_failures
            assert failures >= 2
            assert values(registry)["renew_failures_total"] == failures
            assert values(registry)["is_leader"] == 0

    clock.run(main())


def test_campaign_failures_are_counted(registry: CollectorRegistry) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        store.fail_acquire = True
        async with election(store, "a") as a:
            await asyncio.sleep(LEASE)
            failures = a.statistics().acquire_failures
            assert failures >= 2
            assert values(registry)["campaign_failures_total"] == failures
            assert values(registry)["is_leader"] == 0
            store.fail_acquire = False
            await a.wait_until_leader()
            assert values(registry)["is_leader"] == 1

    clock.run(main())


def test_a_term_begun_before_instrument_is_counted_at_its_next_renew() -> None:
    clock = FakeClock()
    registry = CollectorRegistry()

    async def main() -> None:
        store = FlakyProvider(clock)
        async with election(store, "a") as a:
            await a.wait_until_leader()
            observer = multilock.prometheus.instrument(registry)
            try:
                await asyncio.sleep(LEASE)
                assert values(registry)["is_leader"] == 1
                await a.stop()  # LOST, then stopped: never below 0
                assert values(registry)["is_leader"] == 0
            finally:
                observer.close()

    clock.run(main())


def test_instrument_is_idempotent_per_registry_and_close_removes_it() -> None:
    clock = FakeClock()
    registry, other = CollectorRegistry(), CollectorRegistry()
    first = multilock.prometheus.instrument(registry)
    try:
        assert multilock.prometheus.instrument(registry) is first  # no "Duplicated timeseries"
        assert multilock.prometheus.instrument(other) is not first
        renamed = multilock.prometheus.instrument(registry, namespace="jobs")
        assert renamed is not first
    finally:
        first.close()
        first.close()  # idempotent
    multilock.prometheus.instrument(other).close()

    async def main() -> None:
        async with election(FlakyProvider(clock), "a") as a:
            await a.wait_until_leader()
        assert value(registry, "jobs_terms_won_total") == 1  # still instrumented
        renamed.close()

    clock.run(main())
    assert registry.get_sample_value("multilock_terms_won_total", {"group": "g"}) is None
    assert registry.get_sample_value("jobs_terms_won_total", {"group": "g"}) is None
    assert list(registry.collect()) == []

    again = multilock.prometheus.instrument(registry)  # a fresh start after close()
    try:
        assert again is not first
        assert "open" in repr(again)
    finally:
        again.close()
    assert "closed" in repr(again)


def test_default_registry() -> None:
    observer = multilock.prometheus.instrument()
    try:
        assert multilock.prometheus.instrument(REGISTRY) is observer
        assert "multilock_is_leader" in REGISTRY._names_to_collectors
    finally:
        observer.close()
    assert "multilock_is_leader" not in REGISTRY._names_to_collectors


def test_a_failing_metric_never_breaks_the_election(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: Histogram, amount: float, exemplar: Any = None) -> None:
        raise RuntimeError("histogram broken in this test")

    monkeypatch.setattr(Histogram, "observe", broken)
    clock = FakeClock()

    async def main() -> None:
        async with election(FlakyProvider(clock), "a") as a:
            await a.wait_until_leader()
            await asyncio.sleep(LEASE * 2)
            assert a.is_leader
            assert a.statistics().renewals >= 5
            assert values(registry)["renew_latency_seconds_count"] == 0

    with caplog.at_level(logging.ERROR, logger="multilock.core"):
        clock.run(main())
    assert "histogram broken in this test" in caplog.text
