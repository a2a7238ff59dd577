"""`FakeClock`: virtual monotonic time for asyncio, so tests never sleep for real."""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["FakeClock"]

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Poll real I/O without waiting; when idle, jump the clock to the next timer."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self._fake = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if ready:
            return ready
        if timeout is None:
            # Nothing is scheduled: only another thread can wake the loop. Wait for it.
            result: list[tuple[selectors.SelectorKey, int]] = super().select(None)
            return result
        if self._fake.real_grace and timeout > 0:
            ready = super().select(min(timeout, self._fake.real_grace))
            if ready:
                return ready
        self._fake.advance(timeout)
        return []


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: FakeClock) -> None:
        super().__init__(selector=_JumpingSelector(clock))
        self._fake = clock
        # A real loop runs timers up to the clock's resolution early; with a clock that
        # only moves when told, that would re-run a "just not yet" timer forever.
        self._clock_resolution = 0.0

    def time(self) -> float:
        return self._fake.now


class FakeClock:
    """A monotonic clock that only moves when told to, or when its event loop is idle.

    ``run(coro)`` runs *coro* on an event loop whose ``time()`` is this clock; whenever every
    task is waiting on a timer, the clock jumps straight to the next one ("autojump"), so a
    test of a 15 s lease finishes in milliseconds, deterministically. Use ``monotonic`` as
    the clock of an `InMemoryProvider` so the store judges expiry on the same time.

    ``real_grace`` (seconds) lets worker threads a little real time to report back before
    the clock jumps; tests that use threads (the sync facade) set it.
    """

    def __init__(self, start: float = 1000.0, *, real_grace: float = 0.0) -> None:
        self.now = float(start)
        self.real_grace = real_grace

    def monotonic(self) -> float:
        """Return the current virtual time in seconds."""
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by *seconds* (never backwards)."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        # Always move by at least one representable step, so a timer due a rounding
        # error from now is reached instead of waited for forever.
        self.now = max(self.now + seconds, math.nextafter(self.now, math.inf))

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        """Return an event loop whose time is this clock (pass as a ``loop_factory``)."""
        return _VirtualTimeLoop(self)

    def run(self, main: Coroutine[Any, Any, T] | Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run a coroutine (or a zero-argument coroutine function) in virtual time."""
        coro = main if isinstance(main, Coroutine) else main()
        with asyncio.Runner(loop_factory=self.new_event_loop) as runner:
            return runner.run(coro)

    def __repr__(self) -> str:
        return f"<FakeClock now={self.now:.6f}>"
