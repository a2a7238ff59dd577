"""`current_leadership`: the term that code run by ``leader_run`` or `leader_only` runs in.

A management command cannot be cancelled from outside, so a long one must look at its
term itself. The term travels in a context variable rather than a global, so that two
elections of one process never see each other's term. Context variables do not follow
into threads the code starts itself: pass the `Leadership` on to them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from multilock.core import Leadership

__all__ = ["current_leadership", "leading"]

_current: contextvars.ContextVar[Leadership | None] = contextvars.ContextVar(
    "multilock_django_leadership", default=None
)


def current_leadership() -> Leadership | None:
    """Return the term the running code was started in, or None outside one.

    Inside a command run by ``manage.py leader_run`` (or a function decorated with
    `leader_only`) this is the leader's `Leadership`: call ``.check()`` between steps (it
    raises `multilock.core.LeadershipLost` once the term is over), wait on ``.lost`` (a
    `threading.Event`) instead of sleeping, and pass ``.token`` to what you write to.
    """
    return _current.get()


@contextlib.contextmanager
def leading(leadership: Leadership) -> Iterator[Leadership]:
    """Make *leadership* what `current_leadership` returns, in this context, until exit."""
    reset = _current.set(leadership)
    try:
        yield leadership
    finally:
        _current.reset(reset)
