"""A blocking portal: an event loop in a daemon thread, and the way in from other threads.

In the spirit of anyio's ``BlockingPortal``: a thread without an event loop hands
coroutines to the loop and blocks until the result (`BlockingPortal.call`) or gets a
`concurrent.futures.Future` (`BlockingPortal.start_task_soon`). Portals share loop threads:
see `BlockingPortal`. A forked child starts afresh (the parent's loop threads do not exist
there: portals made before the fork raise instead of blocking).
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
from typing import Any, TypeVar

from ._errors import MultilockError

__all__ = ["BlockingPortal", "LoopFactory"]

log = logging.getLogger(__name__)

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]
#: A coroutine function (called with the arguments that follow it) or a coroutine.
AsyncCall = Callable[..., Coroutine[Any, Any, T]] | Coroutine[Any, Any, T]


class _LoopThread:
    """One event loop running forever in one daemon thread, shared by its portals."""

    def __init__(self, factory: LoopFactory | None, name: str) -> None:
        self.key = factory
        self.users = 0
        self.tasks: set[asyncio.Task[Any]] = set()  # asyncio keeps only weak references
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
                tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def end(self) -> None:
        """Stop the loop, let it finish its tasks, and wait for the thread to exit."""
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.get_ident() != self.thread.ident:
            self.thread.join()


_registry_lock = threading.Lock()
_loops: dict[LoopFactory | None, _LoopThread] = {}
_private_names = itertools.count(1)


def _acquire(factory: LoopFactory | None) -> _LoopThread:
    with _registry_lock:
        loop_thread = _loops.get(factory)
        if loop_thread is None or not loop_thread.thread.is_alive():
            name = "multilock-sync" if factory is None else f"multilock-sync-{next(_private_names)}"
            loop_thread = _loops[factory] = _LoopThread(factory, name)
        loop_thread.users += 1
        return loop_thread


def _forget_loops_after_fork() -> None:
    """In a forked child the loop threads do not exist: start afresh on next use."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _loops.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_loops_after_fork)


class BlockingPortal:
    """Blocking access, from other threads, to an event loop running in a daemon thread.

    ``BlockingPortal()`` uses the process's shared loop thread, ``multilock-sync``, started on
    first use and never stopped. ``BlockingPortal(factory)`` uses the loop thread of
    *factory*, ``multilock-sync-N``, started by its first portal and ended (its tasks
    cancelled) when the last one is closed. Once closed, a portal raises `MultilockError`.
    """

    #: Real seconds an interrupted `call` waits for its cancelled task to end.
    cancel_grace = 0.5

    def __init__(self, loop_factory: LoopFactory | None = None) -> None:
        self._thread = _acquire(loop_factory)
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._thread.loop

    @property
    def running(self) -> bool:
        """True while this portal is open and its loop thread runs."""
        return not self._closed and self._thread.thread.is_alive()

    @property
    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.thread.ident

    def check_thread(self, what: str = "BlockingPortal.call()") -> None:
        """Raise `RuntimeError` on the loop thread, where blocking on the loop deadlocks."""
        if self.in_loop_thread:
            raise RuntimeError(
                f"{what} blocks until multilock's event loop answers, and was called from "
                "that loop's own thread, where it would deadlock; call it from another thread"
            )

    def call(self, fn: AsyncCall[T], *args: Any) -> T:
        """Run ``fn(*args)`` (or the coroutine *fn*) on the loop and block until it ends.

        Return its result or raise its exception. If the wait is interrupted
        (KeyboardInterrupt), cancel the task and give it `cancel_grace` seconds to end
        before re-raising. Raise `RuntimeError` when called from the loop thread.
        """
        future, ended, submit = self._spawn(fn, args, blocking=True)
        try:
            # Submitted inside the try: a Ctrl-C that lands just after the task is
            # scheduled, before the wait, still cancels it.
            submit()
            return future.result()
        except BaseException:
            if future.cancel():  # interrupted while the task runs: stop it first
                ended.wait(self.cancel_grace)
            raise

    def start_task_soon(self, fn: AsyncCall[T], *args: Any) -> concurrent.futures.Future[T]:
        """Start ``fn(*args)`` (or the coroutine *fn*) as a task on the loop; return its future.

        Never blocks, so it also works on the loop thread. Cancelling the future cancels
        the task.
        """
        future, _, submit = self._spawn(fn, args, blocking=False)
        submit()
        return future

    def _spawn(
        self, fn: AsyncCall[T], args: tuple[Any, ...], *, blocking: bool
    ) -> tuple[concurrent.futures.Future[T], threading.Event, Callable[[], None]]:
        """Prepare the task: its future, an event set once it has ended, and its submit."""
        try:
            if blocking:
                self.check_thread()
            if not self.running:
                raise MultilockError(
                    "this blocking portal is closed"
                    if self._closed
                    else "multilock's event loop thread is gone (was the process forked?)"
                )
            coro = fn if asyncio.iscoroutine(fn) else fn(*args)
        except BaseException:
            if asyncio.iscoroutine(fn):
                fn.close()
            raise
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        ended = threading.Event()
        loop, tasks = self._thread.loop, self._thread.tasks

        def settle(task: asyncio.Task[T]) -> None:
            tasks.discard(task)
            ended.set()
            error = None if task.cancelled() else task.exception()  # retrieved in any case
            if task.cancelled():
                future.cancel()
            if not future.set_running_or_notify_cancel():  # cancelled; waiters are told
                return
            if error is None:
                future.set_result(task.result())
            else:
                future.set_exception(error)

        def start() -> None:
            task = loop.create_task(coro)
            tasks.add(task)
            task.add_done_callback(settle)

            def cancel_task(done: concurrent.futures.Future[T]) -> None:
                if done.cancelled():
                    with contextlib.suppress(RuntimeError):  # the loop is closed: so is the task
                        loop.call_soon_threadsafe(task.cancel)

            future.add_done_callback(cancel_task)

        def submit() -> None:
            try:
                loop.call_soon_threadsafe(start)
            except RuntimeError:  # the loop closed meanwhile
                coro.close()
                raise MultilockError("multilock's event loop is closed") from None

        return future, ended, submit

    def close(self) -> None:
        """Release the loop thread; the last portal of a factory's loop ends it. Idempotent."""
        with _registry_lock:
            if self._closed:
                return
            self._closed = True
            loop_thread = self._thread
            loop_thread.users -= 1
            if loop_thread.users > 0 or loop_thread.key is None:
                return  # still in use, or the shared default loop, which lives on
            if _loops.get(loop_thread.key) is loop_thread:
                del _loops[loop_thread.key]
        loop_thread.end()
