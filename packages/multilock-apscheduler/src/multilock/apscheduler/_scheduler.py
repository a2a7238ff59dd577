"""`LeaderScheduler`: run an asyncio program's APScheduler jobs on the elected replica only.

Every replica builds the same scheduler with the same jobs; ``async with
LeaderScheduler(scheduler, provider, group=...)`` starts it *paused*, campaigns with a
`multilock.core.LeaderElection`, resumes the scheduler on ACQUIRED and pauses it on LOST.

What it guarantees and what it does not:

- A scheduler starts jobs only while its replica leads: it is paused until ACQUIRED and
  paused again on LOST, within one turn of the event loop. A job started in that turn sees
  `LeaderScheduler.leadership` None, so a job that reads it first never acts outside a term.
- APScheduler 3.x cannot stop a job that is already running. A job that outlives the term
  keeps running on the ex-leader while the new leader starts its own runs: read
  `LeaderScheduler.leadership` when the job starts, pass its ``token`` to whatever the job
  writes to (fencing), and call ``check()`` between steps. On exit, coroutine jobs of the
  default ``AsyncIOExecutor`` are cancelled by APScheduler's shutdown; jobs in thread or
  process pools are not waited for.
- Jobs that fell due while this replica followed are handled, on resume, by APScheduler's
  own misfire rules (``coalesce``, ``misfire_grace_time``), which do not know whether the
  former leader ran them: a run due less than ``misfire_grace_time`` before a handover can
  happen on both replicas. Jobs whose every run matters record their runs, with the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import Any, Self, Unpack

from multilock.core import (
    ElectionFields,
    ElectionOptions,
    EventKind,
    EventStream,
    LeaderElection,
    Leadership,
    Provider,
    from_url,
    on_transition,
)

from ._common import check_arguments, pause, resume

__all__ = ["LeaderScheduler"]

log = logging.getLogger(__name__)


class LeaderScheduler:
    """Run *scheduler*'s jobs only while this replica leads its group.

    *scheduler* is an APScheduler 3.x scheduler that is not started yet, normally an
    ``AsyncIOScheduler``. *provider* is a `multilock.core.Provider` (never closed here) or
    a URL for `multilock.core.from_url` (the provider is built on entry and closed on
    exit). Pass an `ElectionOptions` or its fields as keywords (``group=``,
    ``lease_duration=``..., typed by `multilock.core.ElectionFields`), not both::

        scheduler = AsyncIOScheduler()
        scheduler.add_job(report, "cron", hour=3)
        async with LeaderScheduler(scheduler, "redis://localhost:6379/0", group="reports"):
            await stop_event.wait()

    Entering starts the scheduler paused, then the election; leaving shuts the scheduler
    down (no new job starts from then on), then stops the election, which releases the
    lease so another replica takes over at once. An exit that is cancelled (a shutdown
    timeout) ends at once, with the scheduler shut down; the election's stop and the
    provider's close go on in the background, in that order. One use only.
    """

    def __init__(
        self,
        scheduler: Any,
        provider: Provider | str,
        options: ElectionOptions | None = None,
        **option_fields: Unpack[ElectionFields],
    ) -> None:
        self._options = check_arguments(scheduler, provider, options, option_fields)
        self._scheduler = scheduler
        self._provider = provider
        self._election: LeaderElection | None = None
        self._stack: contextlib.AsyncExitStack | None = None

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

        A job reads it as it starts: None means the term ended as the job was started, so
        the job should do nothing.
        """
        return None if self._election is None else self._election.leadership

    @property
    def is_leader(self) -> bool:
        return self._election is not None and self._election.is_leader

    def __repr__(self) -> str:
        options = self._options
        return (
            f"<multilock.apscheduler.LeaderScheduler group={options.group!r} "
            f"participant_id={options.participant_id!r} leading={self.is_leader} "
            f"scheduler={type(self._scheduler).__name__}>"
        )

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> Self:
        if self._election is not None:
            raise RuntimeError("a LeaderScheduler can be entered only once")
        async with contextlib.AsyncExitStack() as stack:
            # Callbacks run in reverse on exit: stop following, shut the scheduler down,
            # stop the election (release), then close the provider.
            provider = self._provider
            closing = None
            if isinstance(provider, str):
                provider = closing = from_url(provider)
            try:
                election = self._election = LeaderElection(provider, self._options)
            except BaseException:
                if closing is not None:
                    await closing.aclose()
                raise
            stack.push_async_callback(_stop_then_close, election, closing)
            self._scheduler.start(paused=True)
            stack.push_async_callback(self._shut_down)
            stream = election.events(EventKind.ACQUIRED | EventKind.LOST)
            follower = asyncio.get_running_loop().create_task(
                self._follow(election, stream), name=f"multilock-apscheduler-{election.group}"
            )
            stack.push_async_callback(_stop_following, follower, stream)
            await election.start()
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def _follow(self, election: LeaderElection, stream: EventStream) -> None:
        scheduler = self._scheduler
        await on_transition(
            stream,
            on_acquired=lambda event: resume(scheduler, event, election.is_leader),
            on_lost=lambda event: pause(scheduler, event.group, event.token, "leadership lost"),
        )

    async def _shut_down(self) -> None:
        scheduler = self._scheduler
        if not scheduler.running:  # the program shut it down itself
            return
        leadership = self.leadership
        token = None if leadership is None else leadership.token
        pause(scheduler, self._options.group, token, "stopping")
        scheduler.shutdown(wait=False)  # wait=True would block the event loop
        # AsyncIOScheduler shuts down in a loop callback: let it run before the release.
        await asyncio.sleep(0)


#: Exits whose caller was cancelled, finishing in the background (held until done).
_FINISHING: set[asyncio.Task[None]] = set()


async def _stop_then_close(election: LeaderElection, provider: Provider | None) -> None:
    """Stop the election (releasing the lease), then close *provider* (None: not ours).

    In a task of its own, shielded: an exit that is cancelled (a shutdown timeout) ends at
    once, as `LeaderElection.stop` does, while the stop and the close go on in the
    background, in that order. Closing the provider as the exit unwinds would close it
    under the release, and leave the lease to expire.
    """
    finishing = asyncio.get_running_loop().create_task(
        _stop_and_close(election, provider), name=f"multilock-apscheduler-stop-{election.group}"
    )
    try:
        await asyncio.shield(finishing)
    except asyncio.CancelledError:
        if not finishing.done():
            log.warning(
                "leaving the LeaderScheduler of %s was cancelled: the election stops in the "
                "background",
                election.group,
            )
            _FINISHING.add(finishing)
            finishing.add_done_callback(_finished)
        raise


async def _stop_and_close(election: LeaderElection, provider: Provider | None) -> None:
    try:
        await election.stop()
    finally:
        if provider is not None:
            await provider.aclose()


def _finished(task: asyncio.Task[None]) -> None:
    """An exit that finished in the background: nobody awaits it, so log its error."""
    _FINISHING.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("stopping the election failed", exc_info=error)


async def _stop_following(follower: asyncio.Task[None], stream: EventStream) -> None:
    follower.cancel()
    await asyncio.wait({follower})
    await stream.aclose()
    if not follower.cancelled() and (error := follower.exception()) is not None:
        log.error("following the election failed", exc_info=error)
