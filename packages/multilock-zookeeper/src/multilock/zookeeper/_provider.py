"""`ZooKeeperProvider`: candidates are ephemeral sequential nodes; the lowest one leads.

Guarantees: each participant that calls ``try_acquire`` gets one ephemeral sequential node
under ``<root>/<group>`` (named ``<random prefix>-<participant>-<sequence>``); the node
with the lowest *sequence number* (never the name) is the leader, and that number plus
one is the fencing token (so no token is 0). Sequence numbers come from the group node,
which is never deleted, so tokens rise across release, expiry, session loss and server
restarts. Nodes are only ever removed, never added below the lowest, so a candidate that
sees itself lowest in a listing taken after its node exists leads until its node goes.
Every write is one ZooKeeper operation on the caller's own node: create, set_data, delete.

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
lost is found again by its random prefix. kazoo calls run in worker threads, each bounded
by ``operation_timeout``; failures raise `ProviderError` with the driver's error as
``__cause__``. A cancelled ``try_acquire`` waits for its worker and deletes a node it made.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
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
from ._nodes import Node, decode, encode, ordered, token_of
from ._session import FAILURES, Session

if TYPE_CHECKING:
    from multilock.core._options import ElectionOptions

__all__ = ["ZooKeeperProvider"]

log = logging.getLogger(__name__)


class ZooKeeperProvider(Session, Provider):
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
        lease = lease_duration
        meta = dict(metadata)
        cancelled = threading.Event()
        work = functools.partial(self._acquire, group, participant_id, lease, meta, cancelled)
        future = asyncio.ensure_future(self._run("try_acquire", work))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled.set()  # the worker deletes a node it made; wait for it to settle
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self._settings.operation_timeout * 4):
                    await future
            raise

    def _acquire(
        self, group: str, pid: str, lease: float, meta: dict[str, str], cancelled: threading.Event
    ) -> LeaderInfo | None:
        client = self._connect(lease)
        key = (group, pid)
        with self._lock:
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = Node(group, f"{uuid.uuid4().hex}-{pid}-")
                node.session = client._session_id
        prefix = node.prefix
        if node.name is None:
            self._arm(key, node, lease)  # deletes it even if the create below is left in doubt
        children = self._children(client, group)
        mine = sorted(c for c in children if c.startswith(prefix))
        created = False
        if not mine:  # not there, or an earlier create's reply was lost: look, then create
            data = encode(pid, meta, None)
            self._wait(client.ensure_path_async(self._path(group)))
            path = self._wait(
                client.create_async(self._path(group, prefix), data, ephemeral=True, sequence=True)
            )
            created = True
            mine = [path.rsplit("/", 1)[1]]
            children = self._children(client, group)
            node.acquired_at, node.data = None, data
        for extra in mine[1:]:  # cannot happen with one prefix per create; be tidy anyway
            with contextlib.suppress(NoNodeError):
                self._wait(client.delete_async(self._path(group, extra)))
        node.name, node.seq = mine[0], token_of(mine[0])
        self._arm(key, node, lease)
        if cancelled.is_set() and created:
            self._forget(key, node)
            return None
        line = ordered(children)
        if not line or line[0][1] != node.name:
            return None
        if node.acquired_at is None:
            node.acquired_at = datetime.now(UTC)
        self._write(client, group, node, pid, meta)
        assert node.seq is not None
        return LeaderInfo(
            participant_id=pid, token=node.seq, metadata=meta, acquired_at=node.acquired_at
        )

    def _write(
        self, client: KazooClient, group: str, node: Node, pid: str, meta: dict[str, str]
    ) -> None:
        assert node.acquired_at is not None
        assert node.name is not None
        data = encode(pid, meta, node.acquired_at)
        if data != node.data:
            self._wait(client.set_async(self._path(group, node.name), data))
            node.data = data

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        lease = lease_duration
        meta = dict(metadata)
        work = functools.partial(self._renew, group, participant_id, token, lease, meta)
        return await self._run("renew", work)

    def _renew(self, group: str, pid: str, token: int, lease: float, meta: dict[str, str]) -> bool:
        key = (group, pid)
        with self._lock:
            node = self._nodes.get(key)
        if node is None or node.seq != token or node.name is None:
            return False
        client = self._connect(lease)
        with self._lock:
            node = self._nodes.get(key)
            if node is None or node.seq != token or time.monotonic() >= node.deadline:
                return False
        if client.state != KazooState.CONNECTED:
            log.info("zookeeper session of %s/%s is %s: the term ends", group, pid, client.state)
            self._forget(key, node, now=False)  # deleted on reconnect if the session survives
            return False
        try:
            _, stat = self._wait(client.get_async(self._path(group, node.name)))
        except NoNodeError:
            self._forget(key, node)
            return False
        line = ordered(self._children(client, group))
        if stat.ephemeralOwner != client.client_id[0] or not line or line[0][0] != token:
            self._forget(key, node)
            return False
        if node.acquired_at is None:
            node.acquired_at = datetime.now(UTC)
        self._write(client, group, node, pid, meta)
        self._arm(key, node, lease)
        return True

    async def release(self, group: str, participant_id: str, token: int) -> None:
        key = (group, participant_id)
        with self._lock:
            node = self._nodes.get(key)
            if node is None or node.seq != token:
                return
            del self._nodes[key]
            if node.timer is not None:
                node.timer.cancel()
        # A failed delete is retried in the background while the session lasts.
        await self._run("release", functools.partial(self._delete, node, retry=True))

    async def get_leader(self, group: str) -> LeaderInfo | None:
        return await self._run("get_leader", functools.partial(self._leader, group))

    def _leader(self, group: str) -> LeaderInfo | None:
        client = self._connect(None)
        for seq, name in ordered(self._children(client, group)):
            try:
                data, stat = self._wait(client.get_async(self._path(group, name)))
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
            for node in nodes:
                if node.timer is not None:
                    node.timer.cancel()

        def close() -> None:
            client = self._client
            if client is not None and client.state == KazooState.CONNECTED:
                for node in nodes:
                    with contextlib.suppress(*FAILURES):
                        self._delete(node, retry=False)
            with self._lock:
                self._closed = True
            if self._own and client is not None:
                client.stop()
                client.close()

        await asyncio.to_thread(close)
