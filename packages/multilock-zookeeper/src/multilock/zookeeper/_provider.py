"""`ZooKeeperProvider`: candidates queue as ephemeral sequential nodes; the lowest one leads.

A participant's node, ``<root>/<group>/<random prefix>-<participant>-<sequence>``, holds a
JSON record; the lowest sequence number (never the name) leads, and it plus one is the
token. The group node counts the sequence and is never deleted, so tokens rise across
release, expiry, session loss and restarts. A candidate queues behind the leader, as in
kazoo's recipe, and leads as soon as its watch shows it lowest, with no round trip. Nodes
belong to this provider, keyed (group, participant). A node lives while its session does
(``lease_bounds``: a lease is at least the session timeout) and while it is refreshed
(``try_acquire``/``renew``) once per lease, or waits behind the leader with its group
watched here: a timer on the event loop deletes it otherwise. SUSPENDED ends a term at
once; a candidate in line keeps its place while kazoo reconnects, to the same server or
another of the ensemble, within the session. A create whose reply was lost is found by
its prefix; a cancelled ``try_acquire`` settles, then deletes a node it made.
``contenders`` lists the candidate nodes in line, each read for its participant id. One
kazoo client and session per provider, called through kazoo's asynchronous API from the
loop; only connect and close block, in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import attrs
from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import KazooException  # type: ignore[import-untyped]
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]
from kazoo.protocol.states import KazooState  # type: ignore[import-untyped]
from kazoo.retry import KazooRetry  # type: ignore[import-untyped]

from multilock.core.provider import DriverCalls, LeaderInfo, LeaseBounds, Provider, ProviderError

from ._config import Settings, parse_url
from ._watch import RAISE, Views, future, ordered, token_of

__all__ = ["ZooKeeperProvider"]

FAILURES = (KazooException, KazooTimeoutError, OSError, json.JSONDecodeError, KeyError)
Key = tuple[str, str]


def encode(participant_id: str, metadata: Mapping[str, str], since: datetime | None) -> bytes:
    record: dict[str, Any] = {"participant_id": participant_id, "metadata": dict(metadata)}
    return json.dumps({**record, "acquired_at": since.isoformat()} if since else record).encode()


def decode(token: int, data: bytes, mtime_ms: int) -> LeaderInfo:
    record = json.loads(data.decode())
    since = record.get("acquired_at")
    at = datetime.fromisoformat(since) if since else datetime.fromtimestamp(mtime_ms / 1000, UTC)
    return LeaderInfo(
        participant_id=record["participant_id"],
        token=token,
        metadata=record.get("metadata", {}),
        acquired_at=at,
    )


@attrs.define(eq=False)
class Node:
    """One participant's candidate node in one group, as this provider knows it."""

    group: str
    prefix: str
    session: int | None  # the session that owns (or will own) it: it goes with it
    name: str | None = None
    seq: int | None = None
    sent: bool = False  # a create was sent: if its reply was lost, find it by prefix
    timer: asyncio.TimerHandle | None = None  # deletes it unless refreshed
    acquired_at: datetime | None = None
    stored: Mapping[str, str] | None = None  # the metadata of a record dating the term


class ZooKeeperProvider(Provider):
    """Elect on ``"h1:2181,h2:2181/chroot"`` or a started `KazooClient` (never stopped here)."""

    def __init__(self, hosts: str | KazooClient, /, *, auth: str | None = None, **options: Any):
        self._settings = s = Settings(**options)
        self._hosts, self._auth = hosts, auth
        self._client: Any = None if isinstance(hosts, str) else hosts
        where = f"zookeeper://{hosts}" if isinstance(hosts, str) else "a KazooClient"
        secrets = (auth, auth.partition(":")[2]) if auth else ()
        self._calls = DriverCalls(
            "zookeeper", where, timeout=s.operation_timeout, failures=FAILURES, secrets=secrets
        )
        self._views = Views(s.root, self._calls)
        self._loop: Any = None
        self._connecting: asyncio.Task[None] | None = None
        self._nodes: dict[Key, Node] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ZooKeeperProvider:
        """Build from ``zookeeper://[user:pass@]h1:2181,h2:2181[/chroot][?options]``."""
        hosts, auth, shown, options = parse_url(url)
        provider = cls(hosts, auth=auth, **{**options, **kwargs})
        provider._calls.where = shown
        return provider

    def __repr__(self) -> str:
        return f"<ZooKeeperProvider {self._calls.where} root={self._settings.root}>"

    @property
    def client(self) -> KazooClient | None:
        """The kazoo client in use (None until the first call connects)."""
        return self._client

    @property
    def lease_bounds(self) -> LeaseBounds:
        timeout = self._settings.session_timeout
        why = f"a crashed leader's node lives until its session_timeout ({timeout:g} s) ends"
        return LeaseBounds(minimum=timeout, reason=why)

    def _path(self, group: str, name: str = "") -> str:
        return f"{self._settings.root}/{group}" + (f"/{name}" if name else "")

    def _kz(self, sent: Any, missing: Any = RAISE) -> asyncio.Future[Any]:
        return future(self._loop, sent, missing)

    def _session(self) -> int | None:
        owner = None if self._client is None else self._client.client_id
        return None if owner is None else int(owner[0])

    async def _connect(self) -> Any:
        """The started client; the first call connects (blocking: in a worker thread)."""
        if self._closed:
            raise ProviderError(f"{self!r} is closed")
        task = self._connecting
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            task = self._connecting = asyncio.ensure_future(self._start())
        await asyncio.shield(task)
        return self._client

    async def _start(self) -> None:
        client, timeout = self._client, self._settings.connect_timeout
        if client is None:
            session = self._settings.session_timeout
            retry = KazooRetry(max_tries=-1, delay=0.05, max_delay=max(0.1, session / 4))
            auth = [("digest", self._auth)] if self._auth else None
            client = KazooClient(self._hosts, session, connection_retry=retry, auth_data=auth)
            connecting = asyncio.to_thread(client.start, timeout)
            await self._calls.call("connect", connecting, limit=timeout + 1)
            if self._closed:  # closed while connecting
                await asyncio.to_thread(client.stop)
                raise ProviderError(f"{self!r} is closed")
        self._client, self._loop = client, asyncio.get_running_loop()
        self._views.bind(client, self._loop)
        client.add_listener(self._on_state)

    def _on_state(self, _state: Any) -> None:  # kazoo's connection thread
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(self._views.state_changed)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _arm(self, key: Key, node: Node, lease: float) -> None:
        """The reaper: delete *node* unless refreshed within *lease* (a loop timer)."""
        if node.timer is not None:
            node.timer.cancel()
        node.timer = self._loop.call_later(lease, self._expire, key, node, lease)

    def _expire(self, key: Key, node: Node, lease: float) -> None:
        # Queued behind the leader while its group is watched here: its participant
        # follows (an idle follower refreshes nothing); once it leads, it must renew.
        # Disconnected, a node in line when last seen waits for the session to be back
        # (kazoo moving to another server): the view listed again then decides.
        if self._queued(node) or (self._suspended() and self._queued(node, stale=True)):
            self._arm(key, node, lease)
        else:
            self._forget(key, node)

    def _queued(self, node: Node, stale: bool = False) -> bool:
        line = self._views.known(node.group, stale)  # no read needed
        return line is not None and node.name in [name for _, name in line[1:]]

    def _suspended(self) -> bool:
        return self._client is not None and self._client.state != KazooState.CONNECTED

    def _drop(self, key: Key, node: Node) -> None:
        if self._nodes.get(key) is node:
            del self._nodes[key]
        if node.timer is not None:
            node.timer.cancel()

    def _forget(self, key: Key, node: Node) -> None:
        self._drop(key, node)
        self._spawn(self._quietly("delete", lambda: self._remove(node)))

    async def _quietly(self, op: str, work: Callable[[], Any], delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        with contextlib.suppress(ProviderError):
            await self._calls.call(op, work())

    async def _remove(self, node: Node) -> None:
        """Delete *node* (by prefix if its create is in doubt), retrying while it may live."""
        try:
            names = [node.name] if node.name is not None else []
            if not names:
                listing = await self._kz(
                    self._client.get_children_async(self._path(node.group)), []
                )
                names = [c for c in listing if c.startswith(node.prefix)]
            for name in names:
                await self._kz(self._client.delete_async(self._path(node.group, name)), None)
        except (*FAILURES, asyncio.CancelledError):
            if not self._closed and self._session() in (None, node.session):
                self._spawn(self._quietly("delete", lambda: self._remove(node), 0.5))
            raise

    async def try_acquire(
        self, group: str, participant_id: str, lease_duration: float, metadata: Mapping[str, str]
    ) -> LeaderInfo | None:
        made: list[Node] = []
        acquire = self._acquire(group, participant_id, lease_duration, metadata, made)
        work = asyncio.ensure_future(self._calls.call("try_acquire", acquire))
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:  # let it settle, then undo a node it made
            await asyncio.wait([work], timeout=self._settings.operation_timeout)
            for node in made:
                self._drop((group, participant_id), node)
                await self._quietly("try_acquire", functools.partial(self._remove, node))
            raise

    async def _acquire(
        self, group: str, pid: str, lease: float, meta: Mapping[str, str], made: list[Node]
    ) -> LeaderInfo | None:
        client = await self._connect()
        key = (group, pid)
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = Node(group, f"{uuid.uuid4().hex}-{pid}-", self._session())
        self._arm(key, node, lease)  # deletes it even if the create below is left in doubt
        if self._queued(node):
            return None  # queued behind the leader
        line = self._views.known(group)
        children = [node.name] if line and line[0][1] == node.name else []
        if node.sent and not children:  # made before, or a create's reply was lost
            children = await self._kz(client.get_children_async(self._path(group)), [])
            mine = sorted(c for c in children if c.startswith(node.prefix))
            node.name, node.seq = (mine[0], token_of(mine[0])) if mine else (None, None)
        if node.name is None:
            node.sent, node.acquired_at, node.stored = True, None, None
            made.append(node)
            children = await self._create(client, node, pid, meta)
        line = ordered(children)
        if not line or line[0][1] != node.name:
            return None  # queued behind the leader
        if node.acquired_at is None:  # its term starts: stamp the record, out of the way
            node.acquired_at = datetime.now(UTC)
            self._spawn(self._quietly("try_acquire", lambda: self._write(client, node, pid, meta)))
            stored: Mapping[str, str] | None = meta
        elif (stored := node.stored) is None:
            return None  # a repeated call while the record is in doubt: get_leader finds it
        return LeaderInfo(
            participant_id=pid, token=line[0][0], metadata=stored, acquired_at=node.acquired_at
        )

    async def _create(self, client: Any, node: Node, pid: str, meta: Mapping[str, str]) -> Any:
        """Create *node* and list the group right behind it, pipelined; return the listing."""
        path, data = self._path(node.group, node.prefix), encode(pid, meta, None)
        made = self._kz(client.create_async(
            path, data, ephemeral=True, sequence=True, makepath=True, include_data=True
        ))  # fmt: skip
        listing = self._kz(client.get_children_async(self._path(node.group)), None)
        path, stat = await made
        node.name = path.rpartition("/")[2]
        node.seq, node.session = token_of(node.name), stat.ephemeralOwner
        children = await listing  # None: the group node came with the create (makepath)
        if children is None:
            children = await self._kz(client.get_children_async(self._path(node.group)))
        return children

    async def _write(self, client: Any, node: Node, pid: str, meta: Mapping[str, str]) -> None:
        """Record ``acquired_at`` and the metadata on the leader's node, if not there yet."""
        if node.stored != meta:
            node.stored = None  # in doubt until the reply
            data = encode(pid, meta, node.acquired_at)
            await self._kz(client.set_async(self._path(node.group, str(node.name)), data))
            node.stored = meta

    async def renew(
        self, group: str, participant_id: str, token: int, lease: float, metadata: Mapping[str, str]
    ) -> bool:
        renewing = self._renew((group, participant_id), token, lease, metadata)
        return bool(await self._calls.call("renew", renewing))

    async def _renew(self, key: Key, token: int, lease: float, meta: Mapping[str, str]) -> bool:
        node = self._nodes.get(key)
        if node is None or node.seq != token or node.name is None:
            return False
        client = await self._connect()
        if client.state != KazooState.CONNECTED:
            self._forget(key, node)  # deleted once reconnected, if the session lives
            return False
        got = self._kz(client.get_async(self._path(node.group, node.name)), None)
        listing = self._kz(client.get_children_async(self._path(node.group)), [])  # pipelined
        reply, line, owner = await got, ordered(await listing), client.client_id
        if self._nodes.get(key) is not node:
            return False  # expired, released or forgotten meanwhile
        mine = reply is not None and owner is not None and reply[1].ephemeralOwner == owner[0]
        if not mine or not line or line[0][0] != token:
            self._forget(key, node)
            return False
        node.acquired_at = node.acquired_at or datetime.now(UTC)
        await self._write(client, node, key[1], meta)
        self._arm(key, node, lease)
        return True

    async def release(self, group: str, participant_id: str, token: int) -> None:
        node = self._nodes.get((group, participant_id))
        if node is not None and node.seq == token:
            self._drop((group, participant_id), node)
            await self._calls.call("release", self._remove(node))

    async def get_leader(self, group: str) -> LeaderInfo | None:
        return await self._calls.call("get_leader", self._get_leader(group))

    async def _get_leader(self, group: str) -> LeaderInfo | None:
        client = await self._connect()
        line = self._views.known(group)  # the watches tell, with no read: nobody, or who
        if line is None:
            line = ordered(await self._kz(client.get_children_async(self._path(group)), []))
        for seq, name in line:
            got = await self._kz(client.get_async(self._path(group, name)), None)
            if got is not None:  # else gone since the listing: the next one leads
                return decode(seq, got[0], got[1].mtime)
        return None

    async def contenders(self, group: str) -> Sequence[str]:
        return await self._calls.call("contenders", self._contenders(group))

    async def _contenders(self, group: str) -> tuple[str, ...]:
        """Read every candidate node, pipelined, in line: the lowest sequence number first."""
        client = await self._connect()
        line = ordered(await self._kz(client.get_children_async(self._path(group)), []))
        reads = [self._kz(client.get_async(self._path(group, name)), None) for _, name in line]
        records = await asyncio.gather(*reads)  # None: gone since the listing, not a candidate
        return tuple(json.loads(got[0])["participant_id"] for got in records if got is not None)

    def watch(self, group: str) -> AsyncIterator[None]:
        return self._views.watch(group, self._connect)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        nodes = list(self._nodes.items())
        for key, node in nodes:
            self._drop(key, node)
        client = self._client
        if client is not None and client.state == KazooState.CONNECTED:
            removals = (self._calls.call("aclose", self._remove(node)) for _, node in nodes)
            await asyncio.gather(*removals, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._calls.closed = self._views.closed = True
        self._views.state_changed()
        if client is not None:
            client.remove_listener(self._on_state)
            if isinstance(self._hosts, str):
                await asyncio.to_thread(client.stop)
                await asyncio.to_thread(client.close)
