"""`Batches`: the calls of one kind asked for in one loop turn, sent to the store together.

A process leading thousands of groups renews hundreds of them a second. Sent one by one,
each renewal costs a connection checkout, a send, a reply read and a task; sent together,
the busier the loop, the more share one. A provider hands `Batches` the function that
sends a list of items at once (a pipeline, one statement over arrays) and awaits
``batches(item)`` where it would have sent the item alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Batches"]

T = TypeVar("T")
R = TypeVar("R")

#: What `Batches` calls before sending, once per batch: e.g. take a pool connection.
Slot = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


class Batches(Generic[T, R]):
    """Send the items asked for in one loop turn together, at the end of that turn.

    *send* gets the items of one batch and returns one reply per item, in order: its
    result, or an exception for that item alone. An exception *send* raises fails every
    item of the batch; each caller gets its own copy, so none shares a traceback.

    *slot*, if given, is entered before the batch is sent, and *timeout* (seconds) bounds
    the slot's wait and the send together. An item whose caller has left (cancelled, or
    timed out) by the time the slot is taken is not sent; a batch with none left sends
    nothing. A caller that leaves after that has its item in doubt, as any cancelled call.

    With *eager*, nothing waits for the end of a turn (group commit): an item asked for
    while no batch is on its way is sent at once, alone, from its caller's task (no loop
    turn added: a call on a handoff's critical path, such as a release, costs what it
    cost unbatched); the items asked for while one is on its way wait for it, then go
    together in the next batch.
    """

    def __init__(
        self,
        send: Callable[[list[T]], Awaitable[Sequence[R | Exception]]],
        *,
        timeout: float,
        slot: Slot | None = None,
        eager: bool = False,
    ) -> None:
        self._send_items = send
        self._timeout = timeout
        self._slot: Slot = slot or contextlib.nullcontext
        self._due: list[tuple[T, asyncio.Future[R]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        self._eager = eager
        self._busy = 0  # eager: batches on their way (sent inline or in a task)
        self._closed = False

    async def __call__(self, item: T) -> R:
        """Queue *item* for this loop turn's batch; return its reply (or raise its error)."""
        if self._closed:
            raise ConnectionError("the batches are closed")
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[R] = loop.create_future()
        if self._eager and not self._busy:
            return await self._alone(item, reply)
        if not self._due and not self._eager:
            loop.call_soon(self._flush)
        self._due.append((item, reply))
        return await reply

    async def _alone(self, item: T, reply: asyncio.Future[R]) -> R:
        """Send *item* at once from its caller's task (eager, nothing on its way)."""
        self._busy += 1
        try:
            await self._send([(item, reply)])
        except BaseException:
            if reply.done() and not reply.cancelled():
                reply.exception()  # this caller has left: nobody else will look
            raise
        finally:
            self._sent()
        return reply.result()

    def _sent(self) -> None:
        """An eager batch has its replies: the items that waited for it go next."""
        self._busy -= 1
        if not self._busy:
            self._flush()

    def _flush(self) -> None:
        due, self._due = [d for d in self._due if not d[1].done()], []
        if self._closed:  # nothing goes after aclose: the waiting items fail
            for _, reply in due:
                reply.set_exception(ConnectionError("the batches are closed"))
        elif due:
            task = asyncio.ensure_future(self._send(due))
            task.add_done_callback(lambda _: self._cancelled(due))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
            if self._eager:
                self._busy += 1
                task.add_done_callback(lambda _: self._sent())

    @staticmethod
    def _cancelled(due: list[tuple[T, asyncio.Future[R]]]) -> None:
        """A batch cancelled (`aclose`), on its way or before it began: its callers fail."""
        for _, reply in due:
            if not reply.done():
                reply.set_exception(ConnectionError("the batch was cancelled"))

    async def _send(self, due: list[tuple[T, asyncio.Future[R]]]) -> None:
        replies: Sequence[R | Exception]
        try:
            async with asyncio.timeout(self._timeout), self._slot():
                due = [d for d in due if not d[1].done()]  # whose callers still wait
                if not due:
                    return
                replies = await self._send_items([item for item, _ in due])
        except Exception as exc:
            replies = [exc] * len(due)
        for (_, reply), result in zip(due, replies, strict=True):
            if reply.done():
                continue  # its caller left
            if isinstance(result, Exception):
                own = copy.copy(result)
                own.__cause__, own.__context__ = result.__cause__, result.__context__
                reply.set_exception(own)
            else:
                reply.set_result(result)

    async def aclose(self) -> None:
        """Fail the items waiting, cancel the batches being sent (their callers fail) and
        wait for them; nothing is sent after. An eager item on its way in its caller's
        task is that caller's to cancel."""
        self._closed = True
        self._flush()
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
