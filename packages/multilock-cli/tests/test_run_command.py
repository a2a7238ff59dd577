"""`multilock.cli.run_command`: ``multilock run`` as a coroutine, on a real file store."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import multilock.cli._run as run_module
from multilock.cli import run_command
from multilock.cli._watchdog import Watchdog
from multilock.core import (
    ConfigurationError,
    ElectionObserver,
    LeaderElection,
    MultilockError,
    Provider,
    add_observer,
    from_url,
    remove_observer,
)

#: Real seconds a run may take; a bound, never a sleep.
WAIT = 30.0


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'leases'}"


async def test_runs_the_command_as_leader_and_returns_its_status(url: str, tmp_path: Path) -> None:
    out = tmp_path / "env.txt"
    code = (
        "import os, sys; open(sys.argv[1], 'w').write("
        "os.environ['MULTILOCK_GROUP'] + ' ' + os.environ['MULTILOCK_TOKEN']); sys.exit(3)"
    )
    async with from_url(url) as provider:
        status = await asyncio.wait_for(
            run_command(provider, [sys.executable, "-c", code, str(out)], group="jobs"),
            WAIT,
        )
        assert status == 3
        assert out.read_text() == "jobs 1"
        assert await provider.get_leader("jobs") is None  # released when it exited


async def test_waits_for_the_term(url: str, tmp_path: Path) -> None:
    async with from_url(url) as provider:
        other = LeaderElection(provider, group="jobs", lease_duration=2)
        await other.start()
        await other.wait_until_leader()
        run = asyncio.ensure_future(run_command(provider, ["true"], group="jobs", lease_duration=2))
        await asyncio.sleep(0)
        assert not run.done()
        await other.stop()  # hands over: the command runs, in the next term
        assert await asyncio.wait_for(run, WAIT) == 0


async def test_bad_input_is_refused_before_campaigning(url: str) -> None:
    async with from_url(url) as provider:
        with pytest.raises(ConfigurationError, match="non-empty sequence of strings"):
            await run_command(provider, "echo hi", group="jobs")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="command not found"):
            await run_command(provider, ["no-such-command-here"], group="jobs")
        with pytest.raises(ConfigurationError, match="Provider"):
            await run_command(url, ["true"], group="jobs")  # type: ignore[arg-type]
        assert await provider.get_leader("jobs") is None


async def test_a_command_that_cannot_run_raises_and_releases(url: str, tmp_path: Path) -> None:
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    async with from_url(url) as provider:
        with pytest.raises((ConfigurationError, MultilockError), match="cannot execute"):
            await run_command(provider, [str(script)], group="jobs")
        assert await provider.get_leader("jobs") is None


async def until(condition: Callable[[], bool], what: str, within: float = WAIT) -> None:
    """Poll *condition* until it holds; fail after *within* real seconds."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not {what} within {within} s")
        await asyncio.sleep(0.01)


def gone(pid: int) -> bool:
    """The process has exited and been reaped (a zombie is not gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def watchdogs(monkeypatch: pytest.MonkeyPatch) -> list[Watchdog]:
    """The watchdogs run_command starts, as they start."""
    started: list[Watchdog] = []

    class Recorded(Watchdog):
        async def __aenter__(self) -> Recorded:
            await super().__aenter__()
            started.append(self)
            return self

    monkeypatch.setattr(run_module, "Watchdog", Recorded)
    return started


async def cancel(run: asyncio.Future[int]) -> None:
    """Cancel *run* from outside, as a caller's timeout or TaskGroup would; it ends cancelled."""
    run.cancel()
    await asyncio.wait({run}, timeout=WAIT)
    assert run.cancelled(), run


async def acquired_at_once(provider: Provider) -> None:
    """Another participant leads at once: the lease was released, not left to expire."""
    assert await provider.get_leader("jobs") is None
    async with LeaderElection(provider, group="jobs", lease_duration=30) as other:
        await other.wait_until_leader(timeout=5)  # far below the 30 s lease


@pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")
async def test_cancelled_while_the_command_runs(
    url: str, tmp_path: Path, watchdogs: list[Watchdog]
) -> None:
    pid_file = tmp_path / "pid"
    code = (
        "import os, sys, time; tmp = sys.argv[1] + '.tmp'; open(tmp, 'w').write(str(os.getpid()));"
        " os.rename(tmp, sys.argv[1]); time.sleep(600)"
    )
    argv = [sys.executable, "-c", code, str(pid_file)]
    async with from_url(url) as provider:
        run = asyncio.ensure_future(run_command(provider, argv, group="jobs", lease_duration=30))
        await until(pid_file.exists, "started")
        pid = int(pid_file.read_text())
        (watchdog,) = watchdogs
        watchdog_pid = watchdog.pid
        assert watchdog_pid is not None
        assert not gone(pid)
        assert not gone(watchdog_pid)
        leader = await provider.get_leader("jobs")
        assert leader is not None

        await cancel(run)
        await until(lambda: gone(pid), "the command gone")
        await until(lambda: gone(watchdog_pid), "the watchdog gone")
        await acquired_at_once(provider)


class Started(ElectionObserver):
    """Records the participant ids of the elections that start."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def started(self, election: LeaderElection) -> None:
        self.ids.append(election.participant_id)


@pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX")
async def test_cancelled_while_waiting_for_the_term(url: str, watchdogs: list[Watchdog]) -> None:
    async with from_url(url) as provider:
        other = LeaderElection(provider, group="jobs", participant_id="other")
        await other.start()
        await other.wait_until_leader(timeout=WAIT)
        campaigning = Started()
        add_observer(campaigning)
        try:
            run = asyncio.ensure_future(
                run_command(provider, ["true"], group="jobs", participant_id="me")
            )
            await until(lambda: "me" in campaigning.ids, "campaigning")
        finally:
            remove_observer(campaigning)
        (watchdog,) = watchdogs  # started before campaigning
        watchdog_pid = watchdog.pid
        assert watchdog_pid is not None
        assert not gone(watchdog_pid)
        await cancel(run)
        await until(lambda: gone(watchdog_pid), "the watchdog gone")
        info = await provider.get_leader("jobs")
        assert info is not None
        assert info.participant_id == "other"  # untouched
        await other.stop()
        await acquired_at_once(provider)
