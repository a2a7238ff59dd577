"""Tests of `multilock.core._portal.BlockingPortal`, the sync facade's way into its loop.

Portals run on `FakeClock` loops (``BlockingPortal(clock.new_event_loop)``), so timers
cost no real time; threads are awaited on events and futures with real-time deadlines
(``WAIT``), never slept on. One test uses the shared default loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import warnings
from collections.abc import Iterator

import pytest

from multilock.core import MultilockError
from multilock.core._portal import BlockingPortal
from multilock.core.testing import FakeClock

pytestmark = pytest.mark.timeout(30)

#: Real seconds a thread may take to report back; a bound, never a sleep.
WAIT = 5.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def portal(clock: FakeClock) -> Iterator[BlockingPortal]:
    portal = BlockingPortal(clock.new_event_loop)
    yield portal
    portal.close()


async def add(a: int, b: int) -> int:
    await asyncio.sleep(3600)  # virtual time: no real wait
    return a + b


async def fail(message: str) -> None:
    await asyncio.sleep(0)
    raise KeyError(message)


async def current_thread() -> threading.Thread:
    return threading.current_thread()


def interrupt_main_thread_when(event: threading.Event) -> threading.Thread:
    """Send a real SIGINT to this (main) thread once *event* is set: Ctrl-C, as a user would."""
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    main = threading.get_ident()

    def send() -> None:
        if event.wait(WAIT):
            signal.pthread_kill(main, signal.SIGINT)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


# ---------------------------------------------------------------------- call and submit
def test_call_returns_the_result_or_raises_the_exception(portal: BlockingPortal) -> None:
    assert portal.call(add, 1, 2) == 3
    assert portal.call(add(20, 22)) == 42  # a coroutine object works too
    with pytest.raises(KeyError, match="boom"):
        portal.call(fail, "boom")
    worker = portal.call(current_thread)
    assert worker is not threading.current_thread()
    assert worker.daemon
    assert worker.name.startswith("multilock-sync-")
    assert portal.running


def test_start_task_soon_returns_a_future(portal: BlockingPortal) -> None:
    assert portal.start_task_soon(add, 2, 3).result(WAIT) == 5
    failed = portal.start_task_soon(fail, "later")
    assert isinstance(failed.exception(WAIT), KeyError)


def test_cancelling_the_future_cancels_the_task(portal: BlockingPortal) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = portal.start_task_soon(forever)
    assert started.wait(WAIT)
    assert future.cancel()
    assert cancelled.wait(WAIT)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(WAIT)


def test_blocking_from_the_loop_thread_raises_instead_of_deadlocking(
    portal: BlockingPortal,
) -> None:
    async def on_the_loop() -> tuple[BaseException | None, int]:
        assert portal.in_loop_thread
        error = None
        try:
            portal.call(add(1, 1))  # closed unawaited: no "never awaited" warning
        except RuntimeError as exc:
            error = exc
        # Not blocking, start_task_soon works on the loop thread.
        return error, await asyncio.wrap_future(portal.start_task_soon(add, 1, 2))

    error, value = portal.call(on_the_loop)
    assert isinstance(error, RuntimeError)
    assert "deadlock" in str(error)
    assert value == 3
    assert not portal.in_loop_thread


def test_a_closed_portal_raises(clock: FakeClock) -> None:
    portal = BlockingPortal(clock.new_event_loop)
    portal.close()
    portal.close()  # idempotent
    assert not portal.running
    with pytest.raises(MultilockError, match="closed"):
        portal.call(add(1, 2))  # closed unawaited: no "never awaited" warning
    with pytest.raises(MultilockError, match="closed"):
        portal.start_task_soon(add, 1, 2)


# ---------------------------------------------------------------------- sharing loop threads
def test_portals_of_one_factory_share_a_thread_that_ends_with_the_last(clock: FakeClock) -> None:
    first = BlockingPortal(clock.new_event_loop)
    second = BlockingPortal(clock.new_event_loop)
    other = BlockingPortal(FakeClock().new_event_loop)
    try:
        assert first.loop is second.loop
        assert other.loop is not first.loop
        thread = first.call(current_thread)
        assert second.call(current_thread) is thread
        assert other.call(current_thread) is not thread

        first.close()
        assert thread.is_alive()  # second still uses it
        assert second.call(add, 1, 1) == 2
        second.close()
        assert not thread.is_alive()  # close() of the last user joined it
        assert first.loop.is_closed()

        again = BlockingPortal(clock.new_event_loop)  # a new thread for the factory
        try:
            assert again.call(current_thread) is not thread
        finally:
            again.close()
    finally:
        for portal in (first, second, other):
            portal.close()


def test_the_shared_default_loop_outlives_its_portals() -> None:
    first, second = BlockingPortal(), BlockingPortal()
    thread = first.call(current_thread)
    assert thread.name == "multilock-sync"
    assert second.call(current_thread) is thread
    first.close()
    second.close()
    assert thread.is_alive()
    third = BlockingPortal()
    try:
        assert third.call(current_thread) is thread
    finally:
        third.close()


def test_the_loop_ending_cancels_its_tasks(clock: FakeClock) -> None:
    portal = BlockingPortal(clock.new_event_loop)
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    future = portal.start_task_soon(forever)
    assert started.wait(WAIT)
    portal.close()
    assert cancelled.is_set()  # close() waited for the loop to finish its tasks
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(WAIT)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_afresh(portal: BlockingPortal, clock: FakeClock) -> None:
    with warnings.catch_warnings():  # 3.12+ warns of forking with threads: this test means it
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: only this thread exists; report through the exit code
        code = 1
        try:
            if not portal.running:
                try:
                    portal.call(add, 1, 1)
                except MultilockError:
                    fresh = BlockingPortal(clock.new_event_loop)
                    code = 0 if fresh.call(add, 1, 1) == 2 else 2
                    fresh.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert portal.call(add, 1, 1) == 2  # the parent's portal is untouched


# ---------------------------------------------------------------------- interrupts
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_an_interrupted_call_cancels_its_coroutine(portal: BlockingPortal) -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    sender = interrupt_main_thread_when(started)
    with pytest.raises(KeyboardInterrupt):
        portal.call(forever)
    sender.join(WAIT)
    assert cancelled.is_set()  # call() waited for the cancellation before re-raising
    assert portal.call(add, 1, 1) == 2  # the loop goes on


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
def test_an_interrupted_call_waits_for_the_cancellation_only_briefly(
    portal: BlockingPortal,
) -> None:
    started, release = threading.Event(), asyncio.Event()
    ended: concurrent.futures.Future[None] = concurrent.futures.Future()

    async def stubborn() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()  # holds on after the cancellation, as leader work may
            ended.set_result(None)
            raise

    portal.cancel_grace = 0.01
    sender = interrupt_main_thread_when(started)
    with pytest.raises(KeyboardInterrupt):
        portal.call(stubborn)
    sender.join(WAIT)
    assert not ended.done()  # call() gave up waiting after cancel_grace

    async def let_go() -> None:
        release.set()

    portal.call(let_go)
    ended.result(WAIT)
