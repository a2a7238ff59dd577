"""`Lock` and `Semaphore`: fenced holders of a name, built on `LeaderElection`.

A lock is an election of one group that is held for the length of an ``async with``
block; a semaphore of *limit* is *limit* such groups, ``<name>.slot-<i>``, of which a
holder takes exactly one. Everything that makes an election safe carries over unchanged:
the store's atomic compare-then-act, the fencing token of each term (rising per group, so
per slot), the local deadline that ends a term whatever the store is doing, the
notifications that wake waiters, and a stop that releases even when its caller is
cancelled.

Where each decision is made:

- waiting: `acquire_one` starts one election per group, one at a time, and keeps the
  first that wins, stopping (and so releasing) the others;
- loss: `Holding` cancels the ``async with`` body's task when the term ends before the
  block does, and turns that cancellation into `LeadershipLost` as the block exits (the
  way `asyncio.timeout` turns its cancellation into `TimeoutError`);
- release: `stop_all`, whose stops run on in their own tasks if the caller is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypedDict, Unpack

from ._election import LeaderElection
from ._errors import ConfigurationError, LeadershipLost, MultilockError
from ._names import default_participant_id, to_seconds
from ._options import Duration, ElectionOptions
from ._provider import Provider
from ._types import EventKind, Leadership

__all__ = ["AcquireTimeout", "HolderFields", "Lock", "Semaphore", "SemaphoreSlot"]

#: Stops and guards that must outlive a cancelled caller (a reference keeps them alive).
_BACKGROUND: set[asyncio.Task[Any]] = set()


class AcquireTimeout(MultilockError, TimeoutError):
    """A `Lock` or `Semaphore` could not be acquired within its ``timeout``."""


class HolderFields(TypedDict, total=False):
    """The election options a `Lock`, `Semaphore` or `Shards` accepts as keywords.

    The name gives the groups, and a holder always releases on exit, so ``group`` and
    ``release_on_stop`` are not among them.
    """

    participant_id: str
    renew_interval: Duration
    retry_interval: Duration
    metadata: Mapping[str, str]
    max_clock_drift: float
    probe_timeout: Duration | None


def holder_options(
    kind: str, groups: Sequence[str], lease_duration: Duration | None, fields: Mapping[str, Any]
) -> list[ElectionOptions]:
    """One `ElectionOptions` per group, validated now (the boundary), with a clear error
    for an option a holder does not take."""
    for refused, why in (
        ("group", "the name gives the group"),
        ("release_on_stop", "a holder always releases on exit"),
    ):
        if refused in fields:
            raise ConfigurationError(f"{kind} takes no {refused!r} option: {why}")
    given = dict(fields)
    # One participant for every group of the holder: drawn once, not once per group.
    given.setdefault("participant_id", default_participant_id())
    if lease_duration is not None:
        given["lease_duration"] = lease_duration
    return [ElectionOptions.from_fields({**given, "group": group}) for group in groups]


def check_timeout(timeout: Duration | None) -> float | None:
    if timeout is None:
        return None
    return to_seconds(timeout, "timeout")


def check_count(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{field} must be an int, not {type(value).__name__}")
    if not 1 <= value <= 10_000:
        raise ConfigurationError(f"{field} must be between 1 and 10000, got {value}")
    return value


def keep(task: asyncio.Task[Any]) -> asyncio.Task[Any]:
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


async def stop_all(elections: Sequence[LeaderElection]) -> None:
    """Stop every election (each releases what it holds), in parallel.

    Each stop starts in its own task, so a cancellation of the caller cuts none of them
    short: they run on, and the cancellation propagates.
    """
    if not elections:
        return
    loop = asyncio.get_running_loop()
    tasks = [keep(loop.create_task(election.stop())) for election in elections]
    await asyncio.shield(asyncio.gather(*tasks))


async def acquire_one(
    elections: Sequence[LeaderElection], deadline: float | None, what: str
) -> int:
    """Start *elections* and return the index of the first to lead; stop all the others.

    The elections start one at a time, in a random order (so that waiters spread over the
    groups), each after the previous one's first campaign round has settled: a free group
    is taken with one acquire, rather than every free group being won and all but one
    released. Then it waits for whichever wins first, woken by the store's notifications.

    Raises `AcquireTimeout` (after stopping them all) when none leads by *deadline* (loop
    time). If the caller is cancelled, every election is stopped before the cancellation
    propagates (the stops run on in their own tasks).
    """
    loop = asyncio.get_running_loop()
    waits: dict[asyncio.Task[Leadership], int] = {}
    winner: int | None = None
    order = list(range(len(elections)))
    random.shuffle(order)
    started: list[int] = []
    try:
        for index in order:
            election = elections[index]
            started.append(index)  # before the await: a cancellation in it stops this one too
            await _first_round(election, deadline)
            if election.is_leader:
                winner = index
                return winner
        waits = {loop.create_task(elections[i].wait_until_leader()): i for i in started}
        timeout = None if deadline is None else max(deadline - loop.time(), 0.0)
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # (not None: checked)
        leading = [i for i in started if elections[i].is_leader]
        if leading:
            winner = leading[0]
        elif done:  # won and already lost again: take the term anyway, the guard sees it
            winner = min(waits[task] for task in done)
        if winner is None:
            raise AcquireTimeout(f"{what}: {_why_waiting(elections)}")
        return winner
    finally:
        for task in waits:
            task.cancel()
        others = [elections[i] for i in started if i != winner]
        if winner is None:  # give the stops until the deadline; they run on after it
            stopping = keep(loop.create_task(stop_all(others)))
            bound = None if deadline is None else max(deadline - loop.time(), 0.0)
            await asyncio.wait({stopping}, timeout=bound)
        else:  # the term is ours now: release any other slot won meanwhile in the background
            keep(loop.create_task(stop_all(others)))


async def _first_round(election: LeaderElection, deadline: float | None) -> None:
    """Start *election* and wait until its first campaign round has an answer (it won, or
    it saw who holds the group), at most a retry interval or until *deadline*."""
    stream = election.events(EventKind.ACQUIRED | EventKind.LEADER_CHANGED)
    try:
        await election.start()
        bound = asyncio.get_running_loop().time() + election.options.retry_interval
        if deadline is not None:
            bound = min(bound, deadline)
        with contextlib.suppress(TimeoutError, StopAsyncIteration):
            async with asyncio.timeout_at(bound):
                await anext(stream)
    finally:
        await stream.aclose()


def _why_waiting(elections: Sequence[LeaderElection]) -> str:
    """Who holds what a timed-out waiter waited for."""
    holders: list[str] = []
    for election in elections:
        observed = election._campaign.observed
        failure = election._campaign.last_failure
        if election._campaign.round_failed and failure is not None:
            return f"the store failed: {str(failure) or type(failure).__name__}"
        if isinstance(observed, tuple):
            holders.append(f"{observed[0]} (token {observed[1]})")
    if not holders:
        return "the store has not answered yet"
    return "held by " + ", ".join(holders)


class Holding:
    """One ``async with`` of a lock or semaphore: the election that holds, and the guard
    that cancels the body's task if the term ends first."""

    def __init__(self, election: LeaderElection, held: Leadership) -> None:
        self.election = election
        self.held = held
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling() if self._task is not None else 0
        self._exiting = False
        self._fired = False
        self._guard = keep(asyncio.get_running_loop().create_task(self._watch()))

    async def _watch(self) -> None:
        await self.held.wait_lost()
        if not self._exiting and self._task is not None:
            self._fired = True
            self._task.cancel(f"{self.held.group}: the lease was lost")

    async def exit(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        """Release, then raise `LeadershipLost` if the term ended inside the block."""
        self._exiting = True
        self._guard.cancel()
        lost = self._fired or not self.held.is_valid
        reason = self.held._term.end_reason
        await stop_all([self.election])
        if self._task is not None:
            pending = self._task.uncancel() if self._fired else self._task.cancelling()
            if pending > self._cancelling:
                return  # cancelled from outside too: that cancellation goes on
        if not lost:
            return
        if exc_type is None or exc_type is asyncio.CancelledError:
            why = f"lost before the block ended ({reason or 'the deadline passed'})"
            raise LeadershipLost(self.held.group, self.held.token, why) from exc


class _Holder:
    """What `Lock` and `Semaphore` share: groups, options, and a stack of holdings per
    task, so one object can be entered by several tasks at once (each a separate holder)."""

    _kind = "holder"

    def __init__(
        self,
        provider: Provider,
        name: str,
        groups: list[str],
        lease_duration: Duration | None,
        timeout: Duration | None,
        fields: Mapping[str, Any],
    ) -> None:
        if not isinstance(provider, Provider):
            raise ConfigurationError(
                f"provider must be a multilock Provider, not {type(provider).__name__}"
            )
        self._provider = provider
        self._name = name
        self._options = holder_options(self._kind, groups, lease_duration, fields)
        for options in self._options[:1]:
            provider.lease_bounds.check(options.lease_duration, type(provider).__name__)
        self._timeout = check_timeout(timeout)
        self._holdings: dict[asyncio.Task[Any] | None, list[Holding]] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def provider(self) -> Provider:
        return self._provider

    @property
    def options(self) -> ElectionOptions:
        """The election options of the first group (all groups share them)."""
        return self._options[0]

    @property
    def timeout(self) -> float | None:
        return self._timeout

    async def _enter(self) -> tuple[int, Holding]:
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout is None else loop.time() + self._timeout
        elections = [LeaderElection(self._provider, options) for options in self._options]
        index = await acquire_one(elections, deadline, self._timeout_message())
        election = elections[index]
        held = election.leadership or election._leadership
        assert held is not None
        holding = Holding(election, held)
        self._holdings.setdefault(asyncio.current_task(), []).append(holding)
        return index, holding

    def _timeout_message(self) -> str:
        within = "" if self._timeout is None else f" within {self._timeout:g} s"
        return f"{self._kind} {self._name!r} not acquired{within}"

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = asyncio.current_task()
        stack = self._holdings.get(task)
        if not stack:
            raise MultilockError(f"{self._kind} {self._name!r} is not held by this task")
        holding = stack.pop()
        if not stack:
            del self._holdings[task]
        await holding.exit(exc_type, exc)

    def held_count(self) -> int:
        """How many ``async with`` blocks of this object hold right now (in this process)."""
        return sum(len(stack) for stack in self._holdings.values())


class Lock(_Holder):
    """A fenced lock on *name* across processes: ``async with Lock(provider, "name") as held``.

    Entering waits until this holder owns the name (at most *timeout* seconds, then
    `AcquireTimeout`), renews it in the background, and gives the `Leadership`: use
    ``held.token`` to fence writes. If the lease is lost before the block ends, the
    block's task is cancelled and the block raises `LeadershipLost`. Leaving releases, and
    a waiter elsewhere is woken by the store's notification.

    One `Lock` object may be entered by several tasks at once: each is a separate holder
    and they exclude each other through the store. It is not reentrant.
    """

    _kind = "lock"

    def __init__(
        self,
        provider: Provider,
        name: str,
        *,
        lease_duration: Duration | None = None,
        timeout: Duration | None = None,
        **options: Unpack[HolderFields],
    ) -> None:
        super().__init__(provider, name, [name], lease_duration, timeout, options)

    async def __aenter__(self) -> Leadership:
        _, holding = await self._enter()
        return holding.held

    def __repr__(self) -> str:
        return f"<Lock name={self._name!r} held={self.held_count()} provider={self._provider!r}>"


class SemaphoreSlot(Leadership):
    """The slot of a `Semaphore` a holder owns: a `Leadership` of that slot's group, plus
    ``slot`` (0 to limit - 1). The token rises per slot."""

    __slots__ = ("slot",)

    def __init__(self, leadership: Leadership, slot: int) -> None:
        super().__init__(
            group=leadership.group, participant_id=leadership.participant_id, term=leadership._term
        )
        self.slot = slot

    def __repr__(self) -> str:
        return f"<SemaphoreSlot slot={self.slot} token={self.token} valid={self.is_valid}>"


def slot_group(name: str, index: int) -> str:
    return f"{name}.slot-{index}"


class Semaphore(_Holder):
    """At most *limit* holders of *name* at any instant, across processes.

    ``async with Semaphore(provider, "name", 3) as held`` waits for one of the slots
    ``<name>.slot-0`` .. ``<name>.slot-2`` (each a group on the store), with ``held.slot``
    and ``held.token`` (rising per slot). Loss and release behave as for `Lock`.

    A waiter tries the slots one at a time (in a random order, so waiters spread), then
    campaigns for all of them and keeps the first it wins (releasing any other it won
    meanwhile), so it is woken by the store's notification on any slot: while it waits it
    costs the store what *limit* followers cost.
    """

    _kind = "semaphore"

    def __init__(
        self,
        provider: Provider,
        name: str,
        limit: int,
        *,
        lease_duration: Duration | None = None,
        timeout: Duration | None = None,
        **options: Unpack[HolderFields],
    ) -> None:
        self._limit = check_count(limit, "limit")
        groups = [slot_group(name, i) for i in range(self._limit)]
        super().__init__(provider, name, groups, lease_duration, timeout, options)

    @property
    def limit(self) -> int:
        return self._limit

    async def __aenter__(self) -> SemaphoreSlot:
        index, holding = await self._enter()
        held = SemaphoreSlot(holding.held, index)
        holding.held = held
        return held

    def __repr__(self) -> str:
        return (
            f"<Semaphore name={self._name!r} limit={self._limit} held={self.held_count()} "
            f"provider={self._provider!r}>"
        )
