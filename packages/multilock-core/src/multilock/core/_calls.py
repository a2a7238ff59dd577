"""The one way the core calls a provider: bounded, and never waiting on a slow cancel."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._errors import ProviderError

__all__ = [
    "call_until",
    "cancel_and_wait",
    "describe_callable",
    "is_async_callable",
    "raise_if_cancelled",
    "sleep_until",
]

log = logging.getLogger("multilock.core._election")

T = TypeVar("T")

#: Provider calls that timed out and are still settling their cancellation.
_SETTLING: set[asyncio.Future[Any]] = set()


async def call_until(call: Coroutine[Any, Any, T] | asyncio.Future[T], deadline: float) -> T:
    """Await a provider *call* until *deadline* (loop time), else raise `TimeoutError`
    naming the call and the seconds it was given.

    A call that times out (or whose caller is cancelled) is cancelled but not waited for:
    a driver may take seconds to settle a cancellation (psycopg cancels the query on the
    server, a worker thread runs to its socket timeout), and the election must step down,
    campaign again or stop meanwhile. The call settles in the background.

    A coroutine runs in a task of its own that hands its outcome to a plain future, which
    is all the caller awaits: cancelling the caller cancels that future, never the call,
    and the caller resumes one loop turn after the call ends (``asyncio.shield`` takes two,
    and every turn on a busy loop waits behind whatever else is ready, a handoff's
    critical path).
    """
    loop = asyncio.get_running_loop()
    seconds = deadline - loop.time()
    reply: asyncio.Future[T]
    if isinstance(call, Coroutine):
        name = getattr(call, "__qualname__", "the provider call")
        reply = loop.create_future()
        task: asyncio.Future[Any] = loop.create_task(_relay(call, reply, name))
        task.add_done_callback(functools.partial(_relayed, call, reply, name))
    else:
        task = asyncio.ensure_future(call)
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        name = getattr(coro, "__qualname__", "the provider call")
        reply = asyncio.shield(task)
    window = asyncio.timeout_at(deadline)
    try:
        async with window:
            return await reply
    except TimeoutError:
        if not window.expired():
            raise  # the call's own TimeoutError
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not task.cancelled() or (current is not None and current.cancelling()):
            raise  # the caller was cancelled: that goes on
        # A shielded future cancelled by its driver (see `_relay`).
        raise ProviderError(f"{name} was cancelled by the driver") from None
    finally:
        if not task.done():
            reply.cancel()
            task.cancel()
            _SETTLING.add(task)
            task.add_done_callback(_settled)
    raise TimeoutError(f"{name} did not finish within {max(seconds, 0):.3g} s")


async def _relay(call: Coroutine[Any, Any, T], reply: asyncio.Future[T], name: str) -> None:
    """Run *call* and hand its outcome to *reply* (unless the caller has left)."""
    try:
        result = await call
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # call_until cancelled it: the caller has left
        # The driver cancelled its own call (gRPC does, on a channel being closed): a
        # failed call, not the end of the caller's loop.
        failure: BaseException = ProviderError(f"{name} was cancelled by the driver")
    except BaseException as exc:
        failure = exc
    else:
        if not reply.done():
            reply.set_result(result)
        return
    if not reply.done():
        reply.set_exception(failure)
    else:
        log.debug("a timed-out provider call ended with %r", failure)
    if not isinstance(failure, Exception):
        raise failure  # KeyboardInterrupt, SystemExit: not the caller's alone


def _relayed(
    call: Coroutine[Any, Any, Any], reply: asyncio.Future[Any], name: str, task: asyncio.Task[Any]
) -> None:
    """The relay ended. Cancelled before its first step (a loop shutting down cancels every
    task), it never awaited the call: close the call, and fail a caller still waiting."""
    call.close()
    if not reply.done():
        reply.set_exception(ProviderError(f"{name} was cancelled before it started"))


def _settled(task: asyncio.Future[Any]) -> None:
    _SETTLING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("a timed-out provider call ended with %r", task.exception())


async def sleep_until(when: float, event: asyncio.Event) -> None:
    """Sleep until *when* (loop time) or until *event* is set."""
    raise_if_cancelled()
    if event.is_set():
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout_at(when):
            await event.wait()


def raise_if_cancelled() -> None:
    """Honour a cancellation that a driver swallowed.

    Python 3.11's ``asyncio.wait_for`` (redis-py sends every command through it) returns
    the inner result when the call finishes just as the cancel lands: the task runs on
    with the cancel still requested, and `stop()` would wait for it forever.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel *tasks* and wait for them."""
    live = [t for t in tasks if t is not None and not t.done()]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live)


def is_async_callable(fn: object) -> bool:
    """True for an ``async def`` function or method, a `functools.partial` of one, or an
    object whose ``__call__`` is ``async def``: what ``await fn(...)`` can be built from."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)  # noqa: B004 (the type's, not the object's)
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(call)


def describe_callable(fn: object) -> str:
    """*fn*'s name for an error message (``report_loop``, ``functools.partial(...)``)."""
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else repr(fn)
