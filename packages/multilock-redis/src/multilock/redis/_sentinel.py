"""Behind Sentinel: send every write to the master the Sentinels name at that moment.

redis-py asks the Sentinels for the master only when it opens a connection, and when the
answer changes it closes only the idle connections: a connection in use at that moment
goes back to the pool still connected to the old master, and every pooled connection
stays there for as long as the old master accepts writes. After a failover in which the
old master was cut off from the Sentinels but not from the clients (the classic split
brain), or before the Sentinels reconfigure it as a replica (several seconds after a
failover), a client would then go on writing to a master nobody else uses.

`FollowMasterPool` closes every connection, in use or not, when the master changes, and
`MasterCheck` asks the Sentinels before each acquire and renew (concurrent calls share one
question in flight). So a write that starts or extends a term goes to the master the
Sentinels name, and a client that reaches no Sentinel writes nothing: it cannot tell
which node is the master, and its leader steps down at its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.asyncio.sentinel import SentinelConnectionPool

__all__ = ["FollowMasterPool", "MasterCheck"]

log = logging.getLogger(__name__)


class FollowMasterPool(SentinelConnectionPool):
    """A Sentinel pool that drops every connection to an old master once the master changes."""

    async def get_master_address(self) -> Any:
        previous = self.master_address
        address = await super().get_master_address()  # type: ignore[no-untyped-call]
        if previous is not None and address != previous:
            log.info("the Sentinels name a new master; closing the connections to the old one")
            # Those in use too: their command fails (a broken connection, retried once on
            # a new connection to the new master) instead of landing on the old master.
            await self.disconnect(inuse_connections=True)
        return address


class MasterCheck:
    """Ask the Sentinels which node is the master; concurrent callers share one question."""

    def __init__(self, pool: FollowMasterPool) -> None:
        self._pool = pool
        self._asking: asyncio.Future[Any] | None = None

    async def __call__(self) -> None:
        asking = self._asking
        if asking is None or asking.done():
            asking = self._asking = asyncio.ensure_future(self._pool.get_master_address())
            asking.add_done_callback(_retrieve)
        await asyncio.shield(asking)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark the outcome as seen, even when every caller waiting for it was cancelled."""
    if not future.cancelled():
        future.exception()
