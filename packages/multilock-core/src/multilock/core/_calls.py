"""The one way the core calls a provider: bounded, and never waiting on a slow cancel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["call_until", "cancel_and_wait", "raise_if_cancelled", "sleep_until"]

log = logging.getLogger("multilock.core._election")

T = TypeVar("T")

#: Provider calls that timed out and are still settling their cancellation.
_SETTLING: set[asyncio.Task[Any]] = set()


async def call_until(call: Coroutine[Any, Any, T] | asyncio.Future[T], deadline: float) -> T:
    """Await a provider *call* until *deadline* (loop time), else raise `TimeoutError`.

    A call that times out (or whose caller is cancelled) is cancelled but not waited for:
    a driver may take seconds to settle a cancellation (psycopg cancels the query on the
    server, a worker thread runs to its socket timeout), and the election must step down,
    campaign again or stop meanwhile. The call settles in the background.
    """
    task = asyncio.ensure_future(call)
    try:
        async with asyncio.timeout_at(deadline):
            return await asyncio.shield(task)
    finally:
        if not task.done():
            task.cancel()
            _SETTLING.add(task)
            task.add_done_callback(_settled)


def _settled(task: asyncio.Task[Any]) -> None:
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
