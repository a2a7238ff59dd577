"""`stop_on_signals`: SIGTERM and SIGINT release every lease before the program exits.

systemd, Docker and Kubernetes stop a process with SIGTERM, whose default action kills an
asyncio program where it stands: its lease then lives on and followers wait for it to
expire. Inside ``async with stop_on_signals():`` the signal instead stops every running
election of the loop (each releases its lease, so a follower takes over within one
notification round trip), then cancels the body, and the block ends with
``SystemExit(128 + signum)``: the exit status a shell reports for that signal, with no
traceback.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from ._election import running

__all__ = ["stop_on_signals"]

log = logging.getLogger("multilock.core")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def stop_running_elections(loop: asyncio.AbstractEventLoop) -> None:
    """Stop every election running on *loop*, concurrently; errors are logged."""
    elections = [e for e in list(running) if e._loop is loop]
    results = await asyncio.gather(*(e.stop() for e in elections), return_exceptions=True)
    for election, result in zip(elections, results, strict=True):
        if isinstance(result, BaseException):
            log.error("stopping %r on a signal raised", election, exc_info=result)


class stop_on_signals:
    """Make SIGTERM and SIGINT stop the loop's elections gracefully, then exit.

    Wrap the body of the program's main coroutine::

        async def main() -> None:
            async with stop_on_signals(), LeaderElection(provider, group="g") as election:
                await election.run_while_leader(work)

    On the first of *signals* every election running on this loop is stopped (leader work
    cancelled, leases released, LOST emitted), then the body is cancelled, and the block
    raises ``SystemExit(128 + signum)``. A second signal while stopping is ignored. The
    handlers are the loop's (`loop.add_signal_handler`, main thread only); those there
    before are put back on exit.
    """

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self._signals = tuple(signal.Signals(s) for s in signals)
        if not self._signals:
            raise ValueError("stop_on_signals() needs at least one signal")
        self._task: asyncio.Task[Any] | None = None
        self._previous: dict[signal.Signals, Callable[..., Any] | int | None] = {}
        self._received: signal.Signals | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._cancelled = False

    @property
    def received(self) -> signal.Signals | None:
        """The signal that stopped the program, or None."""
        return self._received

    async def __aenter__(self) -> stop_on_signals:
        if self._task is not None:
            raise RuntimeError("stop_on_signals() is not reentrant")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("stop_on_signals() must be used inside a task")
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            self._previous[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, self._on_signal, sig)
        self._task = task
        return self

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._received is not None:
            log.info("%s received while stopping; still stopping", sig.name)
            return
        self._received = sig
        log.info("%s received: stopping this process's elections", sig.name)
        self._stopping = asyncio.get_running_loop().create_task(
            self._stop(), name="multilock-signal"
        )

    async def _stop(self) -> None:
        await stop_running_elections(asyncio.get_running_loop())
        if self._task is not None:  # the body is still running: end it
            self._cancelled = True
            self._task.cancel(msg=f"multilock: {self._received}")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        loop = asyncio.get_running_loop()
        for sig, previous in self._previous.items():
            loop.remove_signal_handler(sig)
            if previous is not None:
                signal.signal(sig, previous)
        self._previous.clear()
        received = self._received
        if received is None:
            return
        if self._stopping is not None and not self._stopping.done():
            await asyncio.shield(self._stopping)  # the body ended on its own meanwhile
        if self._cancelled and task is not None:
            task.uncancel()
        if exc_type is None or (self._cancelled and issubclass(exc_type, asyncio.CancelledError)):
            raise SystemExit(128 + received)
