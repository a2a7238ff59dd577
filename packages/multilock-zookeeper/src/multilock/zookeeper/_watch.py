"""kazoo's replies and watches on the event loop: `future`, and the `Views` of watched groups.

A view is a group as its watches show it: its candidates (a children watch) and a data
watch on the lowest, the leader. kazoo's threads hop to the loop, which alone keeps the
views (no lock); a listing's reply is applied only if no change the loop saw came after it
was sent. Watches wake when the leader changes: its node's deletion (applied at once, with no
read: nodes only come after it), a listing with another lowest node, a change of its
record (a term began), any connection state change (every view is then stale, and listed
again once CONNECTED).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
from kazoo.exceptions import NoNodeError  # type: ignore[import-untyped]
from kazoo.handlers.threading import SequentialThreadingHandler  # type: ignore[import-untyped]
from kazoo.protocol.states import EventType, KazooState  # type: ignore[import-untyped]

from multilock.core.provider import DriverCalls, ProviderError

__all__ = ["RAISE", "Handler", "Views", "future", "hop", "ordered", "token_of"]

log = logging.getLogger(__name__)

RAISE: Any = object()  # `future`'s default: a NoNodeError fails it like any other error


def token_of(name: str) -> int | None:
    """A candidate's token: the sequence number ZooKeeper appended, plus one (never 0)."""
    tail = name[-10:]
    return int(tail) + 1 if len(name) > 10 and tail.isdigit() else None


def ordered(children: list[str]) -> list[tuple[int, str]]:
    """Candidates as (token, name), lowest sequence number first (never by name)."""
    return sorted((s, c) for c in children if (s := token_of(c)) is not None)


def hop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Call *fn* on *loop* from one of kazoo's threads (a closed loop has nobody waiting)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


class _Inline(queue.Queue[Any]):
    """kazoo's callback queues, run as filled: a callback runs on the thread that queues it
    (kazoo's connection thread); only the stop marker is queued. Our client's callbacks only
    hop to the loop (`hop`): another thread first would add a wake-up to every reply and
    watch event, on a handoff's critical path."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if not callable(item):
            return super().put(item, block, timeout)
        try:
            item()
        except Exception:
            log.exception("a kazoo callback raised")


class Handler(SequentialThreadingHandler):  # type: ignore[misc]
    """kazoo's threading handler with `_Inline` callback queues (for clients we build)."""

    queue_impl = _Inline


def future(sent: Any, missing: Any = RAISE) -> asyncio.Future[Any]:
    """The reply to kazoo request *sent* as a future of this loop; NoNodeError gives *missing*."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[Any] = loop.create_future()
    reply.add_done_callback(lambda f: f.cancelled() or f.exception())

    def settle() -> None:
        if reply.done():
            return
        if sent.successful():
            reply.set_result(sent.value)
        elif missing is not RAISE and isinstance(sent.exception, NoNodeError):
            reply.set_result(missing)
        else:
            reply.set_exception(sent.exception)

    settle() if sent.ready() else sent.rawlink(lambda _: hop(loop, settle))
    return reply


@attrs.define(eq=False)
class View:
    path: str
    line: list[tuple[int, str]] = attrs.field(factory=list)  # candidates, lowest first
    current: bool = False  # the group as of the last change ZooKeeper reported
    listing: asyncio.Future[Any] | None = None  # on its way; current and none: watch armed
    expected: bool = False  # the next children event is the leader's deletion, applied
    head: str | None = None  # the leader node, read with a data watch
    events: set[asyncio.Event] = attrs.field(factory=set)
    on_event: Callable[[Any], None] = print  # kazoo keeps a function once: one per view


class Views:
    """The watched groups of one provider, on its one kazoo client and event loop."""

    def __init__(self, root: str, calls: DriverCalls) -> None:
        self._root, self._calls = root, calls
        self._views: dict[str, View] = {}
        self.client: Any = None  # the provider's, once connected

    @property
    def connected(self) -> bool:
        return self.client is not None and bool(self.client.state == KazooState.CONNECTED)

    def known(self, group: str, stale: bool = False) -> list[tuple[int, str]] | None:
        """The candidates of a current view of *group*; None: read the store. With
        *stale*, those of the last listing, current or not (none if never listed)."""
        view = self._views.get(f"{self._root}/{group}")
        if view is None or not (stale or (view.current and self.connected)):
            return None
        return view.line

    def _wake(self, view: View) -> None:
        for event in view.events:
            event.set()

    def _list(self, view: View, notify: bool) -> asyncio.Future[Any]:
        """List *view*'s group with a children watch; with *notify*, wake on news."""
        reply = future(self.client.get_children_async(view.path, view.on_event), None)
        reply.add_done_callback(functools.partial(self._listed, view, notify))
        view.listing = reply
        return reply

    def _listed(self, view: View, notify: bool, reply: asyncio.Future[Any]) -> None:
        if reply is not view.listing:
            return  # a change (or a state change) came after it was sent
        view.listing = None
        children = None if reply.cancelled() or reply.exception() else reply.result()
        if children is not None:
            line, seen = ordered(children), view.line[:1] if view.current else None
            view.line, view.current = line, True
            self._watch_head(view)
            if notify and line[:1] == seen:
                return  # the same leader: a new candidate, or one behind it gone
            self._wake(view)  # a new leader, or (again) watched: look at the group now
        else:  # a failure: no watch is set, so the view is not current; the watch lists again
            view.current = False
            if notify:
                self._wake(view)

    def _watch_head(self, view: View) -> None:
        """Read the leader's record with a data watch: wake once its term is stamped."""
        head = view.line[0][1] if view.line else None
        if head is not None and head != view.head:
            reply = future(self.client.get_async(f"{view.path}/{head}", view.on_event), None)
            reply.add_done_callback(functools.partial(self._head_read, view, head))
        view.head = head

    def _head_read(self, view: View, head: str, reply: asyncio.Future[Any]) -> None:
        got = None if reply.cancelled() or reply.exception() else reply.result()
        if view.head == head and got is not None and b'"acquired_at"' in got[0]:
            self._wake(view)  # else its data watch wakes when the new leader stamps it

    def _changed(self, view: View, event: Any) -> None:
        """The group's children watch or its leader's data watch fired."""
        if self._views.get(view.path) is not view or not event.path:
            return  # no path: a session event, see the listener
        if event.path == view.path:
            view.current, view.expected = view.expected and view.current, False
            with contextlib.suppress(*self._calls.failures):
                self._list(view, notify=True)
        elif (name := event.path.rpartition("/")[2]) == view.head:
            view.head = None  # its watch fired: set a new one
            if view.current and event.type == EventType.DELETED:
                view.line = [c for c in view.line if c[1] != name]
                view.expected = view.listing is None  # its children event comes next
            if view.current:
                self._wake(view)  # the leader is gone, or its record changed (a term began)
                self._watch_head(view)

    def state_changed(self, _state: Any = None) -> None:
        """A connection state change: every view is stale, every watch wakes."""
        for view in self._views.values():
            view.current = view.expected = False
            view.listing = view.head = None
            self._wake(view)

    async def watch(self, group: str, connect: Callable[[], Awaitable[Any]]) -> AsyncIterator[None]:
        """Yield once the group is watched, then whenever it or the connection changes."""
        await connect()
        path = f"{self._root}/{group}"
        if (view := self._views.get(path)) is None:
            view = self._views[path] = View(path)
            view.on_event = functools.partial(hop, asyncio.get_running_loop(), self._changed, view)
        event = asyncio.Event()
        view.events.add(event)
        if view.current and view.listing is None:
            event.set()  # watched already: yield at once
        try:
            while not self._calls.closed:
                if not view.current and view.listing is None and self.connected:
                    await self._start(view)
                await event.wait()
                event.clear()
                if not self._calls.closed:
                    yield None
            raise ProviderError(f"the zookeeper provider for {self._calls.where} is closed")
        finally:
            view.events.discard(event)
            if not view.events and self._views.get(path) is view:
                del self._views[path]

    async def _start(self, view: View) -> None:
        """List and watch the group, first making its node if it is not there yet."""
        if await self._calls.call("watch", self._list(view, False)) is None:
            await self._calls.call("watch", future(self.client.ensure_path_async(view.path)))
            await self._calls.call("watch", self._list(view, False))
