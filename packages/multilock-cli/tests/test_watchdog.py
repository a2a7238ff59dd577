"""The watchdog process kills the command's group by the deadline, on its own.

Real processes (the watchdog is one): each waits on a process's exit with a deadline, never
sleeps and hopes. The deadlines are short and the bounds generous for a loaded machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from multilock.cli._child import spawn_process
from multilock.cli._watchdog import Watchdog

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")

#: Real seconds a process may take to be killed or to exit; a bound, never a sleep.
WAIT = 10.0


def alive(pid: int) -> bool:
    """Running (a zombie, killed but not reaped by its frozen parent, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return not sys.platform.startswith("linux")


async def sleeper() -> asyncio.subprocess.Process:
    """``sleep`` in a process group of its own, registered with no watchdog."""
    return await asyncio.create_subprocess_exec("sleep", "60", process_group=0)


async def test_the_group_dies_at_the_deadline_without_an_extension() -> None:
    async with Watchdog() as watchdog:
        deadline = time.monotonic() + 0.3
        watchdog.arm(deadline)
        child = await spawn_process(["sleep", "60"], dict(os.environ), watchdog)
        status = await asyncio.wait_for(child.wait(), WAIT)
        died = time.monotonic()
    assert status == 128 + signal.SIGKILL
    assert died >= deadline  # not before the deadline: the term was still valid


async def test_extensions_keep_it_alive_and_the_last_one_bounds_it() -> None:
    async with Watchdog() as watchdog:
        watchdog.arm(time.monotonic() + 0.3)
        child = await spawn_process(["sleep", "60"], dict(os.environ), watchdog)
        end = time.monotonic() + 1.0
        last = 0.0
        while time.monotonic() < end:  # renewals every 0.1 s, each 0.3 s ahead
            last = time.monotonic() + 0.3
            watchdog.extend(last)
            await asyncio.sleep(0.1)
            assert alive(child.pid), "killed although every renewal came in time"
        watchdog.extend(last - 10)  # an older deadline never shortens the term
        status = await asyncio.wait_for(child.wait(), WAIT)
        assert time.monotonic() >= last
    assert status == 128 + signal.SIGKILL


async def test_disarm_spares_the_next_command_and_a_new_term_rearms() -> None:
    async with Watchdog() as watchdog:
        watchdog.arm(time.monotonic() + 0.2)
        first = await spawn_process(["true"], dict(os.environ), watchdog)
        assert await asyncio.wait_for(first.wait(), WAIT) == 0
        watchdog.disarm()
        stranger = await sleeper()  # not the term's command: never killed
        watchdog.arm(time.monotonic() + 0.2)
        second = await spawn_process(["sleep", "60"], dict(os.environ), watchdog)
        assert await asyncio.wait_for(second.wait(), WAIT) == 128 + signal.SIGKILL
        assert stranger.returncode is None
        stranger.kill()
        await stranger.wait()


async def test_a_dead_supervisor_takes_its_command_with_it(tmp_path: Path) -> None:
    """The pipe closes when the supervisor goes: the watchdog kills what it holds."""
    watchdog = Watchdog()
    await watchdog.__aenter__()
    watchdog.arm(time.monotonic() + 60)
    child = await spawn_process(["sleep", "60"], dict(os.environ), watchdog)
    await watchdog.aclose()  # what the kernel does to the pipe when the supervisor dies
    assert await asyncio.wait_for(child.wait(), WAIT) == 128 + signal.SIGKILL


async def test_a_frozen_supervisor_does_not_delay_the_kill(tmp_path: Path) -> None:
    """SIGSTOP the process that armed the watchdog: the command still dies on time."""
    script = tmp_path / "supervisor.py"
    script.write_text(
        """
import asyncio, os, sys, time
from multilock.cli._child import spawn_process
from multilock.cli._watchdog import Watchdog

async def main():
    async with Watchdog() as watchdog:
        watchdog.arm(time.monotonic() + 1.0)
        child = await spawn_process(["sleep", "60"], dict(os.environ), watchdog)
        print(child.pid, flush=True)
        os.kill(os.getpid(), 19)  # SIGSTOP: frozen before it can kill anything itself
        await child.wait()

asyncio.run(main())
"""
    )
    supervisor = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        assert supervisor.stdout is not None
        pid = int(await asyncio.wait_for(supervisor.stdout.readline(), WAIT))
        end = time.monotonic() + WAIT
        while alive(pid) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        assert not alive(pid), "the command outlived its deadline while the supervisor was frozen"
    finally:
        supervisor.send_signal(signal.SIGCONT)
        supervisor.kill()
        _, err = await supervisor.communicate()
    assert b"multilock: watchdog: the term's deadline passed" in err, err
