"""`EtcdProvider`: one etcd key per group, attached to a lease and taken by a transaction.

Guarantees: a term is the key ``<prefix>/<group>``, created by one txn
``if create_revision(key) == 0 then put(key, record, lease)``, so exactly one of many
concurrent acquires wins (etcd is linearizable). The key's lease has a TTL of
``ceil(lease_duration)`` whole seconds, granted just before the txn, so the store never
ends a term before the core's deadline; each renew sends one keepalive and checks that
the key still exists with the caller's participant id and token. The token is the key's
create revision: etcd revisions are global to the cluster and only rise, also across
restarts (they live in the data dir), so every new term's token is larger than every
earlier one. A key attached to a lease vanishes when the lease expires, so
``get_leader`` reports only live terms, with the record exactly as its term last wrote
it. A live term is never joined: the txn writes nothing while the key exists, whoever
holds it (the same participant id too: two processes may share one); a refused acquire
revokes the lease it granted, and one that has seen no delete since the key was last
written reads the key first, so it grants nothing at all. Release of a term this provider
wrote revokes the term's lease, which etcd gives to that one key only: the key goes in the
same raft entry, with no read first. Any other release is a txn that deletes the key only
if its create revision and value are still the caller's. ``watch``: one etcd watch on the
whole prefix per provider, fanned out to the watches of every group (`Notifications`); it
wakes followers on every put and delete, including the delete etcd makes when a lease
expires, so no expiry timer is needed.

Failure modes: every failed or timed-out call raises `ProviderError` with the driver's
error as ``__cause__`` (passwords scrubbed). Every call is bounded by ``timeout`` (no
retries: the core owns them). An acquiring txn whose reply is lost leaves a term the
caller does not know it has: the election finds it with ``get_leader`` (by the instance
nonce in its metadata) and takes it up with ``renew``; a lease granted for a txn that
never ran expires by itself. gRPC reconnects by itself after a server restart; a broken
watch stream raises `ProviderError` in every open watch and the core watches again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

import aetcd  # type: ignore[import-untyped]
import aetcd.rpc  # type: ignore[import-untyped]

from multilock.core.provider import (
    ConfigurationError,
    DriverCalls,
    LeaderInfo,
    LeaseBounds,
    Notifications,
    Provider,
    ProviderError,
    to_seconds,
)

from ._config import CHANNEL_OPTIONS, parse_url
from ._record import decode, encode

__all__ = ["EtcdProvider"]


class _Term(NamedTuple):
    """A term this provider wrote: its owner, and the lease no other key is attached to."""

    participant_id: str
    token: int
    lease: int


class EtcdProvider(Provider):
    """Keep each group's term in the etcd key ``<prefix>/<group>``, attached to a lease.

    ``timeout`` (seconds) bounds every call. ``min_lease`` is the server's minimum lease
    TTL (etcd: 1.5 x election timeout, rounded up; 2 s with default flags): elections
    with a shorter ``lease_duration`` are refused, because etcd would silently grant the
    longer TTL and followers would wait for it.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 2379,
        *,
        username: str | None = None,
        password: str | None = None,
        prefix: str = "multilock",
        timeout: float = 5.0,
        min_lease: float = 2.0,
    ) -> None:
        if not host or not 0 < port < 65536:
            raise ConfigurationError(f"bad etcd address {host!r}:{port!r}")
        if (username is None) != (password is None):
            raise ConfigurationError("etcd needs both a username and a password, or neither")
        prefix = prefix.strip("/")
        if not prefix or any(not part for part in prefix.split("/")):
            raise ConfigurationError(f"bad key prefix {prefix!r}: use e.g. 'multilock'")
        self._timeout = to_seconds(timeout, "timeout")
        self._min_lease = to_seconds(min_lease, "min_lease")
        self._prefix = prefix
        self._where = f"{host}:{port}"
        self._client: Any = aetcd.Client(
            host=host,
            port=port,
            username=username,
            password=password,
            timeout=self._timeout,  # a gRPC deadline on every call (aetcd never retries)
            options=CHANNEL_OPTIONS,
        )
        # The asyncio bound is a little longer, so that gRPC's own deadline error shows.
        self._calls = DriverCalls(
            "etcd",
            self._where,
            timeout=self._timeout + 1.0,
            failures=(aetcd.ClientError, aetcd.rpc.RpcError, OSError),
            secrets=[password or ""],
        )
        self._notes = Notifications(self._listen, name=f"etcd watch on {self._where}/{prefix}/")
        #: The term this provider last wrote in each group, so release needs no read.
        self._terms: dict[str, _Term] = {}
        #: Watched groups whose last event was a delete: an acquire there skips its read.
        self._freed: set[str] = set()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> EtcdProvider:
        """``etcd://[user:pass@]host[:port][/prefix][?timeout=5&min_lease=2]``."""
        host, port, options = parse_url(url)
        return cls(host, port, **(options | kwargs))

    def __repr__(self) -> str:
        return f"<EtcdProvider {self._where} prefix={self._prefix!r}>"

    @property
    def lease_bounds(self) -> LeaseBounds:
        return LeaseBounds(
            minimum=self._min_lease,
            reason=f"this etcd server's minimum lease TTL is {self._min_lease:g} s (min_lease)",
        )

    # -- plumbing ---------------------------------------------------------------------

    def _key(self, group: str) -> bytes:
        return f"{self._prefix}/{group}".encode()

    async def _get(self, key: bytes) -> Any:
        return await self._calls.call("get", self._client.get(key))

    async def _revoke(self, lease_id: int) -> bool:
        """Revoke a lease (its keys go with it); False if it had already ended."""
        try:
            await self._calls.call("lease revoke", self._client.revoke_lease(lease_id))
        except ProviderError as exc:
            # aetcd chains the gRPC error, whose status tells "no such lease" apart.
            cause = getattr(exc.__cause__, "__cause__", None)
            code = cause.code() if isinstance(cause, aetcd.rpc.AioRpcError) else None
            if code == aetcd.rpc.StatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def _discard(self, lease_id: int) -> None:
        """Revoke a lease nobody needs; it expires by itself if this fails."""
        with contextlib.suppress(ProviderError):
            await self._revoke(lease_id)

    async def _extend(
        self, group: str, kv: Any, info: LeaderInfo, ttl: int, metadata: Mapping[str, str]
    ) -> bool:
        """Keep the term in *kv* alive for *ttl* s more; False if it has already ended."""
        reply = await self._calls.call("lease keepalive", self._client.refresh_lease(kv.lease))
        granted = 0 if reply is None else int(reply.TTL)
        if granted <= 0:
            return False  # the lease expired or was revoked: the key is gone with it
        if granted >= ttl and metadata == info.metadata:
            self._terms[group] = _Term(info.participant_id, info.token, kv.lease)
            return True
        # A longer lease or new metadata: rewrite the record, on a new lease if need be.
        self._terms.pop(group, None)  # until the txn's outcome is known
        lease_id = kv.lease
        if granted < ttl:
            lease_id = (await self._calls.call("lease grant", self._client.lease(ttl))).id
        key, tx = kv.key, self._client.transactions
        record = encode(info.participant_id, metadata, info.acquired_at)
        ok, _ = await self._calls.call(
            "txn",
            self._client.transaction(
                compare=[tx.create(key) == kv.create_revision, tx.value(key) == kv.value],
                success=[tx.put(key, record, lease=lease_id)],
                failure=[],
            ),
        )
        if ok:
            self._terms[group] = _Term(info.participant_id, info.token, lease_id)
        if lease_id != kv.lease:
            await self._discard(lease_id if not ok else kv.lease)
        return bool(ok)

    # -- the provider -----------------------------------------------------------------

    async def try_acquire(
        self, group: str, participant_id: str, lease_duration: float, metadata: Mapping[str, str]
    ) -> LeaderInfo | None:
        key = self._key(group)
        if group in self._freed:
            # The watch saw the key deleted: go straight for it (a handoff's critical path).
            self._freed.discard(group)
        elif await self._get(key) is not None:
            # A live term, even one of this participant id: never joined, nothing written
            # (a key's lease ends it, so an existing key is a live term).
            return None
        lease = await self._calls.call("lease grant", self._client.lease(math.ceil(lease_duration)))
        record = encode(participant_id, metadata, datetime.now(UTC))
        tx = self._client.transactions
        # If the put goes through but the reply is lost, the election finds the term with
        # get_leader and takes it up with renew; a lease granted for a txn that never ran
        # expires by itself.
        ok, responses = await self._calls.call(
            "txn",
            self._client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, record, lease=lease.id), tx.get(key)],
                failure=[],
            ),
        )
        if not ok:
            await self._discard(lease.id)
            return None
        info = decode(responses[1][0][1])
        if info is not None:
            self._terms[group] = _Term(participant_id, info.token, lease.id)
        return info

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        kv = await self._get(self._key(group))
        info = None if kv is None else decode(kv)
        if info is None or (info.participant_id, info.token) != (participant_id, token):
            return False
        try:
            return await self._extend(group, kv, info, math.ceil(lease_duration), metadata)
        except BaseException:
            self._terms.pop(group, None)  # the key may have moved to another lease
            raise

    async def release(self, group: str, participant_id: str, token: int) -> None:
        term = self._terms.get(group)
        if term is not None and term[:2] == (participant_id, token):
            # Only this term's key is attached to its lease: revoking it deletes exactly
            # that key if it is still there, in one raft entry, and nothing otherwise.
            await self._revoke(term.lease)
            if self._terms.get(group) is term:
                del self._terms[group]
            return
        key = self._key(group)
        kv = await self._get(key)
        info = None if kv is None else decode(kv)
        if info is None or (info.participant_id, info.token) != (participant_id, token):
            return
        tx = self._client.transactions
        ok, _ = await self._calls.call(
            "txn",
            self._client.transaction(
                compare=[tx.create(key) == token, tx.value(key) == kv.value],
                success=[tx.delete(key)],
                failure=[],
            ),
        )
        if ok:
            await self._revoke(kv.lease)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        kv = await self._get(self._key(group))
        return None if kv is None else decode(kv)

    def watch(self, group: str) -> AsyncIterator[None]:
        return self._notes.watch(group)

    async def _listen(self, notes: Notifications) -> None:
        """The provider's one etcd watch, on every key under the prefix."""
        prefix = f"{self._prefix}/".encode()
        stream = await self._calls.call("watch", self._client.watch_prefix(prefix))
        failure: BaseException | None = None
        try:
            notes.ready()
            async for event in stream:
                group = event.kv.key[len(prefix) :].decode("utf-8", "replace")
                if event.kind == "DELETE" and group in notes.groups:
                    self._freed.add(group)
                else:
                    self._freed.discard(group)
                notes.notify(group)
        except self._calls.failures as exc:
            failure = exc  # raised below, outside the handler: no secret rides as context
        finally:
            self._freed.clear()
            with contextlib.suppress(*self._calls.failures, ProviderError):
                async with asyncio.timeout(self._timeout):
                    await stream.cancel()
        if failure is not None:
            self._calls.fail("watch", failure)

    async def aclose(self) -> None:
        if self._calls.closed:
            return
        await self._notes.aclose()
        self._calls.closed = True
        with contextlib.suppress(*self._calls.failures):
            async with asyncio.timeout(self._timeout):
                await self._client.close()
