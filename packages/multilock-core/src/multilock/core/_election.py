"""`LeaderElection`: the state machine that campaigns, leads, renews and steps down.

Safety (design section 3): a term's deadline is computed from the moment the last
successful acquire/renew was *sent*, on the event loop's monotonic clock:
``sent + lease_duration * (1 - max_clock_drift) - margin``. The store cannot expire the
lease before that instant, so when the deadline passes without a successful renew this
process has already stopped leading (``is_leader`` is judged on the clock, leader tasks are
cancelled, LOST is emitted), whatever the provider is doing. Every provider call made while
leading is bounded by the deadline; a renew that raises or hangs is a failed renew.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypeVar

from ._errors import ConfigurationError, MultilockError, ProviderError
from ._events import EventHub, EventStream
from ._options import ElectionOptions
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
)

__all__ = ["LeaderElection", "watch_leader"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_ALLOWED: dict[ElectionState, frozenset[ElectionState]] = {
    ElectionState.IDLE: frozenset({ElectionState.CAMPAIGNING}),
    ElectionState.CAMPAIGNING: frozenset({ElectionState.LEADING, ElectionState.STOPPING}),
    ElectionState.LEADING: frozenset({ElectionState.CAMPAIGNING, ElectionState.STOPPING}),
    ElectionState.STOPPING: frozenset({ElectionState.STOPPED}),
    ElectionState.STOPPED: frozenset({ElectionState.CAMPAIGNING}),
}


class _Unknown(enum.Enum):
    UNKNOWN = "unknown"


_UNKNOWN = _Unknown.UNKNOWN


def _key(info: LeaderInfo | None) -> tuple[str, int] | None:
    return None if info is None else (info.participant_id, info.token)


def _jitter(seconds: float) -> float:
    """Spread retries of many followers over the last quarter of the interval."""
    return seconds * random.uniform(0.75, 1.0)


class LeaderElection:
    """Campaign for leadership of one group through one provider.

    Pass an `ElectionOptions` or its fields as keywords, not both::

        async with LeaderElection(provider, group="nightly-report") as election:
            await election.run_while_leader(report_loop)

    The election never closes the provider: whoever made it closes it.
    """

    def __init__(
        self,
        provider: Provider,
        options: ElectionOptions | None = None,
        **option_fields: Any,
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
            options = ElectionOptions.from_fields(option_fields)
        elif not isinstance(options, ElectionOptions):
            raise ConfigurationError(
                f"options must be an ElectionOptions, not {type(options).__name__}"
            )
        provider.check_options(options)
        self._provider = provider
        self._options = options
        self._usable_lease = (
            options.lease_duration * (1 - options.max_clock_drift) - options.step_down_margin
        )
        self._hub = EventHub()
        self._state = ElectionState.IDLE
        self._clock: Callable[[], float] = _no_clock
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._lifecycle: asyncio.Lock | None = None
        self._leadership: Leadership | None = None
        self._term_tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._interrupt = asyncio.Event()
        self._observed: tuple[str, int] | _Unknown | None = _UNKNOWN
        self._lost_token: int | None = None
        self._acquire_in_doubt = False
        self._holdoff_until = 0.0
        self._watch_alive = False
        # statistics
        self._terms_won = 0
        self._acquire_attempts = 0
        self._acquire_failures = 0
        self._renewals = 0
        self._renew_failures = 0
        self._last_renew_latency: float | None = None
        self._leader_time = 0.0
        self._term_started = 0.0

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
        leadership = self._leadership
        return leadership is not None and leadership.is_valid

    @property
    def leadership(self) -> Leadership | None:
        """The current valid term, or None."""
        leadership = self._leadership
        return leadership if leadership is not None and leadership.is_valid else None

    def __repr__(self) -> str:
        return (
            f"<LeaderElection group={self.group!r} participant_id={self.participant_id!r} "
            f"state={self._state.value} provider={self._provider!r}>"
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Begin campaigning in a background task. Idempotent; works again after stop()."""
        if self._lifecycle is None:
            self._lifecycle = asyncio.Lock()
        async with self._lifecycle:
            if self._state in (ElectionState.CAMPAIGNING, ElectionState.LEADING):
                return
            loop = asyncio.get_running_loop()
            self._clock = loop.time
            self._observed = _UNKNOWN
            self._acquire_in_doubt = False
            self._holdoff_until = 0.0
            self._wake = asyncio.Event()
            self._interrupt = asyncio.Event()
            self._transition(ElectionState.CAMPAIGNING)
            options = self._options
            log.info(
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
            self._task = loop.create_task(self._run(), name=f"multilock-{options.group}")

    async def stop(self) -> None:
        """Cancel leader work, release leadership (if ``release_on_stop``), emit LOST.

        Idempotent. The provider stays open.
        """
        if self._lifecycle is None:
            self._hub.end_all()
            return
        async with self._lifecycle:
            if self._state in (ElectionState.IDLE, ElectionState.STOPPED):
                self._hub.end_all()
                return
            self._transition(ElectionState.STOPPING)
            await _cancel_and_wait(self._task, self._watch_task)
            self._task = self._watch_task = None
            leadership = self._leadership
            if leadership is not None:
                self._end_term(leadership, "stopping", emit=False)
                await self._wait_term_tasks(leadership)
                if self._options.release_on_stop:
                    await self._release(leadership.token)
                self._emit(EventKind.LOST, token=leadership.token)
            elif self._acquire_in_doubt and self._options.release_on_stop:
                await self._release_if_mine()
            self._transition(ElectionState.STOPPED)
            self._hub.end_all()

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
    async def wait_until_leader(self) -> Leadership:
        """Return the current term, waiting for one if needed.

        Raises `MultilockError` if the election is not running or stops meanwhile.
        """
        while True:
            leadership = self.leadership
            if leadership is not None:
                return leadership
            self._require_running("wait_until_leader")
            await self._wait_change()

    async def run_while_leader(
        self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any
    ) -> None:
        """Run ``await fn(leadership, *args)`` in each term until the election stops.

        The task is cancelled the moment leadership is lost and started again in the next
        term. If *fn* returns, this waits for the term to end. If *fn* raises, leadership
        is resigned and the exception propagates.
        """
        self._require_running("run_while_leader")
        while True:
            try:
                leadership = await self.wait_until_leader()
            except MultilockError:
                return  # stopped
            task = self._start_term_task(leadership, fn(leadership, *args))
            await _wait_shielding_cancel(task)
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                assert exc is not None
                log.error("leader work of %s raised; resigning", self.group, exc_info=exc)
                await self.resign()
                raise exc
            while self._leadership is leadership and leadership.is_valid:
                await self._wait_change()

    async def run_if_leader(
        self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any
    ) -> RunResult[T]:
        """Run ``await fn(leadership, *args)`` once, only if leading now.

        Returns a `RunResult`: NOT_LEADER (fn never ran), COMPLETED (with fn's value) or
        LOST (fn was cancelled because the term ended). Exceptions of *fn* propagate.
        """
        leadership = self.leadership
        if leadership is None:
            return RunResult(status=RunStatus.NOT_LEADER)
        task = self._start_term_task(leadership, fn(leadership, *args))
        await _wait_shielding_cancel(task)
        if task.cancelled():
            return RunResult(status=RunStatus.LOST)
        return RunResult(status=RunStatus.COMPLETED, value=task.result())

    async def resign(self) -> None:
        """Give up leadership now and go back to campaigning after ``retry_interval``.

        A waiting candidate takes over in the meantime. A no-op when not leading.
        """
        leadership = self._leadership
        if leadership is None or self._state is not ElectionState.LEADING:
            return
        self._end_term(leadership, "resigned", emit=False)
        self._interrupt.set()
        await self._wait_term_tasks(leadership)
        await self._release(leadership.token)
        self._emit(EventKind.LOST, token=leadership.token)

    async def current_leader(self) -> LeaderInfo | None:
        """Ask the store for the live leader (None when nobody holds a live lease)."""
        try:
            async with asyncio.timeout(self._options.lease_duration):
                return await self._provider.get_leader(self.group)
        except TimeoutError:
            raise ProviderError(
                f"get_leader({self.group!r}) did not answer within "
                f"{self._options.lease_duration:g} s"
            ) from None

    def events(self, kinds: EventKind = EventKind.ALL) -> EventStream:
        """Subscribe to this election's events; the stream ends when the election stops."""
        return self._hub.subscribe(kinds)

    def statistics(self) -> ElectionStatistics:
        leadership = self._leadership
        current = self._clock() - self._term_started if leadership is not None else 0.0
        return ElectionStatistics(
            state=self._state,
            is_leader=self.is_leader,
            token=leadership.token if leadership is not None else None,
            terms_won=self._terms_won,
            acquire_attempts=self._acquire_attempts,
            acquire_failures=self._acquire_failures,
            renewals=self._renewals,
            renew_failures=self._renew_failures,
            last_renew_latency=self._last_renew_latency,
            time_as_leader=self._leader_time + current,
        )

    # ------------------------------------------------------------------ internals
    def _require_running(self, what: str) -> None:
        if self._state not in (ElectionState.CAMPAIGNING, ElectionState.LEADING):
            raise MultilockError(
                f"{what}: election {self.group}/{self.participant_id} is "
                f"{self._state.value}; start it first"
            )

    def _transition(self, new: ElectionState) -> None:
        if new not in _ALLOWED[self._state]:
            raise MultilockError(f"illegal election transition {self._state.value} -> {new.value}")
        self._state = new
        self._notify_change()

    def _notify_change(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def _emit(
        self, kind: EventKind, *, token: int | None, leader: LeaderInfo | None = None
    ) -> None:
        self._hub.publish(
            LeadershipEvent(
                kind=kind,
                group=self.group,
                participant_id=self.participant_id,
                leader=leader,
                token=token,
                at=datetime.now(UTC),
            )
        )

    def _observe(self, info: LeaderInfo | None) -> None:
        """Record the leader the store reports; emit LEADER_CHANGED when it differs."""
        key = _key(info)
        if key != self._observed:
            self._observed = key
            self._emit(
                EventKind.LEADER_CHANGED, token=None if info is None else info.token, leader=info
            )

    def _start_term_task(
        self, leadership: Leadership, coro: Coroutine[Any, Any, T]
    ) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        if self._leadership is not leadership or not leadership.is_valid:
            task.cancel()
        else:
            self._term_tasks.add(task)
            task.add_done_callback(self._term_tasks.discard)
        return task

    def _end_term(self, leadership: Leadership, reason: str, *, emit: bool = True) -> None:
        """Step down locally, synchronously: invalid at once, leader tasks cancelled."""
        if self._leadership is not leadership:
            return
        leadership._ended_at = self._clock()
        leadership.lost.set()
        self._leadership = None
        self._lost_token = leadership.token
        # Whatever ended the term (a broken connection, a refused renew, resign), give the
        # other candidates the first try, long enough for polling followers to notice:
        # otherwise a participant whose renews fail but whose acquires succeed would take
        # every term back at once, and a resign on a polling store would not hand over.
        self._holdoff_until = (
            self._clock() + self._options.retry_interval + self._provider.notify_delay
        )
        self._leader_time += self._clock() - self._term_started
        for task in list(self._term_tasks):
            task.cancel()
        if self._state is ElectionState.LEADING:
            self._transition(ElectionState.CAMPAIGNING)
        else:
            self._notify_change()
        self._interrupt.set()
        level = logging.INFO if reason in ("resigned", "stopping") else logging.WARNING
        log.log(
            level,
            "%s/%s stepped down (token %d): %s",
            self.group,
            self.participant_id,
            leadership.token,
            reason,
        )
        if emit:
            self._emit(EventKind.LOST, token=leadership.token)

    async def _wait_term_tasks(self, leadership: Leadership) -> None:
        """Give cancelled leader work until the term's deadline to finish."""
        tasks = list(self._term_tasks)
        if not tasks:
            return
        remaining = max(leadership._deadline - self._clock(), 0.0)
        _, pending = await asyncio.wait(tasks, timeout=max(remaining, 0.05))
        if pending:
            log.warning("%d leader task(s) of %s ignored cancellation", len(pending), self.group)

    async def _release(self, token: int) -> None:
        try:
            await _call_until(
                self._provider.release(self.group, self.participant_id, token),
                asyncio.get_running_loop().time() + self._options.renew_interval,
            )
        except Exception as exc:  # the lease then simply expires
            log.warning("release of %s token %d failed: %r", self.group, token, exc)

    async def _release_if_mine(self) -> None:
        """After an acquire whose outcome is unknown, make sure nothing of ours stays."""
        try:
            async with asyncio.timeout(self._options.renew_interval):
                info = await self._provider.get_leader(self.group)
                if info is not None and info.participant_id == self.participant_id:
                    await self._provider.release(self.group, self.participant_id, info.token)
        except Exception as exc:
            log.warning("could not check %s for an orphaned lease: %r", self.group, exc)

    async def _run(self) -> None:
        while True:
            holdoff = self._holdoff_until - self._clock()
            if holdoff > 0:  # after resign(): let a waiting candidate take over first
                await asyncio.sleep(holdoff)
            acquired = await self._attempt()
            if acquired is None:
                await self._wait_as_follower()
                continue
            info, sent = acquired
            leadership = self._begin_term(info, sent)
            if leadership is not None:
                await self._lead(leadership, sent)

    async def _attempt(self) -> tuple[LeaderInfo, float] | None:
        """One campaign round: look, and write only if the group looks free or ours."""
        self._acquire_attempts += 1
        provider, group, me = self._provider, self.group, self.participant_id
        try:
            async with asyncio.timeout(self._usable_lease):
                leader = await provider.get_leader(group)
                # A term we already gave up may still be on the store until it expires:
                # treat it as foreign, never resume it (its work was cancelled; a new term
                # must get a new token). Our own live term from an acquire whose reply was
                # lost is picked up again by try_acquire below.
                if leader is not None and (
                    leader.participant_id != me or leader.token == self._lost_token
                ):
                    self._observe(leader)
                    return None
                sent = self._clock()
                self._acquire_in_doubt = True
                info = await provider.try_acquire(
                    group, me, self._options.lease_duration, self._options.metadata
                )
                self._acquire_in_doubt = False
                if info is None or info.participant_id != me:
                    self._observe(await provider.get_leader(group))
                    return None
        except Exception as exc:
            self._acquire_failures += 1
            log.warning("campaign round for %s failed: %r", group, exc)
            return None
        return info, sent

    async def _wait_as_follower(self) -> None:
        now = self._clock()
        options = self._options
        # With a working watch the store wakes us (on release, and when the lease we saw
        # expires); the timer is only a safety net, and must not double the idle cost.
        interval = 2 * options.lease_duration if self._watch_alive else options.retry_interval
        await self._sleep_until(now + _jitter(interval), self._wake)
        self._wake.clear()

    async def _sleep_until(self, when: float, event: asyncio.Event) -> None:
        _raise_if_cancelled()
        if event.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(when):
                await event.wait()

    def _begin_term(self, info: LeaderInfo, sent: float) -> Leadership | None:
        deadline = sent + self._usable_lease
        if self._clock() >= deadline:
            log.warning("acquire of %s answered too late to lead on", self.group)
            return None
        leadership = Leadership(
            group=self.group,
            participant_id=self.participant_id,
            token=info.token,
            acquired_at=info.acquired_at,
            metadata=info.metadata,
            deadline=deadline,
            clock=self._clock,
        )
        self._leadership = leadership
        self._terms_won += 1
        self._term_started = self._clock()
        self._interrupt = asyncio.Event()
        self._transition(ElectionState.LEADING)
        log.info("%s/%s is leader with token %d", self.group, self.participant_id, info.token)
        self._emit(EventKind.ACQUIRED, token=info.token, leader=info)
        self._observe(info)
        return leadership

    async def _lead(self, leadership: Leadership, sent: float) -> None:
        options = self._options
        next_renew = sent + options.renew_interval
        while self._leadership is leadership:
            await self._sleep_until(min(next_renew, leadership._deadline), self._interrupt)
            if self._leadership is not leadership:
                return  # resigned or stopped
            # Woken early by the store's watch (a session suspended, the key deleted...):
            # renew now, so a lease the store has dropped ends the term at once.
            self._interrupt.clear()
            now = self._clock()
            if now >= leadership._deadline:
                self._renew_failures += 1
                self._end_term(leadership, "deadline passed without a successful renew")
                return
            ok: bool | None = None
            # The timeout below cancels the renew, but a provider may take a while to settle
            # a cancelled call (psycopg cancels the query on the server, a worker thread runs
            # to its socket timeout): end the term at its deadline all the same.
            watchdog = asyncio.get_running_loop().call_at(
                leadership._deadline,
                self._end_term,
                leadership,
                "deadline passed while a renew was still settling",
            )
            try:
                bound = min(leadership._deadline, now + options.renew_interval)
                ok = await _call_until(
                    self._provider.renew(
                        self.group,
                        self.participant_id,
                        leadership.token,
                        options.lease_duration,
                        options.metadata,
                    ),
                    bound,
                )
            except Exception as exc:
                log.warning("renew of %s token %d failed: %r", self.group, leadership.token, exc)
            finally:
                watchdog.cancel()
            if self._leadership is not leadership:
                return
            if ok is True:
                self._renewals += 1
                self._last_renew_latency = self._clock() - now
                leadership._deadline = now + self._usable_lease
                next_renew = now + options.renew_interval
            elif ok is False:
                self._renew_failures += 1
                self._end_term(leadership, "the store reports the lease is no longer ours")
                return
            else:
                self._renew_failures += 1
                remaining = leadership._deadline - self._clock()
                next_renew = self._clock() + max(min(options.renew_interval, remaining) / 2, 0.005)

    async def _watch_loop(self) -> None:
        """Turn the provider's notifications into wake-ups; fall back to polling on errors."""
        while True:
            stream = self._provider.watch(self.group)
            if stream is None:
                return
            try:
                self._watch_alive = True
                async for _ in stream:
                    _raise_if_cancelled()
                    self._wake.set()
                    if self._leadership is not None:
                        self._interrupt.set()  # a leader checks its lease at once
            except Exception as exc:
                log.warning("watch of %s broke, polling until it is back: %r", self.group, exc)
            finally:
                self._watch_alive = False
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
            _raise_if_cancelled()
            self._wake.set()
            await asyncio.sleep(_jitter(self._options.retry_interval))


#: Provider calls that timed out and are still settling their cancellation.
_SETTLING: set[asyncio.Task[Any]] = set()


async def _call_until(call: Coroutine[Any, Any, T], deadline: float) -> T:
    """Await a provider *call* until *deadline* (loop time), else raise `TimeoutError`.

    A call that times out (or whose caller is cancelled) is cancelled but not waited for:
    a driver may take seconds to settle a cancellation (psycopg cancels the query on the
    server, a worker thread runs to its socket timeout), and the election must step down,
    campaign again or stop meanwhile. The call settles in the background.
    """
    task = asyncio.ensure_future(call)
    try:
        async with asyncio.timeout_at(deadline):
            return await asyncio.shield(task)
    finally:
        if not task.done():
            task.cancel()
            _SETTLING.add(task)
            task.add_done_callback(_settled)


def _settled(task: asyncio.Task[Any]) -> None:
    _SETTLING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.debug("a timed-out provider call ended with %r", task.exception())


def _raise_if_cancelled() -> None:
    """Honour a cancellation that a driver swallowed.

    Python 3.11's ``asyncio.wait_for`` (redis-py sends every command through it) returns
    the inner result when the call finishes just as the cancel lands: the task runs on
    with the cancel still requested, and `stop()` would wait for it forever.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _no_clock() -> float:
    raise MultilockError("the election has not been started")


async def _cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel *tasks* and wait for them; a cancel of the caller still propagates."""
    live = [t for t in tasks if t is not None and not t.done()]
    for task in live:
        task.cancel()
    if live:
        await asyncio.wait(live)


async def _wait_shielding_cancel(task: asyncio.Task[Any]) -> None:
    """Wait for *task*; if the caller is cancelled, cancel the task first, then re-raise."""
    try:
        await asyncio.wait({task})
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.wait({task})
        raise


async def watch_leader(
    provider: Provider, group: str, *, poll_interval: float = 2.0
) -> AsyncIterator[LeaderInfo | None]:
    """Observe *group* without campaigning: yield the leader now and on every change.

    Uses the provider's notifications when it has them, and polls every *poll_interval*
    seconds otherwise (and as a safety net). Store errors are logged and retried.
    """
    last: tuple[str, int] | _Unknown | None = _UNKNOWN
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
                async with asyncio.timeout(max(poll_interval, 1.0) * 5):
                    info = await provider.get_leader(group)
            except Exception as exc:
                log.warning("get_leader(%r) failed: %r", group, exc)
            else:
                if _key(info) != last:
                    last = _key(info)
                    yield info
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(poll_interval):
                    await wake.wait()
    finally:
        await _cancel_and_wait(follower)
