"""`Supervisor`: run a command only while this process leads, and kill it in time.

The timing argument. A `Leadership` has a local deadline, ``sent + lease * (1 - drift) -
margin`` on the monotonic clock, where ``sent`` is when the last successful acquire or
renew was sent; the store cannot give the lease to anyone else before ``deadline +
margin``. The supervisor therefore:

- sends SIGTERM to the command's process group as soon as ``time_left`` drops to
  ``grace`` (renews are failing: a healthy term never gets that low, the options are
  checked for it) or this process is asked to stop;
- sends SIGKILL ``grace`` seconds after the SIGTERM, and never later than the deadline;
- sends SIGKILL at once when the election reports the term over (the store said the lease
  is gone or taken, or the deadline passed): the election cancels the supervising task
  the moment the term ends;
- reaps the command, kills whatever it left in its process group, and only then lets the
  election release the lease.

So the command is dead before the lease can pass to another process, with the step-down
margin (``min(0.25 s, 2% of the lease)`` plus the drift allowance) to spare for signal
delivery. A supervisor that is itself frozen (SIGSTOP, a stall) cannot kill anything: the
*guard* (``multilock run``'s watchdog process, see ``_watchdog``) holds the deadline too,
armed before the command starts and extended after each successful renew, and kills the
command's group when it passes without an extension.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol

import attrs

from multilock.core import (
    ConfigurationError,
    ElectionObserver,
    ElectionOptions,
    LeaderElection,
    Leadership,
    add_observer,
    remove_observer,
)
from multilock.core import RunStatus as _RunStatus

from ._common import SIGNAL_BASE, ExitCode

__all__ = ["Child", "Guard", "Spawn", "Supervisor", "check_grace", "default_grace"]

log = logging.getLogger("multilock.cli")


class Child(Protocol):
    """A started command: signals go to its whole process group."""

    @property
    def pid(self) -> int: ...

    def send(self, signum: int) -> None:
        """Send *signum* to the command's process group (a no-op once it is gone)."""

    async def wait(self) -> int:
        """Wait for the command to exit; return its status as a shell reports it."""


#: Start the command with this environment; raise `CliError` if it cannot be run.
Spawn = Callable[[Mapping[str, str]], Awaitable[Child]]


class Guard(Protocol):
    """Kills the command at the term's deadline on its own, however the supervisor fares."""

    def arm(self, deadline: float) -> None:
        """A term with *deadline* (monotonic seconds) begins; its command is about to start."""

    def extend(self, deadline: float) -> None:
        """A renew succeeded: the term now ends at *deadline*."""

    def disarm(self) -> None:
        """The term's command and its process group are gone."""


class _Renewals(ElectionObserver):
    """Passes each successful renew of one election on to the guard, as it happens."""

    def __init__(self, election: LeaderElection, guard: Guard) -> None:
        self._election, self._guard = election, guard

    def renewed(self, election: LeaderElection, latency: float) -> None:
        leadership = election.leadership if election is self._election else None
        if leadership is not None:
            self._guard.extend(leadership.deadline)


def _healthy_low(options: ElectionOptions) -> float:
    """The least ``time_left`` of a healthy term: just before a renew, minus nothing yet."""
    usable = options.lease_duration * (1 - options.max_clock_drift) - options.step_down_margin
    return usable - options.renew_interval


def default_grace(options: ElectionOptions) -> float:
    """A fifth of the lease: always within the rule of `check_grace`."""
    return options.lease_duration / 5


def check_grace(grace: float, options: ElectionOptions) -> float:
    """Reject a grace period that a healthy term could trigger.

    Rule: ``0 < grace <= (lease * (1 - drift) - margin - renew_interval) / 2``. Just before
    each renew a healthy leader has ``lease * (1 - drift) - margin - renew_interval`` left;
    half of that stays for the renew's round trip, half may be the grace.
    """
    low = _healthy_low(options)
    if not grace > 0:
        raise ConfigurationError(f"--grace must be positive, got {grace:g}")
    if not grace <= low / 2:
        raise ConfigurationError(
            f"--grace {grace:g} is too long for --lease {options.lease_duration:g}: a healthy "
            "term could trigger it; the rule (lease * (1 - drift) - margin - renew_interval) / 2 "
            f">= grace gives ({options.lease_duration:g} * (1 - {options.max_clock_drift:g}) - "
            f"{options.step_down_margin:g} - {options.renew_interval:g}) / 2 = {low / 2:.3g}"
        )
    return grace


#: Why a command ended: by itself, because we were asked to stop, or because renewals failed.
_Why = Literal["exited", "stopped", "at-risk"]


@attrs.frozen
class _Outcome:
    why: _Why
    status: int


class Supervisor:
    """Campaign with *election*; in each term run the command that *spawn* starts.

    Without *forever*, `run` returns after the first command ends; with it, it runs the
    command again in every new term until asked to stop (`request_stop`).
    """

    def __init__(
        self,
        election: LeaderElection,
        spawn: Spawn,
        *,
        grace: float,
        forever: bool = False,
        guard: Guard | None = None,
    ) -> None:
        self._election = election
        self._spawn = spawn
        self._guard = guard
        self._grace = check_grace(grace, election.options)
        self._forever = forever
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()
        self._stop_signal: int | None = None
        self._child: Child | None = None

    def request_stop(self, signum: int) -> None:
        """Stop: SIGTERM to the command, SIGKILL after the grace; a second request kills now."""
        if self._stop_signal is None:
            self._stop_signal = signum
            log.info("received signal %d: stopping", signum)
            self._stopping.set()
        else:
            self._hurry.set()

    def forward(self, signum: int) -> bool:
        """Pass *signum* to the running command; False when none runs."""
        if self._child is None:
            return False
        self._child.send(signum)
        return True

    def _stopped_status(self) -> int:
        return SIGNAL_BASE + (self._stop_signal or signal.SIGTERM)

    async def run(self) -> int:
        """Campaign, run, supervise; release when done. Return the exit code."""
        election = self._election
        renewals = None if self._guard is None else _Renewals(election, self._guard)
        if renewals is not None:
            add_observer(renewals)
        await election.start()
        try:
            while True:
                leadership = await self._wait_for_term()
                if leadership is None:
                    return self._stopped_status()
                result = await election.run_if_leader(self._term)
                if result.status is _RunStatus.NOT_LEADER:
                    continue  # the term ended before the command could start
                if result.status is _RunStatus.LOST or result.value is None:
                    if self._stopping.is_set():
                        return self._stopped_status()
                    if not self._forever:
                        return ExitCode.LOST
                    continue
                outcome = result.value
                if outcome.why == "stopped":
                    return outcome.status
                if not self._forever:
                    return ExitCode.LOST if outcome.why == "at-risk" else outcome.status
                # --forever: a new run needs a new term; let a waiting candidate have it first.
                await election.resign()
        finally:
            await election.stop()
            if renewals is not None:
                remove_observer(renewals)

    async def _wait_for_term(self) -> Leadership | None:
        """The next term, or None when asked to stop first."""
        if self._stopping.is_set():
            return None
        waiter = asyncio.ensure_future(self._election.wait_until_leader())
        stopper = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (waiter, stopper):
                task.cancel()
            await asyncio.wait({waiter, stopper})
        if self._stopping.is_set():
            return None
        return waiter.result()

    def _environment(self, leadership: Leadership) -> dict[str, str]:
        return {
            **os.environ,
            "MULTILOCK_TOKEN": str(leadership.token),
            "MULTILOCK_GROUP": leadership.group,
            "MULTILOCK_PARTICIPANT_ID": leadership.participant_id,
        }

    async def _term(self, leadership: Leadership) -> _Outcome:
        """Run the command for this term; the election cancels this task when the term ends."""
        if self._stopping.is_set():
            return _Outcome("stopped", self._stopped_status())
        guard = self._guard
        if guard is not None:
            guard.arm(leadership.deadline)  # before the command can run
        try:
            child = await self._spawn(self._environment(leadership))
        except BaseException:
            if guard is not None:
                guard.disarm()
            raise
        self._child = child
        log.info("leading with token %d: started the command (pid %d)", leadership.token, child.pid)
        try:
            return await self._supervise(child, leadership)
        except asyncio.CancelledError:
            # _supervise sent SIGKILL before anything else could run; now reap.
            log.warning(
                "the term of token %d ended: sent SIGKILL to the command (pid %d)",
                leadership.token,
                child.pid,
            )
            await child.wait()
            raise
        finally:
            child.send(signal.SIGKILL)  # whatever the command left in its process group
            self._child = None
            if guard is not None:
                guard.disarm()

    async def _supervise(self, child: Child, leadership: Leadership) -> _Outcome:
        loop = asyncio.get_running_loop()
        grace = self._grace
        exited = asyncio.ensure_future(child.wait())
        stop_wait = asyncio.ensure_future(self._stopping.wait())
        hurry_wait = asyncio.ensure_future(self._hurry.wait())
        why: _Why = "exited"
        termed_at: float | None = None
        killed = False
        try:
            while not exited.done():
                now, left = loop.time(), leadership.time_left
                if termed_at is None and (left <= grace or self._stopping.is_set()):
                    why = "stopped" if self._stopping.is_set() else "at-risk"
                    if why == "at-risk":
                        log.warning(
                            "renewals of token %d are failing (%.3g s left): sending SIGTERM "
                            "to the command (pid %d)",
                            leadership.token,
                            left,
                            child.pid,
                        )
                    child.send(signal.SIGTERM)
                    termed_at = now
                overdue = termed_at is not None and (
                    left <= 0 or now >= termed_at + grace or self._hurry.is_set()
                )
                if overdue and not killed:
                    log.warning("the command (pid %d) is still running: SIGKILL", child.pid)
                    child.send(signal.SIGKILL)
                    killed = True
                waiters: set[asyncio.Future[Any]] = {exited}
                timeout: float | None = None
                if termed_at is None:
                    waiters.add(stop_wait)
                    timeout = left - grace
                elif not killed:
                    waiters.add(hurry_wait)
                    timeout = min(termed_at + grace - now, left)
                await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            child.send(signal.SIGKILL)  # the term is over: not one await before this
            raise
        finally:
            for task in (stop_wait, hurry_wait):
                task.cancel()
            if not exited.done():  # cancelled: the caller kills and reaps
                exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({stop_wait, hurry_wait})
        status = exited.result()
        log.info("the command (pid %d) exited with status %d", child.pid, status)
        return _Outcome(why, status)
