"""What ``status`` and ``watch`` print, from a real in-memory election in this process."""

from __future__ import annotations

import asyncio
import io
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from rich.console import Console

from multilock.cli._common import leader_record
from multilock.cli._views import Board, describe_leader, watch_group
from multilock.core import InMemoryProvider, LeaderElection, LeaderInfo

#: 12 s ago, when the test module was imported: ages below are at least that.
INFO = LeaderInfo(
    participant_id="web-1",
    token=17,
    metadata={"host": "web-1", "az": "b"},
    acquired_at=datetime.now(UTC) - timedelta(seconds=12),
)


def test_describe_leader() -> None:
    assert describe_leader("g", None) == "group g: no leader"
    lines = describe_leader("g", INFO).splitlines()
    assert lines[0] == "group:       g"
    assert lines[1] == "leader:      web-1"
    assert lines[2] == "token:       17"
    match = re.fullmatch(
        rf"acquired at: {re.escape(INFO.acquired_at.isoformat())} \(([\d.]+) s ago\)", lines[3]
    )
    assert match, lines[3]
    assert float(match[1]) >= 12
    assert lines[4] == "metadata:    az=b, host=web-1"


def test_leader_record_is_never_negative_in_age() -> None:
    future = LeaderInfo(
        participant_id="x", token=1, acquired_at=datetime.now(UTC) + timedelta(seconds=5)
    )
    assert leader_record(future)["age_seconds"] == 0.0
    assert leader_record(INFO)["age_seconds"] >= 12


def test_the_live_board_shows_the_leader_and_the_changes() -> None:
    board = Board("g", "redis://:***@host/0")
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(board)
    assert "asking the store" in console.export_text()
    board.update(None)
    board.update(INFO)
    console.print(board)
    text = console.export_text()
    assert "redis://:***@host/0" in text
    assert "web-1" in text
    assert "17" in text
    assert "az=b, host=web-1" in text
    assert "none" in text  # the earlier change, in the history


async def _until(condition: Callable[[], bool], seconds: float = 10) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.005)


async def test_watch_prints_one_json_line_per_change() -> None:
    store = InMemoryProvider()
    out = io.StringIO()
    watcher = asyncio.ensure_future(
        watch_group(store, "g", shown_url="memory://", poll_interval=1, json_lines=True, out=out)
    )

    def lines() -> list[dict[str, object]]:
        return [json.loads(line) for line in out.getvalue().splitlines()]

    await _until(lambda: len(lines()) == 1)
    async with LeaderElection(store, group="g", participant_id="p1") as election:
        leadership = await election.wait_until_leader()
        await _until(lambda: len(lines()) == 2)
    await _until(lambda: len(lines()) == 3)
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    first, second, third = lines()
    assert (first["group"], first["leader"]) == ("g", None)
    leader = second["leader"]
    assert isinstance(leader, dict)
    assert (leader["id"], leader["token"]) == ("p1", leadership.token)
    assert third["leader"] is None
    assert all(isinstance(line["at"], str) for line in (first, second, third))


async def test_watch_on_a_terminal_is_a_live_view() -> None:
    store = InMemoryProvider()
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    watcher = asyncio.ensure_future(
        watch_group(
            store, "g", shown_url="memory://", poll_interval=1, json_lines=False, console=console
        )
    )
    async with LeaderElection(store, group="g", participant_id="live-1") as election:
        await election.wait_until_leader()
        await _until(lambda: "live-1" in screen.getvalue())
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    assert "Ctrl-C to quit" in screen.getvalue()
