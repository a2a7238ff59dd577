"""Tests of the blocking facade `multilock.core.sync.LeaderElection`.

Elections run in virtual time: each test's `FakeClock` drives one event loop thread
(``loop_factory=clock.new_event_loop``; elections made with the same factory share it) and
judges expiry in the `InMemoryProvider`. Threads are awaited on events with real-time
deadlines (``WAIT``), never slept on. One test uses the real shared loop and real time.
The ``clock``, ``store``, ``background`` and ``loop_thread`` fixtures are in conftest.py.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    ElectionState,
    EventKind,
    InMemoryProvider,
    LeaderInfo,
    Leadership,
    LeadershipEvent,
    LeadershipLost,
    MultilockError,
    Provider,
    RunStatus,
)
from multilock.core.sync import LeaderElection
from multilock.core.testing import FakeClock, Fault, FaultyProvider

if TYPE_CHECKING:
    from conftest import Background, LoopThread

pytestmark = pytest.mark.timeout(30)

#: Real seconds a thread may take to report back; a bound, never a sleep.
WAIT = 5.0
#: Virtual seconds.
LEASE = 15.0
GROUP = "jobs"

Make = Callable[..., LeaderElection]


@pytest.fixture
def make(clock: FakeClock, store: InMemoryProvider) -> Iterator[Make]:
    made: list[LeaderElection] = []

    def make(name: str, provider: Provider | None = None, **fields: Any) -> LeaderElection:
        fields.setdefault("group", GROUP)
        fields.setdefault("lease_duration", LEASE)
        election = LeaderElection(
            store if provider is None else provider,
            loop_factory=clock.new_event_loop,
            participant_id=name,
            **fields,
        )
        made.append(election)
        return election

    yield make
    for election in reversed(made):
        election.close()


def private_loop_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("multilock-sync-")}


# ---------------------------------------------------------------------- lifecycle
def test_start_stop_and_start_again(make: Make) -> None:
    a = make("a")
    assert (a.state, a.is_leader, a.leadership) == (ElectionState.IDLE, False, None)

    a.start()
    a.start()  # idempotent
    first = a.wait_until_leader(timeout=LEASE)
    assert a.is_leader
    assert a.leadership is first
    assert first.is_valid
    assert a.statistics().state is ElectionState.LEADING

    a.stop()
    a.stop()  # idempotent
    assert a.statistics().state is ElectionState.STOPPED
    assert (a.is_leader, first.is_valid, first.lost.is_set()) == (False, False, True)
    assert a.current_leader() is None  # released on stop

    a.start()
    second = a.wait_until_leader(timeout=LEASE)
    assert second.token > first.token
    stats = a.statistics()
    assert stats.terms_won == 2
    assert stats.is_leader
    assert stats.token == second.token


def test_context_manager_starts_and_stops_but_does_not_close(make: Make) -> None:
    a = make("a")
    with a as entered:
        assert entered is a
        leadership = a.wait_until_leader(timeout=LEASE)
    assert a.statistics().state is ElectionState.STOPPED
    assert leadership.lost.is_set()
    assert not a.closed
    with a:  # usable again
        assert a.wait_until_leader(timeout=LEASE).token > leadership.token


def test_options_properties_and_repr(make: Make, clock: FakeClock) -> None:
    options = ElectionOptions(group="reports", participant_id="p-1", lease_duration=LEASE)
    store = InMemoryProvider(clock=clock.monotonic)
    election = LeaderElection(store, options, loop_factory=clock.new_event_loop)
    try:
        assert election.options is options
        assert election.group == "reports"
        assert election.participant_id == "p-1"
        assert election.provider is store
        text = repr(election)
        assert "sync.LeaderElection" in text
        assert "'reports'" in text
        assert "idle" in text
    finally:
        election.close()
    assert "closed" in repr(election)


def test_bad_arguments_raise_and_leave_no_loop_thread(clock: FakeClock) -> None:
    store = InMemoryProvider(clock=clock.monotonic)
    before = private_loop_threads()
    with pytest.raises(ConfigurationError, match="not both"):
        LeaderElection(store, ElectionOptions(), loop_factory=clock.new_event_loop, group="other")
    with pytest.raises(ConfigurationError, match="Provider"):
        LeaderElection(object(), loop_factory=clock.new_event_loop)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="renew_interval"):
        LeaderElection(store, loop_factory=clock.new_event_loop, lease_duration=1, renew_interval=1)
    assert private_loop_threads() == before


def test_wait_until_leader_requires_a_running_election(make: Make) -> None:
    a = make("a")
    with pytest.raises(MultilockError, match="start it first"):
        a.wait_until_leader(timeout=LEASE)
    with pytest.raises(MultilockError, match="start it first"):
        a.run_while_leader(lambda leadership: None)


# ---------------------------------------------------------------------- two elections
def test_two_elections_sharing_a_provider_exactly_one_leads(
    make: Make, background: type[Background]
) -> None:
    a, b = make("a"), make("b")
    acquired: queue.Queue[tuple[str, LeadershipEvent]] = queue.Queue()
    streams = [(e.participant_id, e.events(EventKind.ACQUIRED)) for e in (a, b)]

    def forward(name: str, stream: Iterator[LeadershipEvent]) -> None:
        for event in stream:
            acquired.put((name, event))

    readers = [background(forward, name, stream) for name, stream in streams]
    a.start()
    b.start()
    name, event = acquired.get(timeout=WAIT)
    winner, loser = (a, b) if name == "a" else (b, a)
    assert winner.is_leader
    assert not loser.is_leader

    # Three leases of virtual time pass: the winner keeps renewing, the loser never leads.
    with pytest.raises(TimeoutError):
        loser.wait_until_leader(timeout=3 * LEASE)
    assert winner.is_leader
    assert winner.leadership is not None
    assert winner.leadership.token == event.token
    assert winner.statistics().renewals >= 3
    assert loser.statistics().terms_won == 0
    for election in (a, b):
        leader = election.current_leader()
        assert leader is not None
        assert leader.participant_id == winner.participant_id
    assert acquired.empty()

    a.stop()
    b.stop()
    for reader in readers:  # the streams end when their elections stop
        reader.result()


def test_resign_hands_over_to_the_waiting_election(make: Make) -> None:
    a, b = make("a"), make("b")
    a.start()
    first = a.wait_until_leader(timeout=LEASE)
    b.start()
    with pytest.raises(TimeoutError):
        b.wait_until_leader(timeout=LEASE)

    a.resign()
    assert not a.is_leader
    assert first.lost.is_set()
    second = b.wait_until_leader(timeout=LEASE)
    assert second.token > first.token
    leader = a.current_leader()
    assert leader is not None
    assert leader.participant_id == "b"
    a.resign()  # a no-op when not leading
    assert b.is_leader


def test_run_while_leader_sees_the_loss_and_the_other_takes_over(
    make: Make, store: InMemoryProvider, background: type[Background]
) -> None:
    faulty = FaultyProvider(store)
    a, b = make("a", faulty), make("b")
    a.start()
    first = a.wait_until_leader(timeout=LEASE)
    b.start()

    calls: list[tuple[int, str, str]] = []
    started, saw_loss = threading.Event(), threading.Event()
    after_loss: dict[str, object] = {}

    def work(leadership: Leadership, tag: str) -> None:
        calls.append((leadership.token, tag, threading.current_thread().name))
        started.set()
        if leadership.lost.wait(WAIT):
            after_loss["is_valid"] = leadership.is_valid
            try:
                leadership.check()
            except LeadershipLost as exc:
                after_loss["check"] = exc
            saw_loss.set()

    runner = background(a.run_while_leader, work, "tag")
    assert started.wait(WAIT)
    token, tag, thread_name = calls[0]
    assert (token, tag) == (first.token, "tag")
    assert thread_name != threading.current_thread().name
    assert thread_name != runner.thread.name  # a worker thread, not the caller

    faulty.inject(Fault.HANG)  # cut the leader off from the store
    assert saw_loss.wait(WAIT)
    assert after_loss["is_valid"] is False
    assert isinstance(after_loss["check"], LeadershipLost)
    assert not a.is_leader

    taken = b.wait_until_leader(timeout=3 * LEASE)
    assert taken.token > first.token
    assert not runner.done.is_set()  # still waiting for a's next term

    a.stop()  # from another thread: run_while_leader returns
    assert runner.result() is None
    assert len(calls) == 1


def test_run_while_leader_runs_again_in_each_term(make: Make, background: type[Background]) -> None:
    a = make("a")
    a.start()
    tokens: list[int] = []
    second_term = threading.Event()

    def work(leadership: Leadership) -> None:
        tokens.append(leadership.token)  # returns at once: wait for the term to end
        if len(tokens) == 2:
            second_term.set()

    runner = background(a.run_while_leader, work)
    first = a.wait_until_leader(timeout=LEASE)
    a.resign()  # ends the term; a campaigns again after retry_interval
    assert second_term.wait(WAIT)
    a.stop()
    assert runner.result() is None
    assert tokens[0] == first.token
    assert tokens == sorted(set(tokens))  # one call per term, terms in order


def test_an_exception_in_run_while_leader_propagates_and_resigns(make: Make) -> None:
    a, b = make("a"), make("b")
    a.start()
    first = a.wait_until_leader(timeout=LEASE)
    b.start()

    def boom(leadership: Leadership) -> None:
        raise ValueError(f"boom {leadership.token}")

    with pytest.raises(ValueError, match=f"boom {first.token}"):
        a.run_while_leader(boom)
    assert first.lost.is_set()
    assert not a.is_leader
    assert b.wait_until_leader(timeout=LEASE).token > first.token


def test_system_exit_in_run_while_leader_reaches_the_caller(make: Make) -> None:
    a = make("a")
    a.start()
    first = a.wait_until_leader(timeout=LEASE)

    def leave(leadership: Leadership) -> None:
        sys.exit(3)

    with pytest.raises(SystemExit) as info:
        a.run_while_leader(leave)
    assert info.value.code == 3
    assert first.lost.is_set()


def test_run_if_leader_not_leader_completed_and_lost(make: Make, store: InMemoryProvider) -> None:
    faulty_a, faulty_b = FaultyProvider(store), FaultyProvider(store)
    a, b = make("a", faulty_a), make("b", faulty_b)
    a.start()
    first = a.wait_until_leader(timeout=LEASE)
    b.start()

    called: list[Leadership] = []
    not_leader = b.run_if_leader(called.append)
    assert not_leader.status is RunStatus.NOT_LEADER
    assert not_leader.value is None
    assert called == []

    def double(leadership: Leadership, x: int) -> tuple[threading.Thread, int, int]:
        return threading.current_thread(), leadership.token, 2 * x

    completed = a.run_if_leader(double, 21)
    assert completed.status is RunStatus.COMPLETED
    assert completed.completed
    assert completed.value == (threading.current_thread(), first.token, 42)

    def fail(leadership: Leadership) -> None:
        raise KeyError("not a loss")

    with pytest.raises(KeyError, match="not a loss"):
        a.run_if_leader(fail)
    assert a.is_leader  # run_if_leader does not resign

    def cut_off(faulty: FaultyProvider) -> Callable[[Leadership], str]:
        def fn(leadership: Leadership) -> str:
            faulty.inject(Fault.HANG)
            assert leadership.lost.wait(WAIT)
            return "finished too late"

        return fn

    lost = a.run_if_leader(cut_off(faulty_a))
    assert lost.status is RunStatus.LOST
    assert lost.value is None

    second = b.wait_until_leader(timeout=3 * LEASE)
    assert second.token > first.token

    def checked(leadership: Leadership) -> str:
        cut_off(faulty_b)(leadership)
        leadership.check()  # raises LeadershipLost: reported as LOST, not raised
        return "unreachable"

    assert b.run_if_leader(checked).status is RunStatus.LOST


# ---------------------------------------------------------------------- events
def test_events_yield_acquired_then_lost_and_end_at_stop(make: Make) -> None:
    a = make("a")
    with a.events(EventKind.ACQUIRED | EventKind.LOST) as events:
        assert events.kinds == EventKind.ACQUIRED | EventKind.LOST
        a.start()
        acquired = next(events)
        assert acquired.kind is EventKind.ACQUIRED
        assert acquired.participant_id == "a"
        assert acquired.group == GROUP
        a.stop()
        lost = next(events)
        assert lost.kind is EventKind.LOST
        assert lost.token == acquired.token
        assert list(events) == []  # the stream ended with the election


def test_events_report_the_observed_leader(make: Make) -> None:
    a, b = make("a"), make("b")
    a.start()
    a.wait_until_leader(timeout=LEASE)
    with b.events(EventKind.LEADER_CHANGED) as changes:
        b.start()
        changed = next(changes)
    assert changed.kind is EventKind.LEADER_CHANGED
    assert isinstance(changed.leader, LeaderInfo)
    assert changed.leader.participant_id == "a"


def test_closing_an_event_iterator_wakes_its_reader(
    make: Make, background: type[Background]
) -> None:
    a = make("a")
    events = a.events()
    reader = background(list, events)  # blocks: nothing happens before start
    events.close()
    events.close()  # idempotent
    assert reader.result() == []
    with pytest.raises(StopIteration):
        next(events)


# ---------------------------------------------------------------------- providers and loops
def test_url_election_owns_and_closes_its_provider(
    monkeypatch: pytest.MonkeyPatch, clock: FakeClock, store: InMemoryProvider
) -> None:
    built_in: list[threading.Thread] = []
    closed: list[tuple[InMemoryProvider, threading.Thread]] = []
    original_from_url = InMemoryProvider.from_url.__func__  # type: ignore[attr-defined]

    def from_url(cls: type[InMemoryProvider], url: str) -> InMemoryProvider:
        built_in.append(threading.current_thread())
        provider: InMemoryProvider = original_from_url(cls, url)
        return provider

    async def aclose(self: InMemoryProvider) -> None:
        closed.append((self, threading.current_thread()))

    monkeypatch.setattr(InMemoryProvider, "from_url", classmethod(from_url))
    monkeypatch.setattr(InMemoryProvider, "aclose", aclose)

    election = LeaderElection(
        "memory://sync-url-test",
        loop_factory=clock.new_event_loop,
        group=GROUP,
        participant_id="u",
        lease_duration=LEASE,
    )
    provider = election.provider
    assert isinstance(provider, InMemoryProvider)
    assert "sync-url-test" in repr(provider)
    assert built_in[0] is not threading.current_thread()  # built on the loop thread
    election.start()
    election.wait_until_leader(timeout=LEASE)
    election.stop()
    assert closed == []  # stop() leaves the provider open
    with election:  # built from a URL: leaving the block closes the election and provider
        election.wait_until_leader(timeout=LEASE)
    assert closed == [(provider, built_in[0])]
    election.close()  # idempotent
    assert election.closed
    assert election.state is ElectionState.STOPPED
    assert closed == [(provider, built_in[0])]
    assert not built_in[0].is_alive()  # the private loop thread has ended
    with pytest.raises(MultilockError, match="closed"):
        election.start()
    election.stop()  # a no-op once closed

    # A provider that was passed in belongs to the caller: close() leaves it open.
    borrowed = LeaderElection(store, loop_factory=clock.new_event_loop)
    with borrowed:
        pass
    borrowed.close()
    assert len(closed) == 1

    # Options rejected after the provider was built: the provider is closed again.
    with pytest.raises(ConfigurationError):
        LeaderElection("memory://sync-url-test", loop_factory=clock.new_event_loop, group="/")
    assert len(closed) == 2


def test_blocking_calls_from_the_loop_thread_raise(
    store: InMemoryProvider, loop_thread: LoopThread
) -> None:
    factory = loop_thread.factory
    a = LeaderElection(store, loop_factory=factory, group=GROUP, participant_id="a")
    try:
        a.start()
        a.wait_until_leader(timeout=LEASE)
        events = a.events()
        calls: dict[str, Callable[[], object]] = {
            "start": a.start,
            "stop": a.stop,
            "resign": a.resign,
            "wait_until_leader": a.wait_until_leader,
            "current_leader": a.current_leader,
            "run_if_leader": lambda: a.run_if_leader(lambda leadership: None),
            "run_while_leader": lambda: a.run_while_leader(lambda leadership: None),
            "events": a.events,
            "next": lambda: next(events),
            "close": a.close,
            "LeaderElection": lambda: LeaderElection(store, loop_factory=factory),
        }
        loop_thread.assert_deadlocks_refused(calls)
        # Local state never blocks.
        assert loop_thread.run(lambda: (a.is_leader, a.statistics().is_leader)) == (True, True)
        assert a.is_leader  # nothing was stopped or closed
        assert not a.closed
        events.close()
    finally:
        a.close()
    assert a.closed


class RecordingProvider(InMemoryProvider):
    """Real time. Record the threads that call the store, and each release."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()
        self.released = threading.Event()
        self.work_running = threading.Event()
        self.released_during_work: bool | None = None

    async def get_leader(self, group: str) -> LeaderInfo | None:
        self.threads.add(threading.current_thread().name)
        return await super().get_leader(group)

    async def release(self, group: str, participant_id: str, token: int) -> None:
        self.threads.add(threading.current_thread().name)
        if self.released_during_work is None:
            self.released_during_work = self.work_running.is_set()
        self.released.set()
        await super().release(group, participant_id, token)


def test_shared_default_loop_serves_two_elections_and_one_provider(
    background: type[Background],
) -> None:
    """Real time, lease 2 s: every wait is on an event with a deadline."""

    provider = RecordingProvider()
    fields: dict[str, Any] = {"group": "sync-default", "lease_duration": 2.0}
    a = LeaderElection(provider, participant_id="a", **fields)
    b = LeaderElection(provider, participant_id="b", **fields)
    try:
        a.start()
        first = a.wait_until_leader(timeout=WAIT)
        b.start()

        inside = threading.Event()
        observed: dict[str, object] = {}

        def work(leadership: Leadership) -> None:
            provider.work_running.set()
            observed["thread"] = threading.current_thread().name
            inside.set()
            try:
                if leadership.lost.wait(WAIT):
                    observed["holder"] = b.current_leader()
                    # stop() must not release the lease while this still runs: give a
                    # release that came too early the time to show (0.3 s, well inside
                    # the 1.3 s or more left before the term's deadline).
                    provider.released.wait(0.3)
            finally:
                provider.work_running.clear()

        runner = background(a.run_while_leader, work)
        assert inside.wait(WAIT)
        a.stop()
        assert provider.released_during_work is False
        holder = observed["holder"]
        assert isinstance(holder, LeaderInfo)
        assert (holder.participant_id, holder.token) == ("a", first.token)
        assert str(observed["thread"]).startswith("multilock-leader-")
        assert runner.result() is None

        second = b.wait_until_leader(timeout=WAIT)
        assert second.token > first.token
        assert provider.threads == {"multilock-sync"}
    finally:
        a.close()
        b.close()
    shared = [t for t in threading.enumerate() if t.name == "multilock-sync"]
    assert len(shared) == 1  # one shared loop thread, still there for later elections


def interrupt_main_thread_when(event: threading.Event, background: type[Background]) -> Background:
    """Send a real SIGINT to this (main) thread once *event* is set: Ctrl-C, as a user would."""
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    main = threading.get_ident()

    def send() -> None:
        assert event.wait(WAIT)
        signal.pthread_kill(main, signal.SIGINT)

    return background(send)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_stop_after_an_interrupted_run_while_leader_still_waits_for_the_work(
    background: type[Background],
) -> None:
    """Real time, lease 2 s. Ctrl-C while blocked in run_while_leader, then stop().

    The interrupt cancels the term task once (through run_while_leader) and stop() cancels
    it again: the lease must still be released only after the work has returned.
    """
    provider = RecordingProvider()
    a = LeaderElection(provider, participant_id="a", group="sync-interrupt", lease_duration=2.0)
    try:
        a.start()
        first = a.wait_until_leader(timeout=WAIT)
        inside = threading.Event()

        def work(leadership: Leadership) -> None:
            provider.work_running.set()
            inside.set()
            try:
                if leadership.lost.wait(WAIT):
                    # A release that comes too early shows within 0.3 s, well inside the
                    # 1.3 s or more left before the term's deadline.
                    provider.released.wait(0.3)
            finally:
                provider.work_running.clear()

        sender = interrupt_main_thread_when(inside, background)
        with pytest.raises(KeyboardInterrupt):
            a.run_while_leader(work)
        sender.result()
        # Round trips through the loop: the interrupt's cancellation reaches the term task
        # (a few loop iterations) before stop() cancels it again.
        for _ in range(3):
            a.statistics()
        assert a.is_leader  # the work is not told of the interrupt: the term goes on
        assert not first.lost.is_set()
        assert provider.work_running.is_set()

        a.stop()
        assert first.lost.is_set()
        assert provider.released_during_work is False
        assert not provider.work_running.is_set()  # stop() returned after the work
        assert a.current_leader() is None
    finally:
        a.close()
