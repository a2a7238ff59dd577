"""`ZooKeeperProvider`: candidates queue as ephemeral sequential nodes; the lowest one leads.

A participant's node, ``<root>/<group>/<random prefix>-<participant>-<sequence>``, holds a
JSON record. The lowest sequence number (never the name) leads, and it plus one is the
token; the group node counts the sequence and is never deleted, so tokens rise across
release, expiry, session loss and restarts. A candidate queues behind the leader, as in
kazoo's recipe, and leads as soon as its watch shows it lowest, with no round trip. A node
(one per group and participant of a provider) lives while its session does (a lease is at
least the session timeout) and while it is refreshed once per lease, or waits in line with
its group watched here: a loop timer deletes it otherwise. SUSPENDED ends a term at once;
a candidate in line keeps its place while kazoo reconnects within the session. A create
whose reply was lost is found by its prefix; a cancelled ``try_acquire`` settles, then
deletes a node it made. One kazoo client and session per provider, called through kazoo's
asynchronous API from the loop; only connect and close block, in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

import attrs
from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import KazooException  # type: ignore[import-untyped]
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]
from kazoo.retry import KazooRetry  # type: ignore[import-untyped]

from multilock.core import ConfigurationError, LeaderInfo, ProviderError
from multilock.core.provider import (
    DriverCalls,
    LeaseBounds,
    Provider,
    check_url_options,
    redact_url,
    split_url,
    to_seconds,
    url_seconds,
)

from ._watch import RAISE, Handler, Views, future, hop, ordered, token_of

__all__ = ["ZooKeeperProvider"]

FAILURES = (KazooException, KazooTimeoutError, OSError, json.JSONDecodeError, KeyError)
_SEGMENT = re.compile(r"[A-Za-z0-9_.\-:@+=,]{1,200}")  # no '/', printable ASCII
_HOST = re.compile(r"[A-Za-z0-9_.\-\[\]:]+")


def validate_root(value: Any, field: str = "root") -> str:
    """Return an absolute ZooKeeper path like ``/multilock`` (no trailing slash)."""
    if not isinstance(value, str) or not value.startswith("/") or value.endswith("/"):
        raise ConfigurationError(f"{field} must be an absolute path like '/multilock'")
    for segment in value[1:].split("/"):
        if not _SEGMENT.fullmatch(segment) or segment in (".", "..", "zookeeper"):
            raise ConfigurationError(f"{field} {value!r} has an invalid segment {segment!r}")
    return value


_SECONDS: Any = attrs.Converter(lambda v, f: to_seconds(v, f.name), takes_field=True)


@attrs.frozen(kw_only=True)
class Settings:
    """The options of a provider; keywords win over the URL's query string."""

    root: str = attrs.field(default="/multilock", converter=validate_root)
    #: The shortest lease; kazoo's default, so a plain ``KazooClient()`` passed in matches.
    session_timeout: float = attrs.field(default=10.0, converter=_SECONDS)  # type: ignore[misc]
    connect_timeout: float = attrs.field(default=10.0, converter=_SECONDS)  # type: ignore[misc]
    operation_timeout: float = attrs.field(default=5.0, converter=_SECONDS)  # type: ignore[misc]


def encode(participant_id: str, metadata: Mapping[str, str], since: datetime | None) -> bytes:
    record: dict[str, Any] = {"participant_id": participant_id, "metadata": dict(metadata)}
    return json.dumps({**record, "acquired_at": since.isoformat()} if since else record).encode()


def decode(token: int, data: bytes, mtime_ms: int) -> LeaderInfo:
    record = json.loads(data.decode())
    since = record.get("acquired_at")
    at = datetime.fromisoformat(since) if since else datetime.fromtimestamp(mtime_ms / 1000, UTC)
    pid, meta = record["participant_id"], record.get("metadata", {})
    return LeaderInfo(participant_id=pid, token=token, metadata=meta, acquired_at=at)


@attrs.define(eq=False)
class Node:
    """One participant's candidate node in one group, as this provider knows it."""

    group: str
    pid: str
    prefix: str
    session: int | None  # the session that owns (or will own) it: it goes with it
    name: str | None = None  # None until a create's reply (or a listing) names it
    timer: asyncio.TimerHandle | None = None  # deletes it unless refreshed
    acquired_at: datetime | None = None
    stored: Mapping[str, str] | None = None  # the metadata of a record dating the term


class ZooKeeperProvider(Provider):
    """Elect on ``"h1:2181,h2:2181/chroot"`` or a started `KazooClient` (never stopped here)."""

    def __init__(self, hosts: str | KazooClient, /, *, auth: str | None = None, **options: Any):
        self._settings = s = Settings(**options)
        if isinstance(hosts, str):
            split_url(f"zookeeper://{hosts}", "ZooKeeper")  # else kazoo's error quotes it
        self._hosts, self._auth = hosts, auth
        self._client: Any = None if isinstance(hosts, str) else hosts
        where = f"zookeeper://{hosts}" if isinstance(hosts, str) else "a KazooClient"
        secrets = (auth, auth.partition(":")[2]) if auth else ()
        self._calls = DriverCalls(
            "zookeeper", where, timeout=s.operation_timeout, failures=FAILURES, secrets=secrets
        )
        self._views = Views(s.root, self._calls)
        self._listener: Any = None  # wakes every watch on a connection state change
        self._connecting: asyncio.Task[None] | None = None
        self._nodes: dict[tuple[str, str], Node] = {}  # by (group, participant id)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ZooKeeperProvider:
        """Build from ``zookeeper://[user:pass@]h1:2181,h2:2181[/chroot][?options]``."""
        shown, parts = redact_url(url), split_url(url, "ZooKeeper")
        if parts.scheme not in ("zookeeper", "zk"):
            raise ConfigurationError(f"not a ZooKeeper URL: {shown}")
        userinfo, _, hosts = parts.netloc.rpartition("@")
        if not all(_HOST.fullmatch(host) for host in hosts.split(",")):
            raise ConfigurationError(f"a ZooKeeper URL names host[:port],...: {shown}")
        if chroot := parts.path.rstrip("/"):
            validate_root(chroot, "chroot")
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        check_url_options([k for k, _ in pairs], attrs.fields_dict(Settings), scheme=parts.scheme)
        options = {key: value if key == "root" else url_seconds(key, value) for key, value in pairs}
        user, sep, password = userinfo.partition(":")
        if userinfo and (not sep or not user):
            raise ConfigurationError(f"credentials in a ZooKeeper URL are user:password: {shown}")
        auth = f"{unquote(user)}:{unquote(password)}" if userinfo else None
        provider = cls(hosts + chroot, auth=auth, **{**options, **kwargs})
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

    @property
    def queues_candidates(self) -> bool:
        return True

    def _path(self, group: str, name: str = "") -> str:
        return f"{self._settings.root}/{group}" + (f"/{name}" if name else "")

    def _ls(self, group: str, missing: Any = RAISE) -> asyncio.Future[Any]:
        """List *group* (sent at once: requests sent back to back are pipelined)."""
        return future(self._client.get_children_async(self._path(group)), missing)

    def _read(self, group: str, name: str) -> asyncio.Future[Any]:
        """Read a node's ``(data, stat)``; None once it is gone."""
        return future(self._client.get_async(self._path(group, name)), None)

    def _session(self) -> int | None:
        owner = None if self._client is None else self._client.client_id
        return None if owner is None else int(owner[0])

    async def _connect(self) -> None:
        """Start the client on the first call (blocking: in a worker thread)."""
        if self._closed:
            raise ProviderError(f"{self!r} is closed")
        task = self._connecting
        if task is None or (task.done() and (task.cancelled() or task.exception())):
            task = self._connecting = asyncio.ensure_future(self._start())
        await asyncio.shield(task)

    async def _start(self) -> None:
        client, timeout = self._client, self._settings.connect_timeout
        if client is None:
            session = self._settings.session_timeout
            retry = KazooRetry(max_tries=-1, delay=0.05, max_delay=max(0.1, session / 4))
            auth = [("digest", self._auth)] if self._auth else None
            client = KazooClient(
                self._hosts, session, connection_retry=retry, auth_data=auth, handler=Handler()
            )
            connecting = asyncio.to_thread(client.start, timeout)
            await self._calls.call("connect", connecting, limit=timeout + 1)
            if self._closed:  # closed while connecting
                await asyncio.to_thread(client.stop)
                raise ProviderError(f"{self!r} is closed")
        self._client = self._views.client = client
        loop = asyncio.get_running_loop()  # the listener runs in kazoo's connection thread
        self._listener = functools.partial(hop, loop, self._views.state_changed)
        client.add_listener(self._listener)

    def _background(self, op: str, work: Callable[[], Awaitable[Any]], delay: float = 0.0) -> None:
        """Call *work* after *delay* (at least one loop turn) in a task, its failure ignored."""

        async def run() -> None:
            await asyncio.sleep(delay)
            with contextlib.suppress(ProviderError):
                await self._calls.call(op, work())

        task = asyncio.ensure_future(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _arm(self, node: Node, lease: float) -> None:
        """The reaper: delete *node* unless refreshed within *lease* (a loop timer)."""
        if node.timer is not None:
            node.timer.cancel()
        node.timer = asyncio.get_running_loop().call_later(lease, self._expire, node, lease)

    def _expire(self, node: Node, lease: float) -> None:
        # Queued behind the leader, its group watched here: its participant follows (an
        # idle follower refreshes nothing); once it leads, it must renew. Disconnected, a
        # node in line when last seen waits for the session to be back: the view decides.
        line = self._views.known(node.group, stale=not self._views.connected) or []
        if node.name in [name for _, name in line[1:]]:
            self._arm(node, lease)
        else:
            self._drop(node, delete=True)

    def _drop(self, node: Node, delete: bool = False) -> None:
        """Forget *node* (and its timer); with *delete*, delete it in the background."""
        if self._nodes.get((node.group, node.pid)) is node:
            del self._nodes[node.group, node.pid]
        if node.timer is not None:
            node.timer.cancel()
        if delete:
            self._background("delete", lambda: self._remove(node))

    async def _remove(self, node: Node) -> None:
        """Delete *node* (by prefix if its create is in doubt), retrying while it may live."""
        try:
            if node.name is None:
                names = [c for c in await self._ls(node.group, []) if c.startswith(node.prefix)]
            else:
                names = [node.name]
            for name in names:
                await future(self._client.delete_async(self._path(node.group, name)), None)
        except (*FAILURES, asyncio.CancelledError):
            if not self._closed and self._session() in (None, node.session):
                self._background("delete", lambda: self._remove(node), 0.5)
            raise

    async def try_acquire(
        self, group: str, participant_id: str, lease_duration: float, metadata: Mapping[str, str]
    ) -> LeaderInfo | None:
        made: list[Node] = []
        acquire = self._acquire(group, participant_id, lease_duration, metadata, made)
        node, line = self._nodes.get((group, participant_id)), self._views.known(group)
        if node is not None and line and node.name in [name for _, name in line]:
            # In line, as the watch shows: no I/O, so no cancellation can cut it in half
            # (a handoff's path: spawning and shielding a task costs two loop turns).
            return await self._calls.call("try_acquire", acquire)
        work = asyncio.ensure_future(self._calls.call("try_acquire", acquire))
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:  # let it settle, then undo a node it made
            await asyncio.wait([work], timeout=self._settings.operation_timeout)
            for node in made:
                self._drop(node)
                with contextlib.suppress(ProviderError):
                    await self._calls.call("try_acquire", self._remove(node))
            raise

    async def _acquire(
        self, group: str, pid: str, lease: float, meta: Mapping[str, str], made: list[Node]
    ) -> LeaderInfo | None:
        await self._connect()
        node = self._nodes.get((group, pid))
        sent = node is not None  # a create was sent: if its reply was lost, find it by prefix
        if node is None:
            node = Node(group, pid, f"{uuid.uuid4().hex}-{pid}-", self._session())
            self._nodes[group, pid] = node
        self._arm(node, lease)  # deletes it even if the create below is left in doubt
        line = self._views.known(group) or []  # a current view needs no read
        if node.name not in [name for _, name in line]:
            children = await self._ls(group, []) if sent else []
            node.name = min((c for c in children if c.startswith(node.prefix)), default=None)
            if node.name is None:
                node.acquired_at = node.stored = None
                made.append(node)
                children = await self._create(node, meta)
            line = ordered(children)
        if not line or line[0][1] != node.name:
            return None  # queued behind the leader
        if node.acquired_at is None:  # its term starts: stamp the record, out of the way
            node.acquired_at = datetime.now(UTC)
            loop, write = asyncio.get_running_loop(), functools.partial(self._write, node, meta)
            loop.call_soon(self._background, "try_acquire", write)  # after ours
            stored: Mapping[str, str] | None = meta
        elif (stored := node.stored) is None:
            return None  # a repeated call while the record is in doubt: get_leader finds it
        return LeaderInfo(
            participant_id=pid, token=line[0][0], metadata=stored, acquired_at=node.acquired_at
        )

    async def _create(self, node: Node, meta: Mapping[str, str]) -> Any:
        """Create *node* and list the group right behind it, pipelined; return the listing."""
        path, data = self._path(node.group, node.prefix), encode(node.pid, meta, None)
        creating = self._client.create_async(
            path, data, ephemeral=True, sequence=True, makepath=True, include_data=True
        )
        made, listing = future(creating), self._ls(node.group, None)
        path, stat = await made
        node.name, node.session = path.rpartition("/")[2], stat.ephemeralOwner
        children = await listing  # None: the group node came with the create (makepath)
        return await self._ls(node.group) if children is None else children

    async def _write(self, node: Node, meta: Mapping[str, str]) -> None:
        """Record ``acquired_at`` and the metadata on the leader's node, if not there yet."""
        if node.stored != meta:
            node.stored = None  # in doubt until the reply
            data = encode(node.pid, meta, node.acquired_at)
            await future(self._client.set_async(self._path(node.group, str(node.name)), data))
            node.stored = meta

    async def renew(
        self, group: str, participant_id: str, token: int, lease: float, metadata: Mapping[str, str]
    ) -> bool:
        renewing = self._renew((group, participant_id), token, lease, metadata)
        return bool(await self._calls.call("renew", renewing))

    async def _renew(
        self, key: tuple[str, str], token: int, lease: float, meta: Mapping[str, str]
    ) -> bool:
        node = self._nodes.get(key)
        if node is None or node.name is None or token_of(node.name) != token:
            return False
        await self._connect()
        if self._views.connected:  # else SUSPENDED: forgotten, deleted once reconnected
            got, listing = self._read(node.group, node.name), self._ls(node.group, [])
            reply, line = await got, ordered(await listing)  # one round trip, pipelined
            if self._nodes.get(key) is not node:
                return False  # expired, released or forgotten meanwhile
            mine = reply is not None and reply[1].ephemeralOwner == self._session()
            if mine and line and line[0][0] == token:
                node.acquired_at = node.acquired_at or datetime.now(UTC)
                await self._write(node, meta)
                self._arm(node, lease)
                return True
        self._drop(node, delete=True)
        return False

    async def release(self, group: str, participant_id: str, token: int) -> None:
        node = self._nodes.get((group, participant_id))
        if node is not None and node.name is not None and token_of(node.name) == token:
            self._drop(node)
            await self._calls.call("release", self._remove(node))

    async def get_leader(self, group: str) -> LeaderInfo | None:
        return await self._calls.call("get_leader", self._get_leader(group))

    async def _get_leader(self, group: str) -> LeaderInfo | None:
        await self._connect()
        line = self._views.known(group)  # the watches tell, with no read: nobody, or who
        for seq, name in ordered(await self._ls(group, [])) if line is None else line:
            got = await self._read(group, name)
            if got is not None:  # else gone since the listing: the next one leads
                return decode(seq, got[0], got[1].mtime)
        return None

    async def contenders(self, group: str) -> Sequence[str]:
        return await self._calls.call("contenders", self._contenders(group))

    async def _contenders(self, group: str) -> tuple[str, ...]:
        """Read every candidate node, pipelined, in line; a node gone meanwhile is none."""
        await self._connect()
        line = ordered(await self._ls(group, []))
        records = await asyncio.gather(*[self._read(group, name) for _, name in line])
        return tuple(json.loads(got[0])["participant_id"] for got in records if got is not None)

    def watch(self, group: str) -> AsyncIterator[None]:
        return self._views.watch(group, self._connect)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        nodes = list(self._nodes.values())
        for node in nodes:
            self._drop(node)
        if self._views.connected:
            removals = (self._calls.call("aclose", self._remove(node)) for node in nodes)
            await asyncio.gather(*removals, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._calls.closed = True
        self._views.state_changed()
        if self._client is not None:
            self._client.remove_listener(self._listener)
            if isinstance(self._hosts, str):
                await asyncio.to_thread(self._client.stop)
                await asyncio.to_thread(self._client.close)
