"""The threaded `LeaderScheduler`: a ``BackgroundScheduler`` that runs jobs only on the leader.

The same switch as `multilock.apscheduler.LeaderScheduler`, over the blocking facade
`multilock.core.sync.LeaderElection`: one daemon thread reads the election's ACQUIRED and
LOST events and resumes or pauses the scheduler. The same guarantees and limits apply
(see that module): jobs already running when the term ends go on, so they fence with
``leadership.token`` and watch ``leadership.lost`` / ``leadership.check()``.

The difference is on exit: by default the scheduler's shutdown waits for running jobs
*before* the election stops, so the lease is released only once they are done and a
graceful handoff never overlaps two runs. The term stays valid (and renewed) meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, Unpack

from multilock.core import ElectionFields, ElectionOptions, EventKind, Leadership, Provider
from multilock.core.sync import EventIterator, LeaderElection

from ._common import check_arguments, pause, resume

__all__ = ["LeaderScheduler"]

#: How long leaving waits for the event thread to notice it is closed (it is woken at once).
_JOIN_TIMEOUT = 5.0


class LeaderScheduler:
    """Run *scheduler*'s jobs only while this replica leads its group, from threaded code.

    *scheduler* is an APScheduler 3.x scheduler that is not started yet, normally a
    ``BackgroundScheduler``. *provider* is a `multilock.core.Provider` (never closed here)
    or a URL (the provider is built and, on exit, closed by the election). Pass an
    `ElectionOptions` or its fields as keywords (typed by `multilock.core.ElectionFields`),
    not both; *loop_factory* is passed to
    `multilock.core.sync.LeaderElection`::

        scheduler = BackgroundScheduler()
        scheduler.add_job(report, "cron", hour=3)
        with LeaderScheduler(scheduler, "redis://localhost:6379/0", group="reports"):
            stop_event.wait()

    Leaving shuts the scheduler down (waiting for running jobs when *wait_for_jobs*), then
    stops the election, releasing the lease. One use only.
    """

    def __init__(
        self,
        scheduler: Any,
        provider: Provider | str,
        options: ElectionOptions | None = None,
        *,
        wait_for_jobs: bool = True,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        **option_fields: Unpack[ElectionFields],
    ) -> None:
        self._options = check_arguments(scheduler, provider, options, option_fields)
        self._scheduler = scheduler
        self._provider = provider
        self._wait_for_jobs = wait_for_jobs
        self._loop_factory = loop_factory
        self._election: LeaderElection | None = None
        self._stack: contextlib.ExitStack | None = None
        # Held while the event thread switches the scheduler; _closing ends its switching.
        self._lock = threading.Lock()
        self._closing = False

    # ------------------------------------------------------------------ properties
    @property
    def scheduler(self) -> Any:
        """The APScheduler scheduler this switches."""
        return self._scheduler

    @property
    def options(self) -> ElectionOptions:
        return self._options

    @property
    def election(self) -> LeaderElection:
        """The election, built on entry (`RuntimeError` before)."""
        if self._election is None:
            raise RuntimeError("the election is built when the LeaderScheduler is entered")
        return self._election

    @property
    def leadership(self) -> Leadership | None:
        """The current term (its ``token`` fences a job's writes), or None when not leading.

        A job reads it as it starts (None: do nothing) and watches its ``lost`` event.
        """
        return None if self._election is None else self._election.leadership

    @property
    def is_leader(self) -> bool:
        return self._election is not None and self._election.is_leader

    def __repr__(self) -> str:
        options = self._options
        return (
            f"<multilock.apscheduler.sync.LeaderScheduler group={options.group!r} "
            f"participant_id={options.participant_id!r} leading={self.is_leader} "
            f"scheduler={type(self._scheduler).__name__}>"
        )

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        if self._election is not None:
            raise RuntimeError("a LeaderScheduler can be entered only once")
        with contextlib.ExitStack() as stack:
            # Callbacks run in reverse on exit: stop the event thread, shut the scheduler
            # down, stop the election (release; close it when it was built from a URL).
            election = self._election = LeaderElection(
                self._provider, self._options, loop_factory=self._loop_factory
            )
            stack.push(election.__exit__)
            self._scheduler.start(paused=True)
            stack.callback(self._shut_down)
            events = election.events(EventKind.ACQUIRED | EventKind.LOST)
            thread = threading.Thread(
                target=self._follow,
                args=(election, events),
                name=f"multilock-apscheduler-{election.group}",
                daemon=True,
            )
            stack.callback(_stop_following, thread, events)
            thread.start()
            election.start()
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _follow(self, election: LeaderElection, events: EventIterator) -> None:
        scheduler = self._scheduler
        for event in events:  # ends when the election stops or the iterator is closed
            with self._lock:
                if self._closing:
                    return
                if event.kind is EventKind.ACQUIRED:
                    resume(scheduler, event, election.is_leader)
                else:
                    pause(scheduler, event.group, event.token, "leadership lost")

    def _shut_down(self) -> None:
        scheduler = self._scheduler
        with self._lock:
            self._closing = True
            if not scheduler.running:  # the program shut it down itself
                return
            leadership = self.leadership
            token = None if leadership is None else leadership.token
            pause(scheduler, self._options.group, token, "stopping")
        # Outside the lock: waiting for jobs can take long. No job starts: it is paused.
        scheduler.shutdown(wait=self._wait_for_jobs)


def _stop_following(thread: threading.Thread, events: EventIterator) -> None:
    events.close()  # wakes the thread if it waits for an event
    if thread.is_alive():  # not started when entering failed early
        thread.join(_JOIN_TIMEOUT)
