"""`multilock.apscheduler.LeaderScheduler` with an ``AsyncIOScheduler`` on the in-memory store.

Everything runs in virtual time (`FakeClock`): nothing sleeps for real. Jobs are one-shot
``date`` jobs due at once (no misfire limit), so the scheduler never waits on the wall
clock; a job that runs is recorded with the token its replica held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import pytest
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING, STATE_STOPPED

import multilock.apscheduler._scheduler as private
from multilock.apscheduler import LeaderScheduler
from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    ElectionState,
    InMemoryProvider,
    LeaderElection,
)
from multilock.core.testing import FakeClock, Fault, FaultyProvider

LEASE = 10.0
GROUP = "jobs"
#: Virtual seconds to wait for a state; a bound, free in virtual time.
WAIT = 60.0


def run(body: Callable[[FakeClock, InMemoryProvider], Awaitable[None]]) -> None:
    clock = FakeClock()

    async def main() -> None:
        await body(clock, InMemoryProvider(clock=clock.monotonic))

    clock.run(main())


async def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll *condition* in virtual time; fail after WAIT virtual seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not condition():
        assert loop.time() < deadline, f"not {what} within {WAIT} virtual seconds"
        await asyncio.sleep(0.01)


def replica(store: Any, name: str, runs: list[tuple[str, int]] | None = None) -> LeaderScheduler:
    """A scheduler with one job due now, switched by an election named *name*."""
    scheduler = AsyncIOScheduler()
    leader = LeaderScheduler(
        scheduler, store, group=GROUP, participant_id=name, lease_duration=LEASE
    )

    async def job() -> None:
        leadership = leader.leadership
        assert leadership is not None, f"{name}'s job ran while not leading"
        assert runs is not None
        runs.append((name, leadership.token))

    if runs is not None:
        scheduler.add_job(job, "date", run_date=datetime.now(), misfire_grace_time=None)
    return leader


def test_paused_while_following_resumed_on_acquired() -> None:
    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        runs: list[tuple[str, int]] = []
        async with LeaderElection(store, group=GROUP, participant_id="rival") as rival:
            first = await rival.wait_until_leader()
            async with replica(store, "a", runs) as leader:
                await asyncio.sleep(LEASE * 3)  # rival renews; a follows all along
                assert leader.scheduler.state == STATE_PAUSED
                assert leader.leadership is None
                assert runs == []

                await rival.resign()
                await wait_for(lambda: leader.scheduler.state == STATE_RUNNING, "resumed")
                assert leader.is_leader
                assert leader.leadership is not None
                assert leader.leadership.token > first.token
                await wait_for(lambda: bool(runs), "the job run")
                assert runs == [("a", leader.leadership.token)]

    run(body)


def test_only_the_leader_runs_jobs_and_a_resign_hands_them_over() -> None:
    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        runs: list[tuple[str, int]] = []
        async with replica(store, "a", runs) as a, replica(store, "b", runs) as b:
            await wait_for(lambda: bool(runs), "a job run")
            await asyncio.sleep(LEASE)
            first, second = (a, b) if a.is_leader else (b, a)
            assert [name for name, _ in runs] == [first.election.participant_id]
            assert (first.scheduler.state, second.scheduler.state) == (
                STATE_RUNNING,
                STATE_PAUSED,
            )

            await first.election.resign()  # LOST at once: paused; the other wins
            assert second.scheduler.state == STATE_PAUSED
            await wait_for(lambda: len(runs) == 2, "the other job run")
            assert first.scheduler.state == STATE_PAUSED
            assert second.scheduler.state == STATE_RUNNING
            assert runs[1][0] == second.election.participant_id
            assert runs[1][1] > runs[0][1], "tokens rise from term to term"

    run(body)


def test_paused_on_lost_when_renewals_are_refused_and_resumed_on_the_next_term() -> None:
    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        faulty = FaultyProvider(store)
        async with replica(faulty, "a") as leader:
            await wait_for(lambda: leader.scheduler.state == STATE_RUNNING, "resumed")
            assert leader.leadership is not None
            token = leader.leadership.token

            faulty.inject(Fault.REFUSE, "renew")
            await wait_for(lambda: leader.scheduler.state == STATE_PAUSED, "paused")
            assert not leader.is_leader

            faulty.heal()
            await wait_for(lambda: leader.scheduler.state == STATE_RUNNING, "resumed again")
            assert leader.leadership is not None
            assert leader.leadership.token > token

    run(body)


def test_paused_when_the_election_is_stopped_from_outside() -> None:
    """What a signal handler that stops every election does: LOST, then the body ends."""

    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        async with replica(store, "a") as leader:
            await wait_for(lambda: leader.scheduler.state == STATE_RUNNING, "resumed")
            await leader.election.stop()
            await wait_for(lambda: leader.scheduler.state == STATE_PAUSED, "paused")
        assert leader.scheduler.state == STATE_STOPPED

    run(body)


def test_exit_shuts_the_scheduler_down_and_releases() -> None:
    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        leader = replica(store, "a")
        with pytest.raises(RuntimeError, match="built when"):
            _ = leader.election
        assert leader.leadership is None
        async with leader:
            await wait_for(lambda: leader.is_leader, "leading")
            assert "leading=True" in repr(leader)
        assert leader.scheduler.state == STATE_STOPPED
        assert leader.election.state is ElectionState.STOPPED
        assert not leader.is_leader
        assert await store.get_leader(GROUP) is None, "released on exit"
        with pytest.raises(RuntimeError, match="only once"):
            await leader.__aenter__()

    run(body)


def test_exit_on_an_error_in_the_body_still_shuts_down_and_releases() -> None:
    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        leader = replica(store, "a")

        async def fail_while_leading() -> None:
            async with leader:
                await wait_for(lambda: leader.is_leader, "leading")
                raise ZeroDivisionError

        with pytest.raises(ZeroDivisionError):
            await fail_while_leading()
        assert leader.scheduler.state == STATE_STOPPED
        assert await store.get_leader(GROUP) is None

    run(body)


def test_a_scheduler_the_program_shut_down_itself_is_left_alone() -> None:
    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        async with replica(store, "a") as leader:
            await wait_for(lambda: leader.is_leader, "leading")
            leader.scheduler.shutdown()
            await asyncio.sleep(1)
        assert leader.scheduler.state == STATE_STOPPED

    run(body)


def test_a_url_builds_a_provider_that_is_closed_on_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Closing] = []

    class Closing(InMemoryProvider):
        closed = False

        async def aclose(self) -> None:
            self.closed = True

    def from_url(url: str) -> Closing:
        assert url == "memory://apscheduler-test"
        built.append(Closing())
        return built[-1]

    monkeypatch.setattr(private, "from_url", from_url)

    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        scheduler = AsyncIOScheduler()
        async with LeaderScheduler(scheduler, "memory://apscheduler-test", group=GROUP) as leader:
            assert leader.election.provider is built[0]
            assert not built[0].closed
        assert built[0].closed
        assert scheduler.state == STATE_STOPPED

    run(body)


def test_a_failed_entry_leaves_the_scheduler_stopped() -> None:
    async def body(clock: FakeClock, store: InMemoryProvider) -> None:
        scheduler = AsyncIOScheduler()
        with pytest.raises(ConfigurationError, match="nope"):
            async with LeaderScheduler(scheduler, "nope://host", group=GROUP):
                pytest.fail("entered")
        assert scheduler.state == STATE_STOPPED

    run(body)


def test_bad_arguments_are_refused_at_once() -> None:
    with pytest.raises(TypeError, match=r"APScheduler 3\.x scheduler"):
        LeaderScheduler(object(), InMemoryProvider())
    with pytest.raises(ConfigurationError, match="not both"):
        LeaderScheduler(
            AsyncIOScheduler(), InMemoryProvider(), ElectionOptions(group=GROUP), group=GROUP
        )
    with pytest.raises(ConfigurationError, match="lease_duration"):
        LeaderScheduler(AsyncIOScheduler(), InMemoryProvider(), lease_duration=-1)
    with pytest.raises(ConfigurationError, match="unknown election option"):
        LeaderScheduler(AsyncIOScheduler(), InMemoryProvider(), lease=10)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="Provider or a URL, not dict"):
        LeaderScheduler(AsyncIOScheduler(), {"url": "redis://"})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="options must be an ElectionOptions"):
        LeaderScheduler(AsyncIOScheduler(), InMemoryProvider(), {"group": GROUP})  # type: ignore[arg-type]

    async def started(clock: FakeClock, store: InMemoryProvider) -> None:
        scheduler = AsyncIOScheduler()
        scheduler.start()
        try:
            with pytest.raises(RuntimeError, match="already started"):
                LeaderScheduler(scheduler, store)
        finally:
            scheduler.shutdown()
            await asyncio.sleep(0)

    run(started)
