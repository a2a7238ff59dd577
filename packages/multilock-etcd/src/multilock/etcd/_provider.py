"""`EtcdProvider`: one etcd key per group, attached to a lease and taken by a transaction.

Guarantees: a term is the key ``<prefix>/<group>``, created by one txn
``if create_revision(key) == 0 then put(key, record, lease)``, so exactly one of many
concurrent acquires wins (etcd is linearizable). The key's lease has a TTL of
``ceil(lease_duration)`` whole seconds, so the store never ends a term before the core's
deadline; each renew sends one keepalive and checks that the key still exists with the
caller's participant id and token. The token is the key's create revision: etcd revisions
are global to the cluster and only rise, also across restarts (they live in the data
dir), so every new term's token is larger than every earlier one. A key attached to a
lease vanishes when the lease expires, so ``get_leader`` reports only live terms, with
the record exactly as its term last wrote it. A live term is never joined: while the
key exists ``try_acquire`` returns None, whoever holds it (the same participant id too:
two processes may share one), and writes nothing; one that loses the txn race revokes
the lease it granted. Release is a txn that deletes the key only if its create revision
and value are still the caller's, then revokes the lease. ``watch`` uses an etcd watch on
the key: it wakes followers on every put and delete, including the delete etcd makes
when a lease expires.

Failure modes: every failed or timed-out call raises `ProviderError` with the driver's
error as ``__cause__`` (passwords scrubbed). Every call is bounded by ``timeout`` (no
retries: the core owns them). An acquiring txn whose reply is lost leaves a term the
caller does not know it has: the election finds it with ``get_leader`` (by the instance
nonce in its metadata) and takes it up with ``renew``; a lease granted for a txn that
never ran expires by itself. gRPC reconnects by itself after a server restart; a broken
watch stream raises `ProviderError` and the core watches again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Coroutine, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

import aetcd  # type: ignore[import-untyped]
import aetcd.rpc  # type: ignore[import-untyped]

from multilock.core import (
    ConfigurationError,
    LeaderInfo,
    Provider,
    ProviderError,
    validate_name,
)
from multilock.core._names import to_seconds
from multilock.core._url import redact_url

if TYPE_CHECKING:
    from multilock.core import ElectionOptions

__all__ = ["EtcdProvider"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
#: gRPC waits up to 120 s between reconnects by default: far longer than a lease. Retry
#: within a second, and ping idle streams so a silently cut watch breaks in ~15 s.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
}
_FAILURES = (aetcd.ClientError, aetcd.rpc.RpcError, OSError, TimeoutError)


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
        self._secret = "" if password is None else password
        self._client: Any = aetcd.Client(
            host=host,
            port=port,
            username=username,
            password=password,
            timeout=self._timeout,  # a gRPC deadline on every call (aetcd never retries)
            options=_CHANNEL_OPTIONS,
        )
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> EtcdProvider:
        """``etcd://[user:pass@]host[:port][/prefix][?timeout=5&min_lease=2]``."""
        parts = urlsplit(url)
        try:
            port = parts.port or 2379
        except ValueError as exc:
            raise ConfigurationError(f"bad port in {redact_url(url)}") from exc
        if parts.scheme != "etcd" or not parts.hostname or parts.fragment:
            raise ConfigurationError(
                f"an etcd URL is etcd://[user:pass@]host[:port][/prefix], not {redact_url(url)}"
            )
        options: dict[str, Any] = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in ("timeout", "min_lease"):
                raise ConfigurationError(f"unknown etcd URL parameter {name!r}")
            try:
                options[name] = float(value)
            except ValueError as exc:
                raise ConfigurationError(f"etcd URL parameter {name} is not a number") from exc
        if parts.path.strip("/"):
            options["prefix"] = unquote(parts.path)
        if parts.username is not None:
            options["username"] = unquote(parts.username)
            options["password"] = unquote(parts.password or "")
        options.update(kwargs)
        return cls(parts.hostname, port, **options)

    def __repr__(self) -> str:
        return f"<EtcdProvider {self._where} prefix={self._prefix!r}>"

    def check_options(self, options: ElectionOptions) -> None:
        if options.lease_duration < self._min_lease:
            raise ConfigurationError(
                f"lease_duration {options.lease_duration} s is below this etcd server's "
                f"minimum lease TTL of {self._min_lease} s (min_lease)"
            )

    # -- plumbing ---------------------------------------------------------------------

    def _key(self, group: str) -> bytes:
        return f"{self._prefix}/{validate_name(group, 'group')}".encode()

    async def _call(self, what: str, call: Awaitable[_T]) -> _T:
        """Await one driver call, bounded, with its failures turned into ProviderError."""
        if self._closed:
            if isinstance(call, Coroutine):
                call.close()
            raise ProviderError("the etcd provider is closed")
        try:
            async with asyncio.timeout(self._timeout + 1.0):
                return await call
        except _FAILURES as exc:
            detail = str(exc) or type(exc).__name__
            if self._secret:
                detail = detail.replace(self._secret, "***")
            raise ProviderError(f"etcd {what} at {self._where} failed: {detail}") from exc

    async def _get(self, key: bytes) -> Any:
        return await self._call("get", self._client.get(key))

    async def _revoke(self, lease_id: int) -> None:
        """Revoke a lease nobody needs; it expires by itself if this fails."""
        with contextlib.suppress(ProviderError):
            await self._call("lease revoke", self._client.revoke_lease(lease_id))

    @staticmethod
    def _record(participant_id: str, metadata: Mapping[str, str], at: datetime) -> bytes:
        body = {
            "participant_id": participant_id,
            "metadata": dict(metadata),
            "acquired_at": at.isoformat(),
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def _info(kv: Any) -> LeaderInfo | None:
        """The term *kv* records, or None for a key that is not ours to read."""
        try:
            body = json.loads(kv.value)
            acquired_at = datetime.fromisoformat(body["acquired_at"]).astimezone(UTC)
            return LeaderInfo(
                participant_id=body["participant_id"],
                token=int(kv.create_revision),
                metadata=dict(body["metadata"]),
                acquired_at=acquired_at,
            )
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed multilock record in etcd key %r", kv.key)
            return None

    async def _extend(
        self, key: bytes, kv: Any, info: LeaderInfo, ttl: int, metadata: dict[str, str]
    ) -> bool:
        """Keep the term in *kv* alive for *ttl* s more; False if it has already ended."""
        reply = await self._call("lease keepalive", self._client.refresh_lease(kv.lease))
        granted = 0 if reply is None else int(reply.TTL)
        if granted <= 0:
            return False  # the lease expired or was revoked: the key is gone with it
        if granted >= ttl and metadata == info.metadata:
            return True
        # A longer lease or new metadata: rewrite the record, on a new lease if need be.
        lease_id = kv.lease
        if granted < ttl:
            lease_id = (await self._call("lease grant", self._client.lease(ttl))).id
        tx = self._client.transactions
        ok, _ = await self._call(
            "txn",
            self._client.transaction(
                compare=[tx.create(key) == kv.create_revision, tx.value(key) == kv.value],
                success=[
                    tx.put(
                        key,
                        self._record(info.participant_id, metadata, info.acquired_at),
                        lease=lease_id,
                    )
                ],
                failure=[],
            ),
        )
        if lease_id != kv.lease:
            await self._revoke(lease_id if not ok else kv.lease)
        return bool(ok)

    # -- the provider -----------------------------------------------------------------

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        key = self._key(group)
        ttl = math.ceil(to_seconds(lease_duration, "lease_duration"))
        if await self._get(key) is not None:
            # A live term, even one of this participant id: never joined, nothing written
            # (a key's lease ends it, so an existing key is a live term).
            return None
        lease = await self._call("lease grant", self._client.lease(ttl))
        record = self._record(participant_id, dict(metadata), datetime.now(UTC))
        tx = self._client.transactions
        # If the put goes through but the reply is lost, the election finds the term with
        # get_leader and takes it up with renew; a lease granted for a txn that never ran
        # expires by itself.
        ok, responses = await self._call(
            "txn",
            self._client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, record, lease=lease.id), tx.get(key)],
                failure=[],
            ),
        )
        if not ok:
            await self._revoke(lease.id)
            return None
        _, created = responses[1][0]
        return self._info(created)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        key = self._key(group)
        ttl = math.ceil(to_seconds(lease_duration, "lease_duration"))
        meta = dict(metadata)
        kv = await self._get(key)
        info = None if kv is None else self._info(kv)
        if info is None or (info.participant_id, info.token) != (participant_id, token):
            return False
        return await self._extend(key, kv, info, ttl, meta)

    async def release(self, group: str, participant_id: str, token: int) -> None:
        key = self._key(group)
        kv = await self._get(key)
        info = None if kv is None else self._info(kv)
        if info is None or (info.participant_id, info.token) != (participant_id, token):
            return
        tx = self._client.transactions
        ok, _ = await self._call(
            "txn",
            self._client.transaction(
                compare=[tx.create(key) == token, tx.value(key) == kv.value],
                success=[tx.delete(key)],
                failure=[],
            ),
        )
        if ok:
            await self._call("lease revoke", self._client.revoke_lease(kv.lease))

    async def get_leader(self, group: str) -> LeaderInfo | None:
        kv = await self._get(self._key(group))
        return None if kv is None else self._info(kv)

    def watch(self, group: str) -> AsyncIterator[None]:
        return self._watch(self._key(group))

    async def _watch(self, key: bytes) -> AsyncIterator[None]:
        stream = await self._call("watch", self._client.watch(key))
        try:
            # A change between the caller's last look and the subscription is not seen
            # by the stream: wake once now, so the caller looks again.
            yield None
            async for _ in stream:
                yield None
            raise ProviderError(f"the etcd watch at {self._where} ended")
        except _FAILURES as exc:
            raise ProviderError(f"the etcd watch at {self._where} broke: {exc}") from exc
        finally:
            with contextlib.suppress(*_FAILURES, ProviderError):
                async with asyncio.timeout(self._timeout):
                    await stream.cancel()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(*_FAILURES):
            async with asyncio.timeout(self._timeout):
                await self._client.close()
