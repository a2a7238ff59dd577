"""The deterministic simulator's worlds for `Semaphore` and `Shards`, with their own invariants.

`simulate_holders` runs one seeded world of one kind on the pieces of the election
simulator (`simulate`): its event loop on a `FakeClock` that jumps to the next timer, with
a hook that checks the invariants at every loop iteration; one faulty link per participant
(a `Provider` wrapping one shared `InMemoryProvider`: delays, hangs, errors, lost replies,
writes that land after their caller gave up, cuts, broken watches); the ledger that checks
every store reply; and `SimulationFailure`, which carries the seed, a line that replays the
run and the end of the trace. One seed is one trace.

A run alternates *storms* (faults at the seeded intensity, partitions, membership changes)
and *quiet* episodes (no fault, no partition, no membership change), then heals everything
and makes every participant leave.

The semaphore world: 2 to 6 participants (each with its own link and participant id) enter
``Semaphore(link, "s", limit)`` (limit 1 to 3) again and again, each entry with a random
timeout (or none), holding for a random virtual time, its block sleeping, checking
``held.check()`` or ignoring its cancellation for a while; the simulator cancels entries
from outside at random points. Invariants:

* at every loop iteration, at most *limit* blocks hold a valid slot, and no two hold one
  slot; no two elections lead one slot's group, and the store holds every valid term;
* per slot, the tokens blocks are given rise strictly in the order they get them, and so do
  the tokens of every term any election begins (the order of acquisition);
* a block whose slot is lost is cancelled at once, and leaving it raises `LeadershipLost`
  exactly when the slot was lost; `AcquireTimeout` only after the timeout; a cancellation
  the simulator did not make never leaks out of an ``async with``;
* once an entry has ended (however: released, timed out, lost, cancelled anywhere), every
  election it started is stopped within a bound (no leaked slot);
* in a quiet episode, a slot free on the store is taken by a waiter within a bound; at the
  end, with every entry gone, every slot is free on the store.

The shards world: 2 to 5 participants join (``Shards(link, "w", count)``, count 2 to 12)
and leave at random (a leave sometimes cancelled), some crash (their link is cut for good
and their tasks are abandoned, like a dead process: their leases expire) and restart under
the same participant id; ``run_for_each`` runs work that returns, raises or runs until
cancelled, and ``wait_changed`` waiters come and go. Invariants:

* at every loop iteration, no shard has two owners (over the participants' ``owned`` views
  and over every election), and the store holds every valid term;
* tokens rise strictly per shard in the order terms begin;
* work runs only for a valid term, is cancelled as soon as it ends, runs once per term;
  ``run_for_each`` returns only when the participant leaves; ``wait_changed`` returns
  when the ownership, the share or the live count changes;
* after a quiet period of 3 leases (no membership change, no fault, no partition), every
  live participant owns at most ``ceil(count / live participants)`` shards and every shard
  is owned;
* once a participant has left, every election it started is stopped within a bound; at
  the end every shard and membership slot is free on the store.

In both worlds the ledger checks every store reply (fencing, one live term per group), and
the core must neither log an ERROR nor drop a coroutine unawaited (a provider call built
and never run: users see a RuntimeWarning, and ``-W error`` fails their tests).

"At every loop iteration": the checks over every term and every ``owned`` view run at each
iteration in which something may have changed ownership (a term began or ended, an
election started or stopped, a membership changed) and at least every 5 virtual ms
otherwise, since a second owner can only appear when a term begins (a term only becomes
invalid with time); the entries' checks run at every iteration.

`run_holder_simulations` and `main` run long campaigns over many seeds (``nox``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import random
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from .._election import LeaderElection
from .._errors import LeadershipLost, MultilockError
from .._lock import AcquireTimeout, Semaphore, SemaphoreSlot
from .._observe import ElectionObserver, add_observer, remove_observer
from .._provider import Provider
from .._shards import ShardLeadership, Shards
from .._types import ElectionState, Leadership
from ._simulator import (
    SimulationFailure,
    StoreFactory,
    _campaign,
    _campaign_parser,
    _campaign_seeds,
    _draw_timing,
    _Link,
    _SimulatedWorkError,
    _Work,
    _World,
)

__all__ = [
    "HolderKind",
    "HoldersConfig",
    "HoldersReport",
    "run_holder_simulations",
    "simulate_holders",
]

#: The primitive a run exercises.
HolderKind = Literal["semaphore", "shards"]
_KINDS: tuple[HolderKind, ...] = ("semaphore", "shards")

_SEMAPHORE_ACTIONS: tuple[tuple[str, int], ...] = (("enter", 14), ("partition", 2), ("idle", 8))
_SHARDS_ACTIONS: tuple[tuple[str, int], ...] = (
    ("join", 10),
    ("leave", 6),
    ("crash", 1),
    ("restart", 3),
    ("work", 5),
    ("wait_changed", 4),
    ("partition", 2),
    ("idle", 8),
)
#: What a quiet episode may do: nothing that changes the membership or injects a fault.
_QUIET = frozenset({"enter", "work", "wait_changed", "idle"})
#: Quiet leases after which the shards must be balanced (and semaphore waiters served).
_SETTLE_LEASES = 3.0


# ---------------------------------------------------------------------- public records
@attrs.frozen(kw_only=True)
class HoldersConfig:
    """Everything that shapes one run; fields left unset in `simulate_holders` come from
    the seed."""

    seed: int
    steps: int
    kind: HolderKind
    participants: int
    #: The semaphore's limit (None in a shards run).
    limit: int | None
    #: The number of shards (None in a semaphore run).
    count: int | None
    lease_duration: float
    #: Fault intensity during storms, 0 (a perfect store) to 1 (a very bad network).
    faults: float
    #: Probability that an entry (or a leave, or a work loop) is cancelled from outside.
    cancel_rate: float
    custom_store: bool = False

    def reproduce(self) -> str:
        """The call that replays this run."""
        size = f"limit={self.limit}" if self.kind == "semaphore" else f"count={self.count}"
        store = ", store=<the same store factory>" if self.custom_store else ""
        return (
            f"simulate_holders({self.seed}, steps={self.steps}, kind={self.kind!r}, "
            f"participants={self.participants}, {size}, "
            f"lease_duration={self.lease_duration!r}, faults={self.faults!r}, "
            f"cancel_rate={self.cancel_rate!r}{store})"
        )


@attrs.frozen(kw_only=True)
class HoldersReport:
    """What a run that kept every invariant did."""

    config: HoldersConfig
    steps: int
    virtual_seconds: float
    #: Terms begun by any election (slots, shards, membership slots).
    terms: int
    #: Semaphore: blocks entered with a valid slot. Shards: shard terms begun.
    holds: int
    #: The highest fencing token the store granted, per group.
    tokens: Mapping[str, int]
    #: Simulated actions, per kind.
    actions: Mapping[str, int]
    #: How entries, leaves and work loops ended, per outcome.
    outcomes: Mapping[str, int]
    cancellations: int
    crashes: int
    #: Faults injected, per kind.
    faults: Mapping[str, int]
    #: Quiet episodes after which the shards were found balanced and all owned (shards), or
    #: the semaphore's free slots served (semaphore).
    settled: int
    #: SHA-256 of the canonical trace: equal for two runs of one seed.
    trace_digest: str
    #: The canonical trace, with ``keep_trace=True`` (empty otherwise).
    trace: tuple[str, ...] = ()
    #: Messages the event loop reported (unretrieved exceptions...); not part of the trace.
    loop_errors: tuple[str, ...] = ()


# ---------------------------------------------------------------------- bookkeeping
@attrs.define(eq=False)
class _Seat:
    """One participant process (a new seat object per restart, same participant id)."""

    index: int
    generation: int
    pid: str
    lease: float
    renew: float
    retry: float
    link: _Link
    crashed: bool = False
    crashed_at: float = 0.0
    #: Semaphore: the object several entries of this participant share (no timeout).
    shared: Semaphore | None = None
    #: Shards: the membership joined and not yet left, and whether a join/leave runs.
    member: _Session | None = None
    busy: bool = False
    sessions: list[_Session] = attrs.field(factory=list)

    @property
    def name(self) -> str:
        return self.pid if self.generation == 0 else f"{self.pid}.{self.generation}"


@attrs.define(eq=False)
class _Session:
    """What starts elections: one ``async with`` of a semaphore, or one membership of the
    shards (join to leave)."""

    id: int
    seat: _Seat
    src: str
    began: float
    elections: list[LeaderElection] = attrs.field(factory=list)
    ended_at: float | None = None
    #: Its process crashed: nothing it started has to stop.
    exempt: bool = False
    #: The simulator cancelled it.
    cancelled: bool = False
    task: asyncio.Task[None] | None = None
    # -- an entry of the semaphore
    timeout: float | None = None
    phase: str = "waiting"  # waiting, holding, leaving, done
    slot: SemaphoreSlot | None = None
    body_cancelled: bool = False
    valid_at_end: bool = False
    invalid_since: float | None = None
    # -- a membership of the shards
    shards: Shards | None = None
    entered: bool = False
    closing: bool = False

    cancel_note = "cancelled from outside"


@attrs.define(eq=False)
class _Loop:
    """A ``run_for_each`` call."""

    src: str
    session: _Session
    task: asyncio.Task[None] | None = None


@attrs.define(eq=False)
class _Waiter:
    """A ``wait_changed`` call."""

    src: str
    session: _Session
    snapshot: tuple[object, ...] | None = None
    changed_at: float | None = None
    task: asyncio.Task[None] | None = None


def _unawaited(caught: warnings.WarningMessage) -> bool:
    return issubclass(caught.category, RuntimeWarning) and "was never awaited" in str(
        caught.message
    )


class _Observer(ElectionObserver):
    """Hears every election of the run: which entry or membership started it, when it
    stops, and every term it begins and ends."""

    def __init__(self, world: _HoldersWorld) -> None:
        self._world = world

    def started(self, election: LeaderElection) -> None:
        self._world.on_started(election)

    def stopped(self, election: LeaderElection) -> None:
        self._world.on_stopped(election)

    def acquired(
        self, election: LeaderElection, leadership: Leadership, failover: float | None
    ) -> None:
        self._world.on_acquired(election, leadership)

    def lost(self, election: LeaderElection, token: int, reason: str) -> None:
        self._world.on_lost(election, token, reason)


class _FailureLog(logging.Handler):
    """Turns an ERROR logged by the core during a run (a failed internal task of the
    shards, a raising observer) into a broken invariant."""

    def __init__(self, world: _HoldersWorld) -> None:
        super().__init__(logging.ERROR)
        self._world = world

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        self._world.fail(
            f"the core logged an error: {record.getMessage()}"
            + ("" if error is None else f" ({error!r})")
        )


# ---------------------------------------------------------------------- the world
class _HoldersWorld(_World[HoldersConfig]):
    """One run of a semaphore or shards world."""

    def __init__(self, config: HoldersConfig, store: StoreFactory | None, lines: int) -> None:
        seed = f"multilock-sim-holders:{config.kind}:{config.seed}"
        super().__init__(config, store, lines, seed=seed)
        self.kind = config.kind
        self.name = "s" if config.kind == "semaphore" else "w"
        self.size = config.limit if config.kind == "semaphore" else config.count
        assert self.size is not None
        self.seats: list[_Seat] = []
        self.seat_of: dict[Provider, _Seat] = {}
        self.dead_links: set[str] = set()
        self.session_seq = 0
        #: Every started election not yet stopped, and the session that started it.
        self.elections: dict[LeaderElection, _Session] = {}
        #: Every term begun and not yet reported lost: the only ones that can be valid.
        self.leading: dict[LeaderElection, Leadership] = {}
        #: Bumped by every event that may change ownership; the costlier checks run when it
        #: moved, or when some virtual time passed.
        self.version = 0
        self.checked_version = -1
        self.next_check = 0.0
        self.task_session: dict[asyncio.Task[Any], _Session] = {}
        self.entries: list[_Session] = []  # semaphore entries not yet done
        self.members: list[_Session] = []  # shards memberships joined, not yet left
        self.ended: list[_Session] = []  # ended sessions whose elections must stop
        self.leavers: list[_Session] = []  # aclose() calls in flight
        self.works: list[_Work] = []
        self.loops: list[_Loop] = []
        self.waiters: list[_Waiter] = []
        self.top_acquired: dict[str, int] = {}
        self.top_held: dict[int, int] = {}
        self.free_since: dict[str, float] = {}
        self.actions: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.crashes = 0
        self.terms = 0
        self.holds = 0
        self.settled = 0
        self.episode_settled = False
        self.quiet = False
        self.quiet_began = 0.0
        self.episode_end = 0.0
        #: The last membership change or late write: a quiet period starts after it.
        self.disturbed = self.clock.now
        self.warnings: list[warnings.WarningMessage] = []
        self.warnings_seen = 0
        self.exit_bound = 3 * self.lease

    # -- what the links use, and utilities
    def trace(self, src: str, text: str) -> None:
        if src not in self.dead_links:  # a crashed participant's calls into its cut link: noise
            super().trace(src, text)

    def _landing(self) -> None:
        self._disturb()

    def _disturb(self) -> None:
        """A membership change or a late write: a quiet period starts after it."""
        self.disturbed = self.now()
        self.version += 1

    def _at(self, when: float) -> str:
        return f"t={when - self.t0:.6f}"

    def _what(self, group: str) -> str:
        """A group's name for people: which slot, shard or membership slot it is."""
        base, _, tail = group.rpartition(".")
        kind, _, index = tail.partition("-")
        if self.kind == "semaphore" and kind == "slot":
            return f"semaphore {base!r} slot {index}"
        if kind == "shard":
            return f"shards {base!r} shard {index}"
        if kind == "member":
            return f"shards {base!r} membership slot {index}"
        return group  # pragma: no cover

    def _who(self, election: LeaderElection) -> str:
        session = self.elections.get(election)
        return election.participant_id if session is None else session.src

    # -- the run
    def run(self, *, keep_trace: bool) -> HoldersReport:
        config = self.config
        digest = self._run(f"multilock-sim-holders-core:{config.kind}:{config.seed}", logging.ERROR)
        return HoldersReport(
            config=config,
            steps=self.step,
            virtual_seconds=self.clock.now - self.t0,
            terms=self.terms,
            holds=self.holds,
            tokens=dict(self.ledger.top),
            actions=dict(self.actions),
            outcomes=dict(self.outcomes),
            cancellations=self.cancellations,
            crashes=self.crashes,
            faults=dict(self.faults),
            settled=self.settled,
            trace_digest=digest,
            trace=tuple(self.full_trace) if keep_trace else (),
            loop_errors=tuple(self.loop_errors),
        )

    @contextlib.contextmanager
    def _watching(self, logger: logging.Logger) -> Iterator[None]:
        """Hear every election (`_Observer`), every ERROR the core logs (`_FailureLog`) and
        every coroutine it drops unawaited, over the run and its teardown."""
        handler = _FailureLog(self)
        logger.addHandler(handler)
        observer = _Observer(self)
        add_observer(observer)
        try:
            with warnings.catch_warnings(record=True) as self.warnings:
                warnings.simplefilter("always")
                try:
                    yield
                finally:
                    gc.collect()  # a coroutine dropped in a cycle warns now
                    self._check_warnings()
        finally:
            remove_observer(observer)
            logger.removeHandler(handler)
        for caught in self.warnings:  # the others, as if the run had not caught them
            if not _unawaited(caught):
                warnings.warn_explicit(
                    caught.message, caught.category, caught.filename, caught.lineno
                )

    def _check_warnings(self) -> None:
        """A coroutine created and dropped unawaited (a provider call made but never run)
        breaks the run: users see the warning, and ``-W error`` fails their tests."""
        while self.warnings_seen < len(self.warnings):
            caught = self.warnings[self.warnings_seen]
            self.warnings_seen += 1
            if _unawaited(caught):
                self.fail(f"the core dropped a coroutine without awaiting it: {caught.message}")

    def _teardown(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cancel what is left (crashed participants' tasks...) and close the loop."""
        self.closing = True
        super()._teardown(loop)

    async def _drive(self) -> None:
        self._build()
        self.checking = True
        self._storm()
        if await self._play():
            await self._finish()

    def _build(self) -> None:
        config, rng = self.config, self.rng
        self._make_store()
        for i in range(config.participants):
            lease, renew, retry = self._timings(i)
            seat = _Seat(
                index=i, generation=0, pid=f"p{i}", lease=lease, renew=renew, retry=retry,
                link=self._new_link(),
            )  # fmt: skip
            self._seat(seat)
            self.trace("sim", f"{seat.name}: lease {lease} renew {renew} retry {retry}")
        self.max_lease = max(seat.lease for seat in self.seats)
        self.exit_bound = 3 * self.max_lease
        self.call_bound = 12 * self.max_lease + 2.0
        what = f"limit {self.size}" if self.kind == "semaphore" else f"{self.size} shards"
        self.trace("sim", f"{self.kind} {self.name!r}, {what}, faults {config.faults}")
        if self.kind == "shards":
            for seat in self.seats:
                if rng.random() < 0.8:
                    self._join(seat)

    def _seat(self, seat: _Seat) -> None:
        if seat.index < len(self.seats):
            self.seats[seat.index] = seat
        else:
            self.seats.append(seat)
        self.seat_of[seat.link] = seat
        if self.kind == "semaphore":
            seat.shared = self._semaphore(seat, None)

    def _semaphore(self, seat: _Seat, timeout: float | None) -> Semaphore:
        assert self.config.limit is not None
        return Semaphore(
            seat.link, self.name, self.config.limit, lease_duration=seat.lease, timeout=timeout,
            participant_id=seat.pid, renew_interval=seat.renew, retry_interval=seat.retry,
        )  # fmt: skip

    def _session(self, seat: _Seat, what: str) -> _Session:
        self.session_seq += 1
        session = _Session(
            id=self.session_seq, seat=seat, src=f"{seat.name}#{self.session_seq}", began=self.now()
        )
        seat.sessions.append(session)
        self.actions[what] += 1
        return session

    # -- episodes
    def _storm(self) -> None:
        self.quiet = False
        self.fault_level = self.config.faults
        self.episode_end = self.now() + self.rng.uniform(2.0, 8.0) * self.lease
        self.trace("sim", f"storm until t={self.episode_end - self.t0:.6f}")

    def _quiet(self) -> None:
        self.quiet = True
        self.episode_settled = False
        self.fault_level = 0.0
        self.quiet_began = self.now()
        self.episode_end = self.now() + self.rng.uniform(4.0, 7.0) * self.max_lease
        self.trace("sim", f"quiet until t={self.episode_end - self.t0:.6f}")

    def _calm_since(self) -> float | None:
        """Since when nothing has disturbed the world (None outside quiet episodes)."""
        if not self.quiet:
            return None
        since = max(self.quiet_began, self.disturbed)
        for seat in self.seats:
            if not seat.crashed:
                since = max(since, seat.link.cut_until)
        return since

    # -- actions
    def _act(self) -> None:
        if self.now() >= self.episode_end:
            if self.quiet:
                self._storm()
            else:
                self._quiet()
        rng = self.rng
        table = _SEMAPHORE_ACTIONS if self.kind == "semaphore" else _SHARDS_ACTIONS
        kind = rng.choices([n for n, _ in table], weights=[w for _, w in table])[0]
        if self.quiet and kind not in _QUIET:
            kind = "idle"
        if kind == "idle":
            return
        if kind == "partition":
            live = [s for s in self.seats if not s.crashed]
            if live:
                self._partition(rng.choice(live))
            return
        if kind == "enter":
            seat = rng.choice(self.seats)
            if sum(1 for e in self.entries if e.seat is seat) < 2:
                self._enter(seat)
            return
        candidates = self._candidates(kind)
        if not candidates:
            return
        seat = rng.choice(candidates)
        if kind == "join":
            self._join(seat)
        elif kind == "leave":
            self._leave(seat)
        elif kind == "crash":
            self._crash(seat)
        elif kind == "restart":
            self._restart(seat)
        elif kind == "work":
            self._work(seat)
        else:
            self._wait_changed(seat)

    def _candidates(self, kind: str) -> list[_Seat]:
        seats = self.seats
        if kind == "join":
            return [s for s in seats if not s.crashed and s.member is None and not s.busy]
        if kind == "restart":
            return [s for s in seats if s.crashed]
        joined = [s for s in seats if not s.crashed and s.member is not None and s.member.entered]
        if kind == "crash":  # a few per run: a dead process's tasks still cost CPU here
            return joined if self.crashes < max(2, self.config.participants) else []
        joined = [s for s in joined if s.member is not None and not s.member.closing]
        if kind == "leave":
            return [s for s in joined if not s.busy]
        if kind == "work":
            busy = {loop.session for loop in self.loops}
            return [s for s in joined if s.member not in busy]
        return joined

    def _partition(self, seat: _Seat) -> None:
        self.actions["partition"] += 1
        self._cut_off(seat.name, seat.link, extend=True)

    def _may_cancel(self, session: _Session, rate: float | None = None) -> None:
        """Perhaps cancel *session* from outside, within 3 leases."""
        rate = self.config.cancel_rate if rate is None else rate
        self._maybe_cancel(session, rate, 3 * self.lease)

    # -- the semaphore world
    def _enter(self, seat: _Seat) -> None:
        rng = self.rng
        if rng.random() < 0.3:
            assert seat.shared is not None
            semaphore, timeout = seat.shared, None
        else:
            timeout = None if rng.random() < 0.3 else round(rng.uniform(0.05, 3.0) * self.lease, 4)
            semaphore = self._semaphore(seat, timeout)
        hold = rng.uniform(0, 2 * self.lease)
        mode = rng.choices(("sleep", "checks", "stubborn"), weights=(6, 3, 1))[0]
        body_rng = random.Random(rng.getrandbits(64))
        session = self._session(seat, "enter")
        session.timeout = timeout
        shared = " (the shared object)" if semaphore is seat.shared else ""
        self.trace(
            session.src,
            f"enters{shared}, timeout {timeout}, to hold {hold:.3f} s ({mode})",
        )
        session.task = task = self._spawn(
            self._hold(session, semaphore, hold, mode, body_rng), f"sim-enter:{session.src}"
        )
        self.task_session[task] = session
        self.entries.append(session)
        task.add_done_callback(lambda _: self._entry_done(session))
        if not self.closing:
            self._may_cancel(session)

    async def _hold(
        self, session: _Session, semaphore: Semaphore, hold: float, mode: str, rng: random.Random
    ) -> None:
        outcome = "released"
        try:
            async with semaphore as slot:
                self._body_begins(session, slot)
                try:
                    await self._body(session, slot, hold, mode, rng)
                except asyncio.CancelledError:
                    session.body_cancelled = True
                    raise
                finally:
                    session.phase = "leaving"
                    session.valid_at_end = slot.is_valid
            if not session.valid_at_end:
                self.fail(
                    f"the block of {session.src} ended normally after slot {slot.slot} "
                    f"(token {slot.token}) was lost, but leaving it raised no LeadershipLost"
                )
        except AcquireTimeout as exc:
            outcome = "AcquireTimeout"
            waited = self.now() - session.began
            if session.timeout is None:
                self.fail(f"{session.src} entered without a timeout but got {exc!r}")
            elif session.slot is not None:
                self.fail(f"{session.src} got AcquireTimeout after its block began")
            elif waited < session.timeout - 1e-6:
                self.fail(
                    f"{session.src} got AcquireTimeout after {waited:.6f} s, before its "
                    f"timeout of {session.timeout} s"
                )
        except LeadershipLost as exc:
            outcome = "LeadershipLost"
            if session.slot is None:
                self.fail(f"entering by {session.src} raised {exc!r} before its block began")
            elif session.valid_at_end:
                self.fail(
                    f"leaving the block of {session.src} raised {exc!r} although slot "
                    f"{session.slot.slot} (token {session.slot.token}) was valid when it ended"
                )
        except asyncio.CancelledError:
            outcome = "cancelled"
            if not session.cancelled:
                self.fail(
                    f"the async with of {session.src} raised CancelledError but nobody "
                    "cancelled it: the cancellation of a lost slot leaked out of the block"
                )
        except Exception as exc:
            outcome = f"raised {type(exc).__name__}"
            self.fail(f"the async with of {session.src} raised {exc!r}")
        self.outcomes[outcome] += 1
        self.trace(session.src, f"-> {outcome}")

    def _body_begins(self, session: _Session, slot: SemaphoreSlot) -> None:
        session.slot, session.phase = slot, "holding"
        limit = self.config.limit
        assert limit is not None
        if (
            not 0 <= slot.slot < limit
            or slot.group != f"{self.name}.slot-{slot.slot}"
            or slot.participant_id != session.seat.pid
        ):
            self.fail(f"{session.src} was given {slot!r} of group {slot.group!r}")
            return
        if not slot.is_valid:
            self.trace(session.src, f"block begins with slot {slot.slot} token {slot.token} lost")
            return
        self.holds += 1
        top = self.top_held.get(slot.slot, 0)
        if slot.token <= top:
            self.fail(
                f"fencing: semaphore {self.name!r}: {session.src} holds slot {slot.slot} with "
                f"token {slot.token} after a block held that slot with token {top}: tokens "
                "must rise per slot"
            )
        self.top_held[slot.slot] = max(top, slot.token)
        self.trace(
            session.src,
            f"holds slot {slot.slot} token {slot.token} for {slot.deadline - self.now():.3f} s",
        )

    async def _body(
        self, session: _Session, slot: SemaphoreSlot, hold: float, mode: str, rng: random.Random
    ) -> None:
        if mode == "checks":
            end = self.now() + hold
            while True:
                slot.check()
                if self.now() >= end:
                    return
                await asyncio.sleep(min(rng.uniform(0.05, 0.3) * self.lease, end - self.now()))
        try:
            await asyncio.sleep(hold)
        except asyncio.CancelledError:
            if mode != "stubborn":
                raise
            session.body_cancelled = True
            ignore = rng.uniform(0, 0.5 * self.lease)
            self.trace(session.src, f"the block ignores its cancellation for {ignore:.3f} s")
            await self._ignore_cancellation(ignore)
            raise

    def _entry_done(self, session: _Session) -> None:
        session.phase = "done"
        session.ended_at = self.now()
        self.entries.remove(session)
        if session.task is not None:
            self.task_session.pop(session.task, None)
        self.ended.append(session)

    def _check_entries(self, now: float) -> None:
        limit = self.config.limit
        assert limit is not None
        valid = [
            e for e in self.entries
            if e.phase == "holding" and e.slot is not None and e.slot.is_valid
        ]  # fmt: skip
        if len(valid) > limit:
            who = ", ".join(
                f"{e.src} (slot {e.slot.slot}, token {e.slot.token})" for e in valid if e.slot
            )
            self.fail(
                f"semaphore {self.name!r} has {len(valid)} valid holders at once, over its "
                f"limit {limit}: {who}"
            )
            return
        by_slot: dict[int, list[_Session]] = {}
        for entry in valid:
            assert entry.slot is not None
            by_slot.setdefault(entry.slot.slot, []).append(entry)
        for index, holders in by_slot.items():
            if len(holders) > 1:
                who = ", ".join(f"{e.src} (token {e.slot.token})" for e in holders if e.slot)
                self.fail(
                    f"semaphore {self.name!r} has {len(holders)} valid holders of slot {index} "
                    f"at once: {who}"
                )
                return
        for entry in self.entries:
            slot = entry.slot
            if entry.phase == "holding" and slot is not None and not entry.body_cancelled:
                if slot.is_valid:
                    continue
                if entry.invalid_since is None:
                    entry.invalid_since = now
                elif now - entry.invalid_since > 0.001:
                    self.fail(
                        f"the block of {entry.src} still runs {now - entry.invalid_since:.4f} s "
                        f"after slot {slot.slot} (token {slot.token}) was lost: it was not "
                        "cancelled"
                    )
                    return
        if self.strict_store:
            self._check_waiters_served(now)

    def _check_waiters_served(self, now: float) -> None:
        """Quiet: a slot free on the store is taken by a waiter within a bound."""
        calm = self._calm_since()
        limit = self.config.limit
        assert limit is not None
        waiting = [e for e in self.entries if e.phase == "waiting" and not e.cancelled]
        for index in range(limit):
            group = f"{self.name}.slot-{index}"
            if self.ledger.live(group, now) is not None:
                self.free_since.pop(group, None)
                continue
            since = self.free_since.setdefault(group, now)
            if calm is None:
                continue
            for entry in waiting:
                start = max(since, calm, entry.began)
                if now - start > _SETTLE_LEASES * self.max_lease:
                    self.fail(
                        f"liveness: slot {index} of semaphore {self.name!r} has been free on "
                        f"the store since {self._at(since)}, with no fault since "
                        f"{self._at(calm)}, but {entry.src} (waiting since "
                        f"{self._at(entry.began)}) has not taken it"
                    )
                    return
        settled = calm is not None and now - calm > _SETTLE_LEASES * self.max_lease
        if settled and not self.episode_settled:
            self.episode_settled = True
            self.settled += 1

    # -- the shards world
    def _join(self, seat: _Seat) -> None:
        assert self.config.count is not None
        shards = Shards(
            seat.link, self.name, self.config.count, lease_duration=seat.lease,
            participant_id=seat.pid, renew_interval=seat.renew, retry_interval=seat.retry,
        )  # fmt: skip
        session = self._session(seat, "join")
        session.shards = shards
        seat.member, seat.busy = session, True
        self.members.append(session)
        self._disturb()
        self.trace(session.src, "joins")

        async def join() -> None:
            await shards.__aenter__()
            session.entered, seat.busy = True, False
            self._disturb()

        session.task = self._spawn(join(), f"sim-join:{session.src}")

    def _leave(self, seat: _Seat) -> None:
        session = seat.member
        assert session is not None
        assert session.shards is not None
        shards = session.shards
        session.closing = seat.busy = True
        self._disturb()
        self.actions["leave"] += 1
        self.trace(session.src, "leaves")
        began = False
        started = self.now()

        async def leave() -> None:
            nonlocal began
            began = True  # aclose() marks the shards closed before its first await
            try:
                await shards.aclose()
            except asyncio.CancelledError:
                self.outcomes["leave cancelled"] += 1
                self.trace(session.src, "leave cancelled")
                return
            self.outcomes["left"] += 1
            self.trace(session.src, "left")

        def done(_: asyncio.Task[None]) -> None:
            if seat.crashed:
                return
            seat.busy = False
            self._disturb()
            if not began:  # cancelled before aclose() ran: still a member
                session.closing = False
                self.trace(session.src, "leave cancelled before it began")
                return
            self._left(session)

        leaver = _Session(id=0, seat=seat, src=session.src, began=started)
        leaver.task = self._spawn(leave(), f"sim-leave:{session.src}")
        leaver.task.add_done_callback(done)
        self.leavers.append(leaver)
        self._may_cancel(leaver)

    def _left(self, session: _Session) -> None:
        seat = session.seat
        session.ended_at = self.now()
        if seat.member is session:
            seat.member = None
        if session in self.members:
            self.members.remove(session)
        self.ended.append(session)

    def _crash(self, seat: _Seat) -> None:
        seat.crashed, seat.crashed_at = True, self.now()
        seat.link.cut_until = math.inf
        seat.link.cut_mode = self.rng.choice(("hang", "raise"))
        self.dead_links.add(seat.link.name)
        for session in seat.sessions:
            session.exempt = True
        self.crashes += 1
        self.actions["crash"] += 1
        self._disturb()
        self.trace(seat.name, f"crashes: its link is cut for good ({seat.link.cut_mode})")

    def _restart(self, old: _Seat) -> None:
        seat = _Seat(
            index=old.index, generation=old.generation + 1, pid=old.pid, lease=old.lease,
            renew=old.renew, retry=old.retry, link=self._new_link(),
        )  # fmt: skip
        self._seat(seat)
        self.actions["restart"] += 1
        self._disturb()
        self.trace(seat.name, "restarts (same participant id, a new link)")

    def _work(self, seat: _Seat) -> None:
        session = seat.member
        assert session is not None
        assert session.shards is not None
        shards = session.shards
        self.session_seq += 1
        loop = _Loop(f"{seat.name}#{self.session_seq}", session)
        rng = random.Random(self.rng.getrandbits(64))
        self.actions["work"] += 1
        self.trace(loop.src, "run_for_each() called")
        seen: set[tuple[int, int]] = set()

        async def fn(view: ShardLeadership) -> None:
            key = (view.shard, view.token)
            if key in seen:
                self.fail(f"run_for_each of {loop.src} ran its work twice for shard "
                          f"{view.shard} token {view.token}")  # fmt: skip
            seen.add(key)
            work = _Work(f"{loop.src}.{view.shard}", view)
            if not view.is_valid:
                self.fail(f"run_for_each of {loop.src} started work for shard {view.shard} "
                          f"token {view.token}, a term that had already ended")  # fmt: skip
            self.works.append(work)
            mode = rng.choices(("forever", "return", "raise"), weights=(6, 3, 1))[0]
            duration = rng.uniform(0, 2 * self.lease)
            self.trace(work.src, f"work for token {view.token}: {mode} ({duration:.3f} s)")
            try:
                if mode == "forever":
                    await asyncio.get_running_loop().create_future()
                await asyncio.sleep(duration)
            except asyncio.CancelledError:
                work.cancelled = True
                self.trace(work.src, "work cancelled")
                raise
            finally:
                work.finished = True
            if mode == "raise":
                self.trace(work.src, "work raises")
                raise _SimulatedWorkError(work.src)
            self.trace(work.src, "work returns")

        async def run() -> None:
            outcome = "returned"
            try:
                await shards.run_for_each(fn)
                if not (session.closing or seat.crashed):
                    self.fail(f"run_for_each of {loop.src} returned while its shards are entered")
            except _SimulatedWorkError:
                outcome = "raised the work's error"
            except asyncio.CancelledError:
                outcome = "cancelled"
            except MultilockError as exc:  # left before it began
                outcome = "not entered"
                if not session.closing:
                    self.fail(f"run_for_each of {loop.src} raised {exc!r}")
            except Exception as exc:
                outcome = f"raised {type(exc).__name__}"
                self.fail(f"run_for_each of {loop.src} raised {exc!r}")
            self.outcomes[f"run_for_each {outcome}"] += 1
            self.trace(loop.src, f"run_for_each -> {outcome}")

        loop.task = self._spawn(run(), f"sim-work:{loop.src}")
        self.loops.append(loop)
        proxy = _Session(id=0, seat=seat, src=loop.src, began=self.now(), task=loop.task)
        self._may_cancel(proxy, self.config.cancel_rate / 2)

    def _wait_changed(self, seat: _Seat) -> None:
        session = seat.member
        assert session is not None
        assert session.shards is not None
        shards = session.shards
        self.session_seq += 1
        waiter = _Waiter(f"{seat.name}#{self.session_seq}", session)
        self.actions["wait_changed"] += 1

        async def wait() -> None:
            waiter.snapshot = self._snapshot(session)
            await shards.wait_changed()
            self.trace(waiter.src, "wait_changed() returned")

        waiter.task = self._spawn(wait(), f"sim-wait:{waiter.src}")
        self.waiters.append(waiter)

    @staticmethod
    def _snapshot(session: _Session) -> tuple[object, ...]:
        shards = session.shards
        assert shards is not None
        return (tuple(shards.owned), shards.share, shards.live_participants)

    def _check_shards(self, now: float) -> None:
        owners: dict[int, list[tuple[_Session, ShardLeadership]]] = {}
        owned_by: dict[_Session, int] = {}
        # A crashed participant's terms have all ended a lease after its crash.
        self.members = [
            s for s in self.members
            if not s.seat.crashed or now < s.seat.crashed_at + self.max_lease
        ]  # fmt: skip
        for session in self.members:
            assert session.shards is not None
            owned = session.shards.owned
            owned_by[session] = len(owned)
            for index, view in owned.items():
                if view.shard != index or view.group != f"{self.name}.shard-{index}":
                    self.fail(f"{session.src}: owned[{index}] is {view!r} of {view.group!r}")
                    return
                owners.setdefault(index, []).append((session, view))
        for index, holders in owners.items():
            if len(holders) > 1:
                who = ", ".join(f"{s.src} (token {v.token})" for s, v in holders)
                self.fail(
                    f"shards {self.name!r}: shard {index} has {len(holders)} owners at once: {who}"
                )
                return
        for waiter in self.waiters:
            if waiter.snapshot is None or waiter.task is None or waiter.task.done():
                continue
            if waiter.session.ended_at is not None or waiter.session.seat.crashed:
                continue
            if self._snapshot(waiter.session) == waiter.snapshot:
                continue
            if waiter.changed_at is None:
                waiter.changed_at = now
            elif now - waiter.changed_at > 0.01:
                self.fail(
                    f"wait_changed() of {waiter.src} has not returned "
                    f"{now - waiter.changed_at:.4f} s after (owned, share, live) changed from "
                    f"{waiter.snapshot} to {self._snapshot(waiter.session)}"
                )
                return
        self.waiters = [w for w in self.waiters if not (w.task and w.task.done())]
        for loop in self.loops:
            ended = loop.session.ended_at
            running = loop.task is not None and not loop.task.done()
            if running and ended is not None and not loop.session.exempt:  # noqa: SIM102
                if now - ended > self.exit_bound:
                    self.fail(
                        f"run_for_each of {loop.src} still runs {now - ended:.3f} s after its "
                        "shards were left"
                    )
                    return
        self.loops = [loop for loop in self.loops if loop.task and not loop.task.done()]
        calm = self._calm_since()
        if calm is None or now - calm < _SETTLE_LEASES * self.max_lease:
            return
        self._check_balance(now, calm, owners, owned_by)

    def _check_balance(
        self,
        now: float,
        calm: float,
        owners: Mapping[int, list[tuple[_Session, ShardLeadership]]],
        owned_by: Mapping[_Session, int],
    ) -> None:
        count = self.config.count
        assert count is not None
        live = [s for s in self.members if s.entered and not s.closing and not s.seat.crashed]
        if not live:
            return
        share = math.ceil(count / len(live))
        table = ", ".join(f"{s.src}={owned_by.get(s, 0)}" for s in live)
        quiet = f"{now - calm:.3f} s after the last membership change or fault"
        for session in live:
            if owned_by.get(session, 0) > share:
                self.fail(
                    f"balance: shards {self.name!r}: {session.src} owns "
                    f"{owned_by[session]} shards {quiet}, over ceil({count} / {len(live)} live) "
                    f"= {share} (owned: {table})"
                )
                return
        alive = set(live)
        unowned = [i for i in range(count) if not any(s in alive for s, _ in owners.get(i, ()))]
        if unowned:
            self.fail(
                f"balance: shards {self.name!r}: shard(s) {', '.join(map(str, unowned))} have "
                f"no live owner {quiet} (owned: {table})"
            )
            return
        if not self.episode_settled:
            self.episode_settled = True
            self.settled += 1
            self.trace("CHECK", f"balanced, every shard owned: {table}")

    # -- the observer's reports
    def _owner(self, seat: _Seat) -> _Session | None:
        task = asyncio.current_task()
        if task is None:
            return None
        if self.kind == "semaphore":
            return self.task_session.get(task)
        for session in reversed(seat.sessions):
            shards = session.shards
            if shards is not None and (task is shards._run_task or task in shards._tasks):
                return session
        return None

    def on_started(self, election: LeaderElection) -> None:
        seat = self.seat_of.get(election.provider)
        if seat is None:
            return  # not this run's
        session = self._owner(seat)
        if session is None:
            self.fail(f"an election of {self._what(election.group)} was started by {seat.name} "
                      "outside any entry or membership")  # fmt: skip
            return
        if session.ended_at is not None:
            self.fail(f"{session.src} started an election of {self._what(election.group)} "
                      f"after it ended at {self._at(session.ended_at)}")  # fmt: skip
        session.elections.append(election)
        self.elections[election] = session
        self.version += 1

    def on_stopped(self, election: LeaderElection) -> None:
        self.elections.pop(election, None)
        self.version += 1

    def on_acquired(self, election: LeaderElection, leadership: Leadership) -> None:
        session = self.elections.get(election)
        if session is None:
            return
        group, token = election.group, leadership.token
        self.leading[election] = leadership
        self.version += 1
        self.terms += 1
        if self.kind == "shards" and ".shard-" in group:
            self.holds += 1
        self.trace(session.seat.name, f"{session.src} acquires {group} token {token}")
        top = self.top_acquired.get(group, 0)
        if token <= top:
            self.fail(
                f"fencing: {session.src} began a term of {self._what(group)} with token "
                f"{token} after token {top}: tokens must rise in the order terms begin"
            )
        self.top_acquired[group] = max(top, token)
        if self.strict_store and self.ledger.granted.get((group, token)) != election.participant_id:
            self.fail(f"{session.src} began a term of {self._what(group)} with token {token}, "
                      "never granted to it by the store")  # fmt: skip

    def on_lost(self, election: LeaderElection, token: int, reason: str) -> None:
        leadership = self.leading.get(election)
        if leadership is not None and leadership.token == token:
            del self.leading[election]
        self.version += 1
        session = self.elections.get(election)
        if session is not None:
            self.trace(
                session.seat.name, f"{session.src} loses {election.group} token {token}: {reason}"
            )

    # -- invariants
    def _check_iteration(self, now: float) -> None:
        if self.warnings_seen < len(self.warnings):
            self._check_warnings()
        # Two owners can only begin at a term's start (an event), a view only turns invalid
        # with time: the checks over every term run when an event came, or every 5 ms.
        if self.version != self.checked_version or now >= self.next_check:
            self.checked_version, self.next_check = self.version, now + 0.005
            self._check_terms(now)
            if self.kind == "shards" and not self.failed():
                self._check_shards(now)
        if self.kind == "semaphore" and not self.failed():
            self._check_entries(now)
        if self.failed():
            return
        if self.works:
            self.works = self._check_works(self.works, now, "work")
        if not self.failed():
            self._check_exits(now)

    def _check_terms(self, now: float) -> None:
        """One valid term per group over every election, and the store holds it."""
        leading: dict[str, list[tuple[LeaderElection, Leadership]]] = {}
        for election, leadership in self.leading.items():
            if leadership.is_valid:
                leading.setdefault(election.group, []).append((election, leadership))
        for group, leaders in leading.items():
            if len(leaders) > 1:
                who = ", ".join(f"{self._who(e)} (token {le.token})" for e, le in leaders)
                self.fail(f"{self._what(group)} has {len(leaders)} owners at once: {who}")
                return
            if not self.strict_store:
                continue
            election, leadership = leaders[0]
            held = self._held_instead(group, election.participant_id, leadership.token, now)
            if held is not None:
                self.fail(
                    f"{self._who(election)} holds {self._what(group)} with token "
                    f"{leadership.token} but the store holds {held}"
                )
                return

    def _check_exits(self, now: float) -> None:
        """Everything an ended entry or membership started stops within a bound."""
        if not self.ended:
            return
        still = []
        for session in self.ended:
            if session.exempt:
                continue
            running = [e for e in session.elections if e.state is not ElectionState.STOPPED]
            if not running:
                continue
            still.append(session)
            assert session.ended_at is not None
            if now - session.ended_at > self.exit_bound:
                election = running[0]
                leadership = election.leadership
                holding = "" if leadership is None else f", holding token {leadership.token}"
                what = "entry" if self.kind == "semaphore" else "membership"
                self.fail(
                    f"the {what} {session.src} ended at {self._at(session.ended_at)} but its "
                    f"election of {self._what(election.group)} is still "
                    f"{election.state.value}{holding} {now - session.ended_at:.3f} s later: "
                    "every election a holder starts must stop when it leaves"
                )
                return
        self.ended = still

    def _check_step(self, now: float) -> None:
        self._check_warnings()
        for entry in self.entries:
            timeout = entry.timeout
            if entry.phase != "waiting" or timeout is None:
                continue
            if now - entry.began > timeout + self.call_bound:
                self.fail(
                    f"{entry.src} has waited {now - entry.began:.3f} s to enter with a "
                    f"timeout of {timeout} s"
                )
                return
        for leaver in self.leavers:
            if leaver.task is None or leaver.task.done() or leaver.seat.crashed:
                continue
            if now - leaver.began > self.call_bound:
                self.fail(f"aclose() of {leaver.src} has not returned after "
                          f"{now - leaver.began:.3f} s")  # fmt: skip
                return
        self.leavers[:] = [v for v in self.leavers if v.task and not v.task.done()]

    # -- the end of a run
    async def _finish(self) -> None:
        """Heal every fault; let the world settle; make everyone leave; the store empties."""
        self.fault_level = 0.0
        for seat in self.seats:
            if not seat.crashed:
                seat.link.cut_until = 0.0
        self._quiet()
        self.trace("sim", "finish: faults healed")
        await self._wait_virtual((_SETTLE_LEASES + 1.5) * self.max_lease)
        if self.failed():
            return
        self.closing = True
        self.trace("sim", "finish: everyone leaves")
        for entry in list(self.entries):
            if entry.task is not None:
                entry.cancelled = True
                entry.task.cancel()
        limit = self.now() + self.call_bound
        while True:
            for seat in self._candidates("leave"):  # (a join still in flight leaves next)
                self._leave(seat)
            if self._everyone_gone():
                break
            await asyncio.sleep(0.05 * self.lease)
            if self.failed():
                return
            self._step_checks()
            if self.now() > limit:
                left = [e.src for e in self.entries] + [v.src for v in self.leavers]
                left += [s.member.src for s in self.seats if s.member and not s.crashed]
                self.fail(f"finish: still not gone after {self.call_bound:.3f} s: {left}")
                return
        await self._wait_virtual(1.5 * self.max_lease)
        if self.failed():
            return
        now = self.now()
        for group in sorted(self.ledger.top):
            live = self.ledger.live(group, now)
            if live is not None and self.strict_store:
                self.fail(
                    f"after every participant left, {self._what(group)} is still held on the "
                    f"store by {live[1].pid} with token {live[0]}"
                )
                return
        self.checking = False
        self.trace("sim", "finish: everyone left, the store is empty")

    def _everyone_gone(self) -> bool:
        """No entry, no membership, and every election of theirs stopped (crashes aside)."""
        if self.entries or self.leavers:
            return False
        if any(seat.member is not None and not seat.crashed for seat in self.seats):
            return False
        return all(session.exempt for session in self.ended)

    async def _wait_virtual(self, seconds: float) -> None:
        end = self.now() + seconds
        while self.now() < end and not self.failed():
            await asyncio.sleep(0.05 * self.lease)
            self._step_checks()


# ---------------------------------------------------------------------- the entry points
def _resolve(
    seed: int,
    *,
    steps: int,
    kind: str,
    participants: int | None,
    limit: int | None,
    count: int | None,
    lease_duration: float | None,
    faults: float | None,
    cancel_rate: float | None,
    custom_store: bool,
) -> HoldersConfig:
    if kind not in _KINDS:
        raise ValueError(f"kind must be 'semaphore' or 'shards', not {kind!r}")
    if kind == "semaphore" and count is not None:
        raise ValueError("count is for kind='shards'; a semaphore takes limit")
    if kind == "shards" and limit is not None:
        raise ValueError("limit is for kind='semaphore'; shards take count")
    rng = random.Random(f"multilock-sim-holders-config:{kind}:{seed}")
    if kind == "semaphore":
        drawn_participants, drawn_size = rng.randint(2, 6), rng.randint(1, 3)
    else:
        drawn_participants, drawn_size = rng.randint(2, 5), rng.randint(2, 12)
    n = drawn_participants if participants is None else participants
    size = drawn_size if (limit if kind == "semaphore" else count) is None else (limit or count)
    if steps < 0:
        raise ValueError("steps must be >= 0")
    if n < 1 or size is None or not 1 <= size <= 10_000:
        raise ValueError("need at least 1 participant and a limit or count of 1 to 10000")
    lease, level, cancel = _draw_timing(rng, lease_duration, faults, cancel_rate, min_lease=0.5)
    return HoldersConfig(
        seed=seed,
        steps=steps,
        kind=kind,
        participants=n,
        limit=size if kind == "semaphore" else None,
        count=size if kind == "shards" else None,
        lease_duration=lease,
        faults=level,
        cancel_rate=cancel,
        custom_store=custom_store,
    )


def simulate_holders(
    seed: int,
    *,
    steps: int = 1000,
    kind: HolderKind = "semaphore",
    participants: int | None = None,
    limit: int | None = None,
    count: int | None = None,
    lease_duration: float | None = None,
    faults: float | None = None,
    cancel_rate: float | None = None,
    store: StoreFactory | None = None,
    keep_trace: bool = False,
    trace_lines: int = 200,
) -> HoldersReport:
    """Run one seeded world of *kind* (``"semaphore"`` or ``"shards"``) for *steps* random
    steps; raise `SimulationFailure` on a broken invariant.

    Options left None are drawn from *seed*: 2-6 participants and a limit of 1-3 (a
    semaphore) or 2-5 participants and 2-12 shards, a lease of 1-2 virtual seconds, a fault
    intensity for the storms and a cancellation rate. *store* builds the store under the
    faulty links from the simulation's clock (default: an `InMemoryProvider`, whose every
    answer is also checked against the simulator's ledger).

    Returns a `HoldersReport`. The failure carries the seed, a line that replays the run and
    the last *trace_lines* lines of the trace. The same arguments give the same trace: the
    run has its own event loop on a `FakeClock`, and the global `random` (the core's
    jitter, the shards' choices) is seeded for the run and restored after it.
    """
    config = _resolve(
        seed,
        steps=steps,
        kind=kind,
        participants=participants,
        limit=limit,
        count=count,
        lease_duration=lease_duration,
        faults=faults,
        cancel_rate=cancel_rate,
        custom_store=store is not None,
    )
    return _HoldersWorld(config, store, trace_lines).run(keep_trace=keep_trace)


def run_holder_simulations(
    seeds: Iterable[int],
    *,
    steps: int = 1000,
    kinds: Sequence[HolderKind] = _KINDS,
    jobs: int = 1,
    out: Callable[[str], None] = print,
) -> list[SimulationFailure]:
    """Simulate every seed in every kind of world (in *jobs* processes); print a line per
    run and a summary; return the failures (each printed in full as it comes)."""
    runs = [
        (f"{kind} seed {seed}", f"{kind} {seed}", seed, {"steps": steps, "kind": kind})
        for seed in seeds
        for kind in kinds
    ]
    return _campaign(
        simulate_holders,
        runs,
        describe=_describe_report,
        seeds=list(dict.fromkeys(seed for _, _, seed, _ in runs)),
        what=f" of {', '.join(kinds)}",
        jobs=jobs,
        out=out,
    )


def _describe_report(report: HoldersReport) -> str:
    c = report.config
    size = f"limit {c.limit}" if c.kind == "semaphore" else f"{c.count} shards"
    return (
        f"{report.steps} steps, {c.participants} participants, {size}, "
        f"lease {c.lease_duration} s, faults {c.faults}, {report.terms} terms, "
        f"{report.settled} settled, {report.crashes} crashes, "
        f"{report.virtual_seconds:.0f} virtual s"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of long campaigns (``nox -s simulate_holders``)."""
    parser = _campaign_parser(
        "Deterministic simulation of multilock semaphores and shards.",
        "MULTILOCK_SIM_HOLDERS",
        total_steps=400_000,
        steps=1000,
        per="run",
        over=", over every kind",
    )
    parser.add_argument(
        "--kind",
        choices=("both", *_KINDS),
        default=os.environ.get("MULTILOCK_SIM_HOLDERS_KIND", "both"),
        help="which world (env MULTILOCK_SIM_HOLDERS_KIND; default both)",
    )
    args = parser.parse_args(argv)
    kinds: tuple[HolderKind, ...] = _KINDS if args.kind == "both" else (args.kind,)
    seeds = _campaign_seeds(args, runs_per_seed=len(kinds))
    failures = run_holder_simulations(seeds, steps=args.steps, kinds=kinds, jobs=args.jobs)
    return 1 if failures else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
