"""What ``status`` and ``watch`` print: a leader as text, as JSON, or as a live view."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import TextIO

import attrs
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from multilock.core import LeaderInfo, Provider, watch_leader

from ._common import leader_record, status_document

__all__ = ["Board", "describe_leader", "watch_group"]


def _metadata_text(metadata: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(metadata.items())) or "-"


def describe_leader(group: str, info: LeaderInfo | None) -> str:
    """The human form of ``status``: a few aligned lines, or one line when nobody leads."""
    if info is None:
        return f"group {group}: no leader"
    record = leader_record(info)
    return "\n".join(
        [
            f"group:       {group}",
            f"leader:      {record['id']}",
            f"token:       {record['token']}",
            f"acquired at: {record['acquired_at']} ({record['age_seconds']:.1f} s ago)",
            f"metadata:    {_metadata_text(record['metadata'])}",
        ]
    )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _change_line(group: str, info: LeaderInfo | None) -> str:
    if info is None:
        return f"{_now()} {group}: no leader"
    return (
        f"{_now()} {group}: {info.participant_id} leads with token {info.token} "
        f"(since {info.acquired_at.isoformat()}; metadata {_metadata_text(dict(info.metadata))})"
    )


@attrs.define
class Board:
    """The live view of one group: the leader now, and the last changes."""

    group: str
    url: str
    leader: LeaderInfo | None = None
    seen: bool = False
    history: list[tuple[str, LeaderInfo | None]] = attrs.Factory(list)
    keep: int = 10

    def update(self, info: LeaderInfo | None) -> None:
        self.leader, self.seen = info, True
        self.history.append((_now(), info))
        del self.history[: -self.keep]

    def __rich__(self) -> Group:
        # Called by Live's refresh thread too: read each attribute once.
        leader, seen, history = self.leader, self.seen, list(self.history)
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        head.add_row("group", self.group)
        head.add_row("store", self.url)
        if not seen:
            head.add_row("leader", Text("asking the store...", style="dim"))
        elif leader is None:
            head.add_row("leader", Text("none", style="yellow"))
        else:
            record = leader_record(leader)
            head.add_row("leader", Text(record["id"], style="bold green"))
            head.add_row("token", str(record["token"]))
            head.add_row("acquired", f"{record['acquired_at']} ({record['age_seconds']:.1f} s ago)")
            head.add_row("metadata", _metadata_text(record["metadata"]))
        changes = Table(title="changes", title_justify="left", expand=False)
        changes.add_column("seen at")
        changes.add_column("leader")
        changes.add_column("token", justify="right")
        for at, info in reversed(history):
            if info is None:
                changes.add_row(at, Text("none", style="yellow"), "-")
            else:
                changes.add_row(at, info.participant_id, str(info.token))
        return Group(head, Text(""), changes, Text("Ctrl-C to quit", style="dim"))


async def watch_group(
    provider: Provider,
    group: str,
    *,
    shown_url: str,
    poll_interval: float,
    json_lines: bool,
    console: Console | None = None,
    out: TextIO | None = None,
) -> None:
    """Follow the group's leader until cancelled.

    On a terminal (and without *json_lines*) this is a rich live view; otherwise one line
    per change, flushed at once, so that another program can read it as it comes.
    """
    out = out or sys.stdout
    console = console or Console(file=out)
    changes = watch_leader(provider, group, poll_interval=poll_interval)
    try:
        if console.is_terminal and not json_lines:
            board = Board(group, shown_url)
            with Live(board, console=console, refresh_per_second=2, transient=False):
                async for info in changes:
                    board.update(info)
            return
        async for info in changes:
            if json_lines:
                document = {"at": _now(), **status_document(group, info)}
                line = json.dumps(document)
            else:
                line = _change_line(group, info)
            out.write(line + "\n")
            out.flush()
    finally:
        aclose = getattr(changes, "aclose", None)
        if aclose is not None:
            await aclose()
