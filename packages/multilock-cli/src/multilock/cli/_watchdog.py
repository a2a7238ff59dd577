"""The watchdog: the command dies by the term's deadline even if the supervisor is frozen.

The supervisor kills its command before the lease can pass on, but only while it is
scheduled: a supervisor stopped by SIGSTOP, a debugger, a long GC or swap stall or a
CPU-starved container cannot kill anything, and the command would run on beside the next
leader's. So ``multilock run`` starts, before any command, a second tiny process, the
watchdog (``python -I -S -c ...``: 10 MB resident, 4 MB of it its own, and no CPU while
it waits), in a process group of its own so that signals meant for the supervisor or the
command do not reach it.

It reads lines from a pipe and holds one deadline (``time.monotonic()``, one clock for
every process of the machine) and the command's process groups:

- ``deadline T``: the term's local deadline; the supervisor writes it before it starts
  the command and again after every successful renew (the only thing it costs while
  healthy: one write per renew);
- ``group P``: a process group to kill at the deadline. On Linux the command's launcher
  writes it itself, before it ``exec``s the command, so no command ever runs unwatched,
  however the supervisor is scheduled; elsewhere the supervisor writes it after the start;
- ``disarm``: the command is gone; forget the groups and the deadline.

When the deadline passes without a newer one, the watchdog sends SIGKILL to every group
and says so on standard error (``multilock: watchdog: ...``, with how late it was). When
the pipe closes (the supervisor exited or died, even by SIGKILL), it kills the groups it
still holds and exits.

What remains possible: a freeze of the whole machine, or of the command and the watchdog
together (one cgroup frozen with both in it). Then the command is frozen too, and on
resume the watchdog's first act is the overdue SIGKILL, before the command can do more
than a few milliseconds of work; the fencing token (``MULTILOCK_TOKEN``) is what protects
the resource then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from types import TracebackType
from typing import Self

__all__ = ["Watchdog"]

log = logging.getLogger("multilock.cli")

#: The watchdog process. It imports nothing but the standard library's C modules and
#: ``select``, so it starts in a few milliseconds and never waits for the supervisor.
_PROGRAM = r"""
import os, select, signal, sys, time
fd, deadline, groups, pending = 0, None, set(), b""

def kill(why):
    global deadline
    for group in sorted(groups):
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    if groups:
        sys.stderr.write("multilock: watchdog: %s: sent SIGKILL to process group %s\n"
                         % (why, ", ".join(map(str, sorted(groups)))))
        sys.stderr.flush()
    groups.clear()
    deadline = None

while True:
    if deadline is not None and groups:
        late = time.monotonic() - deadline
        if late >= 0:
            kill("the term's deadline passed %.1f ms ago without a renewal" % (late * 1000))
            continue
        timeout = -late
    else:
        timeout = None
    if not select.select([fd], [], [], timeout)[0]:
        continue
    data = os.read(fd, 65536)
    if not data:
        kill("the supervisor is gone")
        break
    pending += data
    *lines, pending = pending.split(b"\n")
    for line in lines:
        word, _, value = line.decode().partition(" ")
        if word == "deadline":
            deadline = float(value)
        elif word == "group":
            groups.add(int(value))
        elif word == "disarm":
            groups.clear()
            deadline = None
"""


class Watchdog:
    """The supervisor's end of the watchdog process: start it, arm it, extend it, close it.

    ``async with Watchdog() as watchdog:`` starts the process; `child_fd` is the pipe's
    write end for the command's launcher (passed with ``pass_fds``). Every write is one
    short line into a pipe the watchdog keeps reading: it never blocks the event loop.
    """

    def __init__(self) -> None:
        self._process: asyncio.subprocess.Process | None = None
        self._write: int | None = None
        self._deadline: float | None = None

    @property
    def child_fd(self) -> int | None:
        """The pipe's write end, for the command's launcher; None once closed."""
        return self._write

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def __aenter__(self) -> Self:
        read, write = os.pipe()
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", _PROGRAM,
                stdin=read, process_group=0,
            )  # fmt: skip
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._write = write
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the pipe: the watchdog kills what it still holds and exits."""
        write, self._write = self._write, None
        if write is not None:
            os.close(write)
        process = self._process
        if process is not None:
            try:
                await asyncio.wait_for(process.wait(), 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()

    def arm(self, deadline: float) -> None:
        """A term begins with *deadline* (monotonic seconds): before its command starts."""
        self._deadline = None
        self.extend(deadline)

    def extend(self, deadline: float) -> None:
        """A renew succeeded: the command may run until *deadline*."""
        if self._deadline is not None and deadline <= self._deadline:
            return
        self._deadline = deadline
        self._send(f"deadline {deadline!r}")

    def watch(self, group: int) -> None:
        """Kill process group *group* at the deadline (the launcher may have said so first)."""
        self._send(f"group {group}")

    def disarm(self) -> None:
        """The command and its group are gone: nothing to kill until the next `arm`."""
        self._deadline = None
        self._send("disarm")

    def _send(self, line: str) -> None:
        if self._write is None:
            return
        try:
            os.write(self._write, line.encode() + b"\n")
        except OSError as exc:  # the watchdog died: the supervisor's own kills still hold
            log.warning("the watchdog (pid %s) is gone: %r", self.pid, exc)
            with contextlib.suppress(OSError):
                os.close(self._write)
            self._write = None
