"""Blocking `Lock`, `Semaphore` and `Shards`: the ``with`` forms, for threaded programs.

Each wraps its async twin (`multilock.core.Lock`, ...) on the event loop of a blocking
portal, the way `multilock.core.sync.LeaderElection` wraps its election: the shared
``multilock-sync`` loop thread or a ``loop_factory`` of its own, interrupts that cancel the
call on the loop, `RuntimeError` instead of a deadlock on the loop thread (see the
`multilock.core.sync` docstring). What the ``with`` forms add:

- ``with lock as held:`` runs the async ``async with`` in a task of its own on the loop,
  which lasts until the block ends. A thread cannot be cancelled, so where the async form
  cancels the body at loss, here the body learns of it through ``held.lost`` (a
  `threading.Event`), ``held.is_valid`` or ``held.check()``. Leaving the block releases,
  and raises `LeadershipLost` if the lease was lost inside it (unless another exception
  is on its way out).
- ``shards.run_for_each(fn)`` calls ``fn(shard_leadership)`` in a thread per owned shard
  and term, told of loss the same way.
- A provider given as a URL belongs to the object. A `Shards` closes it with ``close()``
  or on leaving its ``with`` block (the block is its life, as for an election). A `Lock`
  or `Semaphore` closes it when its last ``with`` block ends, so ``with Lock(url, "job"):``
  leaves nothing open, and builds it again at the next ``with``: one object can serve a
  loop of jobs, or several threads, without a block ever finding it closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar, Unpack

from ._errors import LeadershipLost, MultilockError
from ._lock import HolderFields, SemaphoreSlot
from ._lock import Lock as AsyncLock
from ._lock import Semaphore as AsyncSemaphore
from ._options import Duration
from ._portal import LoopFactory
from ._provider import Provider
from ._shards import ShardLeadership
from ._shards import Shards as AsyncShards
from ._sync_base import Escaped, Facade, Lifetime, build, in_worker_thread, require_plain, settle
from ._types import Leadership

__all__ = ["Lock", "Semaphore", "Shards"]

log = logging.getLogger(__name__)

T = TypeVar("T")
AsyncHolder = AsyncLock | AsyncSemaphore

#: Tasks that must outlive the call that started them (asyncio keeps weak references).
_BACKGROUND: set[asyncio.Task[Any]] = set()


# ---------------------------------------------------------------------- Lock and Semaphore
class _Hold:
    """One ``with`` block: its task on the loop, and the future that lets it end."""

    __slots__ = ("held", "release", "task")

    def __init__(self) -> None:
        self.held: Leadership | None = None
        self.release: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None


async def _holding(
    holder: AsyncHolder, entered: asyncio.Future[Leadership], release: asyncio.Future[None]
) -> None:
    """The async ``with`` block of one sync holder: hold until released.

    At loss the async holder cancels this task and its exit raises `LeadershipLost`,
    which the thread receives when it leaves its block.
    """
    async with holder as held:
        entered.set_result(held)
        await release


async def _end(hold: _Hold) -> None:
    """Let the hold end (releasing) and raise what its exit raised."""
    assert hold.task is not None
    assert hold.release is not None
    settle(hold.release, None)
    await asyncio.wait({hold.task})
    if not hold.task.cancelled() and (error := hold.task.exception()) is not None:
        raise error


class _SyncHolder(Facade):
    """`Lock` and `Semaphore`: each ``with`` block, from any thread, is one holder."""

    def __init__(
        self,
        provider: Provider | str,
        name: str,
        make: Callable[[Provider], AsyncHolder],
        loop_factory: LoopFactory | None,
    ) -> None:
        super().__init__(provider, loop_factory)
        self._source = provider
        self._make_holder = make
        self._name = name
        self._users = 0  # threads inside a block or entering one
        self._holds: dict[int, list[_Hold]] = {}  # by thread, innermost last
        self._tasks: set[asyncio.Task[None]] = set()  # on the loop thread only
        self._provider: Provider | None
        holder, self._provider = self._make(make, provider)
        self._holder: AsyncHolder | None = holder
        self._timeout = holder.timeout

    @property
    def name(self) -> str:
        return self._name

    @property
    def timeout(self) -> float | None:
        """Seconds a ``with`` waits before `AcquireTimeout` (None: no limit)."""
        return self._timeout

    def _acquire(self) -> Leadership:
        what = f"entering {self._kind} {self._name!r}"
        self._portal.check_thread(what)
        with self._state:
            closed = self._closed
            if not closed:
                self._users += 1
        if closed:
            raise MultilockError(f"{what}: {self!r} is closed")
        hold = _Hold()
        try:
            held = self._portal.call(self._begin, hold)
        except BaseException as exc:
            self._let_go(hold)  # interrupted just as it was acquired: release
            self._leave()
            if isinstance(exc, concurrent.futures.CancelledError) and self.closed:
                raise MultilockError(f"{what}: {self!r} was closed meanwhile") from None
            raise
        hold.held = held
        with self._state:
            self._holds.setdefault(threading.get_ident(), []).append(hold)
        return held

    async def _begin(self, hold: _Hold) -> Leadership:
        """Start the hold's task and return once it holds (or raise why it could not)."""
        loop = asyncio.get_running_loop()
        if self._holder is None:  # built from a URL and closed by the last block: rebuild
            rebuilt, self._provider = await build(self._make_holder, self._source)
            self._holder = rebuilt
        holder = self._holder
        entered: asyncio.Future[Leadership] = loop.create_future()
        hold.release = loop.create_future()
        hold.task = task = loop.create_task(_holding(holder, entered, hold.release))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        either: set[asyncio.Future[Any]] = {entered, task}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # interrupted: stop waiting (or holding)
            task.cancel()
            raise
        if not entered.done():
            await task  # raises why it could not acquire: AcquireTimeout, a store error...
        return entered.result()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        what = f"leaving {self._kind} {self._name!r}"
        self._portal.check_thread(what)
        with self._state:
            stack = self._holds.get(threading.get_ident())
            if not stack:
                raise MultilockError(f"{what}: not held by this thread")
            hold = stack.pop()
            if not stack:
                del self._holds[threading.get_ident()]
        try:
            error = self._release(hold)
        except BaseException:  # interrupted: the hold ends on its own
            self._let_go(hold)
            raise
        finally:
            self._leave()
        if error is not None and exc_type is None:
            raise error

    def _release(self, hold: _Hold) -> LeadershipLost | None:
        """Release *hold*; return the `LeadershipLost` of a lease lost inside the block."""
        try:
            if not self._closed:
                self._portal.call(_end, hold)
                return None
        except LeadershipLost as lost:
            return lost
        except (MultilockError, concurrent.futures.CancelledError):
            if not self._closed:
                raise
        held = hold.held  # close() from another thread ended the hold
        if held is not None and not held.is_valid:
            return LeadershipLost(held.group, held.token, f"{self._kind} closed while held")
        return None

    def _let_go(self, hold: _Hold) -> None:
        """Let *hold* end (and release) without waiting for it."""
        if hold.release is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone, and the hold with it
                self._portal.loop.call_soon_threadsafe(settle, hold.release, None)

    def _leave(self) -> None:
        """One thread less; the last one out closes a provider built from a URL."""
        with self._state:
            self._users -= 1
            retire = self._owns_provider and self._users == 0 and not self._closed
        if retire:
            with contextlib.suppress(MultilockError):  # closed meanwhile: closed anyway
                self._portal.call(self._retire)

    async def _retire(self) -> None:
        while True:
            with self._state:
                if self._users or self._provider is None:
                    return  # a thread came in meanwhile: it uses this provider
                releasing = set(self._tasks)  # holds left by interrupted threads
                if not releasing:
                    provider, self._holder, self._provider = self._provider, None, None
                    break
            await asyncio.wait(releasing)
        log.debug("%s %s: closing its provider until the next block", self._kind, self._name)
        await provider.aclose()

    async def _aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()  # each releases what it holds (its election stops)
        if tasks:
            await asyncio.wait(tasks)
        provider, self._holder, self._provider = self._provider, None, None
        if self._owns_provider and provider is not None:
            await provider.aclose()

    def _describe(self, name: str, fields: str = "") -> str:
        held = sum(len(stack) for stack in list(self._holds.values()))  # no lock: a repr
        return self._repr(name, f"{fields}name={self._name!r} held={held}", self._where)


class Lock(_SyncHolder):
    """A fenced lock on *name* across processes, for threads: ``with Lock(url, "name") as held``.

    Entering blocks until this holder owns the name (at most *timeout* seconds, then
    `AcquireTimeout`) and gives the `Leadership`: pass ``held.token`` with every write
    it protects. The lease is renewed on the loop thread; if it is lost anyway,
    ``held.lost`` is set and ``held.check()`` raises, and leaving the block raises
    `LeadershipLost` (unless another exception is on its way out). Leaving releases.

    *provider* is a `Provider` (never closed here) or a URL (see the module docstring);
    the options are those of `multilock.core.Lock`, plus *loop_factory* (see
    `multilock.core.sync`). One object may be entered by several threads at once: each
    block is a separate holder, excluded by the others through the store. It is not
    reentrant: a nested block of the same name waits for the outer one.
    """

    _kind = "lock"

    def __init__(
        self,
        provider: Provider | str,
        name: str,
        *,
        lease_duration: Duration | None = None,
        timeout: Duration | None = None,
        loop_factory: LoopFactory | None = None,
        **options: Unpack[HolderFields],
    ) -> None:
        def make(built: Provider) -> AsyncLock:
            return AsyncLock(built, name, lease_duration=lease_duration, timeout=timeout, **options)

        super().__init__(provider, name, make, loop_factory)

    def __enter__(self) -> Leadership:
        return self._acquire()

    def __repr__(self) -> str:
        return self._describe("Lock")


class Semaphore(_SyncHolder):
    """At most *limit* holders of *name* at any instant across processes, for threads.

    ``with Semaphore(url, "name", 3) as held:`` blocks for one of the slots, with
    ``held.slot`` (0 to limit - 1) and ``held.token`` (rising per slot). Waiting, loss and
    release behave as for `Lock`; a waiter costs the store what *limit* followers cost.
    """

    _kind = "semaphore"

    def __init__(
        self,
        provider: Provider | str,
        name: str,
        limit: int,
        *,
        lease_duration: Duration | None = None,
        timeout: Duration | None = None,
        loop_factory: LoopFactory | None = None,
        **options: Unpack[HolderFields],
    ) -> None:
        def make(built: Provider) -> AsyncSemaphore:
            return AsyncSemaphore(
                built, name, limit, lease_duration=lease_duration, timeout=timeout, **options
            )

        super().__init__(provider, name, make, loop_factory)
        self._limit = limit  # checked by the async semaphore

    @property
    def limit(self) -> int:
        return self._limit

    def __enter__(self) -> SemaphoreSlot:
        held = self._acquire()
        assert isinstance(held, SemaphoreSlot)
        return held

    def __repr__(self) -> str:
        return self._describe("Semaphore", f"limit={self._limit} ")


# ---------------------------------------------------------------------- Shards
async def _run_for_each(shards: AsyncShards, fn: Callable[[ShardLeadership], object]) -> None:
    """``shards.run_for_each`` with *fn* in a thread per shard and term.

    If *fn* raises, leave the shards: every term ends, so the functions still running in
    other threads (which cancellation cannot reach) see ``lost`` and return; then raise.
    """
    loop = asyncio.get_running_loop()
    failed: list[Exception] = []
    leaving: list[asyncio.Task[None]] = []

    async def work(shard: ShardLeadership) -> None:
        try:
            await in_worker_thread(shard, fn)
        except Exception as exc:  # fn raised (a cancellation is not an Exception)
            if not failed:
                failed.append(exc)
                # Not awaited here: leaving stops the elections, which wait for this task.
                leaving.append(task := loop.create_task(shards.aclose()))
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)
            raise

    try:
        await shards.run_for_each(work)
    except Exception:
        if not failed:
            raise
    if failed:
        await asyncio.wait(leaving)  # every call has returned: let the releases finish
        raise failed[0]


async def _wait_changed(shards: AsyncShards, within: float | None) -> bool:
    try:
        async with asyncio.timeout(within):
            await shards.wait_changed()
    except TimeoutError:
        return False
    return True


class Shards(Lifetime):
    """*count* shards of *name* shared out among the live participants, for threads.

    ``with Shards(url, "name", 64) as shards:`` joins; ``shards.owned`` maps each shard
    index owned now to its `ShardLeadership`, and ``shards.run_for_each(fn)`` blocks,
    calling ``fn(shard_leadership)`` in a thread per owned shard and term until the
    shards are closed (``close()`` from another thread). Leaving the block leaves the
    shards, releasing every one; a `Shards` built from a URL is closed instead.

    The options are those of `multilock.core.Shards`, plus *loop_factory* (see
    `multilock.core.sync`).
    """

    _kind = "shards"

    def __init__(
        self,
        provider: Provider | str,
        name: str,
        count: int,
        *,
        lease_duration: Duration | None = None,
        loop_factory: LoopFactory | None = None,
        **options: Unpack[HolderFields],
    ) -> None:
        super().__init__(provider, loop_factory)

        def make(built: Provider) -> AsyncShards:
            return AsyncShards(built, name, count, lease_duration=lease_duration, **options)

        self._shards, self._provider = self._make(make, provider)

    # ------------------------------------------------------------------ properties
    @property
    def name(self) -> str:
        return self._shards.name

    @property
    def count(self) -> int:
        return self._shards.count

    @property
    def participant_id(self) -> str:
        return self._shards.participant_id

    @property
    def share(self) -> int:
        """The most shards this participant may own now (0 while it is not a member)."""
        return self._shards.share

    @property
    def live_participants(self) -> int:
        """Live participants at the last count (0 before the first)."""
        return self._shards.live_participants

    @property
    def owned(self) -> Mapping[int, ShardLeadership]:
        """A snapshot of the shards owned now (valid terms only), by index, in order."""
        return self._local(lambda: dict(self._shards.owned))

    def __repr__(self) -> str:
        shards = self._shards
        fields = (
            f"name={shards.name!r} count={shards.count} share={shards.share} "
            f"live={shards.live_participants}"
        )
        return self._repr("Shards", fields, self._where)

    # ------------------------------------------------------------------ lifecycle
    def _begin(self) -> None:
        self._call("entering Shards", self._shards.__aenter__)

    def _end(self) -> None:
        if not self._closed:
            self._call("leaving Shards", self._shards.aclose)

    async def _stop(self) -> None:
        await self._shards.aclose()

    # ------------------------------------------------------------------ waiting and work
    def wait_changed(self, timeout: float | None = None) -> bool:
        """Block until the next change of ownership or membership (or the close); return
        False if *timeout* seconds (the loop's clock) pass first."""
        return self._call("wait_changed()", _wait_changed, self._shards, timeout)

    def run_for_each(self, fn: Callable[[ShardLeadership], object]) -> None:
        """Call ``fn(shard_leadership)`` in a thread for each owned shard, once per term,
        until the shards are closed (from another thread); then return.

        *fn* must watch ``shard_leadership.lost`` (or call ``check()``) and return soon
        after it is set: the shard is lost, or released to rebalance, and its lease is
        released only once *fn* has returned (at the latest at the term's deadline). A
        `LeadershipLost` from ``check()`` after the loss ends *fn* like a return. If *fn*
        raises, the shards are left (every term ends, so the other calls see ``lost``)
        and the exception propagates here.

        If this wait is interrupted (KeyboardInterrupt), running calls are not told until
        the shards are left or closed, as leaving the ``with`` block does.
        """
        require_plain(
            fn,
            "run_for_each",
            where="multilock.core.sync.Shards",
            calls="fn(shard_leadership)",
            instead="multilock.core.Shards",
        )
        what = "run_for_each()"
        self._portal.check_thread(what)
        if self._closed:
            raise MultilockError(f"{what}: {self!r} is closed")
        try:
            self._portal.call(_run_for_each, self._shards, fn)
        except Escaped as escaped:
            error = escaped.exc
        except (MultilockError, concurrent.futures.CancelledError):
            if self.closed:
                return  # close() from another thread ended the run
            raise
        else:
            return
        raise error
