"""`LeaderElection`: the state machine that campaigns, leads, renews and steps down.

Where each decision is made (design section 3), one place each:

- states: `_TRANSITIONS` is the whole table, `_step` the only writer of ``_state``;
- ACQUIRED and the first deadline: `_begin_term`;
- a deadline moves only in `_extend` (``sent + lease * (1 - max_clock_drift) - margin``,
  from the moment the successful acquire/renew was *sent*); a timer at that instant ends
  the term whatever the provider is doing;
- LOST and the hold-off: `_end_term`, synchronously, so LOST is emitted exactly once per
  ACQUIRED, as ``is_leader`` turns false, and before any await a cancellation could skip;
- whether a stored term is ours: `_Campaign.mine` (participant id *and* this run's nonce).

Every provider call goes through `_call_until`, which bounds it and never waits for a
driver that is slow to cancel. Public coroutines do their state changes synchronously and
leave the slow part (waiting for leader work, releasing) to code that a cancellation of
the caller cannot cut in half: `stop()` runs it in one shutdown task that a repeated
``stop()`` awaits again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import secrets
import weakref
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypeVar, Unpack

import attrs

from ._calls import (
    call_until,
    cancel_and_wait,
    describe_callable,
    is_async_callable,
    raise_if_cancelled,
    sleep_until,
)
from ._contenders import contenders as _contenders
from ._errors import ConfigurationError, MultilockError, ProviderError
from ._events import EventHub, EventStream
from ._observe import ElectionLog, Health, notify
from ._options import INSTANCE_KEY, ElectionFields, ElectionOptions
from ._options import public_info as _public
from ._probe import probe
from ._provider import Provider
from ._types import (
    ElectionState,
    ElectionStatistics,
    EventKind,
    LeaderInfo,
    Leadership,
    LeadershipEvent,
    RunResult,
    RunStatus,
    _Term,
)

__all__ = ["LeaderElection"]

log = logging.getLogger(__name__)

#: Elections started and not yet stopped, for `stop_on_signals`.
running: weakref.WeakSet[LeaderElection] = weakref.WeakSet()

T = TypeVar("T")
S = ElectionState


class _Event(enum.Enum):
    START = "start"
    WON = "won"
    TERM_ENDED = "term ended"
    STOP = "stop"
    STOPPED = "stopped"


#: Every legal transition: (state, event) -> next state.
_TRANSITIONS: dict[tuple[ElectionState, _Event], ElectionState] = {
    (S.IDLE, _Event.START): S.CAMPAIGNING,
    (S.STOPPED, _Event.START): S.CAMPAIGNING,
    (S.CAMPAIGNING, _Event.WON): S.LEADING,
    (S.LEADING, _Event.TERM_ENDED): S.CAMPAIGNING,
    (S.CAMPAIGNING, _Event.STOP): S.STOPPING,
    (S.LEADING, _Event.STOP): S.STOPPING,
    (S.STOPPING, _Event.STOPPED): S.STOPPED,
}

_UNKNOWN = object()
_RUNNING = (ElectionState.CAMPAIGNING, ElectionState.LEADING)


def _key(info: LeaderInfo | None) -> tuple[str, int] | None:
    return None if info is None else (info.participant_id, info.token)


def _jitter(seconds: float) -> float:
    """Spread retries of many followers over the last quarter of the interval."""
    return seconds * random.uniform(0.75, 1.0)


@attrs.define
class _Campaign:
    """What one run (start to stop) of the election remembers between terms."""

    #: Stored with every term we create, so a term is recognised as this run's own.
    nonce: str = attrs.field(factory=lambda: secrets.token_hex(8))
    #: After a term ends, others get the first try until then (unless one leads meanwhile).
    holdoff_until: float = 0.0
    #: The token of our last term: a record of it on the store is never resumed.
    lost_token: int | None = None
    #: An acquire was sent whose outcome we do not know.
    in_doubt: bool = False
    observed: object = _UNKNOWN
    watch_alive: bool = False
    #: The watch has yielded its first: every change of the group from now on notifies.
    watching: bool = False
    #: The last campaign round raised: no notification will say the store is back.
    round_failed: bool = False
    #: What it raised, for the message of a timed-out `wait_until_leader`.
    last_failure: Exception | None = None
    #: The next round follows a notification (or is the first): it may try at once.
    notified: bool = True
    #: When this participant first saw the group without a live leader (for failover time).
    vacant_since: float | None = None
    #: Seconds the last release or renew took to be answered: the store's round trip.
    round_trip: float = 0.0
    #: A term ended: the next notification is most likely our own release's.
    own_wake_next: bool = False
    #: The watch's notification count (`LeaderElection._notifications`) when it ended.
    notifications_at_end: int = 0
    #: That count when the last acquire was sent (None once a term began from it).
    notifications_at_try: int | None = None
    #: A term began with no notification since its acquire was sent: the next one is
    #: most likely that acquire's own, which gives the leader nothing to check.
    own_start_next: bool = False
    #: The hold-off ended on a notification, perhaps of a successor's acquire still under
    #: way (on one node of several): read before trying.
    look_first: bool = False
    #: This round's last read found another participant leading, and the watch loop's
    #: wake-up count (`LeaderElection._wakeups`) was this when that read was sent (None:
    #: no such read, or sent unwatched). A wake-up from before it announced what the
    #: read then saw.
    held_at_read: int | None = None

    def mine(self, info: LeaderInfo, participant_id: str) -> bool:
        return info.participant_id == participant_id and info.metadata.get(INSTANCE_KEY) == (
            self.nonce
        )


@attrs.define
class _Stats:
    terms_won: int = 0
    acquire_attempts: int = 0
    acquire_failures: int = 0
    renewals: int = 0
    renew_failures: int = 0
    last_renew_latency: float | None = None
    leader_time: float = 0.0


class LeaderElection:
    """Campaign for leadership of one group through one provider.

    Pass an `ElectionOptions` or its fields as keywords (typed by `ElectionFields`, so a
    type checker catches a misspelt name), not both::

        async with LeaderElection(provider, group="nightly-report") as election:
            await election.run_while_leader(report_loop)

    The election never closes the provider: whoever made it closes it.
    """

    def __init__(
        self,
        provider: Provider,
        options: ElectionOptions | None = None,
        **option_fields: Unpack[ElectionFields],
    ) -> None:
        if not isinstance(provider, Provider):
            raise ConfigurationError(
                f"provider must be a multilock Provider, not {type(provider).__name__}"
            )
        if options is not None and option_fields:
            raise ConfigurationError(
                "pass either an ElectionOptions or its fields as keywords, not both "
                f"(got options and {', '.join(sorted(option_fields))})"
            )
        if options is None:
            options = ElectionOptions.from_fields(dict(option_fields))
        elif not isinstance(options, ElectionOptions):
            raise ConfigurationError(
                f"options must be an ElectionOptions, not {type(options).__name__}"
            )
        provider.lease_bounds.check(options.lease_duration, type(provider).__name__)
        self._provider = provider
        self._options = options
        self._usable_lease = (
            options.lease_duration * (1 - options.max_clock_drift) - options.step_down_margin
        )
        self._hub = EventHub()
        self._state = ElectionState.IDLE
        self._clock: Callable[[], float] = _no_clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._campaign = _Campaign()
        self._leadership: Leadership | None = None  # the current term's one view
        self._term_tasks: set[asyncio.Task[Any]] = set()
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._run_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._shutdown_task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()  # the store may have changed: look again
        #: Notifications the watch has yielded (not its first yield, which says it is on):
        #: several may come before the campaign looks, and `_wake` holds only one.
        self._notifications = 0
        #: Every wake-up the watch loop gave (its first yield and its failures too).
        self._wakeups = 0
        self._interrupt = asyncio.Event()  # the leader loop: renew now, or the term ended
        self._stats = _Stats()
        self._log = ElectionLog(log, options.group, options.participant_id, self._now)

    def _now(self) -> float:
        return self._clock()

    # ------------------------------------------------------------------ properties
    @property
    def options(self) -> ElectionOptions:
        return self._options

    @property
    def provider(self) -> Provider:
        return self._provider

    @property
    def group(self) -> str:
        return self._options.group

    @property
    def participant_id(self) -> str:
        return self._options.participant_id

    @property
    def state(self) -> ElectionState:
        return self._state

    @property
    def is_leader(self) -> bool:
        """True only while this process holds a term whose local deadline has not passed."""
        term = self._term
        return term is not None and term.is_valid

    @property
    def leadership(self) -> Leadership | None:
        """The current valid term, or None."""
        leadership = self._leadership
        return leadership if leadership is not None and leadership.is_valid else None

    @property
    def _term(self) -> _Term | None:
        leadership = self._leadership
        return None if leadership is None else leadership._term

    def __repr__(self) -> str:
        return (
            f"<LeaderElection group={self.group!r} participant_id={self.participant_id!r} "
            f"state={self._state.value} provider={self._provider!r}>"
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Begin campaigning in a background task. Idempotent; works again after stop().

        With the ``probe_timeout`` option, first ask the store for the leader once, within
        that time, and raise its `ProviderError` (see `multilock.core.probe`) if it fails:
        a wrong host, port or password is reported here rather than retried for ever.
        """
        probe_timeout = self._options.probe_timeout
        if probe_timeout is not None and self._state not in _RUNNING:
            await probe(self._provider, self.group, timeout=probe_timeout)
        while self._shutdown_task is not None:  # a stop() in progress (maybe cancelled)
            await asyncio.shield(self._shutdown_task)
        if self._state in _RUNNING:
            return
        loop = asyncio.get_running_loop()
        self._loop, self._clock = loop, loop.time
        self._campaign = _Campaign()
        self._wake, self._interrupt = asyncio.Event(), asyncio.Event()
        self._step(_Event.START)
        running.add(self)
        options = self._options
        self._log.log(
            logging.INFO,
            "election %s/%s starting: lease %.3g s, renew every %.3g s, retry every "
            "%.3g s; worst-case failover after a crash %.3g s plus the store's detection",
            options.group,
            options.participant_id,
            options.lease_duration,
            options.renew_interval,
            options.retry_interval,
            options.worst_case_failover,
        )
        self._watch_task = loop.create_task(
            self._watch_loop(), name=f"multilock-watch-{options.group}"
        )
        self._run_task = loop.create_task(self._run(), name=f"multilock-{options.group}")
        notify(lambda o: o.started, self)

    async def stop(self) -> None:
        """Cancel leader work, release leadership (if ``release_on_stop``), end the streams.

        LOST is emitted at once, as the term ends. Idempotent; cancelling the caller does
        not interrupt the shutdown, and a repeated ``stop()`` waits for it. The provider
        stays open.
        """
        if self._shutdown_task is None:
            if self._state not in (ElectionState.CAMPAIGNING, ElectionState.LEADING):
                self._hub.end_all()
                return
            self._step(_Event.STOP)
            for task in (self._run_task, self._watch_task):
                if task is not None:
                    task.cancel()  # now: no campaign round may begin a term after this
            term = self._term
            if term is not None:
                self._end_term(term, "stopping")
            self._shutdown_task = asyncio.get_running_loop().create_task(
                self._shutdown(term), name=f"multilock-stop-{self.group}"
            )
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, term: _Term | None) -> None:
        try:
            await cancel_and_wait(self._run_task, self._watch_task)
            if term is not None:
                await self._wait_term_tasks(term)
                if self._options.release_on_stop:
                    await self._release(term.info.token, term)
            elif self._campaign.in_doubt and self._options.release_on_stop:
                await self._release_if_mine()
        finally:
            self._run_task = self._watch_task = self._shutdown_task = None
            self._step(_Event.STOPPED)
            running.discard(self)
            self._hub.end_all()
            self._log.log(logging.INFO, "election %s/%s stopped", self.group, self.participant_id)
            notify(lambda o: o.stopped, self)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # ------------------------------------------------------------------ waiting and work
    async def wait_until_leader(self, timeout: float | None = None) -> Leadership:  # noqa: ASYNC109 (design section 7 names it)
        """Return the current term, waiting for one if needed (at most *timeout* seconds).

        Raises `MultilockError` if the election is not running or stops meanwhile, and
        `TimeoutError` when *timeout* passes first.
        """
        try:
            async with asyncio.timeout(timeout):
                while True:
                    leadership = self.leadership
                    if leadership is not None:
                        return leadership
                    self._require_running("wait_until_leader")
                    await self._changed.wait()
        except TimeoutError:
            if timeout is None:
                raise  # not this wait's: it has no timeout
            error = TimeoutError(
                f"wait_until_leader: {self.group}/{self.participant_id} did not become "
                f"leader within {timeout:g} s ({self._waiting_for()})"
            )
        raise error

    def _waiting_for(self) -> str:
        """What a waiter for leadership is waiting on, for its timeout message."""
        campaign = self._campaign
        failure = campaign.last_failure
        if campaign.round_failed and failure is not None:
            return f"its last campaign round failed: {str(failure) or type(failure).__name__}"
        observed = campaign.observed
        if isinstance(observed, tuple):
            return f"{observed[0]} leads with token {observed[1]}"
        if observed is None:
            return "nobody leads, but this participant has not won the group yet"
        return "the leader is not known yet"

    async def run_while_leader(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any
    ) -> None:
        """Run ``await fn(leadership, *args)`` in each term until the election stops.

        The task is cancelled the moment leadership is lost and started again in the next
        term. If *fn* returns, this waits for the term to end. If *fn* raises, leadership
        is resigned and the exception propagates.
        """
        _require_async(fn, "run_while_leader")
        self._require_running("run_while_leader")
        while True:
            try:
                leadership = await self.wait_until_leader()
            except MultilockError:
                return  # stopped
            task = self._start_term_task(leadership, fn(leadership, *args))
            await self._wait_task(task, leadership)
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                assert exc is not None
                self._log.log(
                    logging.ERROR, "leader work of %s raised; resigning", self.group,
                    exc_info=exc, token=leadership.token,
                )  # fmt: skip
                await self.resign()
                raise exc
            await leadership.wait_lost()

    async def run_if_leader(
        self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any
    ) -> RunResult[T]:
        """Run ``await fn(leadership, *args)`` once, only if leading now.

        Returns a `RunResult`: NOT_LEADER (fn never ran), COMPLETED (with fn's value) or
        LOST (fn was cancelled because the term ended). Exceptions of *fn* propagate.
        """
        _require_async(fn, "run_if_leader")
        leadership = self.leadership
        if leadership is None:
            return RunResult(status=RunStatus.NOT_LEADER)
        task = self._start_term_task(leadership, fn(leadership, *args))
        await self._wait_task(task, leadership)
        if task.cancelled():
            return RunResult(status=RunStatus.LOST)
        return RunResult(status=RunStatus.COMPLETED, value=task.result())

    async def resign(self) -> None:
        """Give up leadership now; a waiting candidate takes over.

        LOST is emitted at once; leader work is cancelled and given until the term's
        deadline to finish, then the lease is released. This election campaigns again
        after ``retry_interval``, or as soon as another participant has led. A no-op when
        not leading.
        """
        term = self._term
        if term is None or self._state is not ElectionState.LEADING:
            return
        self._end_term(term, "resigned")
        await self._wait_term_tasks(term)
        await self._release(term.info.token, term)

    async def current_leader(self) -> LeaderInfo | None:
        """Ask the store for the live leader (None when nobody holds a live lease)."""
        deadline = asyncio.get_running_loop().time() + self._options.lease_duration
        try:
            return _public(await call_until(self._provider.get_leader(self.group), deadline))
        except TimeoutError:
            raise ProviderError(
                f"get_leader({self.group!r}) did not answer within "
                f"{self._options.lease_duration:g} s"
            ) from None

    async def contenders(self) -> tuple[str, ...]:
        """Ask the store for the group's live candidates: their participant ids, the leader
        first, then in the order they would lead (see `multilock.core.contenders`).

        Raises `UnsupportedOperation` on a store that records only the leader (every
        backend but ZooKeeper), and `ProviderError` when the store fails or does not answer
        within ``lease_duration``, as `current_leader` does.
        """
        return await _contenders(self._provider, self.group, timeout=self._options.lease_duration)

    def events(self, kinds: EventKind = EventKind.ALL) -> EventStream:
        """Subscribe to this election's events; the stream ends when the election stops."""
        return self._hub.subscribe(kinds)

    def statistics(self) -> ElectionStatistics:
        term, stats = self._term, self._stats
        current = self._clock() - term.started if term is not None else 0.0
        return ElectionStatistics(
            state=self._state,
            is_leader=self.is_leader,
            token=term.info.token if term is not None else None,
            terms_won=stats.terms_won,
            acquire_attempts=stats.acquire_attempts,
            acquire_failures=stats.acquire_failures,
            renewals=stats.renewals,
            renew_failures=stats.renew_failures,
            last_renew_latency=stats.last_renew_latency,
            time_as_leader=stats.leader_time + current,
        )

    def health(self) -> Health:
        """Healthy while following, or while leading with renewals on time (no I/O).

        Unhealthy when not running, or when leading and no acquire or renew has succeeded
        for two renew intervals: the term then ends at its deadline unless one gets through.
        """
        state, term = self._state, self._term
        if state not in (ElectionState.CAMPAIGNING, ElectionState.LEADING):
            detail = f"the election is {state.value}"
            return Health(healthy=False, state=state, is_leader=False, detail=detail)
        if term is None or not term.is_valid:
            observed = self._campaign.observed
            who = observed[0] if isinstance(observed, tuple) else "nobody known"
            detail = f"following; the leader is {who}"
            return Health(healthy=True, state=state, is_leader=False, detail=detail)
        now, renew_interval = self._clock(), self._options.renew_interval
        since = now - term.sent
        on_time = since <= 2 * renew_interval
        detail = (
            f"leading with token {term.info.token}; the last successful renew was sent "
            f"{since:.3g} s ago (renew interval {renew_interval:.3g} s), the term's deadline "
            f"is in {term.deadline - now:.3g} s"
        )
        return Health(healthy=on_time, state=state, is_leader=True, detail=detail)

    # ------------------------------------------------------------------ the state machine
    def _step(self, event: _Event) -> None:
        """Apply *event*: the only place the state changes."""
        new = _TRANSITIONS.get((self._state, event))
        if new is None:
            raise MultilockError(
                f"illegal election transition: {event.value} while {self._state.value}"
            )
        self._state = new
        self._notify_change()

    def _begin_term(self, info: LeaderInfo, sent: float) -> None:
        """We won: the only place a term starts and ACQUIRED is emitted."""
        deadline = sent + self._usable_lease
        if self._state is not ElectionState.CAMPAIGNING:  # stop() came first: let it release
            self._campaign.in_doubt = True
            return
        if self._clock() >= deadline:
            self._log.log(logging.WARNING, "acquire of %s answered too late to lead on", self.group)
            return
        term = _Term(
            info=_public(info) or info,
            sent=sent,
            deadline=deadline,
            started=self._clock(),
            clock=self._clock,
        )
        self._leadership = Leadership(
            group=self.group, participant_id=self.participant_id, term=term
        )
        self._stats.terms_won += 1
        self._interrupt.clear()
        campaign = self._campaign
        campaign.own_start_next = campaign.notifications_at_try == self._notifications
        campaign.notifications_at_try = None
        self._schedule_deadline(term)
        self._step(_Event.WON)
        vacant_since, self._campaign.vacant_since = self._campaign.vacant_since, None
        failover = None if vacant_since is None else term.started - vacant_since
        self._log.log(
            logging.INFO,
            "%s/%s is leader with token %d",
            self.group,
            self.participant_id,
            info.token,
            token=info.token,
        )
        self._emit(EventKind.ACQUIRED, token=info.token, leader=term.info)
        self._observe(info)
        notify(lambda o: o.acquired, self, self._leadership, failover)

    def _extend(self, term: _Term, sent: float) -> None:
        """A renew sent at *sent* succeeded: the only place a deadline moves."""
        term.sent, term.deadline = sent, sent + self._usable_lease
        self._schedule_deadline(term)

    def _schedule_deadline(self, term: _Term) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_timer = asyncio.get_running_loop().call_at(
            term.deadline, self._end_term, term, "deadline passed without a successful renew"
        )

    def _end_term(self, term: _Term, reason: str) -> None:
        """Step down, synchronously: the only place LOST is emitted and a hold-off set."""
        if term.ended_at is not None:
            return
        now = self._clock()
        term.ended_at, term.end_reason = now, reason
        term.lost.set()
        term.ended.set()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._leadership = None
        self._stats.leader_time += now - term.started
        for task in list(self._term_tasks):
            task.cancel()
        campaign = self._campaign
        campaign.lost_token = term.info.token
        # Whatever ended the term (a broken connection, a refused renew, resign), give the
        # other candidates the first try, long enough for polling followers to notice:
        # otherwise a participant whose renews fail but whose acquires succeed would take
        # every term back at once. The hold-off ends early once another participant leads.
        campaign.holdoff_until = now + self._options.retry_interval + self._provider.notify_delay
        campaign.own_wake_next, campaign.own_start_next = True, False
        campaign.notifications_at_end = self._notifications
        if self._state is ElectionState.LEADING:
            self._step(_Event.TERM_ENDED)
        else:
            self._notify_change()
        self._interrupt.set()
        level = logging.INFO if reason in ("resigned", "stopping") else logging.WARNING
        token = term.info.token
        self._log.log(
            level,
            "%s/%s stepped down (token %d): %s",
            self.group,
            self.participant_id,
            token,
            reason,
            token=token,
        )
        self._emit(EventKind.LOST, token=token)
        notify(lambda o: o.lost, self, token, reason)

    # ------------------------------------------------------------------ the campaign
    async def _run(self) -> None:
        while True:
            won = await self._attempt()
            if won is None:
                await self._wait_as_follower()
                continue
            self._begin_term(*won)
            term = self._term
            if term is not None:
                await self._lead(term)
                # Held off: nothing to look at before the release (ours) or a notification
                # (a wake-up from the term's time is stale).
                self._wake.clear()
                await self._wait_as_follower()

    async def _attempt(self) -> tuple[LeaderInfo, float] | None:
        """One campaign round: after a notification try at once, else look first and write
        only if the group looks free or ours."""
        self._stats.acquire_attempts += 1
        campaign, group = self._campaign, self.group
        metadata = {**self._options.metadata, INSTANCE_KEY: campaign.nonce}
        bound = self._clock() + self._usable_lease
        campaign.round_failed, campaign.held_at_read = False, None
        try:
            at_once = not (campaign.in_doubt or campaign.look_first or self._holding_off())
            if campaign.notified and at_once:
                # No term of ours can be on the store, and a held group answers None and
                # keeps its lease: try at once, saving a read on every handoff.
                self._log.log(logging.DEBUG, "%s: notified or starting, acquiring at once", group)
                won = await self._acquire(metadata, bound)
            else:
                won = await self._look_then_acquire(metadata, bound)
        except Exception as exc:
            self._stats.acquire_failures += 1
            campaign.round_failed, campaign.last_failure = True, exc
            self._log.failed("campaign round", exc)
            notify(lambda o: o.campaign_failed, self, exc)
            return None
        self._log.succeeded()
        return won

    async def _look_then_acquire(
        self, metadata: dict[str, str], bound: float
    ) -> tuple[LeaderInfo, float] | None:
        provider, group, me, campaign = (
            self._provider,
            self.group,
            self.participant_id,
            self._campaign,
        )
        leader = await self._read_leader(bound)
        held_off = self._holding_off() or campaign.look_first
        campaign.look_first = False
        if leader is not None:
            if campaign.mine(leader, me) and leader.token != campaign.lost_token:
                # Our acquire whose reply was lost: take the term up with a renew.
                self._log.log(logging.DEBUG, "%s: resuming our own term %d", group, leader.token)
                sent = self._clock()
                renew = provider.renew(
                    group, me, leader.token, self._options.lease_duration, metadata
                )
                if await call_until(renew, bound):
                    # Its acquire's notification came long ago, or never will.
                    campaign.in_doubt, campaign.notifications_at_try = False, None
                    return leader, sent
            self._observe(leader)
            self._log.log(
                logging.DEBUG, "%s: held by %s (token %d), following", group,
                leader.participant_id, leader.token,
            )  # fmt: skip
            # The hold-off ended on a notification: on ZooKeeper, answer it as any follower
            # does, with a try, which queues this participant behind the leader. Elsewhere
            # a try on a held group changes nothing.
            ended = campaign.notified and held_off and not self._holding_off()
            if ended and provider.queues_candidates:
                return await self._acquire(metadata, bound, holder=leader)
            return None
        if campaign.vacant_since is None:
            campaign.vacant_since = self._clock()
        if self._holding_off():
            self._log.log(logging.DEBUG, "%s: vacant, but holding off for others", group)
            return None
        self._log.log(logging.DEBUG, "%s: vacant, trying to acquire", group)
        return await self._acquire(metadata, bound)

    async def _acquire(
        self, metadata: dict[str, str], bound: float, holder: LeaderInfo | None = None
    ) -> tuple[LeaderInfo, float] | None:
        """Try to take the lease; when it is held, look who holds it (unless this round
        has just read the *holder*)."""
        campaign, provider, group = self._campaign, self._provider, self.group
        sent = self._clock()
        campaign.in_doubt = True
        # Sent unwatched, its notification may never come: nothing to wait for then.
        campaign.notifications_at_try = self._notifications if campaign.watching else None
        acquire = provider.try_acquire(
            group, self.participant_id, self._options.lease_duration, metadata
        )
        info = await call_until(acquire, bound)
        campaign.in_doubt = False
        if info is None and holder is not None:
            return None  # held, by the leader this round has just seen
        if info is not None and holder is not None and campaign.vacant_since is None:
            campaign.vacant_since = sent  # the leader it saw gave up meanwhile: a failover
        if info is None or not campaign.mine(info, self.participant_id):
            holder = await self._read_leader(bound)
            self._observe(holder)
            self._log.log(
                logging.DEBUG, "%s: acquire refused; held by %s", group,
                "nobody" if holder is None else holder.participant_id,
            )  # fmt: skip
            return None
        return info, sent

    async def _read_leader(self, bound: float) -> LeaderInfo | None:
        """Read the group; if another participant leads, note the wake-ups before the read
        was sent (`_Campaign.held_at_read`)."""
        campaign = self._campaign
        count = self._wakeups if campaign.watching else None
        leader = await call_until(self._provider.get_leader(self.group), bound)
        if leader is not None and not campaign.mine(leader, self.participant_id):
            campaign.held_at_read = count
        return leader

    def _holding_off(self) -> bool:
        return self._clock() < self._campaign.holdoff_until

    async def _wait_as_follower(self) -> None:
        options, campaign = self._options, self._campaign
        if campaign.round_failed:
            self._wake.clear()  # a wake-up from before a failed round is stale: back off
        elif campaign.held_at_read == self._wakeups and not self._holding_off():
            # Every wake-up came before the round's last read was sent, and that read found
            # the group held: it saw what they announced (the winner's acquire, when every
            # follower tried at once). The next change notifies again, or the lease the
            # watch saw runs out; a try now could only fail.
            self._wake.clear()
        if self._holding_off():
            when = self._campaign.holdoff_until  # the watch may show another leader sooner
        else:
            # With a working watch the store wakes us (on release, and when the lease we
            # saw expires); the timer is only a safety net, and must not double idle cost.
            quiet = self._campaign.watch_alive and not self._campaign.round_failed
            interval = 2 * options.lease_duration if quiet else options.retry_interval
            when = self._clock() + _jitter(interval)
        await sleep_until(when, self._wake)
        campaign = self._campaign
        if self._wake.is_set() and self._holding_off() and campaign.own_wake_next:
            # Most likely the notification of our own step-down, with the group vacant: the
            # candidates we hold off for take it about two round trips later. Look then, or
            # at the next notification: a read now finds nobody and, in one process, runs
            # beside their acquire on the handoff's critical path. A next notification means
            # another participant has acted on the group (took it, perhaps gave it up
            # already): the hold-off has done its job, but the round reads first (the
            # successor may still be acquiring, on Redlock one node after another).
            campaign.own_wake_next = False
            if self._notifications - campaign.notifications_at_end > 1:
                # That next one came already, before this look (several notifications
                # read at once, or a busy loop): one wake-up stands for them all.
                campaign.holdoff_until, campaign.look_first = 0.0, True
            else:
                settle = min(self._clock() + 2 * campaign.round_trip, campaign.holdoff_until)
                if settle > self._clock():
                    self._wake.clear()
                    await sleep_until(settle, self._wake)
                    if self._wake.is_set():
                        campaign.holdoff_until, campaign.look_first = 0.0, True
                    self._wake.set()  # still a round after a notification
        # Woken by the store, the group has likely changed hands: the next round tries to
        # acquire at once. Woken by the timer (the safety net), it only looks first.
        campaign.notified = self._wake.is_set()
        if campaign.notified and campaign.vacant_since is None:
            campaign.vacant_since = self._clock()
        self._wake.clear()

    async def _lead(self, term: _Term) -> None:
        options = self._options
        next_renew = term.sent + options.renew_interval
        while True:
            await sleep_until(next_renew, self._interrupt)
            if term.lost.is_set():
                return  # resigned, stopped, or the deadline passed
            # Woken early by the store's watch (a session suspended, the key deleted...):
            # renew now, so a lease the store has dropped ends the term at once.
            self._interrupt.clear()
            sent = self._clock()
            ok: bool | None = None
            error: Exception | None = None
            try:
                renew = self._provider.renew(
                    self.group,
                    self.participant_id,
                    term.info.token,
                    options.lease_duration,
                    {**options.metadata, INSTANCE_KEY: self._campaign.nonce},
                )
                term.renewing = asyncio.ensure_future(renew)  # the release waits for it
                bound = min(term.deadline, sent + options.renew_interval)
                ok = await call_until(term.renewing, bound)
            except Exception as exc:
                error = exc
            if term.lost.is_set():
                return
            token = term.info.token
            if ok is True:
                latency = self._clock() - sent
                # A renewal notifies nobody: any notification from now on is another's act.
                self._campaign.own_start_next = False
                self._campaign.round_trip = latency
                self._stats.renewals += 1
                self._stats.last_renew_latency = latency
                self._extend(term, sent)
                self._log.succeeded(token)
                self._log.log(
                    logging.DEBUG, "%s: renewed token %d in %.3g ms", self.group, token,
                    latency * 1000, token=token,
                )  # fmt: skip
                notify(lambda o: o.renewed, self, latency)
                next_renew = sent + options.renew_interval
                continue
            self._stats.renew_failures += 1
            notify(lambda o: o.renew_failed, self, error)
            if error is not None:
                self._log.failed(f"renew of token {token}", error, token)
            if ok is False:
                self._end_term(term, "the store reports the lease is no longer ours")
                return
            remaining = term.deadline - self._clock()
            next_renew = self._clock() + max(min(options.renew_interval, remaining) / 2, 0.005)

    async def _watch_loop(self) -> None:
        """Turn the provider's notifications into wake-ups; fall back to polling on errors."""
        campaign = self._campaign
        while True:
            stream = self._provider.watch(self.group)
            if stream is None:
                return
            try:
                campaign.watch_alive = True
                async for _ in stream:
                    raise_if_cancelled()
                    self._wake.set()
                    self._wakeups += 1
                    if campaign.watching:
                        self._notifications += 1
                    if self._term is not None and campaign.watching:
                        if campaign.own_start_next:
                            campaign.own_start_next = False  # its own acquire's: no renew
                        else:
                            self._interrupt.set()  # a leader checks its lease at once
                    # The first yield only says the watch is on: a leader need not renew.
                    campaign.watching = True
            except Exception as exc:
                self._log.failed("watch (polling until it is back)", exc)
            finally:
                campaign.watch_alive = campaign.watching = False
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            raise_if_cancelled()
            self._wake.set()
            self._wakeups += 1
            await asyncio.sleep(_jitter(self._options.retry_interval))

    # ------------------------------------------------------------------ helpers
    def _require_running(self, what: str) -> None:
        if self._state not in (ElectionState.CAMPAIGNING, ElectionState.LEADING):
            raise MultilockError(
                f"{what}: election {self.group}/{self.participant_id} is "
                f"{self._state.value}; start it first"
            )

    def _notify_change(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _emit(
        self, kind: EventKind, *, token: int | None, leader: LeaderInfo | None = None
    ) -> None:
        if not self._hub.wants(kind):
            return  # nobody listens for it: build nothing (a step down's critical path)
        self._hub.publish(
            LeadershipEvent(
                kind=kind,
                group=self.group,
                participant_id=self.participant_id,
                leader=_public(leader),
                token=token,
                at=datetime.now(UTC),
            )
        )

    def _observe(self, info: LeaderInfo | None) -> None:
        """Record the leader the store reports; emit LEADER_CHANGED when it differs."""
        campaign = self._campaign
        if info is not None and not campaign.mine(info, self.participant_id):
            campaign.holdoff_until = 0.0  # someone else leads: the hold-off has done its job
        if info is None:
            if campaign.vacant_since is None:
                campaign.vacant_since = self._clock()
        elif not campaign.mine(info, self.participant_id):
            campaign.vacant_since = None
        key = _key(info)
        if key != campaign.observed:
            campaign.observed = key
            token = None if info is None else info.token
            self._emit(EventKind.LEADER_CHANGED, token=token, leader=info)

    def _start_term_task(
        self, leadership: Leadership, coro: Coroutine[Any, Any, T]
    ) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        if self._term is not leadership._term or not leadership.is_valid:
            task.cancel()
        else:
            self._term_tasks.add(task)
            task.add_done_callback(self._term_tasks.discard)
        return task

    async def _wait_task(self, task: asyncio.Task[Any], leadership: Leadership) -> None:
        """Wait for leader work; if the caller is cancelled, cancel it and give it until the
        term's deadline (it stays tracked, so the term's end cancels it again)."""
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait({task}, timeout=max(leadership.deadline - self._clock(), 0.05))
            raise

    async def _wait_term_tasks(self, term: _Term) -> None:
        """Give cancelled leader work until the term's deadline to finish."""
        tasks = list(self._term_tasks)
        if not tasks:
            return
        remaining = max(term.deadline - self._clock(), 0.05)
        _, pending = await asyncio.wait(tasks, timeout=remaining)
        if pending:
            self._log.log(
                logging.WARNING, "%d leader task(s) of %s ignored cancellation", len(pending),
                self.group, token=term.info.token,
            )  # fmt: skip

    async def _release(self, token: int, term: _Term | None = None) -> None:
        """Release *token*, once the term's renew in flight (if any) has settled.

        A renew that lands between a release's read and its write makes a store that checks
        versions (S3 ETags, Azure) refuse the release, and the lease then lives on until
        it expires: a participant's writes for one term never race each other.
        """
        renew_interval = self._options.renew_interval
        if term is not None and term.renewing is not None and not term.renewing.done():
            await asyncio.wait({term.renewing}, timeout=renew_interval)
        sent = self._clock()
        try:
            await call_until(
                self._provider.release(self.group, self.participant_id, token),
                sent + renew_interval,
            )
            self._campaign.round_trip = self._clock() - sent
        except Exception as exc:  # the lease then simply expires
            self._log.log(
                logging.WARNING, "release of %s token %d failed: %r", self.group, token, exc,
                token=token,
            )  # fmt: skip

    async def _release_if_mine(self) -> None:
        """After an acquire whose outcome is unknown, make sure nothing of ours stays."""
        deadline = self._clock() + self._options.renew_interval
        try:
            info = await call_until(self._provider.get_leader(self.group), deadline)
            if info is not None and self._campaign.mine(info, self.participant_id):
                await self._release(info.token)
        except Exception as exc:
            self._log.log(
                logging.WARNING, "could not check %s for an orphaned lease: %r", self.group, exc
            )


def _require_async(fn: object, what: str) -> None:
    """Refuse a plain function now, rather than when this replica first wins a term."""
    if is_async_callable(fn):
        return
    kind = "not callable" if not callable(fn) else "not an async function"
    raise TypeError(
        f"{what}() needs an async function (async def fn(leadership, ...)); "
        f"{describe_callable(fn)} is {kind}. To run a plain function in a thread each "
        "term, use multilock.core.sync.LeaderElection"
    )


def _no_clock() -> float:
    raise MultilockError("the election has not been started")
