"""A blocking facade over `multilock.core.LeaderElection`, for threaded programs.

Use it where there is no event loop of your own: Flask, Django, Celery workers, scripts::

    from multilock.core.sync import LeaderElection

    with LeaderElection("redis://localhost:6379/0", group="nightly-report") as election:
        election.run_while_leader(report_loop)   # report_loop(leadership) runs in a thread

`Lock`, `Semaphore` and `Shards` are the ``with`` forms of their async twins::

    with Lock("redis://localhost:6379/0", "nightly-report", timeout=30) as held:
        write_report(fencing_token=held.token)   # held.lost is set if the lease is lost

Threading model:

- Every sync election wraps an async `multilock.core.LeaderElection` that lives on an
  event loop running in a daemon thread. Each blocking method hands a coroutine to that
  loop through a blocking portal (``multilock.core._portal``) and waits for its result, so
  all timing, renewing and stepping down happen on the loop, never in the caller's thread.
  If the wait is interrupted (KeyboardInterrupt), the coroutine is cancelled, and given a
  moment to end, before the interrupt goes on.
- By default every sync election of the process shares one loop thread, named
  ``multilock-sync``, started on first use and never stopped. One provider can therefore
  serve several sync elections (providers with connections belong to one loop).
  ``loop_factory`` gives elections a loop thread of their own instead: elections made with
  the same factory share one thread, which ends when the last of them is closed (a
  `multilock.core.testing.FakeClock` drives one loop, so this is how tests run several
  elections in virtual time).
- Work runs outside the loop: ``run_while_leader(fn)`` calls ``fn(leadership)`` in a new
  daemon thread per term, and ``run_if_leader(fn)`` calls it in the caller's thread. A
  thread cannot be cancelled, so *fn* learns of a lost term through
  ``leadership.is_valid``, ``leadership.check()`` (raises `LeadershipLost`) or
  ``leadership.lost`` (a `threading.Event` set at step-down) and must return soon after.
  Until it does, ``stop()`` and ``resign()`` wait (at most until the term's deadline)
  before releasing the lease, and no new run of *fn* starts.
- Properties (``is_leader``, ``leadership``, ``state``...) read local state and never
  block. Blocking methods called from the loop thread itself (from provider code or a
  callback running there) raise `RuntimeError` instead of deadlocking.
- The elections never close a provider they were given; one built from a URL is owned and
  closed by ``close()`` or by leaving its ``with`` block. Nothing relies on finalizers.
- `Lock`, `Semaphore` and `Shards` follow the same model. A thread cannot be cancelled, so
  where the async forms cancel the body at loss, the body of ``with Lock(...) as held``
  watches ``held.lost``/``held.check()``, and leaving the block raises `LeadershipLost`
  if the lease was lost inside it; ``shards.run_for_each(fn)`` calls *fn* in a thread per
  owned shard and term. A lock or semaphore built from a URL closes its provider when its
  last ``with`` block ends and builds it again for the next one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import threading
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack

from ._election import LeaderElection as AsyncLeaderElection
from ._errors import MultilockError
from ._events import EventStream
from ._observe import Health
from ._options import ElectionFields, ElectionOptions
from ._portal import BlockingPortal, LoopFactory
from ._provider import Provider
from ._signals import DEFAULT_SIGNALS
from ._sync_base import (
    Escaped,
    Lifetime,
    ended_by_loss,
    in_worker_thread,
    on_loop,
    require_plain,
    settle,
    until_settled,
)
from ._sync_holders import Lock, Semaphore, Shards
from ._types import (
    ElectionState,
    ElectionStatistics,
    EventKind,
    LeaderInfo,
    Leadership,
    LeadershipEvent,
    RunResult,
    RunStatus,
)

__all__ = ["EventIterator", "LeaderElection", "Lock", "Semaphore", "Shards", "stop_on_signals"]

T = TypeVar("T")

log = logging.getLogger("multilock.core")

#: Every sync election not yet closed, for `stop_on_signals`.
_elections: weakref.WeakSet[LeaderElection] = weakref.WeakSet()


# ---------------------------------------------------------------------- work in threads
async def _hold_term(
    election: AsyncLeaderElection,
) -> tuple[asyncio.Task[RunResult[None]], Leadership | None, asyncio.Future[None]]:
    """Start ``election.run_if_leader`` with a stand-in for *fn*; return once it runs or ends.

    The stand-in is a term task that lasts until *finished* is settled (*fn* has returned
    in the caller's thread): the step-down cancels it and ``stop()``/``resign()`` wait for
    it. Return the run, its term (None: not leading) and *finished*.
    """
    loop = asyncio.get_running_loop()
    held: asyncio.Future[Leadership] = loop.create_future()
    finished: asyncio.Future[None] = loop.create_future()

    async def hold(leadership: Leadership) -> None:
        settle(held, leadership)
        await until_settled(finished, leadership)

    run = loop.create_task(election.run_if_leader(hold))
    either: set[asyncio.Future[Any]] = {held, run}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller was interrupted: fn will not run
        settle(finished, None)
        run.cancel()
        raise
    return run, held.result() if held.done() else None, finished


async def _finish(run: asyncio.Task[RunResult[None]], finished: asyncio.Future[None]) -> RunStatus:
    settle(finished, None)
    return (await run).status


def _require_plain(fn: object, what: str) -> None:
    require_plain(
        fn,
        what,
        where="multilock.core.sync",
        calls="fn(leadership, ...)",
        instead="multilock.core.LeaderElection",
    )


# ---------------------------------------------------------------------- the facade
class LeaderElection(Lifetime):
    """Campaign for leadership of one group, with blocking methods, from any thread.

    *provider* is a `Provider` (never closed by this election) or a URL for
    `multilock.core.from_url` (then the provider is built on the loop thread and closed by
    `close`). Pass an `ElectionOptions` or its fields as keywords (typed by
    `multilock.core.ElectionFields`), not both.
    *loop_factory* gives the election a loop thread of its own (see the module docstring).

    ``with election:`` starts it and, on exit, stops it; an election built from a URL is
    closed on exit instead (its provider and private loop thread released), since nobody
    else holds its provider. `close` does the same at any time.
    """

    def __init__(
        self,
        provider: Provider | str,
        options: ElectionOptions | None = None,
        *,
        loop_factory: LoopFactory | None = None,
        **option_fields: Unpack[ElectionFields],
    ) -> None:
        super().__init__(provider, loop_factory)

        def make(built: Provider) -> AsyncLeaderElection:
            return AsyncLeaderElection(built, options, **option_fields)

        self._election, self._provider = self._make(make, provider)
        _elections.add(self)

    # ------------------------------------------------------------------ properties
    @property
    def options(self) -> ElectionOptions:
        return self._election.options

    @property
    def provider(self) -> Provider:
        return self._election.provider

    @property
    def group(self) -> str:
        return self._election.group

    @property
    def participant_id(self) -> str:
        return self._election.participant_id

    @property
    def state(self) -> ElectionState:
        return self._election.state

    @property
    def is_leader(self) -> bool:
        """True only while this process holds a term whose local deadline has not passed."""
        return self._election.is_leader

    @property
    def leadership(self) -> Leadership | None:
        """The current valid term, or None."""
        return self._election.leadership

    def __repr__(self) -> str:
        election = self._election
        fields = (
            f"group={election.group!r} participant_id={election.participant_id!r} "
            f"state={election.state.value}"
        )
        return self._repr("LeaderElection", fields, repr(election.provider))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin campaigning on the loop thread. Idempotent; works again after stop()."""
        self._call("start()", self._election.start)

    def stop(self) -> None:
        """Stop leader work, release leadership (if ``release_on_stop``) and emit LOST.

        Waits, at most until the term's deadline, for leader work running in threads to
        return. Idempotent; the provider stays open. A no-op once closed.
        """
        if not self._closed:
            self._call("stop()", self._election.stop)

    def close(self) -> None:
        """Stop the election, close the provider it owns and end its private loop thread.

        Idempotent. The election cannot be started again.
        """
        super().close()

    async def _stop(self) -> None:
        await self._election.stop()

    def _begin(self) -> None:
        self.start()

    def _end(self) -> None:
        self.stop()

    # ------------------------------------------------------------------ waiting and work
    def wait_until_leader(self, timeout: float | None = None) -> Leadership:
        """Return the current term, waiting for one if needed.

        *timeout* is in seconds, measured on the event loop's clock (virtual time under a
        `FakeClock` loop); when it passes first, raise `TimeoutError`. Raise
        `MultilockError` if the election is not running or stops meanwhile.
        """
        return self._call("wait_until_leader()", self._election.wait_until_leader, timeout)

    def run_while_leader(self, fn: Callable[..., object], *args: Any) -> None:
        """Call ``fn(leadership, *args)`` in a worker thread in each term until stopped.

        *fn* must watch ``leadership.lost`` (or call ``leadership.check()``) and return
        soon after it is set; a `LeadershipLost` raised by ``check()`` after the loss ends
        the run like a return. When *fn* returns, wait for the term to end, then call it
        again in the next one. If *fn* raises, resign and re-raise here. Return once the
        election is stopped (from another thread).

        If this wait is interrupted (KeyboardInterrupt), a running *fn* is not told: the
        term goes on until the election is stopped, which sets ``leadership.lost`` and
        still waits for *fn* (at most until the term's deadline).
        """
        _require_plain(fn, "run_while_leader")
        run = self._election.run_while_leader
        try:
            self._call("run_while_leader()", run, in_worker_thread, fn, *args)
        except Escaped as escaped:
            exc = escaped.exc
        else:
            return
        raise exc

    def run_if_leader(self, fn: Callable[..., T], *args: Any) -> RunResult[T]:
        """Call ``fn(leadership, *args)`` once in this thread, only if leading now.

        Return a `RunResult`: NOT_LEADER (fn was not called), LOST (the term ended before
        fn finished, including when fn raised `LeadershipLost` from ``check()``) or
        COMPLETED with fn's value. Other exceptions of *fn* propagate. While *fn* runs,
        ``stop()`` and ``resign()`` wait for it (at most until the term's deadline).
        """
        _require_plain(fn, "run_if_leader")
        run, leadership, finished = self._call("run_if_leader()", _hold_term, self._election)
        if leadership is None:  # not leading (or the term ended before fn could start)
            return RunResult(status=self._finish_run(run, finished))
        try:
            value = fn(leadership, *args)
        except BaseException as exc:
            self._finish_run(run, finished)
            if ended_by_loss(exc, leadership):
                return RunResult(status=RunStatus.LOST)
            raise
        valid = leadership.is_valid
        if self._finish_run(run, finished) is RunStatus.LOST or not valid:
            return RunResult(status=RunStatus.LOST)
        return RunResult(status=RunStatus.COMPLETED, value=value)

    def _finish_run(
        self, run: asyncio.Task[RunResult[None]], finished: asyncio.Future[None]
    ) -> RunStatus:
        """Tell the term that fn is done and wait for the run; LOST if closed meanwhile."""
        try:
            return self._portal.call(_finish, run, finished)
        except MultilockError:
            if self._portal.running:
                raise
            return RunStatus.LOST  # close() stopped the election, ending the term

    def resign(self) -> None:
        """Give up leadership now; a waiting candidate takes over. A no-op when not leading."""
        self._call("resign()", self._election.resign)

    def current_leader(self) -> LeaderInfo | None:
        """Ask the store for the live leader (None when nobody holds a live lease)."""
        return self._call("current_leader()", self._election.current_leader)

    def contenders(self) -> tuple[str, ...]:
        """Ask the store for the group's live candidates, the leader first (see the async
        `LeaderElection.contenders`); `UnsupportedOperation` where the store cannot list them.
        """
        return self._call("contenders()", self._election.contenders)

    def events(self, kinds: EventKind = EventKind.ALL) -> EventIterator:
        """Subscribe to this election's events, as a blocking iterator.

        It is subscribed at once, so no event after this call is missed; it ends when the
        election next stops, or when closed.
        """
        stream = self._call("events()", on_loop, self._election.events, kinds)
        return EventIterator(self._portal, stream)

    def statistics(self) -> ElectionStatistics:
        """Return a snapshot of the election's counters (safe from any thread)."""
        return self._local(self._election.statistics)

    def health(self) -> Health:
        """Healthy while following, or while leading with renewals on time (see
        `multilock.core.LeaderElection.health`); safe from any thread."""
        return self._local(self._election.health)


class stop_on_signals:
    """Make SIGTERM and SIGINT stop every sync election gracefully, then exit.

    ::

        with stop_on_signals(), LeaderElection(url, group="nightly") as election:
            election.run_while_leader(work)

    On the first of *signals* every running sync election of the process is stopped
    (leader work told through ``leadership.lost``, leases released), then
    ``SystemExit(128 + signum)`` is raised in the main thread, wherever it is blocked, so
    the ``with`` blocks unwind and the program exits with the status a shell reports for
    that signal. Enter it in the main thread (Python runs signal handlers there only); the
    handlers there before are put back on exit.
    """

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self._signals = tuple(signal.Signals(s) for s in signals)
        if not self._signals:
            raise ValueError("stop_on_signals() needs at least one signal")
        self._previous: dict[signal.Signals, Any] = {}
        self._received: signal.Signals | None = None

    @property
    def received(self) -> signal.Signals | None:
        """The signal that stopped the program, or None."""
        return self._received

    def __enter__(self) -> Self:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "stop_on_signals() must be entered in the main thread: Python runs signal "
                "handlers there only"
            )
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self._received is not None:
            return  # already stopping
        self._received = sig = signal.Signals(signum)
        running = [e for e in list(_elections) if not e.closed and e.state in _RUNNING]
        log.info("%s received: stopping %d election(s)", sig.name, len(running))
        with concurrent.futures.ThreadPoolExecutor(max(len(running), 1)) as pool:
            for election, future in [(e, pool.submit(e.stop)) for e in running]:
                with contextlib.suppress(Exception):
                    if future.exception() is not None:
                        log.error("stopping %r raised", election, exc_info=future.exception())
        raise SystemExit(128 + signum)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


_RUNNING = (ElectionState.CAMPAIGNING, ElectionState.LEADING)


class EventIterator:
    """A blocking iterator over one election's events (see `LeaderElection.events`).

    ``close()`` (from any thread) ends it, waking a thread blocked in ``next()``; so does
    leaving a ``with`` block.
    """

    def __init__(self, portal: BlockingPortal, stream: EventStream) -> None:
        self._portal = portal
        self._stream = stream
        self._readers: set[asyncio.Task[Any]] = set()  # on the loop thread only
        self._closed = False

    @property
    def kinds(self) -> EventKind:
        return self._stream.kinds

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> LeadershipEvent:
        self._portal.check_thread("next() of an event iterator")
        try:
            event = self._portal.call(self._next)
        except MultilockError:  # the loop is gone, and the stream ended with it
            event = None
        except concurrent.futures.CancelledError:
            if not self._closed:
                raise
            event = None  # close() woke this reader
        if event is None:
            self._closed = True
            raise StopIteration
        return event

    async def _next(self) -> LeadershipEvent | None:
        task = asyncio.current_task()
        if self._closed or task is None:
            return None
        self._readers.add(task)
        try:
            return await anext(self._stream)
        except StopAsyncIteration:
            return None
        finally:
            self._readers.discard(task)

    def close(self) -> None:
        """Unsubscribe and end the iteration; idempotent."""
        if self._closed:
            return
        self._closed = True  # a reader that has not begun yet sees it and ends
        with contextlib.suppress(MultilockError):  # the loop is gone, and the stream with it
            if self._portal.in_loop_thread:  # which must not block: let the loop do it
                self._portal.start_task_soon(self._aclose)
            else:
                self._portal.call(self._aclose)

    async def _aclose(self) -> None:
        for reader in self._readers:
            reader.cancel()
        await self._stream.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<multilock.core.sync.EventIterator kinds={self.kinds!r} {state}>"
