"""`leader_only`: a function that runs only when this process leads a group.

For jobs that every replica schedules (a thread timer, APScheduler, a cron-like loop in
each web process) but only one should do::

    @leader_only("nightly-report")
    def nightly_report():
        ...

    result = nightly_report()        # RunResult: NOT_LEADER, COMPLETED (value) or LOST

Each group has one election per process, built from ``settings.MULTILOCK`` and started
on first use; it keeps campaigning in the background for the life of the process and
releases the group at exit (``atexit``). The first call, which starts the campaign,
returns NOT_LEADER unless the group was won already: call ``.start()`` where the
scheduler starts, so that the first scheduled run is not missed.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

from multilock.core import Leadership, RunResult, validate_name
from multilock.core.sync import LeaderElection

from ._current import leading
from ._settings import multilock_settings

__all__ = ["LeaderOnly", "close_elections", "leader_only"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
#: The process's elections, by group name as given (without the prefix).
_elections: dict[str, LeaderElection] = {}
_atexit_registered = False


def _forget_after_fork() -> None:
    """A forked child has no loop thread: its elections start afresh on next use."""
    global _lock
    _lock = threading.Lock()
    _elections.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _election_for(name: str) -> LeaderElection:
    """Return this process's started election of group *name*, building it on first use."""
    global _atexit_registered
    election = _elections.get(name)
    if election is not None:  # the settings are read once per group, not on every call
        return election
    with _lock:
        election = _elections.get(name)
        if election is None:
            config = multilock_settings()
            election = LeaderElection(config.url, config.election_options(name))
            try:
                election.start()
            except BaseException:
                election.close()
                raise
            _elections[name] = election
            if not _atexit_registered:
                atexit.register(close_elections)
                _atexit_registered = True
    return election


def close_elections() -> None:
    """Stop every `leader_only` election of this process, releasing the groups it leads.

    Runs at exit; call it yourself to release earlier. A later call of a decorated
    function starts a new election.
    """
    with _lock:
        elections = list(_elections.values())
        _elections.clear()
    for election in elections:
        try:
            election.close()
        except Exception:
            log.exception("closing the election of %r failed", election.group)


class LeaderOnly(Generic[P, T]):
    """A function wrapped by `leader_only`; calling it returns a `RunResult`."""

    # Copied from the function by functools.update_wrapper.
    __name__: str
    __qualname__: str
    __wrapped__: Callable[P, T]

    def __init__(self, group: str, fn: Callable[P, T]) -> None:
        self.group = validate_name(group, "group")
        self._fn = fn
        functools.update_wrapper(self, fn)

    @property
    def election(self) -> LeaderElection:
        """This process's election of the group: built from the settings and started."""
        return _election_for(self.group)

    def start(self) -> None:
        """Start campaigning now (idempotent), so that the first call can already lead."""
        _election_for(self.group)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> RunResult[T]:
        """Call the function in this thread, only if this process leads the group now.

        Return NOT_LEADER (not called), COMPLETED with its value, or LOST (the term ended
        before it returned, or it raised `LeadershipLost` from ``check()``). Other
        exceptions propagate. Inside, `current_leadership()` returns the term.
        """

        def call(leadership: Leadership) -> T:
            with leading(leadership):
                return self._fn(*args, **kwargs)

        return self.election.run_if_leader(call)

    def __repr__(self) -> str:
        return f"<leader_only group={self.group!r} fn={self._fn!r}>"


def leader_only(group: str) -> Callable[[Callable[P, T]], LeaderOnly[P, T]]:
    """Decorate a function to run only when this process leads *group*.

    The group name gets ``MULTILOCK["GROUP_PREFIX"]`` in front; options come from
    ``MULTILOCK["OPTIONS"]``. The settings are read on first use, not at import.
    """
    validate_name(group, "group")

    def decorate(fn: Callable[P, T]) -> LeaderOnly[P, T]:
        return LeaderOnly(group, fn)

    return decorate
