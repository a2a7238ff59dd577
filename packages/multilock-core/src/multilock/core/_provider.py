"""The provider interface: everything a store must do for an election, and nothing more.

A provider is thin. It performs single atomic compare-then-act operations on its store and
reports what happened; the core owns all timing, retries, backoff and jitter.

Rules every implementation keeps (``multilock.core.testing.check_provider`` proves them):

- ``try_acquire`` takes the lease only if it is free or expired, and gives the new term a
  fencing token strictly greater than every earlier token of the group, across release,
  expiry, crash and store restarts. It never lets anyone join a live term: while a lease
  is live it returns None, whoever holds it, even a caller with the same participant id
  (two processes may be configured with one id). A provider that queues its own
  candidates may answer its own repeated call with the same term, its metadata unchanged.
  The election finds a term whose acquire reply was lost with ``get_leader``: it stores an
  instance nonce in the metadata and recognises its own terms by it.
- ``renew`` and ``release`` compare both the participant id and the token.
- ``get_leader`` reports only a live lease, never a stale or expired record.
- A failed call raises `ProviderError` with the driver's exception as ``__cause__``.
  Invalid names, durations or metadata raise `ConfigurationError`: the base class checks
  them before a subclass's method runs.
- Blocking drivers run in worker threads; nothing blocks the event loop.
- Every coroutine is cancel-safe: a cancelled call leaves the store consistent.
"""

from __future__ import annotations

import abc
import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from ._names import to_seconds, validate_metadata, validate_name
from ._types import LeaderInfo

if TYPE_CHECKING:
    from ._options import ElectionOptions

__all__ = ["Provider"]

T = TypeVar("T")


def _validated(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Check and normalise the standard arguments before *method* runs.

    ``group`` and ``participant_id`` must be valid names, ``lease_duration`` becomes float
    seconds and ``metadata`` a checked plain dict; anything else raises
    `ConfigurationError` before the store is touched.
    """
    signature = inspect.signature(method)
    checks = {
        "group": lambda v: validate_name(v, "group"),
        "participant_id": lambda v: validate_name(v, "participant_id"),
        "lease_duration": lambda v: to_seconds(v, "lease_duration"),
        "metadata": validate_metadata,
    }
    used = {name: check for name, check in checks.items() if name in signature.parameters}

    @functools.wraps(method)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        bound = signature.bind(*args, **kwargs)
        for name, check in used.items():
            if name in bound.arguments:
                bound.arguments[name] = check(bound.arguments[name])
        return await method(*bound.args, **bound.kwargs)

    wrapper.__multilock_validated__ = True  # type: ignore[attr-defined]
    return wrapper


class Provider(abc.ABC):
    """Base class of every backend. Durations are float seconds.

    Subclasses get their arguments checked at the boundary: every ``try_acquire``,
    ``renew``, ``release`` and ``get_leader`` they define is wrapped so that invalid group
    names, participant ids, durations and metadata raise `ConfigurationError` before the
    store is touched, and the method receives float seconds and a plain metadata dict.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("try_acquire", "renew", "release", "get_leader"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__multilock_validated__", False):
                setattr(cls, name, _validated(method))

    @abc.abstractmethod
    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        """Take the lease if it is free or expired; return the new term, or None if held.

        None also when the caller's own participant id holds the live lease: a term is
        never shared (see the module docstring).
        """

    @abc.abstractmethod
    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        """Extend the lease held by (participant_id, token); False if it is no longer held."""

    @abc.abstractmethod
    async def release(self, group: str, participant_id: str, token: int) -> None:
        """Give the lease up now; a no-op when (participant_id, token) does not hold it."""

    @abc.abstractmethod
    async def get_leader(self, group: str) -> LeaderInfo | None:
        """Return the holder of the live lease, or None."""

    def watch(self, group: str) -> AsyncIterator[None] | None:
        """Return an iterator that yields whenever the group's leader may have changed.

        It yields on release, on acquisition, and when the observed lease is due to expire,
        so that followers do not poll. Return None (the default) when the store cannot
        notify: the core then polls at ``retry_interval``. The iterator may yield spuriously;
        it raises `ProviderError` if it breaks, and the core falls back to polling and
        calls ``watch`` again later.
        """
        return None

    @property
    def notify_delay(self) -> float:
        """Seconds a follower may take to notice a release: 0 when the store notifies.

        A polling provider returns its poll interval. After stepping down (resign, stop of
        a term), the core holds off for ``retry_interval + notify_delay`` so that a waiting
        candidate notices the release and takes over before this participant campaigns again.
        """
        return 0.0

    def check_options(self, options: ElectionOptions) -> None:
        """Raise `ConfigurationError` for options this store cannot honour (default: none)."""
        return

    async def aclose(self) -> None:
        """Release connections and background tasks. Idempotent."""
        return

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
