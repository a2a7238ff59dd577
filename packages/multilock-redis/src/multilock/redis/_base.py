"""What `RedisProvider` and `RedlockProvider` share: building from a URL, the key prefix and
the watch, which fans one listener's notifications out to every watch of every group."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Self

from multilock.core.provider import ConfigurationError, Notifications, Provider

from ._config import Settings

__all__ = ["RedisBase"]


class RedisBase(Provider):
    """The part of both providers that does not depend on the number of servers."""

    _settings: Settings
    _notifications: Notifications

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Self:
        """Build a provider from one of its URLs (see the class docstring)."""
        if not isinstance(url, str):
            raise ConfigurationError(f"url must be a str, not {type(url).__name__}")
        return cls(url, **kwargs)  # type: ignore[call-arg]

    @property
    def key_prefix(self) -> str:
        """The prefix of every key and channel this provider uses."""
        return self._settings.key_prefix

    def watch(self, group: str) -> AsyncIterator[None]:
        """Yield on every new term and release of *group*, and when its lease is due to end.

        All watches of a provider share one pub/sub connection per server (a pattern
        subscription to every group's channel), opened by the first watch and closed with
        the last. A renewal does not wake a watch.
        """
        return self._notifications.watch(group)

    async def _close_watches(self) -> None:
        await self._notifications.aclose()
