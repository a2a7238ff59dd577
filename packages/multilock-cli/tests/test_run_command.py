"""`multilock.cli.run_command`: ``multilock run`` as a coroutine, on a real file store."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from multilock.cli import run_command
from multilock.core import ConfigurationError, LeaderElection, MultilockError, from_url

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
