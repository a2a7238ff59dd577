"""A lost connection, on an in-memory stand-in for kazoo: what ends, what keeps its place.

On an ensemble, kazoo moves a session to another server when the one it talks to dies, is
cut off, or stops serving while the ensemble elects a new leader; meanwhile the client is
SUSPENDED and its requests wait for the reconnect. The design: SUSPENDED ends a term at
once; a candidate waiting in line keeps its place (its node lives with the session), even
when its reaper timer fires while the connection is down; a leader's node does not.

`FakeZooKeeper` keeps nodes, sequence counters and one-shot watches like the server, and
`FakeClient` has the surface of `KazooClient` the provider uses: replies as kazoo's
asynchronous results, requests held while suspended and sent on reconnect, watches fired
with a session event (no path) and dropped on suspension, state listeners. Virtual time
(`FakeClock`): the reaper's lease passes without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from kazoo.exceptions import NoNodeError  # type: ignore[import-untyped]
from kazoo.protocol.states import (  # type: ignore[import-untyped]
    EventType,
    KazooState,
    KeeperState,
    WatchedEvent,
    ZnodeStat,
)

from multilock.core import contenders
from multilock.core.testing import FakeClock
from multilock.zookeeper import ZooKeeperProvider

LEASE = 1.0


class Reply:
    """A kazoo asynchronous result: ``ready``, ``successful``, ``value``, ``rawlink``."""

    def __init__(self) -> None:
        self.value: Any = None
        self.exception: BaseException | None = None
        self._done = False
        self._links: list[Callable[[Reply], None]] = []

    def ready(self) -> bool:
        return self._done

    def successful(self) -> bool:
        return self._done and self.exception is None

    def rawlink(self, callback: Callable[[Reply], None]) -> None:
        self._links.append(callback)

    def settle(self, work: Callable[[], Any]) -> None:
        try:
            self.value = work()
        except Exception as exc:
            self.exception = exc
        self._done = True
        for callback in self._links:
            callback(self)


class FakeZooKeeper:
    """The data tree of one ensemble, shared by every `FakeClient`."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bytes, int]] = {"/": (b"", 0)}  # path -> (data, owner)
        self.counters: dict[str, int] = {}
        self.watches: list[tuple[FakeClient, str, str, Callable[[Any], None]]] = []
        self.ticks = itertools.count(1)

    def children(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return [
            p[len(prefix) :]
            for p in self.nodes
            if p.startswith(prefix) and "/" not in p[len(prefix) :]
        ]

    def fire(self, kind: str, path: str, event: Any) -> None:
        for watch in [w for w in self.watches if w[1:3] == (kind, path)]:
            self.watches.remove(watch)
            watch[3](WatchedEvent(event, KeeperState.CONNECTED, path))

    def stat(self, path: str) -> Any:
        owner = self.nodes[path][1]
        return ZnodeStat(0, 0, 0, next(self.ticks), 0, 0, 0, owner, 0, 0, 0)


class FakeClient:
    """One session on a `FakeZooKeeper`, with the surface of `KazooClient` used here."""

    def __init__(self, tree: FakeZooKeeper, session: int) -> None:
        self.tree, self.client_id = tree, (session, b"secret")
        self.state = KazooState.CONNECTED
        self.listeners: list[Callable[[Any], None]] = []
        self.held: list[tuple[Reply, Callable[[], Any]]] = []

    def suspend(self) -> None:
        """The server went away: watches fire with a session event and are gone."""
        self.state = KazooState.SUSPENDED
        for listener in self.listeners:
            listener(KazooState.SUSPENDED)
        mine = [w for w in self.tree.watches if w[0] is self]
        for watch in mine:
            self.tree.watches.remove(watch)
            watch[3](WatchedEvent(EventType.NONE, KeeperState.CONNECTING, None))

    def reconnect(self) -> None:
        """The same session on another server: held requests go out."""
        self.state = KazooState.CONNECTED
        for listener in self.listeners:
            listener(KazooState.CONNECTED)
        held, self.held = self.held, []
        for reply, work in held:
            reply.settle(work)

    def add_listener(self, listener: Callable[[Any], None]) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: Callable[[Any], None]) -> None:
        self.listeners.remove(listener)

    def _send(self, work: Callable[[], Any]) -> Reply:
        reply = Reply()
        if self.state == KazooState.CONNECTED:
            reply.settle(work)
        else:
            self.held.append((reply, work))
        return reply

    def _watch(self, kind: str, path: str, watch: Callable[[Any], None] | None) -> None:
        if watch is not None:
            self.tree.watches.append((self, kind, path, watch))

    def _need(self, path: str) -> None:
        if path not in self.tree.nodes:
            raise NoNodeError()

    def ensure_path_async(self, path: str) -> Reply:
        def work() -> bool:
            parts = path.strip("/").split("/")
            for depth in range(1, len(parts) + 1):
                self.tree.nodes.setdefault("/" + "/".join(parts[:depth]), (b"", 0))
            return True

        return self._send(work)

    def create_async(self, path: str, value: bytes, **options: Any) -> Reply:
        assert options["ephemeral"]
        assert options["sequence"]
        assert options["include_data"]

        def work() -> tuple[str, Any]:
            parent = path.rpartition("/")[0]
            if options["makepath"]:
                self.ensure_path_async(parent)
            self._need(parent)
            number = self.tree.counters.get(parent, 0)
            self.tree.counters[parent] = number + 1
            made = f"{path}{number:010d}"
            self.tree.nodes[made] = (value, self.client_id[0])
            self.tree.fire("children", parent, EventType.CHILD)
            return made, self.tree.stat(made)

        return self._send(work)

    def get_children_async(self, path: str, watch: Callable[[Any], None] | None = None) -> Reply:
        def work() -> list[str]:
            self._need(path)
            self._watch("children", path, watch)
            return self.tree.children(path)

        return self._send(work)

    def get_async(self, path: str, watch: Callable[[Any], None] | None = None) -> Reply:
        def work() -> tuple[bytes, Any]:
            self._need(path)
            self._watch("data", path, watch)
            return self.tree.nodes[path][0], self.tree.stat(path)

        return self._send(work)

    def set_async(self, path: str, value: bytes) -> Reply:
        def work() -> Any:
            self._need(path)
            self.tree.nodes[path] = (value, self.tree.nodes[path][1])
            self.tree.fire("data", path, EventType.CHANGED)
            return self.tree.stat(path)

        return self._send(work)

    def delete_async(self, path: str) -> Reply:
        def work() -> bool:
            self._need(path)
            del self.tree.nodes[path]
            self.tree.fire("data", path, EventType.DELETED)
            self.tree.fire("children", path.rpartition("/")[0], EventType.CHILD)
            return True

        return self._send(work)


async def settle() -> None:
    """Let the loop run the hops of replies and watch events (no time passes)."""
    for _ in range(50):
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def watching(provider: ZooKeeperProvider, group: str) -> AsyncIterator[None]:
    """Watch *group* as an election does: the group listed, then every wake-up taken."""
    stream = provider.watch(group)
    await anext(stream)

    async def drain() -> None:
        async for _ in stream:
            pass

    task = asyncio.ensure_future(drain())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await stream.aclose()  # type: ignore[attr-defined]


async def lead_for(provider: ZooKeeperProvider, seconds: float) -> None:
    """Renew participant "a"'s term (token 1) every third of a lease for *seconds*."""
    for _ in range(round(3 * seconds / LEASE)):
        assert await provider.renew("g", "a", 1, LEASE, {})
        await asyncio.sleep(LEASE / 3)


def test_a_candidate_in_line_keeps_its_place_through_a_reconnect() -> None:
    async def main() -> None:
        tree = FakeZooKeeper()
        first, second = FakeClient(tree, 1), FakeClient(tree, 2)
        leader = ZooKeeperProvider(first, session_timeout=LEASE)
        follower = ZooKeeperProvider(second, session_timeout=LEASE)
        term = await leader.try_acquire("g", "a", LEASE, {})
        assert term is not None
        assert term.token == 1
        async with watching(follower, "g"):
            assert await follower.try_acquire("g", "b", LEASE, {}) is None  # in line
            await settle()
            # Its server goes away for three leases: the reaper fires while suspended.
            second.suspend()
            await lead_for(leader, 3 * LEASE)
            second.reconnect()  # the same session, on another server
            await settle()
            assert await contenders(leader, "g") == ("a", "b")
            await lead_for(leader, 2 * LEASE)  # its view is current again: it stays
            assert await contenders(leader, "g") == ("a", "b")
            await leader.release("g", "a", 1)
            await settle()
            term = await follower.try_acquire("g", "b", LEASE, {})
            assert term is not None
            assert term.token == 2
        await follower.aclose()
        await leader.aclose()

    FakeClock().run(main)


def test_suspended_ends_the_term_at_once_and_the_next_in_line_leads() -> None:
    async def main() -> None:
        tree = FakeZooKeeper()
        first, second = FakeClient(tree, 1), FakeClient(tree, 2)
        leader = ZooKeeperProvider(first, session_timeout=LEASE)
        follower = ZooKeeperProvider(second, session_timeout=LEASE)
        assert await leader.try_acquire("g", "a", LEASE, {}) is not None
        async with watching(follower, "g"):
            assert await follower.try_acquire("g", "b", LEASE, {}) is None
            await settle()
            first.suspend()
            assert await leader.renew("g", "a", 1, LEASE, {}) is False  # at once
            first.reconnect()  # the same session: the old term's node is deleted now
            await settle()
            assert await contenders(follower, "g") == ("b",)
            term = await follower.try_acquire("g", "b", LEASE, {})
            assert term is not None
            assert term.token == 2
            # The old leader campaigns again: a new node, behind, with a higher token.
            assert await leader.try_acquire("g", "a", LEASE, {}) is None
            await settle()
            assert await contenders(follower, "g") == ("b", "a")
        await follower.aclose()
        await leader.aclose()

    FakeClock().run(main)


def test_a_leader_node_left_unrenewed_while_suspended_goes_once_reconnected() -> None:
    # Only a node in line waits for the reconnect: the first in line, not renewed for a
    # lease (its election stopped, or it never learnt it leads), is deleted as before.
    async def main() -> None:
        tree = FakeZooKeeper()
        first, second = FakeClient(tree, 1), FakeClient(tree, 2)
        leader = ZooKeeperProvider(first, session_timeout=LEASE)
        observer = ZooKeeperProvider(second, session_timeout=LEASE)
        assert await leader.try_acquire("g", "a", LEASE, {}) is not None
        async with watching(leader, "g"):
            first.suspend()
            await asyncio.sleep(2 * LEASE)
            first.reconnect()
            await settle()
            assert await contenders(observer, "g") == ()
        await observer.aclose()
        await leader.aclose()

    FakeClock().run(main)
