"""A deterministic simulator: elections, a faulty store and a random user, in virtual time.

In the spirit of FoundationDB's simulation and TigerBeetle's VOPR: one seed drives
everything (how many elections, the timings, every fault and every user call), time is a
`FakeClock` that jumps to the next timer, so one seed is one reproducible run, and a whole
run of thousands of steps takes a fraction of a second.

The world of one run (`simulate`):

- 2 to 5 `LeaderElection` objects of one group (sometimes two groups, sometimes two
  elections configured with one participant id) on one event loop, each talking to the
  store through its own faulty link: a `Provider` wrapping one shared `InMemoryProvider`
  that judges expiry on the fake clock. The link adds delays, hangs until cancelled,
  raises `ProviderError`, loses replies after the write was applied (the write happens,
  then the call raises or hangs), applies writes late (the call sleeps before touching the
  store, and a write whose caller gave up may still land later), cuts a participant off
  for a while, and drops, duplicates or breaks watch notifications. Rarely the store
  itself forgets a live lease (a failover): that term is *doomed*, exempt from the
  one-leader rule until its holder hears of it.
- A random user: each step starts one call as a task (start, stop, stop-then-start,
  resign, wait_until_leader, run_while_leader / run_if_leader with work that returns,
  raises, runs until cancelled or ignores its cancellation for a while, current_leader,
  statistics, an ``events()`` consumer) and often cancels it after a random number of
  loop iterations or a random virtual delay.
- Invariants, checked at every loop iteration (a hook in the event loop's selector) and
  after every step; the first one broken ends the run with a `SimulationFailure` carrying
  the seed, a line to replay it, and the last lines of the trace:

  * at most one election of a group has ``is_leader`` true at any instant, and the store
    holds that election's term while it does; a leader whose renew was answered "not
    yours" steps down at once;
  * at most one live term per group on the store, and tokens rise strictly, on the store,
    in the order terms are led, and in ACQUIRED events;
  * per election ACQUIRED and LOST alternate, with matching tokens; LOST arrives for every
    term, no later than the term's deadline plus ``renew_interval`` (and a little); once
    ``is_leader`` turned false for a term it never turns true again, and never after LOST;
    no two LEADER_CHANGED in a row name the same leader;
  * leader work never starts for an ended term, and is cancelled as soon as the term ends;
    run_if_leader reports what its work did;
  * start, stop, resign and current_leader return (or raise what they may raise) within a
    bound; a second stop() after a cancelled one completes, start() after stop() works;
    a call that overlapped no other start()/stop() leaves the election in its state; after
    stop() returns no task of the election runs, and event streams subscribed before it
    end;
  * with faults healed and every election started, each group gets a leader; after the
    final stop() every task is done and every ACQUIRED has had its LOST.

Determinism: every random choice comes from the seed (the global `random`, which the
core's jitter uses, is seeded for the run and restored after it); nothing reads the wall
clock. Timers due at one instant would run in an order that depends on the timer heap's
history, which the core's sets of tasks can perturb, so the simulator never makes such
ties: each election's lease differs by 0.1 %, and watchers of one lease wake a microsecond
apart. Lines written by tasks woken in one loop iteration are sorted by source.

`run_simulations` runs many seeds (in several processes) for long campaigns; ``nox -s
simulate`` drives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import math
import os
import random
import selectors
import sys
import time
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Generic, Protocol, TypeVar

import attrs

from .._election import LeaderElection
from .._errors import MultilockError, ProviderError
from .._memory import InMemoryProvider
from .._provider import Provider
from .._types import ElectionState, EventKind, LeaderInfo, Leadership, LeadershipEvent, RunStatus
from ._clock import FakeClock, _JumpingSelector

__all__ = [
    "SimulationConfig",
    "SimulationFailure",
    "SimulationReport",
    "StoreFactory",
    "run_simulations",
    "simulate",
]

T = TypeVar("T")

#: Builds the store under the faulty links from the simulation's monotonic clock.
StoreFactory = Callable[[Callable[[], float]], Provider]

_RUNNING = (ElectionState.CAMPAIGNING, ElectionState.LEADING)
#: Calls that must return within a bound (the others may wait for a term for ever).
_BOUNDED = frozenset({"start", "stop", "resign", "current_leader"})
_LONG_LIVED = frozenset({"wait_until_leader", "run_while_leader", "run_if_leader", "events"})
_ACTIONS: tuple[tuple[str, int], ...] = (
    ("start", 12),
    ("stop", 8),
    ("bounce", 2),
    ("resign", 10),
    ("wait_until_leader", 6),
    ("run_while_leader", 6),
    ("run_if_leader", 10),
    ("current_leader", 6),
    ("events", 4),
    ("statistics", 4),
    ("partition", 2),
    ("store_forgets", 1),
    ("idle", 14),
)
_ACTION_NAMES = tuple(name for name, _ in _ACTIONS)
_ACTION_WEIGHTS = tuple(weight for _, weight in _ACTIONS)
_UNSET = object()


# ---------------------------------------------------------------------- public records
class _Replayable(Protocol):
    """What a `SimulationFailure` uses of its run's configuration (`SimulationConfig`, or
    the holders' `HoldersConfig`)."""

    @property
    def seed(self) -> int: ...

    def reproduce(self) -> str: ...


class _RunConfig(_Replayable, Protocol):
    """What every simulated world reads of its configuration."""

    @property
    def steps(self) -> int: ...

    @property
    def lease_duration(self) -> float: ...

    @property
    def faults(self) -> float: ...


_ConfigT = TypeVar("_ConfigT", bound=_RunConfig)


@attrs.frozen(kw_only=True)
class SimulationConfig:
    """Everything that shapes one run; fields left unset in `simulate` come from the seed."""

    seed: int
    steps: int
    elections: int
    groups: int
    lease_duration: float
    #: Fault intensity, 0 (a perfect store) to 1 (a very bad network).
    faults: float
    #: Probability that a user call is cancelled at a random point.
    cancel_rate: float
    #: Two elections of a group share one participant id (two processes, one id).
    shared_ids: bool
    custom_store: bool = False

    def reproduce(self) -> str:
        """The call that replays this run."""
        store = ", store=<the same store factory>" if self.custom_store else ""
        return (
            f"simulate({self.seed}, steps={self.steps}, elections={self.elections}, "
            f"groups={self.groups}, lease_duration={self.lease_duration!r}, "
            f"faults={self.faults!r}, cancel_rate={self.cancel_rate!r}, "
            f"shared_ids={self.shared_ids}{store})"
        )


@attrs.frozen(kw_only=True)
class SimulationReport:
    """What a run that kept every invariant did."""

    config: SimulationConfig
    steps: int
    virtual_seconds: float
    #: ACQUIRED events seen, over all elections.
    terms: int
    #: The highest fencing token the store granted, per group.
    tokens: Mapping[str, int]
    #: User calls made, per kind.
    calls: Mapping[str, int]
    cancellations: int
    #: Faults injected, per kind.
    faults: Mapping[str, int]
    #: SHA-256 of the canonical trace: equal for two runs of one seed.
    trace_digest: str
    #: The canonical trace, with ``keep_trace=True`` (empty otherwise).
    trace: tuple[str, ...] = ()
    #: Messages the event loop reported (unretrieved exceptions...); not part of the trace.
    loop_errors: tuple[str, ...] = ()


class SimulationFailure(AssertionError):
    """An invariant broke: carries the seed, how to replay it, and the end of the trace."""

    def __init__(
        self,
        invariant: str,
        *,
        config: _Replayable,
        step: int,
        at: float,
        trace: Sequence[str],
    ) -> None:
        self.invariant = invariant
        self.config = config
        self.seed = config.seed
        self.step = step
        self.at = at
        self.trace = tuple(trace)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(
            [
                f"simulation seed {self.seed} broke an invariant at step {self.step}, "
                f"t={self.at:.6f} s (virtual): {self.invariant}",
                f"replay: {self.config.reproduce()}",
                f"last {len(self.trace)} trace lines (virtual time, who, what):",
                *self.trace,
            ]
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_failure, (self.invariant, self.config, self.step, self.at, self.trace))


def _rebuild_failure(
    invariant: str, config: _Replayable, step: int, at: float, trace: Sequence[str]
) -> SimulationFailure:
    return SimulationFailure(invariant, config=config, step=step, at=at, trace=trace)


# ---------------------------------------------------------------------- the event loop
class _Abort(Exception):
    """Raised out of the event loop to end a run that cannot end by itself."""


class _SimSelector(_JumpingSelector):
    def __init__(self, clock: FakeClock, hook: Callable[[bool], None]) -> None:
        super().__init__(clock)
        self._hook = hook

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Every iteration of the loop passes here: check the invariants in between.
        self._hook(timeout is None)
        return super().select(timeout)


class _SimLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: FakeClock, hook: Callable[[bool], None]) -> None:
        super().__init__(selector=_SimSelector(clock, hook))
        self._fake = clock
        self._clock_resolution = 0.0

    def time(self) -> float:
        return self._fake.now


# ---------------------------------------------------------------------- bookkeeping
@attrs.define(eq=False)
class _Lease:
    pid: str
    expires: float


@attrs.define(eq=False)
class _StopRecord:
    began: float
    effective: bool
    completed: float | None = None


@attrs.define(eq=False)
class _Term:
    member: _Member
    token: int
    leadership: Leadership | None = None
    first_seen: float | None = None
    ended_at: float | None = None
    acquired: bool = False
    lost: bool = False


@attrs.define(eq=False)
class _Member:
    index: int
    name: str
    pid: str
    group: str
    renew_interval: float
    election: LeaderElection
    net: _Link
    leading: _Term | None = None
    holding: int | None = None
    lost_tokens: set[int] = attrs.field(factory=set)
    changed_key: object = _UNSET
    stops: list[_StopRecord] = attrs.field(factory=list)
    #: start()/stop() calls in flight, and how many ever began.
    lifecycle: int = 0
    epoch: int = 0


@attrs.define(eq=False)
class _Call:
    id: int
    kind: str
    member: _Member
    src: str
    rng: random.Random
    started: float
    task: asyncio.Task[None] | None = None
    works: int = 0
    work_value: str | None = None
    cancelled: bool = False

    @property
    def cancel_note(self) -> str:
        return f"cancel {self.kind}()"


class _Cancellable(Protocol):
    """What the simulator may cancel from outside: a user call, an entry, a leave..."""

    src: str
    cancelled: bool

    @property
    def task(self) -> asyncio.Task[None] | None: ...

    @property
    def cancel_note(self) -> str:
        """The trace line of its cancellation."""
        ...


@attrs.define(eq=False)
class _Work:
    """Leader work running for a term; it must be cancelled as soon as the term ends."""

    src: str
    leadership: Leadership
    cancelled: bool = False
    finished: bool = False
    invalid_since: float | None = None


@attrs.define(eq=False)
class _Consumer:
    member: _Member
    subscribed_at: float
    stop_index: int
    active: bool = True


@attrs.frozen
class _Plan:
    pre: str | None = None  # "hang" | "raise"
    pre_delay: float = 0.0
    post: str | None = None  # "hang" | "raise": the write was applied, the reply is lost
    post_delay: float = 0.0
    zombie: bool = False  # a write whose caller gave up during pre_delay still lands


_NO_FAULT = _Plan()


class _SimulatedWorkError(Exception):
    """Raised by leader work on purpose."""


# ---------------------------------------------------------------------- the store
class _Ledger:
    """What the store must hold, from every reply it gave; and the watch notifications."""

    def __init__(self, sim: _World[Any]) -> None:
        self._sim = sim
        self.leases: dict[str, dict[int, _Lease]] = {}
        self.top: dict[str, int] = {}
        self.granted: dict[tuple[str, int], str] = {}
        self._watchers: dict[str, list[asyncio.Event]] = {}

    def live(self, group: str, now: float) -> tuple[int, _Lease] | None:
        best: tuple[int, _Lease] | None = None
        for token, lease in self.leases.get(group, {}).items():
            if lease.expires > now and (best is None or token > best[0]):
                best = (token, lease)
        return best

    def holds(self, group: str, pid: str, token: int, now: float) -> bool:
        lease = self.leases.get(group, {}).get(token)
        return lease is not None and lease.pid == pid and lease.expires > now

    def next_expiry(self, group: str, now: float) -> float | None:
        times = [lease.expires for lease in self.leases.get(group, {}).values()]
        live = [t for t in times if t > now]
        return min(live) if live else None

    def on_grant(self, group: str, info: LeaderInfo, lease_duration: float, now: float) -> None:
        entries = self.leases.setdefault(group, {})
        token, pid = info.token, info.participant_id
        mine = entries.get(token)
        if mine is not None and mine.pid == pid and mine.expires > now:
            mine.expires = now + lease_duration  # the old contract: a holder re-acquired
            return
        top = self.top.get(group, 0)
        if token <= top:
            self._sim.store_violation(
                f"fencing: the store granted token {token} in group {group} to {pid}, "
                f"but token {top} was granted before"
            )
        for other, lease in entries.items():
            if lease.expires > now:
                self._sim.store_violation(
                    f"two live terms on the store in group {group}: token {token} granted to "
                    f"{pid} while token {other} of {lease.pid} is live for "
                    f"{lease.expires - now:.3f} s more"
                )
        for other in [t for t, lease in entries.items() if lease.expires <= now]:
            del entries[other]
        entries[token] = _Lease(pid, now + lease_duration)
        self.top[group] = max(top, token)
        self.granted[(group, token)] = pid
        self.notify(group)

    def on_renew(
        self, group: str, pid: str, token: int, lease_duration: float, now: float, ok: bool
    ) -> None:
        held = self.holds(group, pid, token, now)
        if ok and held:
            self.leases[group][token].expires = now + lease_duration
        elif ok:
            self._sim.store_violation(
                f"the store renewed token {token} of {pid} in group {group}, a term it did not hold"
            )
        elif held and self._sim.strict_store:
            self._sim.store_violation(
                f"the store refused to renew token {token} of {pid} in group {group}, "
                "a term it holds"
            )

    def on_release(self, group: str, pid: str, token: int, now: float) -> None:
        if self.holds(group, pid, token, now):
            del self.leases[group][token]
            self.notify(group)

    def forget(self, group: str, token: int) -> None:
        """The store lost a live lease (a failover, an operator): its holder is doomed."""
        del self.leases[group][token]
        self._sim.doomed.add((group, token))
        self.notify(group)

    def check_leader(self, group: str, info: LeaderInfo | None, now: float) -> None:
        """Compare get_leader's answer with the ledger (only for the plain store)."""
        live = self.live(group, now)
        expected = None if live is None else (live[1].pid, live[0])
        got = None if info is None else (info.participant_id, info.token)
        if expected != got:
            self._sim.store_violation(
                f"simulator error: the ledger of group {group} says {expected}, "
                f"the store's get_leader says {got}"
            )

    def subscribe(self, group: str, event: asyncio.Event) -> None:
        self._watchers.setdefault(group, []).append(event)

    def unsubscribe(self, group: str, event: asyncio.Event) -> None:
        watchers = self._watchers.get(group, [])
        if event in watchers:
            watchers.remove(event)

    def notify(self, group: str) -> None:
        for event in self._watchers.get(group, []):
            event.set()


class _Link(Provider):
    """One election's faulty connection to the shared store."""

    def __init__(self, sim: _World[Any], index: int, inner: Provider, rng: random.Random) -> None:
        self._sim = sim
        self._index = index
        #: The link's name in the trace.
        self.name = f"net{index}"
        # Watchers of one lease would all wake at its expiry, on timers due at the same
        # instant; the loop runs such timers in an order that depends on its heap's history.
        # A microsecond apart, in link order, keeps every run of a seed the same.
        self._tiebreak = (index + 1) * 1e-6
        self._inner = inner
        self._rng = rng
        self.cut_until = 0.0
        self.cut_mode = "hang"

    def __repr__(self) -> str:
        return f"<simulated link {self.name}>"

    # -- faults
    def _delay(self) -> float:
        lease = self._sim.lease
        if self._rng.random() < 0.1:
            return self._rng.uniform(0.2, 1.2) * lease
        return min(self._rng.expovariate(1 / (0.04 * lease)), lease)

    def _plan(self, method: str, write: bool) -> _Plan:
        sim = self._sim
        if sim.now() < self.cut_until:
            return _Plan(pre=self.cut_mode)
        level = sim.fault_level
        if level <= 0:
            return _NO_FAULT
        rng = self._rng
        x = rng.random()
        if x < 0.02 * level:
            return _Plan(pre="hang")
        if x < 0.08 * level:
            return _Plan(pre="raise")
        pre_delay = self._delay() if rng.random() < 0.35 * level else 0.0
        post: str | None = None
        zombie = False
        if write:
            y = rng.random()
            if y < 0.04 * level:
                post = "raise"
            elif y < 0.06 * level:
                post = "hang"
            zombie = rng.random() < 0.5
        post_delay = self._delay() if rng.random() < 0.25 * level else 0.0
        if not (pre_delay or post or post_delay):
            return _NO_FAULT
        return _Plan(pre_delay=pre_delay, post=post, post_delay=post_delay, zombie=zombie)

    async def _hang(self) -> None:
        await asyncio.get_running_loop().create_future()

    async def _call(
        self, method: str, op: Callable[[], Coroutine[Any, Any, T]], *, write: bool
    ) -> T:
        plan = self._plan(method, write)
        sim = self._sim
        if plan is not _NO_FAULT:
            parts = []
            if plan.pre:
                parts.append(f"{plan.pre} before the store")
            if plan.pre_delay:
                parts.append(f"reaches the store after {plan.pre_delay:.3f} s")
            if plan.post:
                parts.append(f"applied, then the reply is lost ({plan.post})")
            if plan.post_delay:
                parts.append(f"reply {plan.post_delay:.3f} s late")
            sim.trace(self.name, f"{method}: {', '.join(parts)}")
            sim.faults[plan.pre or ("lost reply" if plan.post else "delay")] += 1
        if plan.pre == "raise":
            raise ProviderError(f"simulated: {method} failed") from ConnectionError("cut")
        if plan.pre == "hang":
            await self._hang()
        if plan.pre_delay:
            began = sim.now()
            try:
                await asyncio.sleep(plan.pre_delay)
            except asyncio.CancelledError:
                if write and plan.zombie:
                    remaining = max(plan.pre_delay - (sim.now() - began), 0.0)
                    sim.spawn_zombie(self.name, method, remaining, op)
                raise
        result = await op()
        if plan.post == "raise":
            raise ProviderError(f"simulated: the reply to {method} was lost")
        if plan.post == "hang":
            await self._hang()
        if plan.post_delay:
            await asyncio.sleep(plan.post_delay)
        return result

    # -- the provider interface
    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        async def op() -> LeaderInfo | None:
            now = self._sim.now()
            info = await self._inner.try_acquire(group, participant_id, lease_duration, metadata)
            if info is not None:
                self._sim.ledger.on_grant(group, info, lease_duration, now)
            return info

        return await self._call("try_acquire", op, write=True)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        async def op() -> bool:
            now = self._sim.now()
            ok = await self._inner.renew(group, participant_id, token, lease_duration, metadata)
            self._sim.ledger.on_renew(group, participant_id, token, lease_duration, now, ok)
            return ok

        ok = await self._call("renew", op, write=True)
        if not ok:  # delivered: the election now knows the term is gone
            self._sim.refused[(self._index, token)] = self._sim.now()
        return ok

    async def release(self, group: str, participant_id: str, token: int) -> None:
        async def op() -> None:
            now = self._sim.now()
            await self._inner.release(group, participant_id, token)
            self._sim.ledger.on_release(group, participant_id, token, now)

        await self._call("release", op, write=True)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        async def op() -> LeaderInfo | None:
            info = await self._inner.get_leader(group)
            if self._sim.strict_store:
                self._sim.ledger.check_leader(group, info, self._sim.now())
            return info

        return await self._call("get_leader", op, write=False)

    def watch(self, group: str) -> AsyncIterator[None]:
        return self._watch(group)

    async def _watch(self, group: str) -> AsyncIterator[None]:
        sim, ledger = self._sim, self._sim.ledger
        event = asyncio.Event()
        ledger.subscribe(group, event)
        try:
            while True:
                now = sim.now()
                seen = ledger.live(group, now)
                seen_token = None if seen is None else seen[0]
                if not event.is_set():
                    expiry = ledger.next_expiry(group, now)
                    wake = None if expiry is None else expiry + self._tiebreak
                    try:
                        async with asyncio.timeout_at(wake):
                            await event.wait()
                    except TimeoutError:
                        live = ledger.live(group, sim.now())
                        if (None if live is None else live[0]) == seen_token:
                            continue  # renewed meanwhile: nothing to report
                event.clear()
                if sim.now() < self.cut_until:
                    continue  # cut off: hears nothing
                duplicate = False
                if sim.fault_level > 0:
                    x = self._rng.random()
                    if x < 0.02 * sim.fault_level:
                        sim.trace(self.name, "watch: breaks")
                        sim.faults["watch break"] += 1
                        raise ProviderError("simulated: the watch broke")
                    if x < 0.12 * sim.fault_level:
                        sim.trace(self.name, "watch: notification dropped")
                        sim.faults["watch drop"] += 1
                        continue
                    if x < 0.22 * sim.fault_level:
                        sim.faults["watch duplicate"] += 1
                        duplicate = True
                yield None
                if duplicate:
                    yield None
        finally:
            ledger.unsubscribe(group, event)

    async def aclose(self) -> None:
        return


# ---------------------------------------------------------------------- the worlds
class _World(Generic[_ConfigT]):
    """What every simulated world shares: the clock, the seeded randomness, the trace, the
    store and its ledger, the failure, and the run's skeleton on a `_SimLoop`. It offers
    what `_Link` and `_Ledger` use of their simulation.

    A subclass builds its world (`_drive`), acts at each step (`_act`) and checks its
    invariants at every loop iteration (`_check_iteration`) and after every step
    (`_check_step`).
    """

    def __init__(
        self, config: _ConfigT, store: StoreFactory | None, trace_lines: int, *, seed: str
    ) -> None:
        self.config = config
        self.lease = config.lease_duration
        #: The longest lease of any participant: bounds scale with it.
        self.max_lease = self.lease
        self.clock = FakeClock()
        self.t0 = self.clock.now
        self.rng = random.Random(seed)
        self.store_factory = store
        self.strict_store = store is None
        self.trace_lines = trace_lines
        self.fault_level = config.faults
        self.faults: Counter[str] = Counter()
        self.ledger = _Ledger(self)
        self.pending_store: list[str] = []
        #: Terms whose lease the store lost: their holder may lead on until it learns it.
        self.doomed: set[tuple[str, int]] = set()
        #: (link index, token) -> when a renew answered False to it.
        self.refused: dict[tuple[int, int], float] = {}
        self.store: Provider = InMemoryProvider()  # replaced in _make_store
        self.links = 0
        self.lines: list[tuple[float, str, int, str]] = []
        self.full_trace: list[str] = []
        self.seq = 0
        self.step = 0
        self.failure: tuple[str, float, int] | None = None
        self.cancellations = 0
        self.checking = False
        self.closing = False
        self.abort_at: float | None = None
        self.loop_errors: list[str] = []
        self.own_tasks: set[asyncio.Task[Any]] = set()
        self.call_bound = 12 * self.lease + 2.0

    # -- what the links use, and utilities
    def now(self) -> float:
        return self.clock.now

    def trace(self, src: str, text: str) -> None:
        self.seq += 1
        self.lines.append((self.clock.now, src, self.seq, text))

    def canonical_trace(self) -> list[str]:
        # Tasks woken in one loop iteration may run in an order that depends on memory
        # addresses (sets of tasks in the core); every source writes its own lines in
        # order, so sorting by (time, source) gives the same text for the same run.
        ordered = sorted(self.lines, key=lambda line: (line[0], line[1], line[2]))
        return [f"{t - self.t0:14.6f} {src:<10} {text}" for t, src, _, text in ordered]

    def failed(self) -> bool:
        return self.failure is not None

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = (message, self.clock.now, self.step)
            self.trace("CHECK", f"VIOLATION: {message}")

    def store_violation(self, message: str) -> None:
        self.pending_store.append(message)

    def spawn_zombie(
        self, link: str, method: str, delay: float, op: Callable[[], Coroutine[Any, Any, Any]]
    ) -> None:
        async def land() -> None:
            await asyncio.sleep(delay)
            self.trace(link, f"{method}: a write whose caller gave up lands now")
            self._landing()
            await op()

        self.faults["late write"] += 1
        self._spawn(land(), f"sim:late-{method}")

    def _landing(self) -> None:
        """A late write is about to land."""

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.own_tasks.add(task)
        task.add_done_callback(self.own_tasks.discard)
        return task

    # -- the run
    def _run(self, core_seed: str, log_level: int) -> str:
        """Drive the world on its own loop; return the trace's digest, or raise the
        `SimulationFailure`. The global `random` (the core's jitter) is seeded with
        *core_seed* for the run and restored after it."""
        saved_random = random.getstate()
        random.seed(core_seed)
        logger = logging.getLogger("multilock")
        saved_level = logger.level
        logger.setLevel(log_level)
        loop = _SimLoop(self.clock, self._tick)
        loop.set_exception_handler(self._loop_error)
        try:
            with self._watching(logger):
                main = loop.create_task(self._drive(), name="sim:driver")
                try:
                    loop.run_until_complete(main)
                except _Abort as exc:
                    self.fail(str(exc))
                finally:
                    self._teardown(loop)
        finally:
            random.setstate(saved_random)
            logger.setLevel(saved_level)
        trace = self.canonical_trace()
        if self.failure is not None:
            message, at, step = self.failure
            raise SimulationFailure(
                message,
                config=self.config,
                step=step,
                at=at - self.t0,
                trace=trace[-self.trace_lines :],
            )
        self.full_trace = trace
        return hashlib.sha256("\n".join(trace).encode()).hexdigest()

    @contextlib.contextmanager
    def _watching(self, logger: logging.Logger) -> Iterator[None]:
        """What else watches the run, around it and its teardown."""
        yield

    def _teardown(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel what is left and close the loop."""
        self.checking = False
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if pending:
            self.abort_at = self.clock.now + 100 * self.max_lease
            for task in pending:
                task.cancel()
            with contextlib.suppress(_Abort):
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.abort_at = self.clock.now + 100 * self.max_lease
        with contextlib.suppress(_Abort):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.loop_errors.append(f"{context.get('message')}: {context.get('exception')!r}")

    async def _drive(self) -> None:
        raise NotImplementedError

    async def _play(self) -> bool:
        """The random steps: act, let time pass, check. False once an invariant broke."""
        for step in range(1, self.config.steps + 1):
            self.step = step
            self._act()
            await self._advance()
            if not self.failed():
                self._step_checks()
            if self.failed():
                return False
        return True

    def _act(self) -> None:
        raise NotImplementedError

    async def _advance(self) -> None:
        rng = self.rng
        if rng.random() < 0.2:
            for _ in range(rng.randrange(1, 4)):
                await asyncio.sleep(0)
        else:
            await asyncio.sleep(min(rng.expovariate(1 / (0.1 * self.lease)), 3 * self.lease))

    # -- building
    def _make_store(self) -> None:
        """The store under the links, judging expiry on the simulation's clock."""
        clock, factory = self.clock.monotonic, self.store_factory
        self.store = InMemoryProvider(clock=clock) if factory is None else factory(clock)

    def _timings(self, index: int) -> tuple[float, float, float]:
        """A participant's lease, renew and retry intervals, drawn from the seed."""
        # A hair apart, so that no two participants' timers fall due at one instant
        # (see _Link._tiebreak).
        lease = round(self.lease * (1 + 0.001 * index), 6)
        renew = round(self.rng.uniform(0.15, 0.45) * lease, 4)
        retry = round(self.rng.uniform(0.25, 1.0) * lease, 4)
        return lease, renew, retry

    def _new_link(self) -> _Link:
        """A participant's faulty link to the shared store."""
        index, self.links = self.links, self.links + 1
        return _Link(self, index, self.store, random.Random(self.rng.getrandbits(64)))

    # -- faults and cancellations
    def _cut_off(self, name: str, link: _Link, *, extend: bool = False) -> None:
        """A partition: *link* hangs or fails every call for a while."""
        span = self.rng.uniform(0.2, 2.0) * self.lease
        until = self.now() + span
        link.cut_until = max(link.cut_until, until) if extend else until
        link.cut_mode = self.rng.choice(("hang", "raise"))
        self.faults["cut off"] += 1
        self.trace(name, f"cut off from the store for {span:.3f} s ({link.cut_mode})")

    def _maybe_cancel(self, target: _Cancellable, rate: float, span: float) -> None:
        """With probability *rate*, cancel *target* after a few loop iterations or a
        random virtual delay (up to *span*)."""
        rng = self.rng
        if rng.random() >= rate:
            return
        if rng.random() < 0.5:
            self._cancel_in(target, rng.randrange(0, 8))
        else:
            asyncio.get_running_loop().call_later(rng.uniform(0, span), self._cancel, target)

    def _cancel_in(self, target: _Cancellable, iterations: int) -> None:
        if iterations <= 0:
            self._cancel(target)
        else:
            asyncio.get_running_loop().call_soon(self._cancel_in, target, iterations - 1)

    def _cancel(self, target: _Cancellable) -> None:
        task = target.task
        if task is None or task.done() or self.closing:
            return
        target.cancelled = True
        self.cancellations += 1
        self.trace(target.src, target.cancel_note)
        task.cancel()

    async def _ignore_cancellation(self, seconds: float) -> None:
        end = self.now() + seconds
        while self.now() < end:
            try:
                await asyncio.sleep(end - self.now())
            except asyncio.CancelledError:
                continue

    # -- invariants
    def _tick(self, idle: bool) -> None:
        """Called by the event loop at every iteration, before it waits or jumps."""
        now = self.clock.now
        if self.abort_at is not None and now > self.abort_at:
            raise _Abort("the simulation could not wind down (tasks ignore cancellation)")
        if idle:
            raise _Abort("deadlock: no task can make progress and no timer is scheduled")
        if not self.checking or self.failed():
            return
        self._check_iteration(now)

    def _check_iteration(self, now: float) -> None:
        raise NotImplementedError

    def _step_checks(self) -> None:
        if self.pending_store:
            # After the participants' own invariants (checked at every iteration) had their say.
            self.fail(self.pending_store[0])
            return
        self._check_step(self.now())

    def _check_step(self, now: float) -> None:
        raise NotImplementedError

    def _held_instead(self, group: str, pid: str, token: int, now: float) -> str | None:
        """None if the store holds this term of *pid*; otherwise what it holds."""
        if self.ledger.holds(group, pid, token, now):
            return None
        live = self.ledger.live(group, now)
        return "nothing" if live is None else f"token {live[0]} of {live[1].pid}"

    def _check_works(self, works: list[_Work], now: float, what: str) -> list[_Work]:
        """Leader work whose term ended is cancelled at once; return what still runs."""
        alive = []
        for work in works:
            if work.finished:
                continue
            alive.append(work)
            if work.cancelled or work.leadership.is_valid:
                continue
            if work.invalid_since is None:
                work.invalid_since = now
            elif now - work.invalid_since > 0.001:
                self.fail(
                    f"{what} {work.src} of token {work.leadership.token} still runs "
                    f"{now - work.invalid_since:.4f} s after its term ended, not cancelled"
                )
                return works
        return alive


# ---------------------------------------------------------------------- the simulation
class _Simulation(_World[SimulationConfig]):
    def __init__(
        self, config: SimulationConfig, store: StoreFactory | None, trace_lines: int
    ) -> None:
        super().__init__(config, store, trace_lines, seed=f"multilock-sim:{config.seed}")
        self.members: list[_Member] = []
        self.by_group: list[list[_Member]] = []
        self.terms: dict[tuple[int, int], _Term] = {}
        self.open_terms: list[_Term] = []
        self.top_led: dict[str, int] = {}
        self.top_acquired: dict[str, int] = {}
        self.works: list[_Work] = []
        self.consumers: list[_Consumer] = []
        self.calls: list[_Call] = []
        self.call_counts: Counter[str] = Counter()
        self.acquired = 0
        self.call_seq = 0
        self._bodies: dict[str, Callable[[_Call], Coroutine[Any, Any, str]]] = {
            "start": self._do_start,
            "stop": self._do_stop,
            "resign": self._do_resign,
            "wait_until_leader": self._do_wait,
            "run_while_leader": self._do_run_while,
            "run_if_leader": self._do_run_if,
            "current_leader": self._do_current_leader,
            "events": self._do_events,
        }

    # -- the run
    def run(self, *, keep_trace: bool) -> SimulationReport:
        digest = self._run(f"multilock-sim-core:{self.config.seed}", logging.CRITICAL)
        return SimulationReport(
            config=self.config,
            steps=self.step,
            virtual_seconds=self.clock.now - self.t0,
            terms=self.acquired,
            tokens=dict(self.ledger.top),
            calls=dict(self.call_counts),
            cancellations=self.cancellations,
            faults=dict(self.faults),
            trace_digest=digest,
            trace=tuple(self.full_trace) if keep_trace else (),
            loop_errors=tuple(self.loop_errors),
        )

    async def _drive(self) -> None:
        self._build()
        rng = self.rng
        for member in self.members:
            if rng.random() < 0.8:
                self._launch("start", member, cancellable=False)
        self.checking = True
        if not await self._play():
            return
        await self._calm()
        if not self.failed():
            await self._finish()

    def _build(self) -> None:
        config, rng = self.config, self.rng
        self._make_store()
        groups = [f"group{g}" for g in range(config.groups)]
        self.by_group = [[] for _ in groups]
        pids = [f"p{i}" for i in range(config.elections)]
        if config.shared_ids:
            same = [i for i in range(config.elections) if i % config.groups == 0]
            if len(same) >= 2:
                pids[same[1]] = pids[same[0]]
        for i in range(config.elections):
            lease, renew, retry = self._timings(i)
            release_on_stop = rng.random() < 0.85
            name = f"e{i}"
            link = self._new_link()
            election = LeaderElection(
                link,
                group=groups[i % config.groups],
                participant_id=pids[i],
                lease_duration=lease,
                renew_interval=renew,
                retry_interval=retry,
                release_on_stop=release_on_stop,
            )
            member = _Member(
                index=i,
                name=name,
                pid=pids[i],
                group=groups[i % config.groups],
                renew_interval=renew,
                election=election,
                net=link,
            )
            self.members.append(member)
            self.by_group[i % config.groups].append(member)
            self.trace(
                "sim",
                f"{name}: {pids[i]} in {member.group}, lease {lease} renew {renew} "
                f"retry {retry} release_on_stop={release_on_stop}",
            )
            stream = election.events()
            task = asyncio.get_running_loop().create_task(
                self._record(member, stream), name=f"sim:recorder-{name}"
            )
            self.own_tasks.add(task)

    # -- user actions
    def _act(self) -> None:
        rng = self.rng
        kind = rng.choices(_ACTION_NAMES, weights=_ACTION_WEIGHTS)[0]
        member = rng.choice(self.members)
        if kind == "idle":
            return
        if kind == "statistics":
            self._statistics(member)
        elif kind == "partition":
            self._cut_off(member.name, member.net)
        elif kind == "store_forgets":
            if self.fault_level > 0:
                self._forget(member.group)
        elif kind == "bounce":
            self._launch("stop", member)
            self._launch("start", member)
        else:
            busy = sum(
                1
                for c in self.calls
                if c.member is member and c.kind == kind and c.task and not c.task.done()
            )
            if kind in _LONG_LIVED and busy >= 3:
                return
            self._launch(kind, member)

    def _forget(self, group: str) -> None:
        live = self.ledger.live(group, self.now())
        if live is None:
            return
        token, lease = live

        async def forget() -> None:
            await self.store.release(group, lease.pid, token)
            self.ledger.forget(group, token)

        self.faults["store forgets"] += 1
        self.trace("store", f"forgets the lease of {lease.pid}, token {token}, in {group}")
        self._spawn(forget(), "sim:forget")

    def _launch(self, kind: str, member: _Member, *, cancellable: bool = True) -> _Call:
        self.call_seq += 1
        call = _Call(
            id=self.call_seq,
            kind=kind,
            member=member,
            src=f"{member.name}#{self.call_seq}",
            rng=random.Random(self.rng.getrandbits(64)),
            started=self.now(),
        )
        self.call_counts[kind] += 1
        self.trace(call.src, f"{kind}() called")
        # The coroutine is made inside the task: a task cancelled before its first step
        # then leaves no coroutine that was never awaited.
        call.task = asyncio.get_running_loop().create_task(
            self._guard(call, self._bodies[kind]), name=f"sim-call:{call.src}:{kind}"
        )
        self.calls.append(call)
        if cancellable:
            rate = self.config.cancel_rate
            if kind in ("stop", "resign"):
                rate = min(1.0, rate * 1.5)
            if kind in _LONG_LIVED:
                rate = max(rate, 0.5)
            span = 6 * self.lease if kind in _LONG_LIVED else 2 * self.lease
            self._maybe_cancel(call, rate, span)
        return call

    async def _guard(self, call: _Call, body: Callable[[_Call], Coroutine[Any, Any, str]]) -> None:
        try:
            outcome = await body(call)
        except asyncio.CancelledError:
            self.trace(call.src, f"{call.kind}() cancelled")
            return
        except Exception as exc:  # any other exception breaks the contract
            self.trace(call.src, f"{call.kind}() raised {exc!r}")
            self.fail(f"{call.kind}() of {call.member.name} raised {exc!r}")
            return
        self.trace(call.src, f"{call.kind}() -> {outcome}")

    async def _do_start(self, call: _Call) -> str:
        member = call.member
        election = member.election
        member.changed_key = _UNSET
        alone = member.lifecycle == 0
        member.lifecycle += 1
        member.epoch += 1
        epoch = member.epoch
        try:
            await election.start()
            state = election.state
            # Only a call that overlapped no other start()/stop() has one possible outcome.
            if alone and member.epoch == epoch and state not in _RUNNING:
                self.fail(f"start() of {member.name} returned but the election is {state.value}")
        finally:
            member.lifecycle -= 1
        return f"ok ({state.value})"

    async def _do_stop(self, call: _Call) -> str:
        member = call.member
        election = member.election
        record = _StopRecord(
            began=self.now(),
            effective=election.state in (*_RUNNING, ElectionState.STOPPING),
        )
        member.stops.append(record)
        alone = member.lifecycle == 0
        member.lifecycle += 1
        member.epoch += 1
        epoch = member.epoch
        try:
            await election.stop()
            record.completed = self.now()
            state = election.state
            if alone and member.epoch == epoch:
                # It overlapped no other start()/stop(): the election must be at rest.
                if state not in (ElectionState.STOPPED, ElectionState.IDLE):
                    self.fail(f"stop() of {member.name} returned but the election is {state.value}")
                elif election.is_leader:
                    self.fail(f"stop() of {member.name} returned but is_leader is still True")
                else:
                    leftovers = self._tasks_of(election)
                    if leftovers:
                        self.fail(
                            f"stop() of {member.name} returned while tasks of the election "
                            f"still run: {', '.join(leftovers)}"
                        )
        finally:
            member.lifecycle -= 1
        return f"ok ({state.value})"

    def _tasks_of(self, election: LeaderElection) -> list[str]:
        names = []
        for task in asyncio.all_tasks():
            if task.done():
                continue
            frame = getattr(task.get_coro(), "cr_frame", None)
            if frame is not None and frame.f_locals.get("self") is election:
                names.append(_describe(task))
        return sorted(names)

    async def _do_resign(self, call: _Call) -> str:
        election = call.member.election
        before = election.leadership
        await election.resign()
        after = election.leadership
        stopping = election.state is ElectionState.STOPPING  # the stop() ends the term
        if (
            before is not None
            and after is not None
            and after.token == before.token
            and not stopping
        ):
            self.fail(
                f"resign() of {call.member.name} returned but it still leads with token "
                f"{before.token}"
            )
        return "ok" if before is None else f"ok (resigned token {before.token})"

    async def _do_wait(self, call: _Call) -> str:
        election = call.member.election
        try:
            leadership = await election.wait_until_leader()
        except MultilockError as exc:
            return f"raised {type(exc).__name__}"
        current = election.leadership
        if not leadership.is_valid or current is None or current.token != leadership.token:
            self.fail(
                f"wait_until_leader() of {call.member.name} returned token {leadership.token} "
                "that is not the election's valid term"
            )
        return f"leader with token {leadership.token}"

    async def _do_run_while(self, call: _Call) -> str:
        try:
            await call.member.election.run_while_leader(self._work, call)
        except MultilockError as exc:
            return f"raised {type(exc).__name__}"
        except _SimulatedWorkError:
            return "raised the work's error"
        return "returned"

    async def _do_run_if(self, call: _Call) -> str:
        try:
            result = await call.member.election.run_if_leader(self._work, call)
        except _SimulatedWorkError:
            return "raised the work's error"
        if result.status is RunStatus.NOT_LEADER and call.works:
            self.fail(f"run_if_leader() of {call.member.name} said NOT_LEADER but its work ran")
        if result.status is RunStatus.COMPLETED and result.value != call.work_value:
            self.fail(
                f"run_if_leader() of {call.member.name} completed with {result.value!r}, "
                f"the work returned {call.work_value!r}"
            )
        return result.status.value

    async def _do_current_leader(self, call: _Call) -> str:
        member = call.member
        try:
            info = await member.election.current_leader()
        except ProviderError:
            return "ProviderError"
        if info is None:
            return "nobody"
        owner = self.ledger.granted.get((member.group, info.token))
        if owner != info.participant_id:
            self.fail(
                f"current_leader() of {member.name} reported {info.participant_id} with token "
                f"{info.token}, a term the store never granted"
            )
        return f"{info.participant_id} token {info.token}"

    async def _do_events(self, call: _Call) -> str:
        member = call.member
        kinds = call.rng.choice(
            (EventKind.ALL, EventKind.ACQUIRED | EventKind.LOST, EventKind.LEADER_CHANGED)
        )
        limit = call.rng.choice((1, 3, 10, 1_000_000))
        close = call.rng.random() < 0.5
        stream = member.election.events(kinds)
        consumer = _Consumer(member, self.now(), len(member.stops))
        self.consumers.append(consumer)
        count = 0
        try:
            async for event in stream:
                count += 1
                if not event.kind & kinds:
                    self.fail(f"an events({kinds}) stream of {member.name} got {event.kind}")
                if count >= limit:
                    await stream.aclose()
                    return f"closed after {count} events"
            return f"stream ended after {count} events"
        finally:
            consumer.active = False
            if close:
                await stream.aclose()

    def _statistics(self, member: _Member) -> None:
        election = member.election
        stats = election.statistics()
        if stats.is_leader != election.is_leader or stats.state is not election.state:
            self.fail(
                f"statistics() of {member.name} says is_leader={stats.is_leader} "
                f"state={stats.state.value}, the election says {election.is_leader} "
                f"{election.state.value}"
            )
        self.call_counts["statistics"] += 1

    async def _work(self, leadership: Leadership, call: _Call) -> str:
        rng = call.rng
        call.works += 1
        src = f"{call.src}.w{call.works}"
        mode = rng.choices(("return", "raise", "forever", "stubborn"), weights=(4, 1, 3, 2))[0]
        duration = rng.uniform(0, 1.5 * self.lease)
        token = leadership.token
        if leadership.lost.is_set():
            self.fail(
                f"leader work of {call.member.name} started for token {token}, a term that "
                "had already ended"
            )
        work = _Work(src, leadership)
        self.works.append(work)
        self.trace(src, f"work starts for token {token}: {mode}, {duration:.3f} s")
        try:
            if mode == "forever":
                await asyncio.get_running_loop().create_future()
            else:
                await asyncio.sleep(duration)
        except asyncio.CancelledError:
            work.cancelled = True
            if mode != "stubborn":
                self.trace(src, "work cancelled")
                raise
            ignore = rng.uniform(0, 0.8 * self.lease)
            swallow = rng.random() < 0.5
            self.trace(src, f"work ignores its cancellation for {ignore:.3f} s")
            await self._ignore_cancellation(ignore)
            if not swallow:
                self.trace(src, "work ends cancelled")
                raise
            self.trace(src, "work returns despite the cancellation")
        finally:
            work.finished = True
        if mode == "raise":
            self.trace(src, "work raises")
            raise _SimulatedWorkError(src)
        call.work_value = f"value of {src}"
        self.trace(src, "work returns")
        return call.work_value

    # -- the event recorder: the simulator's own subscriber of each election
    async def _record(self, member: _Member, stream: AsyncIterator[LeadershipEvent]) -> None:
        while True:
            async for event in stream:
                self._on_event(member, event)
            self.trace(member.name, "event stream ended")
            member.changed_key = _UNSET
            if self.closing:
                return
            stream = member.election.events()

    def _on_event(self, member: _Member, event: LeadershipEvent) -> None:
        token = event.token
        if event.participant_id != member.pid or event.group != member.group:
            self.fail(f"{member.name} got an event of {event.participant_id}/{event.group}")
        if event.kind is EventKind.ACQUIRED:
            self.trace(member.name, f"ACQUIRED token {token}")
            self.acquired += 1
            if token is None:
                self.fail(f"{member.name}: ACQUIRED without a token")
                return
            if member.holding is not None:
                self.fail(
                    f"{member.name}: ACQUIRED token {token} while token {member.holding} had "
                    "no LOST: ACQUIRED and LOST must alternate"
                )
            self._check_rising(
                self.top_acquired, member, token, f"ACQUIRED token {token} in {member.group}"
            )
            if self.ledger.granted.get((member.group, token)) != member.pid:
                self.fail(
                    f"{member.name}: ACQUIRED token {token}, never granted to it by the store"
                )
            member.holding = token
            term = self._term(member, token)
            term.acquired = True
        elif event.kind is EventKind.LOST:
            self.trace(member.name, f"LOST token {token}")
            if token is None or member.holding != token:
                self.fail(
                    f"{member.name}: LOST token {token} but the term without LOST is "
                    f"{member.holding}: LOST must follow its ACQUIRED exactly once"
                )
            member.holding = None
            if token is not None:
                member.lost_tokens.add(token)
                self._term(member, token).lost = True
            current = member.election.leadership
            if current is not None and current.token == token:
                self.fail(f"{member.name}: LOST token {token} while is_leader is still True")
        else:
            leader = event.leader
            key = None if leader is None else (leader.participant_id, leader.token)
            self.trace(member.name, f"LEADER_CHANGED {key}")
            if key == member.changed_key:
                self.fail(f"{member.name}: LEADER_CHANGED twice in a row for {key}")
            member.changed_key = key

    def _term(self, member: _Member, token: int) -> _Term:
        term = self.terms.get((member.index, token))
        if term is None:
            term = self.terms[(member.index, token)] = _Term(member, token)
            self.open_terms.append(term)
        return term

    # -- invariants
    def _check_iteration(self, now: float) -> None:
        for members in self.by_group:
            leaders: list[tuple[_Member, _Term]] = []
            for member in members:
                leadership = member.election.leadership
                term = member.leading
                if leadership is None:
                    if term is not None:
                        term.ended_at = now
                        member.leading = None
                    continue
                if term is None or term.token != leadership.token:
                    if term is not None:
                        term.ended_at = now
                    term = member.leading = self._seen(member, leadership, now)
                leaders.append((member, term))
            if not self._check_leaders(members[0].group, leaders, now):
                return
        if self.failed():
            return
        if self.works:
            self.works = self._check_works(self.works, now, "leader work")
            if self.failed():
                return
        if self.open_terms:
            still = []
            for term in self.open_terms:
                if term.lost:
                    continue
                still.append(term)
                leadership = term.leadership
                if leadership is None:
                    continue
                bound = leadership.deadline + term.member.renew_interval + 0.25
                if now > bound:
                    self.fail(
                        f"{term.member.name}: no LOST for token {term.token} by its deadline "
                        f"+ renew_interval + 0.25 s (t={bound - self.t0:.6f}); is_leader went "
                        "False at "
                        + ("?" if term.ended_at is None else f"t={term.ended_at - self.t0:.6f}")
                        + ": every ACQUIRED needs exactly one LOST"
                    )
                    return
            self.open_terms = still

    def _check_leaders(self, group: str, leaders: list[tuple[_Member, _Term]], now: float) -> bool:
        """One leader per group, holding its term on the store, and only while it may."""
        for member, term in leaders:
            refused = self.refused.get((member.index, term.token))
            if refused is not None and now - refused > 0.001:
                self.fail(
                    f"{member.name} still leads with token {term.token} {now - refused:.4f} s "
                    "after a renew answered that the store no longer holds it"
                )
                return False
        # A term whose lease the store lost may lead on until its holder learns it.
        leaders = [(m, t) for m, t in leaders if (group, t.token) not in self.doomed]
        if len(leaders) > 1:
            who = ", ".join(f"{m.name} ({m.pid}, token {t.token})" for m, t in leaders)
            self.fail(f"{len(leaders)} leaders in {group} at once: {who}")
            return False
        for member, term in leaders:
            held = self._held_instead(group, member.pid, term.token, now)
            if held is not None:
                self.fail(
                    f"{member.name} leads {group} with token {term.token} but the store "
                    f"holds {held}"
                )
                return False
        return True

    def _seen(self, member: _Member, leadership: Leadership, now: float) -> _Term:
        token = leadership.token
        term = self._term(member, token)
        if term.ended_at is not None:
            self.fail(
                f"{member.name}: is_leader turned True again for token {token}, whose term "
                f"ended at t={term.ended_at - self.t0:.6f}"
            )
        if term.lost or token in member.lost_tokens:
            self.fail(f"{member.name}: is_leader is True for token {token} after its LOST")
        if term.leadership is None:
            term.leadership = leadership
            term.first_seen = now
            self._check_rising(
                self.top_led, member, token, f"leads {member.group} with token {token}"
            )
        return term

    def _check_rising(self, tops: dict[str, int], member: _Member, token: int, what: str) -> None:
        """Fencing: *token* is above every earlier one of its group in *tops* (in which
        order terms were acquired, or led), unless the store lost that term's lease."""
        top = tops.get(member.group, 0)
        if token <= top and (member.group, token) not in self.doomed:
            self.fail(f"fencing: {member.name} {what} after token {top}")
        tops[member.group] = max(top, token)

    def _check_step(self, now: float) -> None:
        for term in self.open_terms:
            if (
                term.first_seen is not None
                and not term.acquired
                and not term.lost
                and now - term.first_seen > 0.01
            ):
                self.fail(
                    f"{term.member.name}: is_leader has been True for token {term.token} since "
                    f"t={term.first_seen - self.t0:.6f} but no ACQUIRED event came"
                )
                return
        if self.consumers:
            active = []
            for consumer in self.consumers:
                if not consumer.active:
                    continue
                active.append(consumer)
                for stop in consumer.member.stops[consumer.stop_index :]:
                    if (
                        stop.effective
                        and stop.began > consumer.subscribed_at
                        and stop.completed is not None
                        and now - stop.completed > 0.05
                    ):
                        self.fail(
                            f"an events() stream of {consumer.member.name} subscribed at "
                            f"t={consumer.subscribed_at - self.t0:.6f} did not end after "
                            f"stop() completed at t={stop.completed - self.t0:.6f}"
                        )
                        return
            self.consumers = active
        live = []
        for call in self.calls:
            task = call.task
            if task is None or task.done():
                continue
            live.append(call)
            if call.kind in _BOUNDED and now - call.started > self.call_bound:
                self.fail(
                    f"{call.kind}() of {call.member.name} (call {call.src}) has not returned "
                    f"after {now - call.started:.3f} s"
                )
                return
        self.calls = live

    # -- the end of a run
    async def _settle(self) -> bool:
        """Wait until no start()/stop() is in flight (they must return within a bound)."""
        limit = self.now() + self.call_bound
        while any(
            call.kind in ("start", "stop") and call.task is not None and not call.task.done()
            for call in self.calls
        ):
            await asyncio.sleep(0.05 * self.lease)
            if not self.failed():
                self._step_checks()
            if self.failed():
                return False
            if self.now() > limit:  # pragma: no cover (the step checks fail first)
                self.fail("start()/stop() calls never returned")
                return False
        return True

    async def _calm(self) -> None:
        """Heal every fault, start every election: each group must get a leader."""
        self.fault_level = 0.0
        for member in self.members:
            member.net.cut_until = 0.0
        self.trace("sim", "calm: faults healed")
        if not await self._settle():
            return
        self.trace("sim", "calm: every election started")
        for member in self.members:
            self._launch("start", member, cancellable=False)
        limit = self.now() + 10 * self.lease
        while True:
            await asyncio.sleep(0.05 * self.lease)
            if self.failed():
                return
            self._step_checks()
            missing = [
                members[0].group
                for members in self.by_group
                if not any(m.election.is_leader for m in members)
            ]
            if not missing:
                return
            if self.now() > limit:
                states = ", ".join(f"{m.name}={m.election.state.value}" for m in self.members)
                self.fail(
                    f"liveness: no leader in {', '.join(missing)} {10 * self.lease:.3f} s after "
                    f"every election was started with the faults healed (states: {states})"
                )
                return

    async def _finish(self) -> None:
        """Stop every election: calls return, tasks end, every ACQUIRED has its LOST."""
        if not await self._settle():
            return
        self.trace("sim", "finish: stopping every election")
        self.closing = True
        for member in self.members:
            self._launch("stop", member, cancellable=False)
        limit = self.now() + self.call_bound
        while True:
            await asyncio.sleep(0.05 * self.lease)
            if self.failed():
                return
            self._step_checks()
            if self.failed():
                return
            pending = self._pending_tasks()
            if not pending:
                break
            if self.now() > limit:
                self.fail("tasks still run after every election stopped: " + ", ".join(pending))
                return
        for member in self.members:
            if member.holding is not None:
                self.fail(f"{member.name}: ACQUIRED token {member.holding} never got its LOST")
                return
            if member.election.is_leader or member.election.state is not ElectionState.STOPPED:
                self.fail(
                    f"{member.name} is {member.election.state.value} "
                    f"(is_leader={member.election.is_leader}) after its final stop()"
                )
                return
        self.checking = False
        self.trace("sim", "finish: every election stopped, every task done")

    def _pending_tasks(self) -> list[str]:
        current = asyncio.current_task()
        names = []
        for task in asyncio.all_tasks():
            if task is current or task.done():
                continue
            names.append(_describe(task))
        return sorted(names)


def _describe(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return f"{task.get_name()} ({getattr(coro, '__qualname__', repr(coro))})"


def _resolve(
    seed: int,
    *,
    steps: int,
    elections: int | None,
    groups: int | None,
    lease_duration: float | None,
    faults: float | None,
    cancel_rate: float | None,
    shared_ids: bool | None,
    custom_store: bool,
) -> SimulationConfig:
    rng = random.Random(f"multilock-sim-config:{seed}")
    drawn_elections = rng.randint(2, 5)
    drawn_groups = 2 if rng.random() < 0.3 else 1
    n = drawn_elections if elections is None else elections
    g = (drawn_groups if n >= 3 else 1) if groups is None else groups
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if n < 1 or g < 1 or g > n:
        raise ValueError(f"need 1 <= groups <= elections, got {g} groups and {n} elections")
    lease, level, cancel = _draw_timing(rng, lease_duration, faults, cancel_rate, min_lease=0)
    drawn_shared = rng.random() < 0.2
    return SimulationConfig(
        seed=seed,
        steps=steps,
        elections=n,
        groups=g,
        lease_duration=lease,
        faults=level,
        cancel_rate=cancel,
        shared_ids=drawn_shared if shared_ids is None else shared_ids,
        custom_store=custom_store,
    )


def _draw_timing(
    rng: random.Random,
    lease_duration: float | None,
    faults: float | None,
    cancel_rate: float | None,
    *,
    min_lease: float,
) -> tuple[float, float, float]:
    """A run's lease, fault intensity and cancellation rate: those left None are drawn."""
    drawn_lease = round(rng.uniform(1.0, 2.0), 3)
    drawn_faults = rng.choice((0.0, 0.1, 0.3, 0.6, 1.0))
    drawn_cancel = rng.choice((0.1, 0.3, 0.5))
    lease = drawn_lease if lease_duration is None else float(lease_duration)
    level = drawn_faults if faults is None else float(faults)
    cancel = drawn_cancel if cancel_rate is None else float(cancel_rate)
    if not (0 <= level <= 1 and 0 <= cancel <= 1 and lease > 0 and lease >= min_lease):
        bound = "positive" if min_lease <= 0 else f">= {min_lease}"
        raise ValueError(f"faults and cancel_rate must be in [0, 1], lease_duration {bound}")
    return lease, level, cancel


def simulate(
    seed: int,
    *,
    steps: int = 1000,
    elections: int | None = None,
    groups: int | None = None,
    lease_duration: float | None = None,
    faults: float | None = None,
    cancel_rate: float | None = None,
    shared_ids: bool | None = None,
    store: StoreFactory | None = None,
    keep_trace: bool = False,
    trace_lines: int = 200,
) -> SimulationReport:
    """Run one seeded simulation of *steps* random user steps; raise on a broken invariant.

    Every option left None is drawn from *seed*: 2-5 elections, one group (sometimes two),
    a lease of 1-2 virtual seconds, a fault intensity, a cancellation rate, and whether two
    elections share a participant id. *store* builds the store under the faulty links from
    the simulation's clock (default: an `InMemoryProvider`); the simulator checks the
    plain store's answers against its own ledger, a custom one only by the invariants.

    Returns a `SimulationReport`; raises `SimulationFailure` (an ``AssertionError``) with
    the seed, a line that replays the run and the last *trace_lines* lines of the trace.
    The same arguments give the same trace, whatever else the process does: the run has
    its own event loop on a `FakeClock`, and the global `random` (the core's jitter) is
    seeded for the run and restored after it.
    """
    config = _resolve(
        seed,
        steps=steps,
        elections=elections,
        groups=groups,
        lease_duration=lease_duration,
        faults=faults,
        cancel_rate=cancel_rate,
        shared_ids=shared_ids,
        custom_store=store is not None,
    )
    return _Simulation(config, store, trace_lines).run(keep_trace=keep_trace)


# ---------------------------------------------------------------------- campaigns
class _Report(Protocol):
    @property
    def steps(self) -> int: ...


_ReportT = TypeVar("_ReportT", bound=_Report)
#: One run of a campaign: its name in its line, its name in the summary, its seed, and
#: the options of its simulation.
_Run = tuple[str, str, int, Mapping[str, Any]]


def _timed(
    simulate_one: Callable[..., _ReportT], seed: int, options: Mapping[str, Any]
) -> tuple[_ReportT | SimulationFailure, float]:
    """Run one seed (in a worker process): its report or its failure, and how long it took."""
    began = time.perf_counter()
    try:
        outcome: _ReportT | SimulationFailure = simulate_one(seed, **options)
    except SimulationFailure as failure:
        outcome = failure
    return outcome, time.perf_counter() - began


def _campaign(
    simulate_one: Callable[..., _ReportT],
    runs: Sequence[_Run],
    *,
    describe: Callable[[_ReportT], str],
    seeds: Sequence[int],
    what: str = "",
    failed_as: str = "",
    jobs: int,
    out: Callable[[str], None],
) -> list[SimulationFailure]:
    """Run every run (in *jobs* processes); print a line per run and a summary of *seeds*
    (*what* names the worlds, *failed_as* comes before the names of the failed runs);
    return the failures, each printed in full as it comes."""
    failures: list[SimulationFailure] = []
    failed: list[str] = []
    total = 0
    began = time.perf_counter()

    def report(label: str, key: str, outcome: _ReportT | SimulationFailure, seconds: float) -> None:
        nonlocal total
        if isinstance(outcome, SimulationFailure):
            failures.append(outcome)
            failed.append(key)
            total += outcome.step
            out(f"{label}: FAILED at step {outcome.step} ({seconds:.2f} s)\n{outcome}\n")
            return
        total += outcome.steps
        out(f"{label}: ok, {describe(outcome)} ({seconds:.2f} s)")

    calls = ([simulate_one] * len(runs), [r[2] for r in runs], [r[3] for r in runs])
    if jobs <= 1:
        for (label, key, _, _), result in zip(runs, map(_timed, *calls), strict=True):
            report(label, key, *result)
    else:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = pool.map(_timed, *calls, chunksize=1)
            for (label, key, _, _), result in zip(runs, results, strict=True):
                report(label, key, *result)
    summary = (
        f"simulated {total} steps{what} over {len(seeds)} seeds ({_describe_seeds(seeds)}) "
        f"in {time.perf_counter() - began:.1f} s with {jobs} job(s): "
    )
    if failures:
        summary += f"{len(failures)} FAILED ({failed_as}{', '.join(failed)})"
    else:
        summary += "every invariant held"
    out(summary)
    return failures


def run_simulations(
    seeds: Iterable[int],
    *,
    steps: int = 2000,
    jobs: int = 1,
    out: Callable[[str], None] = print,
) -> list[SimulationFailure]:
    """Simulate every seed (in *jobs* processes); print one line per seed, return failures.

    A failure is printed in full (its trace) as it comes; the run goes on with the other
    seeds, and the summary names every failing seed.
    """
    seeds = list(seeds)
    options = {"steps": steps}
    runs = [(f"seed {seed}", str(seed), seed, options) for seed in seeds]
    return _campaign(
        simulate,
        runs,
        describe=_describe_report,
        seeds=seeds,
        failed_as="seeds ",
        jobs=jobs,
        out=out,
    )


def _describe_report(report: SimulationReport) -> str:
    c = report.config
    return (
        f"{report.steps} steps, {c.elections} elections in {c.groups} group(s), "
        f"lease {c.lease_duration} s, faults {c.faults}, {report.terms} terms, "
        f"{report.cancellations} cancellations, {report.virtual_seconds:.0f} virtual s"
    )


def _describe_seeds(seeds: Sequence[int]) -> str:
    if not seeds:
        return "none"
    if list(seeds) == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _parse_seeds(text: str) -> list[int] | int:
    """``A:B`` is the range A..B-1, ``A,B,C`` a list; a single number is the first seed."""
    if ":" in text:
        first, _, last = text.partition(":")
        return list(range(int(first), int(last)))
    if "," in text:
        return [int(part) for part in text.split(",") if part]
    return int(text)


def _campaign_parser(
    description: str, env: str, *, total_steps: int, steps: int, per: str, over: str = ""
) -> argparse.ArgumentParser:
    """The command line of a campaign; its defaults from the environment (*env*_STEPS...)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--total-steps",
        type=int,
        default=int(os.environ.get(f"{env}_STEPS", str(total_steps))),
        help=f"steps in all{over} (env {env}_STEPS; default {total_steps:,})",
    )
    parser.add_argument(
        "--seeds",
        default=os.environ.get(f"{env}_SEEDS", "0"),
        help=f"first seed N, a range A:B or a list A,B,C (env {env}_SEEDS; default 0)",
    )
    parser.add_argument(
        "--steps", type=int, default=steps, help=f"steps per {per} (default {steps})"
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: every CPU)"
    )
    return parser


def _campaign_seeds(args: argparse.Namespace, runs_per_seed: int = 1) -> list[int]:
    """The seeds named by ``--seeds``; from a first seed, enough for ``--total-steps``."""
    seeds = _parse_seeds(args.seeds)
    if isinstance(seeds, list):
        return seeds
    runs = max(1, math.ceil(args.total_steps / max(args.steps, 1)))
    return list(range(seeds, seeds + max(1, runs // runs_per_seed)))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of long campaigns (``nox -s simulate``)."""
    parser = _campaign_parser(
        "Deterministic simulation of multilock elections on a faulty store.",
        "MULTILOCK_SIM",
        total_steps=2_000_000,
        steps=2000,
        per="seed",
    )
    args = parser.parse_args(argv)
    failures = run_simulations(_campaign_seeds(args), steps=args.steps, jobs=args.jobs)
    return 1 if failures else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
