"""`GroupFeeds`: one notification loop per watched group, shared by the group's watches.

Consul's blocking queries watch one key each, so a provider runs one loop per group (not
one per watch): several elections of one group on one provider share it. Each group gets
its own `Notifications`, whose listener is that loop; it starts with the group's first
watch and stops with its last, when the group's entry goes too.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable

from multilock.core.provider import Notifications

__all__ = ["GroupFeeds"]


class GroupFeeds:
    """Watches of many groups, each group's fed by ``listen(group, notifications)``."""

    def __init__(self, listen: Callable[[str, Notifications], Awaitable[None]], name: str) -> None:
        self._listen = listen
        self._name = name
        self._feeds: dict[str, Notifications] = {}

    def __repr__(self) -> str:
        return f"<GroupFeeds {self._name}: {len(self._feeds)} groups>"

    @property
    def groups(self) -> frozenset[str]:
        """The groups with a loop (an open watch)."""
        return frozenset(self._feeds)

    def watch(self, group: str) -> AsyncIterator[None]:
        feed = self._feeds.get(group)
        if feed is None:
            listen = functools.partial(self._listen, group)
            feed = self._feeds[group] = Notifications(listen, name=f"{self._name} ({group})")
        return self._follow(group, feed)

    async def _follow(self, group: str, feed: Notifications) -> AsyncIterator[None]:
        watch = feed.watch(group)
        try:
            async for _ in watch:
                yield None
        finally:
            await watch.aclose()  # type: ignore[attr-defined]
            if not feed.groups and self._feeds.get(group) is feed:
                del self._feeds[group]  # the group's last watch: its loop ends
                await feed.aclose()

    async def aclose(self) -> None:
        """Stop every loop; open watches raise `ProviderError`."""
        feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            await feed.aclose()
