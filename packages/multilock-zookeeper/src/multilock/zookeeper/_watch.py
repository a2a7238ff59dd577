"""`Watches`: what a watched group looks like, kept current by ZooKeeper's watches.

``watch(group)`` keeps a *view* of the group: its children, listed with a children watch,
and the record of the lowest candidate (the leader), read with a data watch. Watch
events arrive in kazoo's event thread, in the order ZooKeeper sent them (before any later
reply on the session), and every change bumps a generation so that a reply to a request
sent before the change, which kazoo's completion thread may hand over late, is ignored.

- A change of the children makes the view stale; the group is listed again at once (with
  a new watch) and the watchers are woken when that listing arrives.
- The deletion of the watched leader node takes it out of the view, which stays right
  (a node created since can only come after every node in the view), and wakes the
  watchers at once, without waiting for a new listing. When the children watch was
  armed, that deletion is the first change since the listing, and ZooKeeper sends its
  children event right after the node's own: that event then keeps the view current, and
  the listing it triggers wakes again only if it shows something else.
- Every connection state change makes every view stale and wakes every watcher, so a
  leader renews (and ends its term when SUSPENDED) at once.

While a view is current, ``get_leader`` answers from it: nobody when it has no candidate,
the leader's record when it has read it, and otherwise reads only that record.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import NoNodeError  # type: ignore[import-untyped]
from kazoo.protocol.states import EventType, KazooState  # type: ignore[import-untyped]

from multilock.core import LeaderInfo

from ._nodes import decode, ordered
from ._session import FAILURES, Session

__all__ = ["Watches"]


@attrs.define(eq=False)
class View:
    """One group as the watches show it, and whom to wake when it changes."""

    group: str
    children: list[str] = attrs.field(factory=list)
    #: ``children`` is the group as of the last change ZooKeeper notified.
    current: bool = False
    #: ... and the children watch that reports the next change is set.
    armed: bool = False
    #: The next children event is the leader's deletion, already applied.
    expected: bool = False
    #: A listing is on its way.
    pending: bool = False
    #: Bumped by every change of the children: older answers are ignored.
    generation: int = 0
    #: The leader node whose record is watched, and that record (data, mtime) once read.
    head: str | None = None
    record: tuple[bytes, int] | None = None
    head_generation: int = 0
    #: The highest token of every listing taken so far (0: none yet).
    highest: int = 0
    wakers: list[Callable[[], None]] = attrs.field(factory=list)
    #: The watch functions kazoo calls (one each per group: kazoo keeps them once).
    on_children: Callable[[Any], None] | None = None
    on_head: Callable[[Any], None] | None = None


class Watches(Session):
    """Children and leader watches, and the views they keep current, on top of `Session`."""

    def __init__(self, hosts: str | KazooClient, /, **options: Any) -> None:
        super().__init__(hosts, **options)
        self._views: dict[str, View] = {}
        self._listening: KazooClient | None = None

    def _known(self, client: KazooClient, group: str) -> tuple[list[str], LeaderInfo | None] | None:
        """From a current view: its candidates, and the leader when its record is read.

        None when there is no current view of *group*: read the store.
        """
        with self._lock:
            view = self._views.get(group)
            if view is None or not view.current or client.state != KazooState.CONNECTED:
                return None
            line = ordered(view.children)
            if line and line[0][1] == view.head and view.record is not None:
                return [view.head], decode(line[0][0], *view.record)
            return [name for _, name in line], None

    def _all_gone(self, client: KazooClient, group: str) -> int | None:
        """The highest token ever listed, when a current view shows every candidate of its
        latest listing deleted since (each seen go by its own watch event); else None.

        Every candidate up to that token was then created before the latest listing, so it
        was either not in it (gone already) or has gone since.
        """
        with self._lock:
            view = self._views.get(group)
            if view is None or not view.current or client.state != KazooState.CONNECTED:
                return None
            return None if ordered(view.children) else view.highest

    # -- kazoo threads -------------------------------------------------------------------

    def _list(self, client: KazooClient, view: View, *, notify: bool) -> Any:
        """Send a listing of *view*'s group with a watch; return kazoo's result.

        With *notify*, the watchers are woken when it arrives (it follows a change).
        """
        with self._lock:
            view.generation += 1
            view.pending, view.armed = True, False
            generation = view.generation
        result = client.get_children_async(self._path(view.group), watch=view.on_children)
        result.rawlink(functools.partial(self._listed, client, view, generation, notify))
        return result

    def _listed(
        self, client: KazooClient, view: View, generation: int, notify: bool, result: Any
    ) -> None:
        """A listing arrived (kazoo's completion thread): keep it, watch its leader, wake."""
        with self._lock:
            if generation != view.generation:
                return  # a change (or a state change) came after it was sent
            view.pending = False
            if result.successful():
                seen = set(view.children) if view.current else None
                view.children, view.current, view.armed = result.value, True, True
                view.highest = max([view.highest, *(t for t, _ in ordered(view.children))])
                self._watch_head(client, view)
                if not notify or set(view.children) == seen:
                    return  # the first listing of a watch, or nothing new to tell
            elif not notify and isinstance(result.exception, NoNodeError):
                return  # no group node yet: the watch creates it and lists again
            wakers = list(view.wakers)  # after a failure too, to list and watch again
        for wake in wakers:
            wake()

    def _watch_head(self, client: KazooClient, view: View) -> None:
        """Read (with a data watch) the record of the view's leader, if not done yet."""
        line = ordered(view.children)
        head = line[0][1] if line else None
        if head == view.head and (view.record is not None or head is None):
            return
        view.head, view.record = head, None
        view.head_generation += 1
        if head is not None:
            got = client.get_async(self._path(view.group, head), watch=view.on_head)
            got.rawlink(functools.partial(self._head_read, view, view.head_generation))

    def _head_read(self, view: View, generation: int, result: Any) -> None:
        with self._lock:
            if generation == view.head_generation and result.successful():
                data, stat = result.value
                view.record = (data, stat.mtime)

    def _head_changed(self, view: View, event: Any) -> None:
        """The leader's node changed (kazoo's event thread)."""
        name = event.path.rsplit("/", 1)[1] if event.path else None
        client = self._client
        with self._lock:
            if name is None or name != view.head or client is None:
                return
            view.head_generation += 1
            view.head, view.record = None, None
            wakers = []
            if event.type == EventType.DELETED and view.current and name in view.children:
                # Gone: the view without it is still right (new nodes only come after).
                view.children = [c for c in view.children if c != name]
                if view.armed and not view.expected:
                    view.expected = True  # the children event of this deletion is next
                wakers = list(view.wakers)
            if view.current and view.wakers and not self._closed:
                with contextlib.suppress(*FAILURES):
                    self._watch_head(client, view)
        for wake in wakers:
            wake()

    def _changed(self, view: View, _event: Any) -> None:
        """The children watch fired (kazoo's event thread): list again, then wake."""
        client = self._client
        with self._lock:
            watched = bool(view.wakers) and not self._closed and client is not None
            view.armed = False
            if not view.expected or not watched:  # else the listing below follows at once
                view.current = False
            view.expected = False
            wakers = list(view.wakers)
        if not watched:
            return
        try:
            self._list(client, view, notify=True)
        except FAILURES:  # closed under us: let the watchers find out
            with self._lock:
                view.pending = view.current = False
            for wake in wakers:
                wake()

    def _state_changed(self, _state: Any) -> None:
        """Every connection state change (kazoo's connection thread): stale, wake all."""
        with self._lock:
            wakers = []
            for view in self._views.values():
                view.generation += 1
                view.head_generation += 1
                view.current = view.armed = view.expected = view.pending = False
                view.head, view.record = None, None
                wakers.extend(view.wakers)
        for wake in wakers:
            wake()

    # -- the event loop ------------------------------------------------------------------

    def _view(self, client: KazooClient, group: str) -> View:
        with self._lock:
            if self._listening is not client:
                client.add_listener(self._state_changed)
                self._listening = client
            view = self._views.get(group)
            if view is None:
                view = self._views[group] = View(group)
                view.on_children = functools.partial(self._changed, view)
                view.on_head = functools.partial(self._head_changed, view)
            return view

    def _stop_listening(self) -> None:
        with self._lock:
            client, self._listening = self._listening, None
            self._views.clear()
        if client is not None:
            client.remove_listener(self._state_changed)

    async def _start_listing(self, client: KazooClient, view: View) -> None:
        """List (and watch) the group, creating the group node if it is not there yet."""
        try:
            await self._call(self._list(client, view, notify=False))
        except NoNodeError:
            await self._call(client.ensure_path_async(self._path(view.group)))
            await self._call(self._list(client, view, notify=False))

    async def _watch(self, group: str) -> AsyncIterator[None]:
        """Yield on every change of the group's children and every connection state change."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: being torn down
                loop.call_soon_threadsafe(event.set)

        with self._failures("watch"):
            client = await self._client_for(None)
            view = self._view(client, group)
        with self._lock:
            view.wakers.append(wake)
        try:
            while True:
                with self._lock:
                    idle = not view.armed and not view.pending
                if idle:  # first time, or after a failure or a state change
                    with self._failures("watch"):
                        await self._start_listing(client, view)
                await event.wait()
                event.clear()
                yield None
        finally:
            with self._lock:
                view.wakers.remove(wake)
