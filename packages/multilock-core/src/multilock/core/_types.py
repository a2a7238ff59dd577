"""Value types shared by the election, the providers and user code."""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Generic, TypeVar

import attrs

from ._errors import LeadershipLost

__all__ = [
    "ElectionState",
    "ElectionStatistics",
    "EventKind",
    "LeaderInfo",
    "Leadership",
    "LeadershipEvent",
    "RunResult",
    "RunStatus",
]

T = TypeVar("T")


def _frozen_dict(value: Mapping[str, str] | None) -> dict[str, str]:
    return dict(value or {})


@attrs.frozen(kw_only=True)
class LeaderInfo:
    """The live leader of a group as the store sees it."""

    participant_id: str
    #: The fencing token of the term: strictly greater than every earlier term's token.
    token: int
    metadata: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_dict, hash=False)
    #: When the term began (UTC), as recorded by the provider.
    acquired_at: datetime


class EventKind(enum.Flag):
    """What a `LeadershipEvent` reports; combine with ``|`` to subscribe to several."""

    ACQUIRED = enum.auto()
    LOST = enum.auto()
    LEADER_CHANGED = enum.auto()
    ALL = ACQUIRED | LOST | LEADER_CHANGED


@attrs.frozen(kw_only=True)
class LeadershipEvent:
    """One change seen by one election.

    ``participant_id`` is the election's own id; ``leader`` is the leader it observes after
    the change (None: nobody, or not known yet); ``token`` is the term's token for ACQUIRED
    and LOST (LOST carries the token of the term that ended), the new leader's for
    LEADER_CHANGED.
    """

    kind: EventKind
    group: str
    participant_id: str
    leader: LeaderInfo | None
    token: int | None
    at: datetime


class ElectionState(enum.Enum):
    """Where an election is in its life."""

    IDLE = "idle"
    CAMPAIGNING = "campaigning"
    LEADING = "leading"
    STOPPING = "stopping"
    STOPPED = "stopped"


@attrs.frozen(kw_only=True)
class ElectionStatistics:
    """A snapshot for metrics and health checks, from `LeaderElection.statistics()`."""

    state: ElectionState
    is_leader: bool
    token: int | None
    terms_won: int
    acquire_attempts: int
    acquire_failures: int
    renewals: int
    renew_failures: int
    #: Seconds taken by the last successful renew (None before the first one).
    last_renew_latency: float | None
    #: Total seconds spent as leader, the current term included.
    time_as_leader: float


class RunStatus(enum.Enum):
    """How `LeaderElection.run_if_leader` ended."""

    NOT_LEADER = "not_leader"
    COMPLETED = "completed"
    LOST = "lost"


@attrs.frozen(kw_only=True)
class RunResult(Generic[T]):
    """The outcome of `run_if_leader`: ``value`` is set only when ``status`` is COMPLETED."""

    status: RunStatus
    value: T | None = None

    @property
    def completed(self) -> bool:
        return self.status is RunStatus.COMPLETED


@attrs.define(eq=False)
class _Term:
    """The election's record of one term; only the election writes it.

    ``sent`` is when the last successful acquire/renew was sent, on the election's monotonic
    clock, and ``deadline`` is ``sent + usable lease``; ``ended_at`` and ``end_reason`` are
    set once, when the election steps down (before any release is sent).
    """

    info: LeaderInfo
    sent: float
    deadline: float
    started: float
    clock: Callable[[], float]
    lost: threading.Event = attrs.field(factory=threading.Event)
    ended: asyncio.Event = attrs.field(factory=asyncio.Event)
    ended_at: float | None = None
    end_reason: str | None = None
    #: The last renew sent for this term (it may still be in flight when the term ends).
    renewing: asyncio.Future[bool] | None = None

    @property
    def is_valid(self) -> bool:
        return self.ended_at is None and self.clock() < self.deadline


class Leadership:
    """One term of leadership held by this process: a read-only view of the election's term.

    Valid from acquisition until the local deadline passes without a successful renew, the
    provider reports the lease gone, or the election resigns or stops. ``lost`` is a
    `threading.Event` so code in worker threads can wait on it; `wait_lost` is its async
    twin.
    """

    __slots__ = ("_term", "acquired_at", "group", "lost", "metadata", "participant_id", "token")

    def __init__(self, *, group: str, participant_id: str, term: _Term) -> None:
        self._term = term
        self.group = group
        self.participant_id = participant_id
        self.token = term.info.token
        self.acquired_at = term.info.acquired_at
        self.metadata: Mapping[str, str] = dict(term.info.metadata)
        self.lost = term.lost

    @property
    def deadline(self) -> float:
        """The local deadline (the election's monotonic clock): invalid from then on."""
        return self._term.deadline

    @property
    def ended_at(self) -> float | None:
        """When the election stepped down (its monotonic clock), or None while it holds."""
        return self._term.ended_at

    @property
    def is_valid(self) -> bool:
        """True while the term holds: no I/O, judged on the local monotonic clock."""
        return self._term.is_valid

    @property
    def time_left(self) -> float:
        """Seconds until the local deadline (0 once invalid)."""
        if self._term.ended_at is not None:
            return 0.0
        return max(0.0, self._term.deadline - self._term.clock())

    def check(self) -> None:
        """Raise `LeadershipLost` if the term has ended; call it before each protected step."""
        if not self.is_valid:
            raise LeadershipLost(self.group, self.token)

    async def wait_lost(self) -> None:
        """Return once the term has ended (on the election's event loop)."""
        await self._term.ended.wait()

    def __repr__(self) -> str:
        return (
            f"<Leadership group={self.group!r} participant_id={self.participant_id!r} "
            f"token={self.token} valid={self.is_valid}>"
        )
