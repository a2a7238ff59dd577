"""What the asyncio and the threaded `LeaderScheduler` share: their argument checks, and
switching a scheduler.

Both switch an APScheduler 3.x scheduler with its public ``pause()`` / ``resume()`` /
``shutdown()``, so any scheduler class works; ``pause()`` and ``resume()`` are thread-safe
in every 3.x scheduler (they set a state and wake the scheduler up). One private lock is
read as well, to let a pass over due jobs already under way end (`_finish_pass`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from apscheduler.schedulers.base import (  # type: ignore[import-untyped]
    STATE_PAUSED,
    STATE_RUNNING,
    BaseScheduler,
)

from multilock.core import ConfigurationError, ElectionOptions, LeadershipEvent, Provider

__all__ = ["check_arguments", "pause", "resume"]

log = logging.getLogger(__name__)


def check_arguments(
    scheduler: Any,
    provider: object,
    options: ElectionOptions | None,
    fields: Mapping[str, Any],
) -> ElectionOptions:
    """Check the arguments of either `LeaderScheduler` at once; return the election options.

    *scheduler* must be an APScheduler 3.x scheduler that is not started yet: it is started
    paused, so that no job runs before this replica is elected. *provider* must be a
    `multilock.core.Provider` or a URL. The election options (an `ElectionOptions`, or its
    *fields* as keywords, not both) are validated now, as `LeaderElection` would: a
    mistake fails where the scheduler is built, not when it is entered.
    """
    if not isinstance(scheduler, BaseScheduler):
        raise TypeError(
            "scheduler must be an APScheduler 3.x scheduler (apscheduler.schedulers.base."
            f"BaseScheduler), not {type(scheduler).__name__}"
        )
    if scheduler.running:
        raise RuntimeError(
            "the scheduler is already started: give LeaderScheduler a scheduler that is not, "
            "it starts it paused and resumes it only while this replica leads"
        )
    if not isinstance(provider, Provider | str):
        raise ConfigurationError(
            f"provider must be a multilock Provider or a URL, not {type(provider).__name__}"
        )
    if options is None:
        return ElectionOptions.from_fields(fields)
    if fields:
        raise ConfigurationError(
            "pass either an ElectionOptions or its fields as keywords, not both "
            f"(got options and {', '.join(sorted(fields))})"
        )
    if not isinstance(options, ElectionOptions):
        raise ConfigurationError(
            f"options must be an ElectionOptions, not {type(options).__name__}"
        )
    return options


def resume(scheduler: Any, event: LeadershipEvent, still_leading: bool) -> None:
    """Let the scheduler run jobs: this replica won a term.

    *still_leading* is the election's current ``is_leader``: an ACQUIRED event read late,
    after its term already ended, must not resume the scheduler.
    """
    if not still_leading or scheduler.state != STATE_PAUSED:
        return
    scheduler.resume()
    log.info("%s: leading with token %s, scheduler resumed", event.group, event.token)


def pause(scheduler: Any, group: str, token: int | None, why: str) -> None:
    """Stop the scheduler from starting jobs; jobs already running go on (APScheduler 3.x
    cannot cancel them), so they must fence with the term's token or ``check()`` it."""
    if scheduler.state != STATE_RUNNING:
        return
    scheduler.pause()
    _finish_pass(scheduler)
    log.info("%s: %s (token %s), scheduler paused", group, why, token)


def _finish_pass(scheduler: Any) -> None:
    """Wait for a pass over due jobs that is under way in another thread to end.

    ``pause()`` only sets a state, which a pass checks as it begins: one already under
    way (it holds the job stores' lock) still submits the jobs it found due, and a
    ``shutdown()`` during it makes it fail as it removes a finished job. APScheduler 3.x
    has no public way to wait for it; the lock is the same attribute in every 3.x release.
    """
    lock = getattr(scheduler, "_jobstores_lock", None)
    if lock is not None:
        with lock:
            pass
