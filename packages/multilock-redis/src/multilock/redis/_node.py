"""`Node`: one Redis server as both providers use it.

Every call is bounded by a timeout (cancelling a redis-py call drops its connection, so
nothing half-read is reused) and every failure becomes `ProviderError` with the driver's
exception as ``__cause__`` and no credential in its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import attrs
from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from multilock.core import LeaderInfo, ProviderError, redact_url
from multilock.core._url import scrub

from . import _scripts
from ._config import Settings, client_from_url, sentinel_client

__all__ = ["Granted", "Node", "close_pubsub", "encode_metadata"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _time(microseconds: Any) -> datetime:
    return _EPOCH + timedelta(microseconds=int(_text(microseconds)))


def encode_metadata(metadata: dict[str, str]) -> str:
    return json.dumps(metadata, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


@attrs.frozen
class Granted:
    """What one node's acquire script gave: the token of the new lease and when it began."""

    token: int
    acquired_at: datetime


class Node:
    """One Redis server: a client (closed only if this node built it), scripts and keys."""

    def __init__(
        self,
        client: Redis,
        *,
        owned: bool,
        label: str,
        settings: Settings,
        scrubber: Callable[[str], str],
        closers: Sequence[Callable[[], Awaitable[Any]]] = (),
        timeout: float | None = None,
    ) -> None:
        self.client = client
        self.label = label
        self.prefix = settings.key_prefix
        #: The bound of one call when the caller gives none (default: connect + command).
        self.timeout = timeout or settings.connect_timeout + settings.socket_timeout
        self._owned = owned
        self._scrub = scrubber
        self._closers = [client.aclose, *closers] if owned else []
        self._closed = False
        self._acquire = client.register_script(_scripts.ACQUIRE)
        self._renew = client.register_script(_scripts.RENEW)
        self._release = client.register_script(_scripts.RELEASE)
        self._commit = client.register_script(_scripts.COMMIT)

    @classmethod
    def build(
        cls,
        target: str | Redis,
        settings: Settings,
        sentinel_kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Node:
        """A node for a URL (this node owns the client it builds) or a caller's client."""
        if isinstance(target, Redis):
            kwargs = target.connection_pool.connection_kwargs
            password = kwargs.get("password") or ""
            secrets = [s for s in {password, unquote(password)} if s]

            def hide(text: str) -> str:
                for secret in secrets:
                    text = text.replace(secret, "***")
                return text

            where = (
                f"{kwargs.get('host', 'redis')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
            )
            return cls(
                target, owned=False, label=where, settings=settings, scrubber=hide, timeout=timeout
            )
        closers: list[Callable[[], Awaitable[Any]]] = []
        if urlsplit(target).scheme == "redis+sentinel":
            client, close_sentinels = sentinel_client(target, settings, sentinel_kwargs)
            closers.append(close_sentinels)
        else:
            client = client_from_url(target, settings)
        return cls(
            client,
            owned=True,
            label=redact_url(target),
            settings=settings,
            scrubber=lambda text: scrub(text, target),
            closers=closers,
            timeout=timeout,
        )

    async def call(self, op: str, make: Callable[[], Awaitable[T]], within: float | None) -> T:
        """Run one driver call within *within* seconds; wrap its failures."""
        if self._closed:
            raise ProviderError(f"redis {op} on {self.label}: the provider is closed")
        limit = self.timeout if within is None else within
        try:
            async with asyncio.timeout(limit):
                return await make()
        except TimeoutError as exc:
            raise ProviderError(
                f"redis {op} on {self.label} timed out after {limit:.3g} s"
            ) from exc
        except (RedisError, OSError) as exc:
            message = self._scrub(f"{type(exc).__name__}: {exc}")
            raise ProviderError(f"redis {op} on {self.label} failed: {message}") from exc

    def _keys(self, group: str) -> tuple[str, str, str]:
        p = self.prefix
        return (
            _scripts.lease_key(p, group),
            _scripts.token_key(p, group),
            _scripts.channel_name(p, group),
        )

    async def acquire(
        self,
        group: str,
        participant_id: str,
        lease_ms: int,
        metadata: str,
        *,
        candidate: int = 0,
        clock_floor: bool,
        attempt: str = "",
        within: float | None = None,
    ) -> Granted | None:
        """Create a lease if none is live here; None while one is (whoever holds it)."""
        lease, counter, channel = self._keys(group)
        args: list[str | int] = [
            participant_id,
            lease_ms,
            metadata,
            candidate,
            "1" if clock_floor else "0",
            channel,
            attempt,
        ]
        reply = await self.call(
            "acquire", lambda: self._acquire(keys=[lease, counter], args=args), within
        )
        if not reply:
            return None
        token, acquired_at = reply
        return Granted(int(_text(token)), _time(acquired_at))

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_ms: int,
        metadata: str,
        within: float | None = None,
    ) -> bool:
        lease, _, _ = self._keys(group)
        args: list[str | int] = [participant_id, token, lease_ms, metadata]
        reply = await self.call("renew", lambda: self._renew(keys=[lease], args=args), within)
        return int(reply) == 1

    async def release(
        self,
        group: str,
        participant_id: str,
        token: int,
        *,
        attempt: str = "",
        within: float | None = None,
    ) -> bool:
        """Delete the participant's lease with *token*, or with *attempt* (any token) if given."""
        lease, _, channel = self._keys(group)
        args: list[str | int] = [participant_id, token, channel, attempt]
        reply = await self.call("release", lambda: self._release(keys=[lease], args=args), within)
        return int(reply) == 1

    async def commit(
        self, group: str, participant_id: str, given: int, token: int, within: float | None
    ) -> bool:
        lease, counter, _ = self._keys(group)
        args: list[str | int] = [participant_id, given, token]
        reply = await self.call(
            "commit", lambda: self._commit(keys=[lease, counter], args=args), within
        )
        return int(reply) == 1

    async def leader(self, group: str, within: float | None = None) -> LeaderInfo | None:
        """The holder of the group's lease here; a key with PX is live by definition."""
        lease, _, _ = self._keys(group)
        fields = ("participant", "token", "metadata", "acquired_at")
        reply = await self.call(
            "get_leader", lambda: self.client.hmget(lease, list(fields)), within
        )
        if reply[0] is None:
            return None
        try:
            participant, token, metadata, acquired_at = (_text(v) for v in reply)
            meta = json.loads(metadata)
            if not isinstance(meta, dict):
                raise ValueError("metadata is not an object")
            return LeaderInfo(
                participant_id=participant,
                token=int(token),
                metadata={str(k): str(v) for k, v in meta.items()},
                acquired_at=_time(acquired_at),
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise ProviderError(f"malformed lease record {lease!r} on {self.label}") from exc

    async def pttl(self, group: str, within: float | None = None) -> int:
        """Milliseconds the group's lease has left here (0: under one), -2 if there is none."""
        lease, _, _ = self._keys(group)
        reply = await self.call("pttl", lambda: self.client.pttl(lease), within)
        return int(reply)

    async def subscribe(self, group: str) -> PubSub:
        """A subscription to the group's channel on a connection of its own, confirmed."""
        _, _, channel = self._keys(group)
        pubsub = self.client.pubsub()

        async def confirmed() -> None:
            await pubsub.subscribe(channel)
            while True:
                message = await pubsub.get_message(timeout=self.timeout)
                if message is not None and message.get("type") == "subscribe":
                    return

        try:
            await self.call("subscribe", confirmed, None)
        except BaseException:
            await close_pubsub(pubsub)
            raise
        return pubsub

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for close in self._closers:
            try:
                await close()
            except Exception as exc:  # closing is best effort: the server may be gone
                log.debug("closing %s: %r", self.label, exc)


async def close_pubsub(pubsub: PubSub) -> None:
    with contextlib.suppress(Exception):
        await pubsub.aclose()  # type: ignore[no-untyped-call]
