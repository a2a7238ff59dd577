"""A blocking facade over `multilock.core.LeaderElection`, for threaded programs.

Use it where there is no event loop of your own: Flask, Django, Celery workers, scripts::

    from multilock.core.sync import LeaderElection

    with LeaderElection("redis://localhost:6379/0", group="nightly-report") as election:
        election.run_while_leader(report_loop)   # report_loop(leadership) runs in a thread

Threading model:

- Every sync election wraps an async `multilock.core.LeaderElection` that lives on an
  event loop running in a daemon thread. Each blocking method hands a coroutine to that
  loop (``asyncio.run_coroutine_threadsafe``) and waits for its result, so all timing,
  renewing and stepping down happen on the loop, never in the caller's thread.
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
  closed by ``close()``. Nothing relies on finalizers: call ``close()`` when done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Self, TypeVar

from ._election import LeaderElection as AsyncLeaderElection
from ._errors import LeadershipLost, MultilockError
from ._events import EventStream
from ._options import ElectionOptions
from ._provider import Provider
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
from ._url import from_url

__all__ = ["EventIterator", "LeaderElection"]

log = logging.getLogger(__name__)

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


# ---------------------------------------------------------------------- loop threads
class _LoopThread:
    """One event loop running forever in one daemon thread."""

    def __init__(self, factory: LoopFactory | None, name: str) -> None:
        self.key = factory
        self.users = 0
        self.loop = (factory or asyncio.new_event_loop)()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        log.debug("started event loop thread %s", name)

    def _main(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:
                _cancel_all_tasks(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    @property
    def in_thread(self) -> bool:
        return threading.get_ident() == self.thread.ident

    def end(self) -> None:
        """Stop the loop, let it finish its tasks, and wait for the thread to exit."""
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_thread:
            self.thread.join()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


_registry_lock = threading.Lock()
_loops: dict[LoopFactory | None, _LoopThread] = {}
_private_names = itertools.count(1)


def _acquire_loop(factory: LoopFactory | None) -> _LoopThread:
    with _registry_lock:
        loop_thread = _loops.get(factory)
        if loop_thread is None or not loop_thread.thread.is_alive():
            name = "multilock-sync" if factory is None else f"multilock-sync-{next(_private_names)}"
            loop_thread = _loops[factory] = _LoopThread(factory, name)
        loop_thread.users += 1
        return loop_thread


def _release_loop(loop_thread: _LoopThread) -> None:
    with _registry_lock:
        loop_thread.users -= 1
        if loop_thread.users > 0 or loop_thread.key is None:
            return  # still in use, or the shared default loop, which lives on
        if _loops.get(loop_thread.key) is loop_thread:
            del _loops[loop_thread.key]
    loop_thread.end()


def _forget_loops_after_fork() -> None:
    """In a forked child the loop threads do not exist: start afresh on next use."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _loops.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_loops_after_fork)


def _wait(future: concurrent.futures.Future[T]) -> T:
    """Wait for *future*; if the wait is interrupted (Ctrl-C), cancel the work first."""
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


# ---------------------------------------------------------------------- work in threads
class _Escaped(Exception):
    """Carry a BaseException (SystemExit...) of user code through the loop unharmed."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.exc = exc


def _settle(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


async def _until_settled(done: asyncio.Future[T], leadership: Leadership) -> T:
    """Wait for work running in a thread of *leadership*'s term, which cancellation cannot stop.

    When cancelled (the term ended, or the caller gave up), keep waiting until the thread
    is done, through any further cancellation, so that ``stop()``/``resign()`` release the
    lease only after the work has stopped. A term can be cancelled twice: an interrupted
    ``run_while_leader`` cancels it, then ``stop()`` does. The wait ends, and the
    cancellation goes on, when the term's deadline passes (renewals move it while the term
    holds): the lease may expire from then on anyway.
    """
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        clock = asyncio.get_running_loop().time  # the election's clock, as in _election.py
        # Not ``time_left``, which is 0 once the term is lost: read the deadline itself.
        while not done.done() and (left := leadership._deadline - clock()) > 0:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({done}, timeout=left)
        raise


def _ended_by_loss(exc: BaseException, leadership: Leadership) -> bool:
    """True if *exc* is the `LeadershipLost` that ``leadership.check()`` raises at loss."""
    return isinstance(exc, LeadershipLost) and not leadership.is_valid


async def _in_worker_thread(leadership: Leadership, fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(leadership, *args)`` in a new daemon thread and wait for it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[BaseException | None] = loop.create_future()

    def target() -> None:
        outcome: BaseException | None = None
        try:
            fn(leadership, *args)
        except BaseException as exc:
            if not _ended_by_loss(exc, leadership):
                outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(_settle, done, outcome)

    name = f"multilock-leader-{leadership.group}-{leadership.token}"
    threading.Thread(target=target, name=name, daemon=True).start()
    error = await _until_settled(done, leadership)
    if error is not None:
        raise error if isinstance(error, Exception) else _Escaped(error)


# ---------------------------------------------------------------------- the facade
class LeaderElection:
    """Campaign for leadership of one group, with blocking methods, from any thread.

    *provider* is a `Provider` (never closed by this election) or a URL for
    `multilock.core.from_url` (then the provider is built on the loop thread and closed by
    `close`). Pass an `ElectionOptions` or its fields as keywords, not both.
    *loop_factory* gives the election a loop thread of its own (see the module docstring).

    ``with election:`` starts and stops it; `close` also releases the provider it owns and
    its private loop thread.
    """

    def __init__(
        self,
        provider: Provider | str,
        options: ElectionOptions | None = None,
        *,
        loop_factory: LoopFactory | None = None,
        **option_fields: Any,
    ) -> None:
        self._loop_thread = _acquire_loop(loop_factory)
        self._closed = False
        self._close_lock = threading.Lock()
        self._owns_provider = isinstance(provider, str)
        try:
            self._check_thread("LeaderElection()")
            self._election: AsyncLeaderElection = self._call(
                self._build(provider, options, option_fields)
            )
        except BaseException:
            _release_loop(self._loop_thread)
            raise

    async def _build(
        self,
        provider: Provider | str,
        options: ElectionOptions | None,
        option_fields: dict[str, Any],
    ) -> AsyncLeaderElection:
        if not isinstance(provider, str):
            return AsyncLeaderElection(provider, options, **option_fields)
        built = from_url(provider)
        try:
            return AsyncLeaderElection(built, options, **option_fields)
        except BaseException:
            await built.aclose()
            raise

    # ------------------------------------------------------------------ plumbing
    def _check_thread(self, what: str) -> None:
        if self._loop_thread.in_thread:
            raise RuntimeError(
                f"{what} blocks until multilock's event loop answers, and was called from "
                "that loop's own thread, where it would deadlock; call it from another thread"
            )

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Hand *coro* to the loop thread."""
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop_thread.loop)
        except RuntimeError:
            coro.close()
            raise MultilockError("the election's event loop is closed") from None

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run *coro* on the loop thread and wait for its result."""
        return _wait(self._submit(coro))

    def _ensure_usable(self, what: str) -> None:
        """Raise instead of blocking forever: on the loop thread, closed, or loop gone."""
        self._check_thread(what)
        if self._closed:
            raise MultilockError(f"{what}: {self!r} is closed")
        if not self._loop_thread.thread.is_alive():
            raise MultilockError(
                f"{what}: the event loop thread of {self!r} is gone (was the process forked?)"
            )

    def _run(self, what: str, coro: Coroutine[Any, Any, T]) -> T:
        """`_call` after `_ensure_usable`."""
        try:
            self._ensure_usable(what)
        except BaseException:
            coro.close()
            raise
        return self._call(coro)

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

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        election = self._election
        closed = " closed" if self._closed else ""
        return (
            f"<multilock.core.sync.LeaderElection group={election.group!r} "
            f"participant_id={election.participant_id!r} state={election.state.value}"
            f"{closed} provider={election.provider!r}>"
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin campaigning on the loop thread. Idempotent; works again after stop()."""
        self._run("start()", self._election.start())

    def stop(self) -> None:
        """Stop leader work, release leadership (if ``release_on_stop``) and emit LOST.

        Waits, at most until the term's deadline, for leader work running in threads to
        return. Idempotent; the provider stays open. A no-op once closed.
        """
        if self._closed:
            return
        self._run("stop()", self._election.stop())

    def close(self) -> None:
        """Stop the election, close the provider it owns and end its private loop thread.

        Idempotent. The election cannot be started again.
        """
        self._check_thread("close()")
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._loop_thread.thread.is_alive():
                self._call(self._aclose())
        finally:
            _release_loop(self._loop_thread)

    async def _aclose(self) -> None:
        try:
            await self._election.stop()
        finally:
            if self._owns_provider:
                await self._election.provider.aclose()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ waiting and work
    def wait_until_leader(self, timeout: float | None = None) -> Leadership:
        """Return the current term, waiting for one if needed.

        *timeout* is in seconds, measured on the event loop's clock (virtual time under a
        `FakeClock` loop); when it passes first, raise `TimeoutError`. Raise
        `MultilockError` if the election is not running or stops meanwhile.
        """
        return self._run("wait_until_leader()", self._wait_until_leader(timeout))

    async def _wait_until_leader(self, seconds: float | None) -> Leadership:
        async with asyncio.timeout(seconds):
            return await self._election.wait_until_leader()

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
        work = self._election.run_while_leader(_in_worker_thread, fn, *args)
        try:
            self._run("run_while_leader()", work)
        except _Escaped as escaped:
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
        started: concurrent.futures.Future[tuple[Leadership, asyncio.Future[None]] | None]
        started = concurrent.futures.Future()

        async def hold(leadership: Leadership) -> None:
            # Stands in for fn on the loop: a term task that lasts as long as fn runs here,
            # so that the election's step-down cancels it and stop()/resign() wait for it.
            finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            try:
                started.set_result((leadership, finished))
            except concurrent.futures.InvalidStateError:
                return  # the caller was interrupted and has gone
            await _until_settled(finished, leadership)

        def not_started(_: object) -> None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                started.set_result(None)

        self._ensure_usable("run_if_leader()")
        outer = self._submit(self._election.run_if_leader(hold))
        outer.add_done_callback(not_started)
        try:
            got = started.result()
        except BaseException:
            started.cancel()
            outer.cancel()
            raise
        if got is None:  # not leading (or the term ended before hold could start)
            return RunResult(status=_wait(outer).status)
        leadership, finished = got
        try:
            value = fn(leadership, *args)
        except BaseException as exc:
            self._finish(finished)
            _wait(outer)
            if _ended_by_loss(exc, leadership):
                return RunResult(status=RunStatus.LOST)
            raise
        valid = leadership.is_valid
        self._finish(finished)
        if _wait(outer).status is RunStatus.LOST or not valid:
            return RunResult(status=RunStatus.LOST)
        return RunResult(status=RunStatus.COMPLETED, value=value)

    def _finish(self, finished: asyncio.Future[None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits
            self._loop_thread.loop.call_soon_threadsafe(_settle, finished, None)

    def resign(self) -> None:
        """Give up leadership now; a waiting candidate takes over. A no-op when not leading."""
        self._run("resign()", self._election.resign())

    def current_leader(self) -> LeaderInfo | None:
        """Ask the store for the live leader (None when nobody holds a live lease)."""
        return self._run("current_leader()", self._election.current_leader())

    def events(self, kinds: EventKind = EventKind.ALL) -> EventIterator:
        """Subscribe to this election's events, as a blocking iterator.

        It is subscribed at once, so no event after this call is missed; it ends when the
        election next stops, or when closed.
        """
        return EventIterator(self, self._run("events()", self._subscribe(kinds)))

    async def _subscribe(self, kinds: EventKind) -> EventStream:
        return self._election.events(kinds)

    def statistics(self) -> ElectionStatistics:
        """Return a snapshot of the election's counters (safe from any thread)."""
        if self._loop_thread.in_thread or self._closed:
            return self._election.statistics()
        return self._call(self._statistics())

    async def _statistics(self) -> ElectionStatistics:
        return self._election.statistics()


#: Tasks started from the loop thread without a waiter; referenced until they finish.
_background: set[asyncio.Task[None]] = set()


class EventIterator:
    """A blocking iterator over one election's events (see `LeaderElection.events`).

    ``close()`` (from any thread) ends it, waking a thread blocked in ``next()``; so does
    leaving a ``with`` block.
    """

    def __init__(self, election: LeaderElection, stream: EventStream) -> None:
        self._election = election
        self._stream = stream
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[LeadershipEvent | None] | None = None
        self._closed = False

    @property
    def kinds(self) -> EventKind:
        return self._stream.kinds

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> LeadershipEvent:
        with self._lock:
            if self._closed:
                raise StopIteration
            self._election._check_thread("next() of an event iterator")
            try:
                future = self._election._submit(self._next())
            except MultilockError:  # the loop is closed, and the stream ended with it
                self._closed = True
                raise StopIteration from None
            self._pending = future
        try:
            event = _wait(future)
        except concurrent.futures.CancelledError:
            if self._closed:
                raise StopIteration from None
            raise
        finally:
            with self._lock:
                self._pending = None
        if event is None:
            self._closed = True
            raise StopIteration
        return event

    async def _next(self) -> LeadershipEvent | None:
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            return None

    def close(self) -> None:
        """Unsubscribe and end the iteration; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = self._pending
        if pending is not None:
            pending.cancel()
        if self._election._loop_thread.in_thread:
            task = asyncio.get_running_loop().create_task(self._stream.aclose())
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        with contextlib.suppress(MultilockError):  # the loop is gone, and the stream with it
            _wait(self._election._submit(self._stream.aclose()))

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
