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

Members: the provider talks to one member of the cluster at a time, the first of
``endpoints`` to begin with. Every request carries etcd's ``hasleader`` header, so a
member that has lost its leader (cut off from its peers) refuses at once instead of
holding calls until their deadline. A call that fails because of its member (gRPC
UNAVAILABLE: unreachable, no leader; DEADLINE_EXCEEDED: no answer) still fails, and the
calls that follow go to the next member; the old connection is closed, which ends its
watch (the core watches again, on the new member). Every member answers every call
linearizably, so which one answers changes nothing about what a reply means.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
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

from ._config import CHANNEL_OPTIONS, DEFAULT_PORT, format_endpoint, parse_endpoint, parse_url
from ._record import decode, encode

__all__ = ["EtcdProvider"]

log = logging.getLogger(__name__)

#: etcd's "require leader" header: a member without a leader answers UNAVAILABLE ("no
#: leader") at once, and ends such watch streams, instead of holding them.
_REQUIRE_LEADER = ("hasleader", "true")

#: The driver's errors that blame the member rather than the request: move to another.
_MEMBER_FAILED = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, OSError, TimeoutError)


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd has no type hints
    """aetcd's client, with the ``hasleader`` header on every call and watch."""

    async def connect(self) -> None:
        await super().connect()
        # aetcd sends self.metadata (its auth token, if any) with each call, and gave it
        # to its watcher when connecting: add the header to both, once.
        metadata: tuple[tuple[str, str], ...] = getattr(self, "metadata", None) or ()
        if _REQUIRE_LEADER not in metadata:
            self.metadata = (*metadata, _REQUIRE_LEADER)
            self._watcher._metadata = self.metadata


class _Term(NamedTuple):
    """A term this provider wrote: its owner, and the lease no other key is attached to."""

    participant_id: str
    token: int
    lease: int


class EtcdProvider(Provider):
    """Keep each group's term in the etcd key ``<prefix>/<group>``, attached to a lease.

    ``host`` and ``port`` (default ``localhost:2379``) name one member; ``endpoints``
    (``["h1:2379", "h2:2379", ...]``) names several members of one cluster instead, used
    one at a time in this order: after a call fails because of its member, the provider
    moves on to the next. ``timeout`` (seconds) bounds every call. ``min_lease`` is the
    server's minimum lease TTL (etcd: 1.5 x election timeout, rounded up; 2 s with
    default flags): elections with a shorter ``lease_duration`` are refused, because etcd
    would silently grant the longer TTL and followers would wait for it.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        endpoints: Sequence[str] | None = None,
        username: str | None = None,
        password: str | None = None,
        prefix: str = "multilock",
        timeout: float = 5.0,
        min_lease: float = 2.0,
    ) -> None:
        self._members = _members(host, port, endpoints)
        if (username is None) != (password is None):
            raise ConfigurationError("etcd needs both a username and a password, or neither")
        prefix = prefix.strip("/")
        if not prefix or any(not part for part in prefix.split("/")):
            raise ConfigurationError(f"bad key prefix {prefix!r}: use e.g. 'multilock'")
        self._timeout = to_seconds(timeout, "timeout")
        self._min_lease = to_seconds(min_lease, "min_lease")
        self._prefix = prefix
        self._where = ",".join(format_endpoint(*member) for member in self._members)
        self._auth = {"username": username, "password": password}
        self._current = 0
        self._client: Any = self._connect()
        #: Clients of members left behind, closing in the background.
        self._closing: set[asyncio.Task[None]] = set()
        # The asyncio bound is a little longer, so that gRPC's own deadline error shows.
        self._calls = DriverCalls(
            "etcd",
            format_endpoint(*self._members[0]),  # the member in use (see _move_on)
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
        """``etcd://[user:pass@]host[:port][,host[:port]...][/prefix][?timeout=5&min_lease=2]``."""
        endpoints, options = parse_url(url)
        return cls(endpoints=endpoints, **(options | kwargs))

    def __repr__(self) -> str:
        return f"<EtcdProvider {self._where} prefix={self._prefix!r}>"

    @property
    def lease_bounds(self) -> LeaseBounds:
        return LeaseBounds(
            minimum=self._min_lease,
            reason=f"this etcd server's minimum lease TTL is {self._min_lease:g} s (min_lease)",
        )

    # -- plumbing ---------------------------------------------------------------------

    def _connect(self) -> Any:
        """A client of the current member (it connects on its first call)."""
        host, port = self._members[self._current]
        return _Client(
            host=host,
            port=port,
            **self._auth,
            timeout=self._timeout,  # a gRPC deadline on every call (aetcd never retries)
            options=CHANNEL_OPTIONS,
        )

    async def _call(self, op: str, call: Coroutine[Any, Any, Any]) -> Any:
        """Await *call*, made by the current member's client, bounded in time; when it
        fails because of that member, move on to the next."""
        client, where = self._client, self._calls.where
        try:
            return await self._calls.call(op, call)
        except ProviderError as exc:
            if isinstance(exc.__cause__, _MEMBER_FAILED):
                self._move_on(client, exc)
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling() or client is self._client:
                raise  # a cancellation of the caller: pass it on
            # gRPC ends the calls of a channel it closes with CancelledError: this call
            # was on the client closed when the provider moved on. A failure, not a cancel
            # (which would end the caller's task: an election's loop, say).
        raise ProviderError(
            f"etcd {op} failed on {where}: its connection was closed when the provider "
            f"moved on to {self._calls.where}"
        )

    def _move_on(self, client: Any, exc: ProviderError) -> None:
        """Use the next member, *client*'s having failed (unless that was done already)."""
        if client is not self._client or len(self._members) == 1 or self._calls.closed:
            return
        self._current = (self._current + 1) % len(self._members)
        self._client = self._connect()
        self._calls.where = format_endpoint(*self._members[self._current])
        log.warning("%s; moving on to etcd member %s", exc, self._calls.where)
        task = asyncio.ensure_future(self._close(client))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, client: Any) -> None:
        """Close *client*: its calls and watch still running end with an error."""
        with contextlib.suppress(*self._calls.failures):
            async with asyncio.timeout(self._timeout):
                await client.close()

    def _key(self, group: str) -> bytes:
        return f"{self._prefix}/{group}".encode()

    async def _get(self, key: bytes) -> Any:
        return await self._call("get", self._client.get(key))

    async def _revoke(self, lease_id: int) -> bool:
        """Revoke a lease (its keys go with it); False if it had already ended."""
        try:
            await self._call("lease revoke", self._client.revoke_lease(lease_id))
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
        reply = await self._call("lease keepalive", self._client.refresh_lease(kv.lease))
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
            lease_id = (await self._call("lease grant", self._client.lease(ttl))).id
        key, tx = kv.key, self._client.transactions
        record = encode(info.participant_id, metadata, info.acquired_at)
        ok, _ = await self._call(
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
        lease = await self._call("lease grant", self._client.lease(math.ceil(lease_duration)))
        record = encode(participant_id, metadata, datetime.now(UTC))
        tx = self._client.transactions
        # If the put goes through but the reply is lost, the election finds the term with
        # get_leader and takes it up with renew; a lease granted for a txn that never ran
        # expires by itself.
        try:
            ok, responses = await self._call(
                "txn",
                self._client.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, record, lease=lease.id), tx.get(key)],
                    failure=[],
                ),
            )
        except asyncio.CancelledError:
            # The caller has left, and the txn may still be applied after its cancel.
            # Revoking the lease undoes it in either order: it deletes a key the txn put,
            # and a txn applied later fails on the missing lease.
            await self._discard(lease.id)
            raise
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
        ok, _ = await self._call(
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
        client = self._client
        stream = await self._call("watch", client.watch_prefix(prefix))
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
            error = self._calls.error("watch", failure)
            if isinstance(failure, _MEMBER_FAILED):
                self._move_on(client, error)
            raise error

    async def aclose(self) -> None:
        if self._calls.closed:
            return
        await self._notes.aclose()
        self._calls.closed = True
        await asyncio.gather(self._close(self._client), *self._closing)


def _members(
    host: str | None, port: int | None, endpoints: Sequence[str] | None
) -> list[tuple[str, int]]:
    """The members to use, in order: those of *endpoints*, or the one at *host*:*port*."""
    if endpoints is None:
        host = "localhost" if host is None else host
        port = DEFAULT_PORT if port is None else port
        if not host or not 0 < port < 65536:
            raise ConfigurationError(f"bad etcd address {host!r}:{port!r}")
        return [(host, port)]
    if host is not None or port is not None:
        raise ConfigurationError("give an etcd host and port, or endpoints, not both")
    if isinstance(endpoints, str) or not endpoints:
        raise ConfigurationError(f"endpoints is a list of 'host:port' strings, not {endpoints!r}")
    members: list[tuple[str, int]] = []
    for text in endpoints:
        try:
            member = parse_endpoint(text)
        except ValueError as exc:
            raise ConfigurationError(f"bad etcd endpoint {text!r}: {exc}") from None
        if member in members:
            raise ConfigurationError(f"etcd endpoint {text!r} is named twice")
        members.append(member)
    return members
