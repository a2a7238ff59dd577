"""The OpenTelemetry observer over real elections on the in-memory store, in virtual time.

Measurements are read back with the SDK's `InMemoryMetricReader`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, Sum

import multilock.opentelemetry
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


class Metrics:
    """A meter provider read by an in-memory reader, instrumented for the test."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        self.observer = multilock.opentelemetry.instrument(self.provider)

    def points(self, group: str = "g") -> dict[str, Any]:
        """Each instrument's data point for *group*, by instrument name."""
        found: dict[str, Any] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                assert scope.scope.name == "multilock"
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        if point.attributes == {"multilock.group": group}:
                            found[metric.name] = point
        return found

    def value(self, name: str, group: str = "g") -> Any:
        point = self.points(group).get(name)
        if point is None:
            return None
        return point.count if isinstance(point, HistogramDataPoint) else point.value

    def close(self) -> None:
        self.observer.close()
        self.provider.shutdown()


@pytest.fixture
def otel() -> Iterator[Metrics]:
    otel = Metrics()
    yield otel
    otel.close()


class LeaderChecker(ElectionObserver):
    """Added after the metrics observer, so it sees multilock.leader right after each change."""

    def __init__(self, otel: Metrics, elections: list[LeaderElection]) -> None:
        self.otel, self.elections = otel, elections
        self.seen: list[tuple[str, Any, int]] = []

    def _check(self, what: str, election: LeaderElection) -> None:
        expected = int(any(e.is_leader for e in self.elections if e.group == election.group))
        value = self.otel.value("multilock.leader", election.group)
        self.seen.append((f"{what} {election.participant_id}", value, expected))

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
        assert not wrong, f"multilock.leader != expected at {wrong} (all: {self.seen})"


def election(store: InMemoryProvider, name: str, group: str = "g") -> LeaderElection:
    return LeaderElection(store, group=group, participant_id=name, lease_duration=LEASE)


def test_instruments_follow_the_term_through_handoffs(otel: Metrics) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        a, b = election(store, "a"), election(store, "b")
        checker = LeaderChecker(otel, [a, b])
        add_observer(checker)
        try:
            await a.start()
            await a.wait_until_leader()
            await b.start()
            await asyncio.sleep(LEASE)
            assert otel.value("multilock.leader") == 1
            assert otel.value("multilock.terms") == 1
            assert otel.value("multilock.renew.failures") == 0
            assert otel.value("multilock.campaign.failures") == 0
            assert otel.value("multilock.renew.duration") == a.statistics().renewals
            assert otel.value("multilock.failover.duration") is None  # a's first term

            await a.resign()  # b was told of the release: a failover
            await b.wait_until_leader()
            assert otel.value("multilock.terms") == 2
            failover = otel.points()["multilock.failover.duration"]
            assert failover.count == 1
            assert failover.sum < 0.1

            await b.stop()  # the release hands the group back to a
            await a.wait_until_leader()
            assert otel.value("multilock.terms") == 3
            assert otel.value("multilock.failover.duration") == 2
            assert otel.value("multilock.leader") == 1

            await a.stop()
            assert otel.value("multilock.leader") == 0
        finally:
            remove_observer(checker)
            await a.stop()
            await b.stop()
        checker.assert_ok()
        kinds = [s[0] for s in checker.seen]
        assert kinds[:5] == ["started a", "acquired a", "started b", "lost a", "acquired b"], kinds

    clock.run(main())


def test_instrument_shapes(otel: Metrics) -> None:
    clock = FakeClock()

    async def main() -> None:
        async with election(FlakyProvider(clock), "a") as a:
            await a.wait_until_leader()
            await asyncio.sleep(LEASE)

    clock.run(main())
    data = otel.reader.get_metrics_data()
    assert data is not None
    (scope,) = data.resource_metrics[0].scope_metrics
    assert scope.scope.version == "0.1.0"
    shapes = {m.name: (type(m.data).__name__, m.unit) for m in scope.metrics}
    assert shapes == {
        "multilock.leader": ("Sum", "{leader}"),
        "multilock.terms": ("Sum", "{term}"),
        "multilock.renew.failures": ("Sum", "{renew}"),
        "multilock.campaign.failures": ("Sum", "{round}"),
        "multilock.renew.duration": ("Histogram", "s"),
    }
    monotonic = {m.name: m.data.is_monotonic for m in scope.metrics if isinstance(m.data, Sum)}
    assert monotonic == {
        "multilock.leader": False,
        "multilock.terms": True,
        "multilock.renew.failures": True,
        "multilock.campaign.failures": True,
    }
    assert all(m.description for m in scope.metrics)
    renew = otel.points()["multilock.renew.duration"]
    assert renew.explicit_bounds[0] == 0.0005  # the advised buckets, in seconds
    assert renew.explicit_bounds[-1] == 5.0


def test_renew_duration_is_recorded(otel: Metrics) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        store.renew_delay = 0.003
        async with election(store, "a") as a:
            await a.wait_until_leader()
            await asyncio.sleep(LEASE * 3)
            renewals = a.statistics().renewals
            assert renewals >= 8
            point = otel.points()["multilock.renew.duration"]
            assert point.count == renewals
            assert point.sum == pytest.approx(0.003 * renewals)
            assert point.min == pytest.approx(0.003)

    clock.run(main())


def test_renew_failures_are_counted_and_end_the_term(otel: Metrics) -> None:
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
            assert otel.value("multilock.renew.failures") == failures
            assert otel.value("multilock.leader") == 0

    clock.run(main())


def test_campaign_failures_are_counted(otel: Metrics) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = FlakyProvider(clock)
        store.fail_acquire = True
        async with election(store, "a") as a:
            await asyncio.sleep(LEASE)
            failures = a.statistics().acquire_failures
            assert failures >= 2
            assert otel.value("multilock.campaign.failures") == failures
            assert otel.value("multilock.leader") == 0
            store.fail_acquire = False
            await a.wait_until_leader()
            assert otel.value("multilock.leader") == 1

    clock.run(main())


def test_a_term_begun_before_instrument_is_counted_at_its_next_renew() -> None:
    clock = FakeClock()

    async def main() -> None:
        async with election(FlakyProvider(clock), "a") as a:
            await a.wait_until_leader()
            otel = Metrics()
            try:
                await asyncio.sleep(LEASE)
                assert otel.value("multilock.leader") == 1
                await a.stop()  # LOST, then stopped: every -1 matches a +1
                assert otel.value("multilock.leader") == 0
            finally:
                otel.close()

    clock.run(main())


def test_instrument_is_idempotent_per_provider_and_close_removes_it() -> None:
    clock = FakeClock()
    otel = Metrics()
    try:
        assert multilock.opentelemetry.instrument(otel.provider) is otel.observer
        other = Metrics()
        assert other.observer is not otel.observer
        other.close()
        otel.observer.close()
        otel.observer.close()  # idempotent
        assert "closed" in repr(otel.observer)

        async def main() -> None:
            async with election(FlakyProvider(clock), "a") as a:
                await a.wait_until_leader()

        clock.run(main())
        assert otel.points() == {}  # nothing recorded after close()

        again = multilock.opentelemetry.instrument(otel.provider)
        assert again is not otel.observer
        again.close()
    finally:
        otel.provider.shutdown()


def test_default_meter_provider() -> None:
    observer = multilock.opentelemetry.instrument()
    try:
        assert multilock.opentelemetry.instrument(metrics.get_meter_provider()) is observer
    finally:
        observer.close()


def test_a_failing_instrument_never_breaks_the_election(
    otel: Metrics, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("histogram broken in this test")

    monkeypatch.setattr(otel.observer._renew_duration, "record", broken)
    clock = FakeClock()

    async def main() -> None:
        async with election(FlakyProvider(clock), "a") as a:
            await a.wait_until_leader()
            await asyncio.sleep(LEASE * 2)
            assert a.is_leader
            assert a.statistics().renewals >= 5
            assert otel.value("multilock.leader") == 1

    with caplog.at_level(logging.ERROR, logger="multilock.core"):
        clock.run(main())
    assert "histogram broken in this test" in caplog.text
