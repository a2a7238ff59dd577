"""`ConsulProvider`: one Consul session per term, holding the KV lock ``<prefix>/<group>``.

Guarantees: each term is a new session (TTL = the lease rounded up to whole seconds, no
health checks, lock-delay 0, behavior ``delete``) that takes the key with ``PUT
?acquire=<session>``, an atomic compare-then-act on the Consul servers: one session holds
a key at a time. With no health checks only the TTL (or an explicit destroy) ends a
session, and Consul never ends one before its TTL, so the store cannot free the key before
the holder's own deadline; it may wait up to twice the TTL, which only delays a successor
after a crash (a liveness cost, never a safety one). The fencing token is the key's
ModifyIndex right after the acquiring write: a Raft index, which rises with every write to
the cluster, so a new term's token exceeds every earlier one, across release, expiry and
restarts of servers that keep their data. Later writes of the same term (metadata) change
ModifyIndex, so they store the token in the value. Renew renews the session, then checks
that the key is still held by it with the same token. Release is ``PUT ?release=<session>``
(with ``cas``), then destroys the session. A live term is never joined: while any session
holds the key, ``try_acquire`` returns None and writes nothing (no session, no PUT), even
when the holder is this provider's own session for the same participant id. Reads use
``?consistent``; ``get_leader`` reports only a key held by a live session, with the
record as its term last wrote it. ``watch``: one loop of index-based blocking queries
(each at most ``watch_wait`` s) per group and provider, shared by all the group's watches
on this provider (`Notifications`), so several elections of one group cost one loop.

Failure modes: py-consul is blocking, so every call runs in a worker thread
(`DriverCalls.blocking`), and each watched group's blocking query holds one thread of this
provider's watch pool; each HTTP request is bounded by ``timeout`` (no retries), a call
makes at most six. A driver error or timeout raises `ProviderError` (the driver's error as
``__cause__``, the ACL token scrubbed). When the reply to the acquiring PUT is lost, the
provider keeps the term's session: the election finds the term with ``get_leader`` (by
the instance nonce in its metadata) and takes it up with ``renew``, which renews that
session; if the PUT never ran, the next ``try_acquire`` destroys the idle session. A
session that vanished (TTL missed, destroyed by an operator) makes ``renew`` return
False. A cancelled ``try_acquire`` waits (bounded) for its worker and gives back a term
it took. ``aclose`` leaves live sessions alone: destroying one would free a key whose
holder still believes it leads until its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs

import consul  # type: ignore[import-untyped]
from multilock.core.provider import (
    DriverCalls,
    LeaderInfo,
    LeaseBounds,
    Notifications,
    Provider,
)

from ._config import (
    LEASE_BOUNDS,
    Settings,
    check_ttl,
    failures,
    key_for,
    parse_address,
    session_ttl,
)
from ._record import encode, holder, leader_info
from ._watch import GroupFeeds

__all__ = ["ConsulProvider"]

_CONSISTENT = "consistent"
#: The most HTTP requests one call makes (each bounded by ``timeout``).
_REQUESTS_PER_CALL = 6
#: Threads for blocking queries: one per watched group while its query waits.
_WATCH_THREADS = 256


@attrs.define
class _Term:
    session: str
    ttl: int


class ConsulProvider(Provider):
    """Leases as Consul sessions holding KV locks under ``prefix`` (default ``multilock``).

    *address* is ``consul://[:TOKEN@]host[:port][?options]``, ``http(s)://host:port``, or
    a `consul.Consul` client you made (you close it). Durations are float seconds or a
    `timedelta`. Leases must be 10 s to 24 h: Consul's session TTL limits.
    """

    def __init__(
        self,
        address: str | Any = "consul://127.0.0.1:8500",
        /,
        *,
        token: str | None = None,
        dc: str | None = None,
        prefix: str | None = None,
        timeout: float | timedelta | None = None,
        watch_wait: float | timedelta | None = None,
        verify: bool | str | None = None,
        cert: Any = None,
    ) -> None:
        given = {"token": token, "dc": dc, "prefix": prefix, "timeout": timeout}
        given |= {"watch_wait": watch_wait, "verify": verify, "cert": cert}
        keywords = {k: v for k, v in given.items() if v is not None}
        if isinstance(address, str):
            self._settings = Settings(**{**parse_address(address), **keywords})
            self._client = self._settings.client()
            self._owns_client = True
        else:
            http = address.http
            self._settings = Settings(
                host=http.host,
                port=http.port,
                scheme=http.scheme,
                **{"token": address.token} | keywords,
            )
            self._client = address
            self._owns_client = False
        settings = self._settings
        self._calls = DriverCalls(
            "consul",
            settings.where,
            timeout=settings.timeout * _REQUESTS_PER_CALL,
            failures=failures(),
            secrets=[settings.token or ""],
            # Its own threads: the loop's default pool has few, and a Consul call can
            # block for seconds (several HTTP requests, each with its own timeout).
            executor=ThreadPoolExecutor(64, "multilock-consul"),
        )
        # py-consul gives a blocking query timeout + wait * 17/16 before it times out.
        self._wait = f"{max(1, round(settings.watch_wait))}s"
        self._query_limit = settings.timeout + settings.watch_wait * 17 / 16 + 1.0
        self._watch_pool = ThreadPoolExecutor(_WATCH_THREADS, "multilock-consul-watch")
        self._feeds = GroupFeeds(self._listen, f"consul watch on {settings.where}")
        self._terms: dict[tuple[str, str], _Term] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._guard = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ConsulProvider:
        """Build from a ``consul://`` URL; keyword arguments win over its query string."""
        return cls(url, **kwargs)

    @property
    def prefix(self) -> str:
        return self._settings.prefix

    def __repr__(self) -> str:
        return f"<ConsulProvider {self._settings.where} prefix={self._settings.prefix!r}>"

    @property
    def lease_bounds(self) -> LeaseBounds:
        return LEASE_BOUNDS

    # -- plumbing, run in worker threads ---------------------------------------------------

    def _lock(self, group: str, participant_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((group, participant_id), threading.Lock())

    def _read(self, key: str) -> dict[str, Any] | None:
        _, entry = self._client.kv.get(key, consistency=_CONSISTENT)
        return entry if isinstance(entry, dict) else None

    def _put(self, key: str, record: dict[str, Any], **condition: Any) -> bool:
        return bool(self._client.kv.put(key, encode(record), **condition))

    def _destroy(self, term: _Term) -> None:
        with contextlib.suppress(*failures()):
            self._client.session.destroy(term.session)

    def _renew_session(self, term: _Term) -> bool:
        try:
            self._client.session.renew(term.session)
        except consul.NotFound:
            return False
        return True

    # -- the operations, each run in a worker thread ---------------------------------------

    def _acquire(
        self,
        group: str,
        participant_id: str,
        ttl: int,
        metadata: Mapping[str, str],
        taken: list[LeaderInfo],
    ) -> LeaderInfo | None:
        """Start a term with a new session if the key is free; else None, writing nothing.

        The term taken is also put in *taken*, for a caller cancelled meanwhile.
        """
        key, name = key_for(self.prefix, group), (group, participant_id)
        with self._lock(group, participant_id):
            entry = self._read(key)
            if holder(entry) is not None:
                # A live term, even one of our own sessions (a lost reply): never joined.
                # The election takes ours up with renew, which still knows its session.
                return None
            term = self._terms.pop(name, None)
            if term is not None:
                self._destroy(term)  # it holds nothing: its PUT failed or its key was freed
            session = self._client.session.create(
                name=f"multilock {group} {participant_id}"[:200],
                checks=[],  # no serfHealth: only the TTL may end the session
                lock_delay=0,
                behavior="delete",
                ttl=ttl,
            )
            # Kept before the PUT: if its reply is lost, renew and release still find it.
            term = self._terms[name] = _Term(session, ttl)
            record = {"participant": participant_id, "metadata": metadata}
            record["acquired_at"] = datetime.now(UTC).isoformat()
            if self._put(key, record, acquire=session):
                entry = self._read(key)
                if holder(entry) == session:
                    taken.append(leader_info(entry))
                    return taken[0]
            self._forget(name, term)
            return None

    def _update(self, key: str, entry: Any, metadata: Mapping[str, str]) -> LeaderInfo | None:
        """Write new metadata for the holding session's term; None if the key moved."""
        info = leader_info(entry)
        if info.metadata == metadata:
            return info
        record = {"participant": info.participant_id, "metadata": metadata, "token": info.token}
        record["acquired_at"] = info.acquired_at.isoformat()
        cas = entry["ModifyIndex"]
        if not self._put(key, record, acquire=entry["Session"], cas=cas):
            return None
        return attrs.evolve(info, metadata=metadata)

    def _forget(self, name: tuple[str, str], term: _Term) -> None:
        if self._terms.get(name) is term:
            del self._terms[name]
        self._destroy(term)

    def _renew(
        self, group: str, participant_id: str, token: int, metadata: Mapping[str, str]
    ) -> bool:
        key, name = key_for(self.prefix, group), (group, participant_id)
        with self._lock(group, participant_id):
            term = self._terms.get(name)
            if term is None:
                return False
            if not self._renew_session(term):
                self._forget(name, term)
                return False
            entry = self._read(key)
            if holder(entry) != term.session:
                self._forget(name, term)
                return False
            if leader_info(entry).token != token:
                return False
            return self._update(key, entry, metadata) is not None

    def _release(self, group: str, participant_id: str, token: int) -> None:
        key, name = key_for(self.prefix, group), (group, participant_id)
        with self._lock(group, participant_id):
            term = self._terms.get(name)
            if term is None:
                return
            entry = self._read(key)
            if entry is not None and holder(entry) == term.session:
                if leader_info(entry).token != token:
                    return  # not this term: leave it alone
                value = entry["Value"] if isinstance(entry["Value"], bytes) else b""
                cas = entry["ModifyIndex"]
                self._client.kv.put(key, value, release=term.session, cas=cas)
            self._forget(name, term)

    def _index(self, key: str, index: int) -> int:
        """The key's index once it differs from *index* or the wait has passed (0: now)."""
        seen, _ = self._client.kv.get(key, index=index or None, wait=self._wait)
        return int(seen)

    def _leader(self, group: str) -> LeaderInfo | None:
        entry = self._read(key_for(self.prefix, group))
        return leader_info(entry) if holder(entry) is not None else None

    # -- the Provider interface ----------------------------------------------------------

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        ttl = session_ttl(lease_duration)
        taken: list[LeaderInfo] = []
        try:
            return await self._calls.blocking(
                "try_acquire", self._acquire, group, participant_id, ttl, metadata, taken
            )
        except asyncio.CancelledError:
            # The worker has finished (blocking waits for it): give back a term it took.
            if taken:
                with contextlib.suppress(Exception):
                    await self.release(group, participant_id, taken[0].token)
            raise

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        term = self._terms.get((group, participant_id))
        if term is not None:
            check_ttl(session_ttl(lease_duration), term.ttl)
        return await self._calls.blocking(
            "renew", self._renew, group, participant_id, token, metadata
        )

    async def release(self, group: str, participant_id: str, token: int) -> None:
        await self._calls.blocking("release", self._release, group, participant_id, token)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        return await self._calls.blocking("get_leader", self._leader, group)

    def watch(self, group: str) -> AsyncIterator[None]:
        """Yield once ready, then whenever the key may have changed (blocking queries)."""
        return self._feeds.watch(group)

    async def _listen(self, group: str, feed: Notifications) -> None:
        """The group's one loop of blocking queries, for all its watches on this provider."""
        key = key_for(self.prefix, group)
        index = await self._query(key, 0)
        feed.ready()
        while True:
            seen = await self._query(key, index)
            # A smaller index means the servers' state was reset: start over from it.
            if seen != index:
                index = seen
                feed.notify(group)

    async def _query(self, key: str, index: int) -> int:
        """One blocking query, in the watch pool; a cancel leaves it to end by itself."""

        async def query() -> int:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._watch_pool, self._index, key, index)

        return await self._calls.call("watch", query(), limit=self._query_limit)

    async def aclose(self) -> None:
        """Stop the watches and close the HTTP session; live sessions are left to expire."""
        if self._calls.closed:
            return
        await self._feeds.aclose()
        self._calls.closed = True
        self._watch_pool.shutdown(wait=False, cancel_futures=True)
        if self._calls.executor is not None:
            self._calls.executor.shutdown(wait=False)
        if self._owns_client:
            with contextlib.suppress(Exception):
                self._client.http.session.close()
