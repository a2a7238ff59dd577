"""`Shards`: *count* shards of a name, each owned by exactly one live participant, balanced.

Each shard is a group, ``<name>.shard-<i>``, so ownership is leadership: one owner at any
instant, a fencing token per shard, a deadline that ends ownership whatever the store is
doing. Balance needs to know how many participants are live; each holds one membership
slot, ``<name>.member-<k>`` (a semaphore of *count* slots: a participant beyond *count*
could own nothing anyway, and waits as a standby), and counts the slots with a live
holder.

Where each decision is made:

- membership: `_membership` holds one member slot, and takes another if it loses it;
- the share, ``ceil(count / live members)``: `_count_members`, every ``retry_interval``;
- ownership: `_balance`, the only place shard elections start or stop. Under its share a
  participant campaigns for every shard it does not own (woken by the store when one
  frees); at its share it stops campaigning; over it, it releases the surplus (its newest
  terms first), which wakes the campaigners elsewhere;
- work: `run_for_each`, one task per owned shard and term, cancelled when the term ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import Any, Self, Unpack

from ._calls import call_until, cancel_and_wait, describe_callable, is_async_callable, sleep_until
from ._election import LeaderElection
from ._errors import ConfigurationError, LeadershipLost, MultilockError
from ._lock import HolderFields, acquire_one, check_count, holder_options, keep, stop_all
from ._names import default_participant_id
from ._options import Duration
from ._provider import Provider
from ._types import EventKind, LeaderInfo, Leadership

__all__ = ["ShardLeadership", "Shards"]

log = logging.getLogger(__name__)


class ShardLeadership(Leadership):
    """Ownership of one shard: a `Leadership` of the shard's group plus ``shard``, its
    index (0 to count - 1). The token rises per shard."""

    __slots__ = ("shard",)

    def __init__(self, leadership: Leadership, shard: int) -> None:
        super().__init__(
            group=leadership.group, participant_id=leadership.participant_id, term=leadership._term
        )
        self.shard = shard

    def __repr__(self) -> str:
        return f"<ShardLeadership shard={self.shard} token={self.token} valid={self.is_valid}>"


def shard_group(name: str, index: int) -> str:
    return f"{name}.shard-{index}"


def member_group(name: str, index: int) -> str:
    return f"{name}.member-{index}"


class Shards:
    """*count* shards of *name*, shared out among the live participants.

    ``async with Shards(provider, "name", 64) as shards:`` joins; ``shards.owned`` maps
    each shard index this participant owns to its `ShardLeadership`, and ``await
    shards.run_for_each(fn)`` runs ``await fn(shard_leadership)`` for each owned shard,
    cancelled when that shard is lost. Leaving releases every shard at once.

    Every shard has at most one owner at any instant. Once membership has been stable for
    two leases no participant owns more than ``ceil(count / live participants)``: a
    newcomer is counted within ``retry_interval``, the others release their surplus and it
    takes it; the shards of a participant that dies are taken over when their leases
    expire.
    """

    def __init__(
        self,
        provider: Provider,
        name: str,
        count: int,
        *,
        lease_duration: Duration | None = None,
        **options: Unpack[HolderFields],
    ) -> None:
        if not isinstance(provider, Provider):
            raise ConfigurationError(
                f"provider must be a multilock Provider, not {type(provider).__name__}"
            )
        self._count = check_count(count, "count")
        self._provider = provider
        self._name = name
        shards = [shard_group(name, i) for i in range(self._count)]
        members = [member_group(name, i) for i in range(self._count)]
        fields: dict[str, Any] = {"participant_id": default_participant_id(), **options}
        self._shard_options = holder_options("shards", shards, lease_duration, fields)
        self._member_options = holder_options("shards", members, lease_duration, fields)
        options_ = self._shard_options[0]
        provider.lease_bounds.check(options_.lease_duration, type(provider).__name__)
        self._retry = options_.retry_interval
        self._elections: dict[int, LeaderElection] = {}
        self._views: dict[int, ShardLeadership] = {}
        self._member: LeaderElection | None = None
        self._share = 0
        self._live = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._run_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._entered = False
        self._closed = False
        self._count_due = False

    # ------------------------------------------------------------------ public
    @property
    def name(self) -> str:
        return self._name

    @property
    def count(self) -> int:
        return self._count

    @property
    def participant_id(self) -> str:
        return self._shard_options[0].participant_id

    @property
    def live_participants(self) -> int:
        """Live participants at the last count (0 before the first)."""
        return self._live

    @property
    def share(self) -> int:
        """The most shards this participant may own now: ``ceil(count / live)``, or 0
        while it holds no membership slot."""
        return self._share

    @property
    def owned(self) -> Mapping[int, ShardLeadership]:
        """The shards owned now (valid terms only), by index, in index order."""
        owned: dict[int, ShardLeadership] = {}
        for index in sorted(self._elections):
            leadership = self._elections[index].leadership
            if leadership is None:
                continue
            view = self._views.get(index)
            if view is None or view._term is not leadership._term:
                view = self._views[index] = ShardLeadership(leadership, index)
            owned[index] = view
        return owned

    async def wait_changed(self) -> None:
        """Return at the next change of ownership or membership (or when closed)."""
        await self._changed.wait()

    async def run_for_each(self, fn: Callable[[ShardLeadership], Coroutine[Any, Any, Any]]) -> None:
        """Run ``await fn(shard_leadership)`` for each owned shard, once per term, until
        the ``async with`` block ends.

        A shard's task is cancelled the moment its term ends (lost, or released to
        rebalance); the shard's next term runs *fn* again. If *fn* raises, the other tasks
        are cancelled and the exception propagates.
        """
        if not is_async_callable(fn):
            kind = "not callable" if not callable(fn) else "not an async function"
            raise TypeError(
                "run_for_each() needs an async function (async def fn(shard)); "
                f"{describe_callable(fn)} is {kind}. To run a plain function in a thread "
                "per shard, use multilock.core.sync.Shards"
            )
        self._require_entered("run_for_each")
        running: dict[int, tuple[ShardLeadership, asyncio.Task[Any]]] = {}
        try:
            while not self._closed:
                changed = self._changed
                for index, view in self.owned.items():
                    current = running.get(index)
                    if current is None or current[0]._term is not view._term:
                        election = self._elections[index]
                        task = asyncio.ensure_future(election.run_if_leader(_bind(fn, view)))
                        running[index] = (view, task)
                for index, (view, task) in list(running.items()):
                    if task.done():
                        error = None if task.cancelled() else task.exception()
                        if error is not None and not _ended_with(error, view):
                            raise error
                        if not view.is_valid:
                            del running[index]  # the term ended: its next term runs fn again
                waiter = asyncio.ensure_future(changed.wait())
                tasks = [t for _, t in running.values() if not t.done()]
                try:
                    await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
        finally:
            tasks = [t for _, t in running.values()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks)

    async def __aenter__(self) -> Self:
        if self._entered:
            raise MultilockError(f"shards {self._name!r} are already entered")
        self._entered, self._closed = True, False
        self._changed, self._wake = asyncio.Event(), asyncio.Event()
        self._run_task = asyncio.get_running_loop().create_task(
            self._run(), name=f"multilock-shards-{self._name}"
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Leave: stop campaigning and release every shard and the membership slot.

        Cancelling the caller does not cut the releases short (they run on in their own
        tasks).
        """
        if not self._entered:
            return
        self._closed = True
        self._notify()
        elections = [*self._elections.values()]
        if self._member is not None:
            elections.append(self._member)
        self._elections, self._member, self._share = {}, None, 0
        try:
            await cancel_and_wait(self._run_task, *self._tasks)
        finally:
            self._run_task = None
            self._entered = False
            await stop_all(elections)

    def __repr__(self) -> str:
        return (
            f"<Shards name={self._name!r} count={self._count} owned={len(self.owned)} "
            f"share={self._share} live={self._live}>"
        )

    # ------------------------------------------------------------------ the coordinator
    async def _run(self) -> None:
        self._spawn(self._membership())
        loop = asyncio.get_running_loop()
        next_count = loop.time()
        while True:
            if self._count_due or loop.time() >= next_count:
                self._count_due = False
                await self._count_members()
                next_count = loop.time() + self._retry * random.uniform(0.75, 1.0)
            await self._balance()
            await sleep_until(next_count, self._wake)
            self._wake.clear()

    async def _membership(self) -> None:
        """Hold one member slot; when it is lost, take any free one again."""
        while True:
            elections = [LeaderElection(self._provider, o) for o in self._member_options]
            index = await acquire_one(elections, None, "membership")
            member = self._member = elections[index]
            leadership = member.leadership
            self._count_due = True  # count at once: this participant is one more now
            self._wake.set()
            if leadership is not None:
                await leadership.wait_lost()
            self._member = None
            self._wake.set()
            await stop_all([member])

    async def _count_members(self) -> None:
        """Count the member slots with a live holder; on a store error keep the old count."""
        groups = [o.group for o in self._member_options]
        deadline = asyncio.get_running_loop().time() + self._retry

        async def read(group: str) -> LeaderInfo | None:
            # The call is made inside its task: a cancelled gather drops no coroutine.
            return await call_until(self._provider.get_leader(group), deadline)

        results = await asyncio.gather(*(read(g) for g in groups), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning(
                "shards %s: counting the members failed (%d of %d reads): %r",
                self._name, len(failed), len(groups), failed[0],
            )  # fmt: skip
            return
        # Distinct participants, not occupied slots: one rejoining after an outage may hold
        # several slots for a moment, before it stops all but one.
        live = len({r.participant_id for r in results if isinstance(r, LeaderInfo)})
        if live != self._live:
            log.info("shards %s: %d live participant(s)", self._name, live)
            self._live = live
            self._notify()

    async def _balance(self) -> None:
        """Start or stop shard elections so this participant owns its share."""
        member = self._member
        share = math.ceil(self._count / max(self._live, 1)) if member and member.is_leader else 0
        if share != self._share:
            self._share = share
            self._notify()
        owned = [i for i, e in self._elections.items() if e.is_leader]
        if len(owned) > share:
            # The newest terms go first: their work has barely started.
            owned.sort(key=lambda i: _term_started(self._elections[i]), reverse=True)
            surplus = owned[: len(owned) - share]
            self._drop(surplus)
            log.info("shards %s: releasing %d shard(s) over the share", self._name, len(surplus))
        elif len(owned) == share:
            self._drop([i for i, e in self._elections.items() if not e.is_leader])
        else:
            for index in range(self._count):
                if index not in self._elections and not self._closed:
                    election = LeaderElection(self._provider, self._shard_options[index])
                    self._elections[index] = election
                    await election.start()
                    self._spawn(self._follow(election))

    def _drop(self, indexes: list[int]) -> None:
        if not indexes:
            return
        loop = asyncio.get_running_loop()
        for index in indexes:
            self._views.pop(index, None)
            # A task per stop, never cancelled: a cancelled coordinator cannot skip one.
            keep(loop.create_task(self._elections.pop(index).stop()))
        self._notify()

    async def _follow(self, election: LeaderElection) -> None:
        """Wake the coordinator when *election* wins or loses a shard."""
        async for _ in election.events(EventKind.ACQUIRED | EventKind.LOST):
            self._wake.set()
            self._notify()

    # ------------------------------------------------------------------ helpers
    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("shards %s: internal task failed", self._name, exc_info=task.exception())

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _require_entered(self, what: str) -> None:
        if not self._entered or self._closed:
            raise MultilockError(f"{what}: enter the Shards first (async with Shards(...))")


def _ended_with(error: BaseException, view: ShardLeadership) -> bool:
    """*error* is the shard's own term ending (``check()`` after the deadline, before the
    cancellation arrived): the end of that term, not a failure of the work."""
    return isinstance(error, LeadershipLost) and error.token == view.token and not view.is_valid


def _term_started(election: LeaderElection) -> float:
    term = election._term
    return 0.0 if term is None else term.started


def _bind(
    fn: Callable[[ShardLeadership], Coroutine[Any, Any, Any]], view: ShardLeadership
) -> Callable[[Leadership], Coroutine[Any, Any, Any]]:
    async def run(_: Leadership) -> Any:
        return await fn(view)

    return run
