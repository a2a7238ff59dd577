"""Observers, health, structured and rate-limited logs, and graceful signals, in virtual time."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from multilock.core import (
    ElectionObserver,
    InMemoryProvider,
    LeaderElection,
    Leadership,
    add_observer,
    remove_observer,
    stop_on_signals,
)
from multilock.core import sync as msync
from multilock.core.testing import FakeClock, Fault, FaultyProvider

LEASE = 10.0
RENEW = LEASE / 3


class Recorder(ElectionObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def started(self, election: LeaderElection) -> None:
        self.calls.append(("started", election.participant_id))

    def stopped(self, election: LeaderElection) -> None:
        self.calls.append(("stopped", election.participant_id))

    def acquired(
        self, election: LeaderElection, leadership: Leadership, failover: float | None
    ) -> None:
        self.calls.append(("acquired", election.participant_id, leadership.token, failover))

    def lost(self, election: LeaderElection, token: int, reason: str) -> None:
        self.calls.append(("lost", election.participant_id, token, reason))

    def renewed(self, election: LeaderElection, latency: float) -> None:
        self.calls.append(("renewed", election.participant_id, latency))

    def renew_failed(self, election: LeaderElection, error: BaseException | None) -> None:
        self.calls.append(("renew_failed", election.participant_id, type(error).__name__))

    def campaign_failed(self, election: LeaderElection, error: BaseException) -> None:
        self.calls.append(("campaign_failed", election.participant_id))

    def kinds(self, who: str) -> list[str]:
        return [c[0] for c in self.calls if c[1] == who]


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    observer = Recorder()
    add_observer(observer)
    add_observer(observer)  # once, however often
    yield observer
    remove_observer(observer)


def test_observer_sees_terms_renewals_and_a_failover(recorder: Recorder) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        a = LeaderElection(store, group="g", participant_id="a", lease_duration=LEASE)
        b = LeaderElection(store, group="g", participant_id="b", lease_duration=LEASE)
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(LEASE + 0.5)
        await a.stop()  # releases: b is notified and takes over at once
        leadership = await b.wait_until_leader()
        await b.stop()
        assert leadership.token == 2

    clock.run(main())
    assert recorder.calls[0] == ("started", "a")
    acquired = [c for c in recorder.calls if c[0] == "acquired"]
    assert acquired[0][:4] == ("acquired", "a", 1, None)  # nobody seen vacant first
    assert acquired[1][:3] == ("acquired", "b", 2)
    assert acquired[1][3] is not None
    assert 0 <= acquired[1][3] < 0.1
    renewals = [c for c in recorder.calls if c[0] == "renewed" and c[1] == "a"]
    assert len(renewals) == 3  # a renews every LEASE/3 for one LEASE
    assert ("lost", "a", 1, "stopping") in recorder.calls
    assert recorder.kinds("a")[-1] == "stopped"


def test_observer_counts_failures_and_an_observer_that_raises_breaks_nothing(
    recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(ElectionObserver):
        def renewed(self, election: LeaderElection, latency: float) -> None:
            raise RuntimeError("observer bug")

    broken = Broken()
    add_observer(broken)
    clock = FakeClock()

    async def main() -> None:
        faulty = FaultyProvider(InMemoryProvider(clock=clock.monotonic))
        a = LeaderElection(faulty, group="g", participant_id="a", lease_duration=LEASE)
        await a.start()
        await a.wait_until_leader()
        await asyncio.sleep(RENEW * 1.5)  # one renew: the broken observer raises
        assert a.is_leader
        faulty.inject(Fault.RAISE)
        await asyncio.sleep(LEASE * 2)
        assert not a.is_leader
        await a.stop()

    try:
        clock.run(main())
    finally:
        remove_observer(broken)
    assert "observer bug" in caplog.text
    assert recorder.kinds("a").count("renew_failed") >= 2
    assert recorder.kinds("a").count("campaign_failed") >= 2
    lost = [c for c in recorder.calls if c[0] == "lost"]
    assert lost[0][3] == "deadline passed without a successful renew"


def test_add_observer_rejects_what_is_not_one() -> None:
    with pytest.raises(TypeError, match="ElectionObserver"):
        add_observer(object())  # type: ignore[arg-type]


def test_health_follows_the_election() -> None:
    clock = FakeClock()

    async def main() -> None:
        faulty = FaultyProvider(InMemoryProvider(clock=clock.monotonic))
        a = LeaderElection(
            faulty, group="g", participant_id="a", lease_duration=LEASE, renew_interval=2.0
        )
        b = LeaderElection(faulty.inner, group="g", participant_id="b", lease_duration=LEASE)
        assert not a.health().healthy
        assert a.health().detail == "the election is idle"
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(LEASE + 0.5)  # the last renew was sent at LEASE
        health = a.health()
        assert (health.healthy, health.is_leader) == (True, True)
        assert "leading with token 1" in health.detail
        follower = b.health()
        assert (follower.healthy, follower.is_leader) == (True, False)
        assert follower.detail == "following; the leader is a"
        faulty.inject(Fault.HANG, "renew")
        await asyncio.sleep(4.5)  # two renew intervals late, before the deadline (9.7 s)
        late = a.health()
        assert a.is_leader
        assert (late.healthy, late.is_leader) == (False, True)
        assert "renew interval" in late.detail
        await a.stop()
        await b.stop()
        assert not a.health().healthy
        assert a.health().detail == "the election is stopped"

    clock.run(main())


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("multilock.core")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def test_records_carry_structured_fields_and_debug_decisions(records: Records) -> None:
    clock = FakeClock()

    async def main() -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        a = LeaderElection(store, group="g", participant_id="a", lease_duration=LEASE)
        b = LeaderElection(store, group="g", participant_id="b", lease_duration=LEASE)
        await a.start()
        await a.wait_until_leader()
        await b.start()
        await asyncio.sleep(LEASE + 0.5)
        await b.stop()
        await a.stop()

    clock.run(main())
    mine = [r for r in records.records if r.name == "multilock.core._election"]
    assert mine
    assert all(getattr(r, "group", None) == "g" for r in mine)
    assert {r.participant for r in mine} == {"a", "b"}  # type: ignore[attr-defined]
    messages = [(r.levelno, r.getMessage(), r.token) for r in mine]  # type: ignore[attr-defined]
    assert (logging.INFO, "g/a is leader with token 1", 1) in messages
    renews = [m for m in messages if m[0] == logging.DEBUG and "renewed token 1" in m[1]]
    assert len(renews) == 3
    assert all(m[2] == 1 for m in renews)
    assert ("g: acquire refused; held by a") in [m[1] for m in messages if m[0] == logging.DEBUG]


def test_an_outage_warns_once_then_every_minute_and_sums_up(records: Records) -> None:
    clock = FakeClock()

    async def main() -> None:
        faulty = FaultyProvider(InMemoryProvider(clock=clock.monotonic))
        a = LeaderElection(
            faulty, group="g", participant_id="a", lease_duration=LEASE, retry_interval=2.0
        )
        faulty.inject(Fault.RAISE)
        await a.start()
        await asyncio.sleep(150)  # about 75 failed rounds and watch restarts
        faulty.heal()
        await a.wait_until_leader()
        await a.stop()

    clock.run(main())
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
    debug_failures = [r for r in records.records if "failed: ProviderError" in r.getMessage()]
    assert len(debug_failures) > 50  # every failure is still logged, at DEBUG
    assert warnings[0].endswith("of g failed: ProviderError('injected failure in watch')")
    still = [w for w in warnings if "still failing after" in w]
    assert len(still) == 2  # after 60 s and 120 s, not one per round
    assert sum("reaches the store again after" in w for w in warnings) == 1
    assert len(warnings) <= 6


# ---------------------------------------------------------------------- signals
def test_sigterm_stops_every_election_then_exits_with_its_status() -> None:
    clock = FakeClock()
    store = InMemoryProvider(clock=clock.monotonic)
    seen: dict[str, Any] = {}

    async def work(leadership: Leadership) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            await asyncio.sleep(LEASE * 10)
        except asyncio.CancelledError:
            seen["work cancelled while"] = leadership.is_valid
            raise

    async def main() -> None:
        other = LeaderElection(store, group="other", participant_id="a", lease_duration=LEASE)
        await other.start()  # not in the block: stopped all the same
        async with (
            stop_on_signals(),
            LeaderElection(store, group="g", participant_id="a", lease_duration=LEASE) as election,
        ):
            seen["election"] = election
            try:
                await election.run_while_leader(work)
                await asyncio.sleep(LEASE * 10)  # run_while_leader returned: it stopped
            except asyncio.CancelledError:
                seen["body cancelled"] = True
                raise
        seen["after"] = True

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        clock.run(main())
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before
    assert seen["work cancelled while"] is False  # the term ended before the work was cancelled
    assert seen["body cancelled"] is True
    assert "after" not in seen
    assert clock.run(store.get_leader("g")) is None  # released, not left to expire
    assert clock.run(store.get_leader("other")) is None


def test_a_body_that_returns_on_its_own_after_the_signal_still_exits() -> None:
    clock = FakeClock()
    store = InMemoryProvider(clock=clock.monotonic)

    async def main() -> None:
        async with (
            stop_on_signals(signals=[signal.SIGUSR1]),
            LeaderElection(store, group="g", lease_duration=LEASE) as election,
        ):
            await election.wait_until_leader()
            os.kill(os.getpid(), signal.SIGUSR1)
            with pytest.raises(asyncio.CancelledError):
                await asyncio.sleep(LEASE)
            raise RuntimeError("ends differently")

    with pytest.raises(RuntimeError, match="ends differently"):
        clock.run(main())


def test_without_a_signal_the_block_is_transparent() -> None:
    async def main() -> int:
        async with stop_on_signals() as scope:
            pass
        assert scope.received is None
        return 7

    assert asyncio.run(main()) == 7


def test_sync_stop_on_signals_releases_and_exits() -> None:
    clock = FakeClock(real_grace=0.001)
    store = InMemoryProvider(clock=clock.monotonic)
    election = msync.LeaderElection(
        store, loop_factory=clock.new_event_loop, group="g", lease_duration=LEASE
    )
    follower = msync.LeaderElection(
        store, loop_factory=clock.new_event_loop, group="g", lease_duration=LEASE
    )
    main = threading.get_ident()
    lost = threading.Event()

    def work(leadership: Leadership) -> None:
        signal.pthread_kill(main, signal.SIGTERM)
        lost.set() if leadership.lost.wait(5) else None

    def body() -> None:
        with msync.stop_on_signals(), election:
            election.run_while_leader(work)
            pytest.fail("run_while_leader returned without the signal")

    try:
        with pytest.raises(SystemExit) as exit_info:
            body()
        assert exit_info.value.code == 128 + signal.SIGTERM
        assert lost.is_set()
        assert election.state.value == "stopped"
        follower.start()
        assert follower.wait_until_leader(timeout=1.0).token == 2  # released, not expired
    finally:
        follower.close()
        election.close()


def test_sync_stop_on_signals_only_in_the_main_thread() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with msync.stop_on_signals():
                pass
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join(5)
    assert errors
    assert "main thread" in str(errors[0])


def test_sync_health_reads_the_loop_state() -> None:
    clock = FakeClock(real_grace=0.001)
    store = InMemoryProvider(clock=clock.monotonic)
    election = msync.LeaderElection(
        store, loop_factory=clock.new_event_loop, group="g", lease_duration=LEASE
    )
    try:
        assert election.health().detail == "the election is idle"
        election.start()
        election.wait_until_leader(timeout=LEASE)
        health = election.health()
        assert (health.healthy, health.is_leader) == (True, True)
        election.stop()
        assert not election.health().healthy
    finally:
        election.close()
    assert election.health().detail == "the election is stopped"  # closed: read directly
