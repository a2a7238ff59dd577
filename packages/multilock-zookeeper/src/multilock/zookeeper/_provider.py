"""`ZooKeeperProvider`: candidates are ephemeral sequential nodes; the lowest one leads.

Guarantees: each participant that calls ``try_acquire`` gets one ephemeral sequential node
under ``<root>/<group>`` (named ``<random prefix>-<participant>-<sequence>``); the node
with the lowest *sequence number* (never the name) is the leader, and that number plus
one is the fencing token (so no token is 0). Sequence numbers come from the group node,
which is never deleted, so tokens rise across release, expiry, session loss and server
restarts. Nodes are only ever removed, never added below the lowest, so a candidate that
sees itself lowest in a listing taken after its node exists leads until its node goes.
Every write is one ZooKeeper operation on the caller's own node: create, set_data, delete.
Nodes belong to this provider, keyed (group, participant): another provider with the same
participant id queues its own node and cannot join, renew or release this one's term. A
repeated ``try_acquire`` during a term returns that term as stored, metadata unchanged and
nothing written (None while a write of its record is in doubt: the election then finds
the term with ``get_leader`` and takes it up with ``renew``).

Lease: a node lives while its ZooKeeper session does (session timeout <= lease, checked)
and, on top, while its participant calls ``try_acquire``/``renew`` at least once per
``lease_duration`` on this provider's monotonic clock: a timer deletes a node that was
not refreshed in time, so a participant that stops campaigning, or a leader that stops
renewing, frees its place within one lease even though its session is still alive.
``aclose`` deletes every node of this provider at once.

Failure modes: when the connection is SUSPENDED the term ends at once (``watch`` wakes on
every connection state change and ``renew`` answers False unless the client is CONNECTED
and the node still exists, is owned by this session and is the lowest); after a reconnect
ownership is checked again; a LOST session means its nodes are gone and the next
``try_acquire`` creates a new node with a new, higher token. A create whose reply was
lost is found again by its random prefix. kazoo calls use its asynchronous API from the
event loop (no worker threads), each bounded by ``operation_timeout``; failures raise
`ProviderError` with the driver's error as ``__cause__``. A cancelled ``try_acquire``
waits for its calls to settle and deletes a node it made.

Round trips: a new candidate creates its node and lists the group in one pipelined round
trip, or, when its watch has seen every listed candidate go and its node gets the next
sequence number after the highest one listed, only creates it (see ``_create``); a node
that leads from its creation records no ``acquired_at`` (its creation time is the start
of the term). ``renew`` pipelines its two reads. ``get_leader`` answers from the watch's
current view of the group when there is one (see ``_watch.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import NoNodeError  # type: ignore[import-untyped]
from kazoo.protocol.states import KazooState  # type: ignore[import-untyped]

from multilock.core import (
    ConfigurationError,
    LeaderInfo,
    Provider,
    validate_name,
)

from ._config import parse_url
from ._nodes import Node, decode, encode, ordered, server_time, token_of
from ._session import FAILURES
from ._watch import Watches

if TYPE_CHECKING:
    from multilock.core._options import ElectionOptions

__all__ = ["ZooKeeperProvider"]

log = logging.getLogger(__name__)


class ZooKeeperProvider(Watches, Provider):
    """Elect through kazoo. *hosts* is kazoo's ``"h1:2181,h2:2181/chroot"`` or a `KazooClient`.

    A client passed in must be started by its owner; the provider never stops or closes
    it. Options: ``root`` (default ``/multilock``), ``session_timeout`` (None: the lease
    of the first ``check_options``/``try_acquire`` before connecting, else 10 s),
    ``connect_timeout`` (10 s), ``operation_timeout`` (5 s); durations in seconds or
    `timedelta`. ``auth`` is ``"user:password"`` for ZooKeeper's digest scheme.
    """

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ZooKeeperProvider:
        """Build from ``zookeeper://[user:pass@]h1:2181,h2:2181[/chroot][?options]``."""
        target, url_options = parse_url(url)
        provider = cls(target.hosts, auth=target.auth, **{**url_options, **kwargs})
        provider._shown = target.shown
        return provider

    def __repr__(self) -> str:
        return f"<ZooKeeperProvider {self._shown} root={self._settings.root}>"

    # -- the provider ----------------------------------------------------------------------

    def check_options(self, options: ElectionOptions) -> None:
        lease = options.lease_duration
        timeout = self._settings.session_timeout
        if self._client is not None:
            timeout = self._client._session_timeout / 1000
        if timeout is not None and timeout > lease:
            raise ConfigurationError(
                f"lease_duration {lease:g} s is shorter than the ZooKeeper session timeout "
                f"{timeout:g} s: a crashed leader's node would outlive its lease"
            )
        with self._lock:
            self._lease_hint = min(lease, self._lease_hint or lease)

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        cancelled = asyncio.Event()
        work = self._acquire(group, participant_id, lease_duration, dict(metadata), cancelled)
        future = asyncio.ensure_future(work)
        try:
            with self._failures("try_acquire"):
                return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled.set()  # the call deletes a node it made; wait for it to settle
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._settings.operation_timeout * 4):
                    await future
            raise

    async def _acquire(
        self, group: str, pid: str, lease: float, meta: dict[str, str], cancelled: asyncio.Event
    ) -> LeaderInfo | None:
        client = await self._client_for(lease)
        key = (group, pid)
        with self._lock:
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = Node(group, f"{uuid.uuid4().hex}-{pid}-")
                node.session = client._session_id
        self._arm(key, node, lease)  # deletes it even if the create below is left in doubt
        children: list[str] = []
        if node.sent:  # made before, or an earlier create's reply was lost: look for it
            children = await self._children(client.get_children_async(self._path(group)))
            mine = sorted(c for c in children if c.startswith(node.prefix))
            for extra in mine[1:]:  # cannot happen with one prefix per create; be tidy anyway
                with contextlib.suppress(NoNodeError):
                    await self._call(client.delete_async(self._path(group, extra)))
            node.name = mine[0] if mine else None
            node.seq = token_of(mine[0]) if mine else None
        since: datetime | None = None
        created = node.name is None
        if created:
            node.sent, node.acquired_at, node.stamped = True, None, False
            children, since = await self._create(client, node, pid, meta)
        self._arm(key, node, lease)
        if cancelled.is_set() and created:
            await self._forget(key, node)
            return None
        line = ordered(children)
        if not line or line[0][1] != node.name:
            return None
        assert node.seq is not None
        if node.acquired_at is not None:
            # A repeated call during its term: that term as stored, never rewritten (the
            # election knows its terms by their metadata); None while a write is in doubt.
            if not node.stamped or node.meta is None:
                return None
            return LeaderInfo(
                participant_id=pid,
                token=node.seq,
                metadata=dict(node.meta),
                acquired_at=node.acquired_at,
            )
        # Its term starts now, or started when it was made.
        node.acquired_at, node.stamped = (since, True) if since else (datetime.now(UTC), False)
        await self._write(client, group, node, pid, meta)
        return LeaderInfo(
            participant_id=pid, token=node.seq, metadata=meta, acquired_at=node.acquired_at
        )

    async def _create(
        self, client: KazooClient, node: Node, pid: str, meta: dict[str, str]
    ) -> tuple[list[str], datetime | None]:
        """Create *node*; return a listing of the group taken after it exists, and its
        creation time when that is the start of its term if it leads.

        When the group's watched view shows every candidate it listed deleted since, and
        the new node's token follows the highest token listed, no other node can be lower
        (tokens are unique and rise, and every node up to that one is gone): the node
        leads from its creation, with no listing. Otherwise the group is listed right
        behind the create, in the same round trip (ZooKeeper answers a session's requests
        in order); the creation time is the term's start when no other child came or went
        between the two (the group's ``pzxid`` is then the create's own zxid).
        """
        group = node.group
        highest = self._all_gone(client, group)
        made = self._future(client.create_async(
            self._path(group, node.prefix), encode(pid, meta, None), ephemeral=True,
            sequence=True, makepath=True, include_data=True,
        ))  # fmt: skip
        listed = None
        if highest is None:
            listed = self._future(client.get_children_async(self._path(group), include_data=True))
        path, stat = await self._call(made)
        node.name = path.rsplit("/", 1)[1]
        node.seq, node.meta = token_of(node.name), meta
        if highest is not None and node.seq == highest + 1:
            return [node.name], server_time(stat.ctime)
        children, parent = [], None
        if listed is not None:
            with contextlib.suppress(NoNodeError):  # the group node came after the listing
                children, parent = await self._call(listed)
        if parent is None:
            children, parent = await self._call(
                client.get_children_async(self._path(group), include_data=True)
            )
        if parent.pzxid != stat.czxid:  # it may have waited behind another candidate
            return children, None
        return children, server_time(stat.ctime)

    async def _write(
        self, client: KazooClient, group: str, node: Node, pid: str, meta: dict[str, str]
    ) -> None:
        """Record ``acquired_at`` and the metadata on the leader's node, if not there yet."""
        assert node.acquired_at is not None
        assert node.name is not None
        if node.stamped and node.meta == meta:
            return
        data = encode(pid, meta, node.acquired_at)
        node.stamped = False  # the stored record is in doubt until the write is answered
        await self._call(client.set_async(self._path(group, node.name), data))
        node.stamped, node.meta = True, meta

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        with self._failures("renew"):
            return await self._renew(group, participant_id, token, lease_duration, dict(metadata))

    async def _renew(
        self, group: str, pid: str, token: int, lease: float, meta: dict[str, str]
    ) -> bool:
        key = (group, pid)
        with self._lock:
            node = self._nodes.get(key)
        if node is None or node.seq != token or node.name is None:
            return False
        client = await self._client_for(lease)
        with self._lock:
            node = self._nodes.get(key)
            if node is None or node.seq != token or time.monotonic() >= node.deadline:
                return False
        if client.state != KazooState.CONNECTED:
            log.info("zookeeper session of %s/%s is %s: the term ends", group, pid, client.state)
            await self._forget(key, node, now=False)  # deleted on reconnect if the session lives
            return False
        assert node.name is not None
        got = self._future(client.get_async(self._path(group, node.name)))
        listed = self._future(client.get_children_async(self._path(group)))  # right behind
        try:
            _, stat = await self._call(got)
        except NoNodeError:
            await self._forget(key, node)
            return False
        line = ordered(await self._children(listed))
        owner = client.client_id
        if owner is None or stat.ephemeralOwner != owner[0] or not line or line[0][0] != token:
            await self._forget(key, node)
            return False
        if node.acquired_at is None:
            node.acquired_at, node.stamped = datetime.now(UTC), False
        await self._write(client, group, node, pid, meta)
        self._arm(key, node, lease)
        return True

    async def release(self, group: str, participant_id: str, token: int) -> None:
        key = (group, participant_id)
        with self._lock:
            node = self._nodes.get(key)
            if node is None or node.seq != token:
                return
            del self._nodes[key]
        # A failed delete is retried in the background while the session lasts.
        with self._failures("release"):
            await self._remove(node)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        with self._failures("get_leader"):
            client = await self._client_for(None)
            known = self._known(client, group)
            if known is not None and (known[1] is not None or not known[0]):
                return known[1]  # the watches tell: nobody, or the leader's record
            if known is not None:
                names = known[0]
            else:
                names = await self._children(client.get_children_async(self._path(group)))
            for seq, name in ordered(names):
                try:
                    data, stat = await self._call(client.get_async(self._path(group, name)))
                except NoNodeError:
                    continue  # gone since the listing: the next one leads
                return decode(seq, data, stat.mtime)
            return None

    def watch(self, group: str) -> AsyncIterator[None]:
        validate_name(group, "group")
        return self._watch(group)

    async def aclose(self) -> None:
        with self._lock:
            if self._closed:
                return
            nodes = list(self._nodes.values())
            self._nodes.clear()
        client = self._client
        if client is not None and client.state == KazooState.CONNECTED:
            for node in nodes:
                with contextlib.suppress(*FAILURES):
                    await self._remove(node)
        with self._lock:
            self._closed = True
            self._reaped.notify()
        self._stop_listening()
        if self._own and client is not None:
            await asyncio.to_thread(client.stop)
            await asyncio.to_thread(client.close)
