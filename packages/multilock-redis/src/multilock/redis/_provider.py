"""`RedisProvider`: leases on one Redis server (or the master a Sentinel names).

Guarantees. Every write is one Lua script, atomic on the server: acquire takes the lease
only when its key is absent, and while a lease is live it returns None and writes
nothing, whoever holds it, even a caller with the same participant id: a live term is
never joined, so two processes configured with one id cannot share it. A term whose
acquire reply was lost is found with ``get_leader``, which reports the metadata as
written at acquire, and taken up with ``renew``; renew and release compare participant
id and token. Expiry is judged by Redis alone (PX on the lease key), so ``get_leader``
sees only live leases. Tokens come from a per-group counter that is never deleted and
never lower than the server's clock in microseconds, so they keep rising across release,
expiry, and restarts of a Redis that keeps no data, provided the server clock does not
go back by more than the time between the last token and the restart (and, behind
Sentinel, that the new master's clock is not behind the old one's by more than the
failover took). Followers wake on pub/sub (one pattern subscription per provider for
all groups) and exactly at lease expiry, never on a renewal.

Failure modes. A Redis without persistence that restarts forgets the lease: a second
leader can be elected while the first one still believes it leads, until its next renew
fails (at most ``renew_interval`` later, and never past its deadline); in that window
only the fencing token protects the shared resource. The same holds after a failover
to a replica that had not received the last writes (replication is asynchronous),
unless ``wait_replicas`` is set: then every acquire and renew is followed by ``WAIT``
on the same connection, an acquire that fewer replicas acknowledged is not won (it is
released, and `ProviderError` says why) and such a renew does not count (`ProviderError`:
the term keeps its earlier deadline). Behind Sentinel, every acquire and renew first
asks the sentinels which node is the master and goes there (see `_sentinel`), so a
client does not go on writing to an old master. Every call is bounded by
``socket_connect_timeout + socket_timeout`` (twice that for a call sent in a batch: the
batch on its way, then its own; see `_node`); the driver retries only a broken
connection, once and at once; failures raise `ProviderError`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from redis.asyncio import Redis

from multilock.core.provider import ConfigurationError, LeaderInfo, Notifications, ProviderError

from ._base import RedisBase
from ._config import Settings, split_options
from ._node import Node, encode_metadata, lease_ms

__all__ = ["RedisProvider", "lease_ms"]

log = logging.getLogger(__name__)

_SCHEMES = ("redis", "rediss", "redis+sentinel")


class RedisProvider(RedisBase):
    """Leader election on one Redis server.

    *client* is a URL (``redis://``, ``rediss://``, ``redis+sentinel://``; the provider
    builds a client with short timeouts, no retries and a bounded pool, and closes it in
    `aclose`) or an existing ``redis.asyncio.Redis``, which the provider uses as it is and
    never closes. A URL may carry ``key_prefix``, ``socket_timeout``,
    ``socket_connect_timeout``, ``wait_replicas`` and ``wait_timeout`` in its query string
    (keyword arguments win), and the options redis-py takes (``client_name``,
    ``max_connections``...); any other name is refused with the list of the known ones.
    ``wait_replicas`` (default 0: none) is how many replicas must acknowledge every
    acquire and renew, within ``wait_timeout`` (default: the smaller of lease/5 and
    half the ``socket_timeout``); set it to the number of replicas a failover may promote.
    ``sentinel_kwargs`` (e.g. the sentinels' own password) applies to ``redis+sentinel://``
    only. Use a provider from one event loop.
    """

    def __init__(
        self,
        client: str | Redis,
        *,
        key_prefix: str | None = None,
        socket_timeout: float | None = None,
        socket_connect_timeout: float | None = None,
        wait_replicas: int | None = None,
        wait_timeout: float | timedelta | None = None,
        sentinel_kwargs: dict[str, Any] | None = None,
    ) -> None:
        query: dict[str, str] = {}
        if isinstance(client, str):
            client, query = split_options(client, _SCHEMES)
        elif not isinstance(client, Redis):
            raise ConfigurationError(
                f"client must be a URL or a redis.asyncio.Redis, not {type(client).__name__}"
            )
        self._settings = Settings.merge(
            query,
            key_prefix=key_prefix,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            wait_replicas=wait_replicas,
            wait_timeout=wait_timeout,
        )
        if self._settings.node_timeout is not None:
            raise ConfigurationError("node_timeout is an option of redlock:// URLs only")
        node = self._node = Node.build(client, self._settings, sentinel_kwargs)
        self._notifications = Notifications(
            lambda n: node.listen(n.ready, lambda group, _kind, _attempt: n.notify(group)),
            name=f"redis pub/sub on {node.label}",
            expires_in=node.expires_in,
        )

    def __repr__(self) -> str:
        wait = self._settings.wait_replicas
        waiting = f" wait_replicas={wait}" if wait else ""
        return f"<RedisProvider {self._node.label} key_prefix={self.key_prefix!r}{waiting}>"

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        granted = await self._node.acquire(
            group,
            participant_id,
            lease_ms(lease_duration),
            encode_metadata(metadata),
            clock_floor=True,
        )
        if granted is None:
            return None
        wanted = self._settings.wait_replicas
        if granted.replicas is not None and granted.replicas < wanted:
            # Not won: a failover now could hand the master to a replica without this
            # lease. Released at once, so nobody waits for it to expire; if the release
            # fails, the lease is found by `get_leader` and taken up with a renew, which
            # must be acknowledged in turn.
            try:
                await self._node.release(group, participant_id, granted.token)
            except ProviderError as exc:
                log.debug("releasing the unacknowledged lease of %s failed: %s", group, exc)
            raise ProviderError(
                f"redis acquire of {group!r} on {self._node.label}: only {granted.replicas} of "
                f"the {wanted} replicas asked for acknowledged it within "
                f"{self._settings.wait_ms(lease_ms(lease_duration))} ms (wait_replicas): "
                "not won, released"
            )
        return LeaderInfo(
            participant_id=participant_id,
            token=granted.token,
            metadata=metadata,
            acquired_at=granted.acquired_at,
        )

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        meta = encode_metadata(metadata)
        return await self._node.renew(group, participant_id, token, lease_ms(lease_duration), meta)

    async def release(self, group: str, participant_id: str, token: int) -> None:
        await self._node.release(group, participant_id, token)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        return await self._node.leader(group)

    async def aclose(self) -> None:
        """Stop watching and close the client this provider built (a caller's stays open)."""
        await self._close_watches()
        await self._node.aclose()
