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
- ``contenders`` is optional: a store that records every candidate (ZooKeeper) lists
  them, the leader first; the default raises `UnsupportedOperation`.
- A failed call raises `ProviderError` with the driver's exception as ``__cause__``.
  Invalid names, durations, tokens or metadata raise `ConfigurationError`: the base class
  checks them before a subclass's method runs, so the subclass never checks them again.
- A lease duration the store cannot hold is declared in `Provider.lease_bounds`.
- Blocking drivers run in worker threads; nothing blocks the event loop.
- Every coroutine is cancel-safe: a cancelled call leaves the store consistent.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import attrs

from ._errors import ConfigurationError, UnsupportedOperation
from ._names import _NAME, to_seconds, validate_metadata, validate_name
from ._types import LeaderInfo

__all__ = ["LeaseBounds", "Provider"]


@attrs.frozen(kw_only=True)
class LeaseBounds:
    """The lease durations a store can honour, declared by its provider.

    `LeaderElection` checks its ``lease_duration`` against them when it is built, so a
    lease the store cannot hold is refused before anything runs. *reason* says why, in
    the store's words ("Azure Blob leases last 15 to 60 s").
    """

    minimum: float = 0.0
    maximum: float = math.inf
    reason: str = ""

    def check(self, lease_duration: float, store: str = "this store") -> None:
        """Raise `ConfigurationError` if *lease_duration* (seconds) is out of bounds."""
        if self.minimum <= lease_duration <= self.maximum:
            return
        if self.maximum == math.inf:
            allowed = f"at least {self.minimum:g} s"
        elif self.minimum <= 0:
            allowed = f"at most {self.maximum:g} s"
        else:
            allowed = f"{self.minimum:g} to {self.maximum:g} s"
        because = f" ({self.reason})" if self.reason else ""
        raise ConfigurationError(
            f"lease_duration={lease_duration:g} s is out of range for {store}: "
            f"use {allowed}{because}"
        )


def _name(value: Any, field: str) -> str:
    # The common case (a valid str) costs one regex match; validate_name explains the rest.
    if isinstance(value, str) and _NAME.fullmatch(value):
        return value
    return validate_name(value, field)


def _checked(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap interface method *name* so it receives checked, normalised arguments."""
    if name == "try_acquire":

        async def try_acquire(
            self: Provider, group: str, participant_id: str, lease_duration: Any, metadata: Any
        ) -> Any:
            return await method(
                self,
                _name(group, "group"),
                _name(participant_id, "participant_id"),
                to_seconds(lease_duration, "lease_duration"),
                validate_metadata(metadata),
            )

        wrapper: Callable[..., Any] = try_acquire
    elif name == "renew":

        async def renew(
            self: Provider,
            group: str,
            participant_id: str,
            token: int,
            lease_duration: Any,
            metadata: Any,
        ) -> Any:
            return await method(
                self,
                _name(group, "group"),
                _name(participant_id, "participant_id"),
                _token(token),
                to_seconds(lease_duration, "lease_duration"),
                validate_metadata(metadata),
            )

        wrapper = renew
    elif name == "release":

        async def release(self: Provider, group: str, participant_id: str, token: int) -> None:
            await method(
                self, _name(group, "group"), _name(participant_id, "participant_id"), _token(token)
            )

        wrapper = release
    elif name in ("get_leader", "contenders"):

        async def by_group(self: Provider, group: str) -> Any:
            return await method(self, _name(group, "group"))

        wrapper = by_group
    else:

        def watch(self: Provider, group: str) -> AsyncIterator[None] | None:
            return method(self, _name(group, "group"))  # type: ignore[no-any-return]

        wrapper = watch
    functools.update_wrapper(wrapper, method)
    wrapper.__multilock_checked__ = True  # type: ignore[attr-defined]
    return wrapper


def _token(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"token must be a non-negative int, not {value!r}")
    return value


class Provider(abc.ABC):
    """Base class of every backend. Durations are float seconds.

    Subclasses get their arguments checked at the boundary: every ``try_acquire``,
    ``renew``, ``release``, ``get_leader``, ``contenders`` and ``watch`` they define is
    wrapped so that
    invalid group names, participant ids, tokens, durations and metadata raise
    `ConfigurationError` before the store is touched, and the method receives float
    seconds and a plain metadata dict it may keep.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("try_acquire", "renew", "release", "get_leader", "contenders", "watch"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "__multilock_checked__", False):
                setattr(cls, name, _checked(name, method))

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

    async def contenders(self, group: str) -> Sequence[str]:
        """Return the participant ids of the group's live candidates, the leader first, then
        in the order they would lead; empty when nobody campaigns.

        Optional: only a store that records every candidate, not just the leader, can
        answer, and a provider declares it can by overriding this method. The default raises
        `UnsupportedOperation` naming the provider and why.
        """
        _name(group, "group")  # an invalid name is a ConfigurationError here too
        raise UnsupportedOperation(
            f"{type(self).__name__} cannot list the contenders of group {group!r}: its store "
            "records only the leader, not the candidates waiting behind it (contenders are "
            "listed on ZooKeeper, where every candidate holds a node)"
        )

    def watch(self, group: str) -> AsyncIterator[None] | None:
        """Return an iterator that yields whenever the group's leader may have changed.

        It yields once as soon as it is watching (no later change can be missed), then on
        release, on acquisition, and when the observed lease is due to expire without a
        renewal, so that followers do not poll. The kit's `Notifications` and `poll_watch`
        behave so. Return None (the default) when the store cannot
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

    @property
    def lease_bounds(self) -> LeaseBounds:
        """The lease durations this store can honour (default: any)."""
        return LeaseBounds()

    @property
    def queues_candidates(self) -> bool:
        """True when ``try_acquire`` on a held group queues the caller behind the leader
        (ZooKeeper's candidate nodes), so that it leads without a round trip once the
        leader goes. A round that has just read another leader then still tries; on other
        stores such a try changes nothing, and is not sent. Default False."""
        return False

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
