"""The supervisor's timing in virtual time: a fake command, a real election, a faulty store.

`FakeClock` runs the event loop; `FakeChild` records every signal with the loop's time and
"dies" on SIGKILL (and on SIGTERM unless it ignores it), so each test can compare the
moment the command died with the moment another candidate acquired the lease.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import pytest

from multilock.cli._common import CliError, ExitCode
from multilock.cli._supervisor import Supervisor, check_grace, default_grace
from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    EventKind,
    InMemoryProvider,
    LeaderElection,
    Provider,
)
from multilock.core.testing import FakeClock, Fault, FaultyProvider

LEASE = 10.0
GRACE = 2.0


class FakeChild:
    """A command that lives until SIGKILL (or SIGTERM, unless *ignores_term*) or `exit`."""

    def __init__(self, env: Mapping[str, str], *, ignores_term: bool, pid: int) -> None:
        self.env = dict(env)
        self.pid = pid
        self.ignores_term = ignores_term
        self.started_at = asyncio.get_running_loop().time()
        self.signals: list[tuple[float, int]] = []
        self.died_at: float | None = None
        self._status: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def alive(self) -> bool:
        return self.died_at is None

    @property
    def token(self) -> int:
        return int(self.env["MULTILOCK_TOKEN"])

    def send(self, signum: int) -> None:
        if not self.alive:
            return  # its process group is gone: killpg would find nobody
        self.signals.append((asyncio.get_running_loop().time(), signum))
        if signum == signal.SIGKILL or (signum == signal.SIGTERM and not self.ignores_term):
            self.exit(128 + signum)

    def exit(self, status: int) -> None:
        if self.alive:
            self.died_at = asyncio.get_running_loop().time()
            self._status.set_result(status)

    def first(self, signum: int) -> float | None:
        return next((t for t, s in self.signals if s == signum), None)

    async def wait(self) -> int:
        return await asyncio.shield(self._status)


class Lab:
    """One in-memory store on the fake clock; supervisors and plain candidates on it."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.store = InMemoryProvider(clock=clock.monotonic)
        self.children: list[FakeChild] = []
        self.ignores_term = False
        self.acquired: list[tuple[str, int, float]] = []
        self._tasks: list[asyncio.Task[Any]] = []

    async def spawn(self, env: Mapping[str, str]) -> FakeChild:
        child = FakeChild(env, ignores_term=self.ignores_term, pid=1000 + len(self.children))
        self.children.append(child)
        return child

    def election(self, name: str, provider: Provider | None = None) -> LeaderElection:
        election = LeaderElection(
            provider or self.store, group="g", participant_id=name, lease_duration=LEASE
        )
        self._tasks.append(asyncio.ensure_future(self._record(election)))
        return election

    async def _record(self, election: LeaderElection) -> None:
        async for event in election.events(EventKind.ACQUIRED):
            assert event.token is not None
            self.acquired.append((election.participant_id, event.token, self.clock.now))

    def supervisor(
        self, name: str = "a", provider: Provider | None = None, **kwargs: Any
    ) -> tuple[Supervisor, asyncio.Task[int]]:
        kwargs.setdefault("grace", GRACE)
        supervisor = Supervisor(self.election(name, provider), self.spawn, **kwargs)
        return supervisor, asyncio.ensure_future(supervisor.run())

    async def leading(
        self, provider: Provider | None = None, **kwargs: Any
    ) -> tuple[Supervisor, asyncio.Task[int]]:
        """Supervisor "a", once it leads and its command runs."""
        supervisor, task = self.supervisor("a", provider, **kwargs)
        await self.wait_for(lambda: bool(self.children))
        return supervisor, task

    async def faulty_leader(self) -> tuple[Supervisor, asyncio.Task[int], FaultyProvider]:
        """Supervisor "a", talking to the store through a `FaultyProvider`, running its command."""
        faulty = FaultyProvider(self.store)
        return (*await self.leading(faulty), faulty)

    async def wait_for(self, condition: Callable[[], bool], seconds: float = 10 * LEASE) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not condition():
            assert loop.time() < end, "the condition did not come true in time"
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def run(test: Callable[[Lab], Coroutine[Any, Any, None]]) -> None:
    clock = FakeClock()

    async def main() -> None:
        lab = Lab(clock)
        try:
            await test(lab)
        finally:
            await lab.close()

    clock.run(main())


def test_the_command_gets_the_term_and_its_status_is_the_exit_code() -> None:
    async def body(lab: Lab) -> None:
        _, task = await lab.leading()
        child = lab.children[0]
        assert child.env["MULTILOCK_GROUP"] == "g"
        assert child.env["MULTILOCK_PARTICIPANT_ID"] == "a"
        assert child.token == 1
        leader = await lab.store.get_leader("g")
        assert leader is not None
        assert (leader.participant_id, leader.token) == ("a", 1)
        child.exit(3)
        assert await task == 3
        assert await lab.store.get_leader("g") is None, "released when the command exited"
        assert [s for _, s in child.signals] == []

    run(body)


def test_a_healthy_term_never_signals_the_command() -> None:
    async def body(lab: Lab) -> None:
        supervisor, task = await lab.leading()
        await asyncio.sleep(LEASE * 20)
        child = lab.children[0]
        assert child.alive
        assert child.signals == []
        supervisor.request_stop(signal.SIGTERM)
        assert await task == 128 + signal.SIGTERM  # the command died of the SIGTERM

    run(body)


@pytest.mark.parametrize("fault", [Fault.HANG, Fault.RAISE])
@pytest.mark.parametrize("ignores_term", [False, True], ids=["obeys-term", "ignores-term"])
def test_the_command_is_dead_before_anyone_else_can_acquire(
    fault: Fault, ignores_term: bool
) -> None:
    async def body(lab: Lab) -> None:
        lab.ignores_term = ignores_term
        _, task, faulty = await lab.faulty_leader()
        b = lab.election("b")
        await b.start()
        await asyncio.sleep(LEASE * 1.5)
        child = lab.children[0]
        assert child.alive
        faulty.inject(fault)  # a's renewals fail from now on
        assert [who for who, _, _ in lab.acquired] == ["a"]
        await lab.wait_for(lambda: any(who == "b" for who, _, _ in lab.acquired))
        b_acquired = next(t for who, _, t in lab.acquired if who == "b")
        assert child.died_at is not None
        assert child.died_at < b_acquired, "the command outlived the lease"
        term_at = child.first(signal.SIGTERM)
        assert term_at is not None
        if ignores_term:
            kill_at = child.first(signal.SIGKILL)
            assert kill_at is not None
            assert kill_at - term_at == pytest.approx(GRACE, abs=0.02)
        assert await task == ExitCode.LOST
        await b.stop()

    run(body)


def test_sigkill_comes_no_later_than_the_deadline() -> None:
    async def body(lab: Lab) -> None:
        lab.ignores_term = True
        supervisor, task, faulty = await lab.faulty_leader()
        await asyncio.sleep(LEASE)
        leadership = supervisor._election.leadership
        assert leadership is not None
        faulty.inject(Fault.HANG)
        deadline = lab.clock.now + leadership.time_left
        assert await task == ExitCode.LOST
        child = lab.children[0]
        term_at, kill_at = child.first(signal.SIGTERM), child.first(signal.SIGKILL)
        assert term_at is not None
        assert kill_at is not None
        assert term_at == pytest.approx(deadline - GRACE, abs=0.02)
        assert kill_at <= deadline + 1e-6

    run(body)


def test_a_refused_renew_kills_the_command_at_once() -> None:
    async def body(lab: Lab) -> None:
        lab.ignores_term = True
        _, task, faulty = await lab.faulty_leader()
        faulty.inject(Fault.REFUSE, "renew")  # the store says the lease is not ours
        injected = lab.clock.now
        assert await task == ExitCode.LOST
        child = lab.children[0]
        kill_at = child.first(signal.SIGKILL)
        assert kill_at is not None
        # The next renew (a third of the lease later) is refused; SIGKILL follows at once.
        assert kill_at - injected <= LEASE / 3 + 0.01
        assert child.died_at == kill_at

    run(body)


def test_stop_forwards_sigterm_and_keeps_leading_through_the_grace() -> None:
    async def body(lab: Lab) -> None:
        lab.ignores_term = True
        supervisor, task = await lab.leading()
        child = lab.children[0]
        supervisor.request_stop(signal.SIGINT)
        await lab.wait_for(lambda: bool(child.signals))
        assert child.signals[0][1] == signal.SIGTERM
        await asyncio.sleep(GRACE / 2)
        assert supervisor._election.is_leader, "still leading while the command stops"
        assert child.alive
        assert await task == 128 + signal.SIGKILL
        kill_at = child.first(signal.SIGKILL)
        assert kill_at == pytest.approx(child.signals[0][0] + GRACE, abs=0.02)
        assert await lab.store.get_leader("g") is None

    run(body)


def test_a_second_stop_request_kills_at_once() -> None:
    async def body(lab: Lab) -> None:
        lab.ignores_term = True
        supervisor, task = await lab.leading()
        supervisor.request_stop(signal.SIGTERM)
        await asyncio.sleep(0.1)
        supervisor.request_stop(signal.SIGTERM)
        assert await task == 128 + signal.SIGKILL
        child = lab.children[0]
        kill_at, term_at = child.first(signal.SIGKILL), child.first(signal.SIGTERM)
        assert kill_at is not None
        assert term_at is not None
        assert kill_at - term_at < GRACE / 2

    run(body)


def test_a_command_that_exits_on_sigterm_gives_its_own_status() -> None:
    async def body(lab: Lab) -> None:
        supervisor, task = await lab.leading()
        child = lab.children[0]
        child.ignores_term = True
        supervisor.request_stop(signal.SIGTERM)
        await lab.wait_for(lambda: bool(child.signals))
        child.exit(0)  # a clean shutdown
        assert await task == 0

    run(body)


def test_stop_before_leading_exits_with_the_signal() -> None:
    async def body(lab: Lab) -> None:
        holder = lab.election("holder")
        await holder.start()
        await holder.wait_until_leader()
        supervisor, task = lab.supervisor("a")
        await asyncio.sleep(LEASE)
        supervisor.request_stop(signal.SIGTERM)
        assert await task == 128 + signal.SIGTERM
        assert lab.children == []
        await holder.stop()

    run(body)


def test_forever_runs_the_command_again_in_each_new_term() -> None:
    async def body(lab: Lab) -> None:
        supervisor, task = lab.supervisor("a", forever=True)
        for run_number in range(3):
            await lab.wait_for(lambda n=run_number: len(lab.children) > n)
            lab.children[run_number].exit(1 if run_number == 1 else 0)
        await lab.wait_for(lambda: len(lab.children) > 3)
        tokens = [child.token for child in lab.children]
        assert tokens == sorted(set(tokens)), "each run has a term of its own"
        # One run at a time: each started after the previous one died.
        for before, after in zip(lab.children, lab.children[1:], strict=False):
            assert before.died_at is not None
            assert before.died_at < after.started_at
        supervisor.request_stop(signal.SIGTERM)
        assert await task == 128 + signal.SIGTERM

    run(body)


def test_forever_lets_a_waiting_candidate_lead_between_runs() -> None:
    async def body(lab: Lab) -> None:
        a, task_a = lab.supervisor("a", forever=True)
        await lab.wait_for(lambda: bool(lab.children))
        b, task_b = lab.supervisor("b", forever=True)
        await asyncio.sleep(LEASE)
        assert len(lab.children) == 1
        lab.children[0].exit(0)  # a's run ends: a resigns, b is waiting
        await lab.wait_for(lambda: len(lab.children) == 2)
        second = lab.children[1]
        assert second.env["MULTILOCK_PARTICIPANT_ID"] == "b"
        assert second.token > lab.children[0].token
        b.request_stop(signal.SIGTERM)
        assert await task_b == 128 + signal.SIGTERM
        await lab.wait_for(lambda: len(lab.children) == 3)
        assert lab.children[2].env["MULTILOCK_PARTICIPANT_ID"] == "a"
        a.request_stop(signal.SIGTERM)
        assert await task_a == 128 + signal.SIGTERM

    run(body)


def test_a_command_that_cannot_start_ends_the_run_and_releases() -> None:
    async def body(lab: Lab) -> None:
        async def broken(env: Mapping[str, str]) -> FakeChild:
            raise CliError("nosuch: command not found", ExitCode.NOT_FOUND)

        supervisor = Supervisor(lab.election("a"), broken, grace=GRACE)
        with pytest.raises(CliError, match="not found"):
            await supervisor.run()
        assert await lab.store.get_leader("g") is None

    run(body)


@pytest.mark.parametrize("lease", [0.1, 0.5, 1, 2, 5, 10, 15, 30, 60, 3600])
def test_the_default_grace_always_passes_the_rule(lease: float) -> None:
    options = ElectionOptions(lease_duration=lease)
    assert check_grace(default_grace(options), options) == lease / 5


def test_a_grace_that_a_healthy_term_could_trigger_is_rejected() -> None:
    options = ElectionOptions(lease_duration=15)
    # (15 * 0.99 - 0.25 - 5) / 2 = 4.8
    assert check_grace(4.8, options) == 4.8
    with pytest.raises(ConfigurationError, match=r"--grace 4\.9 is too long for --lease 15"):
        check_grace(4.9, options)
    with pytest.raises(ConfigurationError, match="positive"):
        check_grace(0, options)
    with pytest.raises(ConfigurationError, match="positive"):
        check_grace(-1, options)


class FakeGuard:
    """Records what the supervisor tells the watchdog, with the loop's time."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.calls: list[tuple[str, float | None, int]] = []  # (what, deadline, children)

    def _note(self, what: str, deadline: float | None) -> None:
        self.calls.append((what, deadline, len(self.lab.children)))

    def arm(self, deadline: float) -> None:
        self._note("arm", deadline)

    def extend(self, deadline: float) -> None:
        self._note("extend", deadline)

    def disarm(self) -> None:
        self._note("disarm", None)


def test_the_guard_is_armed_before_the_command_extended_on_each_renew_then_disarmed() -> None:
    async def body(lab: Lab) -> None:
        guard = FakeGuard(lab)
        _supervisor, task = await lab.leading(guard=guard)
        await asyncio.sleep(LEASE)  # three renewals
        child = lab.children[0]
        child.exit(0)
        assert await task == 0
        whats = [c[0] for c in guard.calls]
        assert whats == ["arm", "extend", "extend", "extend", "disarm"], guard.calls
        assert guard.calls[0][2] == 0  # armed before the command was started
        deadlines = [c[1] for c in guard.calls[:-1]]
        assert deadlines == sorted(deadlines)
        assert deadlines[0] is not None
        assert deadlines[0] - child.started_at <= LEASE  # the term's own local deadline
        assert guard.calls[-1][2] == 1

    run(body)


def test_a_guard_for_another_election_hears_nothing_of_this_one() -> None:
    async def body(lab: Lab) -> None:
        guard = FakeGuard(lab)
        _, task = await lab.leading(guard=guard)
        other = LeaderElection(lab.store, group="h", participant_id="b", lease_duration=LEASE)
        await other.start()  # leads its own group and renews in the same process
        await asyncio.sleep(LEASE + 0.5)
        assert other.statistics().renewals == 3
        renewals = [c for c in guard.calls if c[0] == "extend"]
        assert len(renewals) == 3  # only supervisor a's own renewals
        lab.children[0].exit(0)
        await task
        await other.stop()

    run(body)
