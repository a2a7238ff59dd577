"""Event streams: one queue per subscriber, and helpers that read a stream."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Self

from ._types import EventKind, LeadershipEvent

__all__ = ["EventHub", "EventStream", "on_transition", "until_leader", "while_leader"]

_END = None


class EventStream:
    """An async iterator over one election's events, with a queue of its own.

    It is subscribed from the moment it is created, so no event is missed between
    ``election.events()`` and the first ``__anext__``. It ends when the election next stops,
    or when closed (``aclose()`` or ``async with``).
    """

    def __init__(self, hub: EventHub, kinds: EventKind) -> None:
        self._hub = hub
        self._kinds = kinds
        self._mask = kinds.value  # an int: `EventKind &` builds a member, on every event
        self._queue: asyncio.Queue[LeadershipEvent | None] = asyncio.Queue()
        self._closed = False

    @property
    def kinds(self) -> EventKind:
        """The kinds of event this stream takes (fixed when it is created)."""
        return self._kinds

    def _put(self, event: LeadershipEvent | None) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> LeadershipEvent:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is _END:
            self._closed = True
            raise StopAsyncIteration
        return event

    async def aclose(self) -> None:
        """Unsubscribe; events already queued are dropped."""
        self._closed = True
        self._hub.unsubscribe(self)
        while not self._queue.empty():
            self._queue.get_nowait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<EventStream kinds={self.kinds!r} pending={self._queue.qsize()}>"


class EventHub:
    """Fan events out to subscribers; private to the election."""

    def __init__(self) -> None:
        self._streams: set[EventStream] = set()

    def subscribe(self, kinds: EventKind) -> EventStream:
        stream = EventStream(self, kinds)
        self._streams.add(stream)
        return stream

    def unsubscribe(self, stream: EventStream) -> None:
        self._streams.discard(stream)

    @property
    def subscriber_count(self) -> int:
        return len(self._streams)

    def wants(self, kind: EventKind) -> bool:
        """Whether any subscriber takes events of *kind*."""
        bit = kind.value
        return any(bit & stream._mask for stream in self._streams)

    def publish(self, event: LeadershipEvent) -> None:
        bit = event.kind.value
        for stream in list(self._streams):
            if bit & stream._mask:
                stream._put(event)

    def end_all(self) -> None:
        """End every stream: the election has stopped."""
        streams, self._streams = self._streams, set()
        for stream in streams:
            stream._put(_END)


async def until_leader(events: AsyncIterator[LeadershipEvent]) -> LeadershipEvent | None:
    """Wait for the next ACQUIRED event and return it (None if the stream ends first)."""
    async for event in events:
        if event.kind is EventKind.ACQUIRED:
            return event
    return None


async def while_leader(events: AsyncIterator[LeadershipEvent]) -> LeadershipEvent | None:
    """Wait while leading: return the next LOST event (None if the stream ends first).

    Pairs with `until_leader`::

        while await until_leader(stream):
            task = asyncio.create_task(work())
            await while_leader(stream)
            task.cancel()
    """
    async for event in events:
        if event.kind is EventKind.LOST:
            return event
    return None


Callback = Callable[[LeadershipEvent], Awaitable[None] | None]


async def on_transition(
    events: AsyncIterator[LeadershipEvent],
    on_acquired: Callback | None = None,
    on_lost: Callback | None = None,
) -> None:
    """Call *on_acquired* / *on_lost* (sync or async) for each transition until the stream ends."""
    async for event in events:
        callback = {EventKind.ACQUIRED: on_acquired, EventKind.LOST: on_lost}.get(event.kind)
        if callback is None:
            continue
        result = callback(event)
        if inspect.isawaitable(result):
            await result
