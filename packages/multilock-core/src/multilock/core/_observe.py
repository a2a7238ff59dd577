"""What an election tells the rest of the process: observers, health and its log records.

- `ElectionObserver` and `add_observer`: the hook metrics packages (``multilock-prometheus``,
  ``multilock-opentelemetry``) use. Observers are process-wide, like a metrics registry, so
  every election reports to them without being wired one by one.
- `Health`: what `LeaderElection.health()` answers, for a web framework's health endpoint.
- `ElectionLog`: every record carries the group, participant and token as structured fields
  (``record.group``, ``record.participant``, ``record.token``), and warnings about a failing
  store are rate-limited while it stays down, with a summary when it answers again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from ._types import ElectionState

if TYPE_CHECKING:
    from ._election import LeaderElection
    from ._types import Leadership

__all__ = ["ElectionObserver", "Health", "add_observer", "remove_observer"]

log = logging.getLogger("multilock.core")


class ElectionObserver:
    """Receives every election's decisions as they happen; override what you need.

    Methods are called on the election's event loop and must return quickly without
    blocking. An observer that raises is logged at ERROR and otherwise ignored: metrics
    never break an election.
    """

    def started(self, election: LeaderElection) -> None:
        """The election began campaigning."""

    def stopped(self, election: LeaderElection) -> None:
        """The election stopped (after its lease was released, if it held one)."""

    def acquired(
        self, election: LeaderElection, leadership: Leadership, failover: float | None
    ) -> None:
        """A term began. *failover* is the seconds from the moment this participant saw
        the group without a live leader (a release or expiry it was told of, or a read
        finding nobody) to winning it; None when it did not see the group vacant first
        (for example the first term after start)."""

    def lost(self, election: LeaderElection, token: int, reason: str) -> None:
        """The term with *token* ended (resigned, stopped, refused or its deadline passed)."""

    def renewed(self, election: LeaderElection, latency: float) -> None:
        """A renew succeeded after *latency* seconds."""

    def renew_failed(self, election: LeaderElection, error: BaseException | None) -> None:
        """A renew raised *error*, or timed out or was refused (*error* None)."""

    def campaign_failed(self, election: LeaderElection, error: BaseException) -> None:
        """A campaign round could not reach the store."""


_observers: tuple[ElectionObserver, ...] = ()


def add_observer(observer: ElectionObserver) -> None:
    """Report every election of this process to *observer* (added once, however often)."""
    global _observers
    if not isinstance(observer, ElectionObserver):
        raise TypeError(
            f"observer must be an ElectionObserver (subclass it), not {type(observer).__name__}"
        )
    if observer not in _observers:
        _observers = (*_observers, observer)


def remove_observer(observer: ElectionObserver) -> None:
    """Stop reporting to *observer*; a no-op when it was not added."""
    global _observers
    _observers = tuple(o for o in _observers if o is not observer)


def notify(method: Callable[[ElectionObserver], Callable[..., None]], *args: Any) -> None:
    """Call ``method(observer)(*args)`` on every observer, isolating their errors."""
    for observer in _observers:
        try:
            method(observer)(*args)
        except Exception:
            log.exception("multilock observer %r raised", observer)


@attrs.frozen(kw_only=True)
class Health:
    """An election's health, from `LeaderElection.health()` (no I/O).

    Healthy while campaigning or following (a store outage alone does not make a replica
    unhealthy: restarting it would not help), and while leading with renewals on time.
    Unhealthy when not running, or when leading and no renew has succeeded for two renew
    intervals (the term is at risk: its deadline comes unless a renew gets through).
    """

    healthy: bool
    state: ElectionState
    is_leader: bool
    #: One sentence for people: why, with the numbers involved.
    detail: str


class ElectionLog:
    """One election's log records: structured fields on each, and outage rate limiting.

    During an outage the first failure is a WARNING; later ones are DEBUG, with one WARNING
    every *every* seconds that counts them; the first success after it logs a summary.
    """

    def __init__(
        self,
        logger: logging.Logger,
        group: str,
        participant: str,
        clock: Callable[[], float],
        every: float = 60.0,
    ) -> None:
        self._logger, self._group, self._participant = logger, group, participant
        self._clock, self._every = clock, every
        self._outage_since: float | None = None
        self._failures = 0
        self._reported = 0
        self._next_report = 0.0

    def log(
        self,
        level: int,
        msg: str,
        *args: object,
        token: int | None = None,
        stacklevel: int = 2,
        **kw: Any,
    ) -> None:
        if self._logger.isEnabledFor(level):
            extra = {"group": self._group, "participant": self._participant, "token": token}
            self._logger.log(level, msg, *args, extra=extra, stacklevel=stacklevel, **kw)

    def failed(self, what: str, exc: BaseException | None, token: int | None = None) -> None:
        """A store call failed: warn now, or count it while the outage goes on."""
        now = self._clock()
        reason = "timed out" if exc is None else repr(exc)
        self._failures += 1
        if self._outage_since is None:
            self._outage_since, self._reported = now, self._failures
            self._next_report = now + self._every
            self.log(
                logging.WARNING,
                "%s of %s failed: %s",
                what,
                self._group,
                reason,
                token=token,
                stacklevel=3,
            )
        elif now >= self._next_report:
            self.log(
                logging.WARNING,
                "%s still failing after %.0f s: %d failures since the last report; last: %s "
                "(repeats are logged at DEBUG)",
                self._group,
                now - self._outage_since,
                self._failures - self._reported,
                reason,
                token=token,
                stacklevel=3,
            )
            self._reported, self._next_report = self._failures, now + self._every
        else:
            self.log(
                logging.DEBUG,
                "%s of %s failed: %s",
                what,
                self._group,
                reason,
                token=token,
                stacklevel=3,
            )

    def succeeded(self, token: int | None = None) -> None:
        """A store call succeeded: end the outage, if any, with its summary."""
        if self._outage_since is None:
            return
        lasted = self._clock() - self._outage_since
        self.log(
            logging.WARNING,
            "%s reaches the store again after %.3g s and %d failed calls",
            self._group,
            lasted,
            self._failures,
            token=token,
            stacklevel=3,
        )
        self._outage_since, self._failures = None, 0
