"""`watch_leader`: observe a group without campaigning."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from ._calls import call_until, cancel_and_wait, sleep_until
from ._election import _UNKNOWN, _key
from ._options import public_info as _public
from ._provider import Provider
from ._types import LeaderInfo

__all__ = ["watch_leader"]

log = logging.getLogger("multilock.core._election")


async def watch_leader(
    provider: Provider, group: str, *, poll_interval: float = 2.0
) -> AsyncIterator[LeaderInfo | None]:
    """Observe *group* without campaigning: yield the leader now and on every change.

    Uses the provider's notifications when it has them, and polls every *poll_interval*
    seconds otherwise (and as a safety net). Store errors are logged and retried.
    """
    last: object = _UNKNOWN
    wake = asyncio.Event()

    async def follow() -> None:
        while True:
            stream = provider.watch(group)
            if stream is None:
                return
            try:
                async for _ in stream:
                    wake.set()
            except Exception as exc:
                log.warning("watch of %s broke: %r", group, exc)
            await asyncio.sleep(poll_interval)

    follower = asyncio.ensure_future(follow())
    try:
        while True:
            wake.clear()
            try:
                deadline = asyncio.get_running_loop().time() + max(poll_interval, 1.0) * 5
                info = await call_until(provider.get_leader(group), deadline)
            except Exception as exc:
                log.warning("get_leader(%r) failed: %r", group, exc)
            else:
                if _key(info) != last:
                    last = _key(info)
                    yield _public(info)
            await sleep_until(asyncio.get_running_loop().time() + poll_interval, wake)
    finally:
        await cancel_and_wait(follower)
