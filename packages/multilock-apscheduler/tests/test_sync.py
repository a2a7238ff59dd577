"""`multilock.apscheduler.sync.LeaderScheduler` with a ``BackgroundScheduler``.

The elections run in virtual time: a `FakeClock` drives their loop thread
(``loop_factory=clock.new_event_loop``) and judges expiry in the `InMemoryProvider`. The
scheduler's pause/resume/shutdown events are read from a queue filled by a scheduler
listener, and jobs report through queues: threads are waited on with real-time bounds
(``WAIT``), never slept on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
from apscheduler.events import (
    EVENT_SCHEDULER_PAUSED,
    EVENT_SCHEDULER_RESUMED,
    EVENT_SCHEDULER_SHUTDOWN,
    EVENT_SCHEDULER_STARTED,
)
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING, STATE_STOPPED

from multilock.apscheduler.sync import LeaderScheduler
from multilock.core import ConfigurationError, ElectionOptions, ElectionState, InMemoryProvider
from multilock.core.sync import LeaderElection
from multilock.core.testing import FakeClock

pytestmark = pytest.mark.timeout(60)

#: Real seconds a thread may take to report back; a bound, never a sleep.
WAIT = 10.0
#: Virtual seconds.
LEASE = 10.0
GROUP = "jobs"

NAMES = {
    EVENT_SCHEDULER_STARTED: "started",
    EVENT_SCHEDULER_PAUSED: "paused",
    EVENT_SCHEDULER_RESUMED: "resumed",
    EVENT_SCHEDULER_SHUTDOWN: "shutdown",
}


class Replica:
    """A BackgroundScheduler whose switching events and job runs land in queues."""

    def __init__(self, clock: FakeClock, store: Any, name: str, **kwargs: Any) -> None:
        self.scheduler = BackgroundScheduler()
        self.switches: queue.Queue[str] = queue.Queue()
        self.runs: queue.Queue[tuple[str, int]] = queue.Queue()
        self.scheduler.add_listener(lambda event: self.switches.put(NAMES[event.code]), sum(NAMES))
        self.leader = LeaderScheduler(
            self.scheduler,
            store,
            group=GROUP,
            participant_id=name,
            lease_duration=LEASE,
            loop_factory=clock.new_event_loop,
            **kwargs,
        )
        self.name = name

    def add_job_due_now(self) -> None:
        def job() -> None:
            leadership = self.leader.leadership
            assert leadership is not None, f"{self.name}'s job ran while not leading"
            self.runs.put((self.name, leadership.token))

        self.scheduler.add_job(job, "date", run_date=datetime.now(), misfire_grace_time=None)

    def expect(self, *names: str) -> None:
        """The next switches of the scheduler are *names*, in this order."""
        for name in names:
            assert self.switches.get(timeout=WAIT) == name

    def next_run(self) -> tuple[str, int]:
        return self.runs.get(timeout=WAIT)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(real_grace=0.001)


@pytest.fixture
def store(clock: FakeClock) -> InMemoryProvider:
    return InMemoryProvider(clock=clock.monotonic)


@pytest.fixture
def rival(clock: FakeClock, store: InMemoryProvider) -> Iterator[LeaderElection]:
    """Another participant of the group, already leading."""
    election = LeaderElection(
        store, group=GROUP, participant_id="rival", lease_duration=LEASE,
        loop_factory=clock.new_event_loop,
    )  # fmt: skip
    with election:
        election.wait_until_leader(timeout=WAIT)
        yield election


def test_paused_while_following_resumed_on_acquired(
    clock: FakeClock, store: InMemoryProvider, rival: LeaderElection
) -> None:
    a = Replica(clock, store, "a")
    a.add_job_due_now()
    first = rival.leadership
    assert first is not None
    with a.leader:
        a.expect("started")
        with pytest.raises(TimeoutError):  # 3 leases of virtual time as a follower
            a.leader.election.wait_until_leader(timeout=LEASE * 3)
        assert a.scheduler.state == STATE_PAUSED
        assert a.runs.empty()
        assert a.switches.empty()

        rival.resign()
        a.expect("resumed")
        name, token = a.next_run()
        assert (name, token) == ("a", a.leader.election.wait_until_leader(timeout=WAIT).token)
        assert token > first.token
    a.expect("paused", "shutdown")


def test_paused_on_lost_and_resumed_in_the_next_term(
    clock: FakeClock, store: InMemoryProvider
) -> None:
    a = Replica(clock, store, "a")
    with a.leader:
        a.expect("started", "resumed")
        first = a.leader.election.wait_until_leader(timeout=WAIT)

        a.leader.election.resign()  # LOST; nobody else campaigns, so a wins again
        a.expect("paused", "resumed")
        assert a.scheduler.state == STATE_RUNNING
        second = a.leader.election.wait_until_leader(timeout=WAIT)
        assert second.token > first.token
        a.add_job_due_now()
        assert a.next_run() == ("a", second.token)
    a.expect("paused", "shutdown")


def test_two_replicas_hand_the_jobs_over(clock: FakeClock, store: InMemoryProvider) -> None:
    a, b = Replica(clock, store, "a"), Replica(clock, store, "b")
    with a.leader:
        a.expect("started", "resumed")
        with b.leader:
            b.expect("started")
            b.add_job_due_now()
            with pytest.raises(TimeoutError):
                b.leader.election.wait_until_leader(timeout=LEASE * 3)
            assert b.runs.empty()
            assert b.scheduler.state == STATE_PAUSED

            a.leader.election.resign()
            a.expect("paused")
            b.expect("resumed")
            assert b.next_run()[0] == "b"
            # a campaigns again, but b renews: a stays paused.
            with pytest.raises(TimeoutError):
                a.leader.election.wait_until_leader(timeout=LEASE * 3)
            assert a.switches.empty()
            assert a.scheduler.state == STATE_PAUSED
        b.expect("paused", "shutdown")  # b left: a takes over
        a.expect("resumed")


def test_exit_waits_for_running_jobs_before_releasing(
    clock: FakeClock, store: InMemoryProvider
) -> None:
    a = Replica(clock, store, "a")
    started, paused = threading.Event(), threading.Event()
    valid_at_end: list[bool] = []
    a.scheduler.add_listener(lambda event: paused.set(), EVENT_SCHEDULER_PAUSED)

    def long_job() -> None:
        leadership = a.leader.leadership
        assert leadership is not None
        started.set()
        assert paused.wait(WAIT), "the scheduler was not paused on exit"
        valid_at_end.append(leadership.is_valid)  # the election is not stopped yet

    with a.leader:
        a.expect("started", "resumed")
        a.scheduler.add_job(long_job, "date", run_date=datetime.now(), misfire_grace_time=None)
        assert started.wait(WAIT)
    assert valid_at_end == [True]
    assert a.scheduler.state == STATE_STOPPED
    assert a.leader.election.state is ElectionState.STOPPED
    assert not a.leader.is_leader


def test_a_url_election_is_closed_on_exit(clock: FakeClock) -> None:
    scheduler = BackgroundScheduler()
    leader = LeaderScheduler(
        scheduler, "memory://apscheduler-sync-test", group=GROUP,
        loop_factory=clock.new_event_loop,
    )  # fmt: skip
    assert "leading=False" in repr(leader)
    with leader:
        leader.election.wait_until_leader(timeout=WAIT)
        assert leader.is_leader
    assert leader.election.closed
    assert scheduler.state == STATE_STOPPED
    with pytest.raises(RuntimeError, match="only once"):
        leader.__enter__()


def test_a_started_scheduler_is_refused(store: InMemoryProvider) -> None:
    scheduler = BackgroundScheduler()
    scheduler.start(paused=True)
    try:
        with pytest.raises(RuntimeError, match="already started"):
            LeaderScheduler(scheduler, store)
    finally:
        scheduler.shutdown()


def test_bad_arguments_are_refused_at_once(store: InMemoryProvider) -> None:
    """The same checks as the asyncio LeaderScheduler's, before any thread starts."""
    with pytest.raises(TypeError, match=r"APScheduler 3\.x scheduler"):
        LeaderScheduler(object(), store)
    with pytest.raises(ConfigurationError, match="Provider or a URL, not int"):
        LeaderScheduler(BackgroundScheduler(), 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not both"):
        LeaderScheduler(BackgroundScheduler(), store, ElectionOptions(group=GROUP), group=GROUP)
    with pytest.raises(ConfigurationError, match="unknown election option"):
        LeaderScheduler(BackgroundScheduler(), store, lease=10)  # type: ignore[call-arg]
