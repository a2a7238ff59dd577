"""`InMemoryProvider`: a store in this process's memory, for tests and single-process apps.

Guarantees: linearizable (one `threading.Lock` around every operation), so elections on
different event loops and threads, such as those of the sync facade, can share one
provider. Expiry is judged on one injectable monotonic clock. Followers are notified
in-process on every change and when the current lease is due to expire.
Failure modes: none of its own; everything is lost when the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime
from urllib.parse import urlsplit

import attrs

from ._errors import ConfigurationError
from ._names import validate_name
from ._provider import Provider
from ._types import LeaderInfo

__all__ = ["InMemoryProvider"]


@attrs.define
class _Lease:
    info: LeaderInfo
    expires_at: float


@attrs.define(eq=False)
class _Store:
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    leases: dict[str, _Lease] = attrs.field(factory=dict)
    #: The last token handed out per group; never deleted, so tokens keep rising.
    tokens: dict[str, int] = attrs.field(factory=dict)
    watchers: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = attrs.field(
        factory=dict
    )


_named_stores: dict[str, _Store] = {}
_named_lock = threading.Lock()


class InMemoryProvider(Provider):
    """Keep leases in a dict. ``clock`` is the monotonic clock that judges expiry.

    Pass ``store_name`` to share one store between providers of this process (what the
    URL ``memory://NAME`` does); without it each provider has a private store.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        store_name: str | None = None,
    ) -> None:
        self._clock = clock
        self._store_name = store_name
        if store_name is None:
            self._store = _Store()
        else:
            validate_name(store_name, "store name")
            with _named_lock:
                self._store = _named_stores.setdefault(store_name, _Store())

    @classmethod
    def from_url(cls, url: str) -> InMemoryProvider:
        """``memory://`` gives a private store; ``memory://NAME`` a store shared by name."""
        parts = urlsplit(url)
        if parts.scheme != "memory" or parts.path not in ("", "/") or parts.query:
            raise ConfigurationError("an in-memory URL is memory:// or memory://NAME")
        return cls(store_name=parts.netloc or None)

    def __repr__(self) -> str:
        name = f" store_name={self._store_name!r}" if self._store_name else ""
        return f"<InMemoryProvider{name}>"

    def _live(self, group: str, now: float) -> _Lease | None:
        lease = self._store.leases.get(group)
        if lease is None or lease.expires_at <= now:
            return None
        return lease

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        with self._store.lock:
            now = self._clock()
            lease = self._live(group, now)
            if lease is not None:
                return None  # held, by someone else or by another election with our id
            token = self._store.tokens.get(group, 0) + 1
            self._store.tokens[group] = token
            info = LeaderInfo(
                participant_id=participant_id,
                token=token,
                metadata=metadata,
                acquired_at=datetime.now(UTC),
            )
            self._store.leases[group] = _Lease(info, now + lease_duration)
        self._notify(group)
        return info

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        with self._store.lock:
            now = self._clock()
            lease = self._live(group, now)
            if lease is None or (lease.info.participant_id, lease.info.token) != (
                participant_id,
                token,
            ):
                return False
            lease.expires_at = now + lease_duration
            if metadata != lease.info.metadata:
                lease.info = attrs.evolve(lease.info, metadata=metadata)
        return True

    async def release(self, group: str, participant_id: str, token: int) -> None:
        with self._store.lock:
            lease = self._live(group, self._clock())
            if lease is None or (lease.info.participant_id, lease.info.token) != (
                participant_id,
                token,
            ):
                return
            del self._store.leases[group]
        self._notify(group)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        with self._store.lock:
            lease = self._live(group, self._clock())
            return None if lease is None else lease.info

    async def watch(self, group: str) -> AsyncIterator[None]:
        event = asyncio.Event()
        watcher = (asyncio.get_running_loop(), event)
        with self._store.lock:
            self._store.watchers.setdefault(group, set()).add(watcher)
        try:
            yield None  # watching: no later change can be missed
            while True:
                with self._store.lock:
                    now = self._clock()
                    lease = self._live(group, now)
                    expires_in = None if lease is None else lease.expires_at - now
                try:
                    async with asyncio.timeout(expires_in):
                        await event.wait()
                except TimeoutError:
                    with self._store.lock:
                        if self._live(group, self._clock()) is lease is not None:
                            continue  # renewed meanwhile: nothing for the follower to see
                event.clear()
                yield None
        finally:
            with self._store.lock:
                watchers = self._store.watchers.get(group)
                if watchers is not None:
                    watchers.discard(watcher)
                    if not watchers:
                        del self._store.watchers[group]

    def _notify(self, group: str) -> None:
        with self._store.lock:
            watchers = list(self._store.watchers.get(group, ()))
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, event in watchers:
            if loop is running:
                event.set()  # this loop's own watchers: no wake-up through its self-pipe
                continue
            # A closed loop raises RuntimeError: its watcher is being torn down anyway.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(event.set)
