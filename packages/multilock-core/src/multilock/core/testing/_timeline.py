"""Check participants' event logs: no two leaders at once, tokens always rising.

Every participant process appends JSON lines to its own log, stamped with
``time.monotonic()``, which is one system-wide clock on one machine, so the logs of all
participants can be merged and compared:

- ``acquired`` (token): the term began.
- ``lost`` (token, valid_until): the term ended; ``valid_until`` is the deadline the term
  had, so a process frozen past its deadline is judged by its deadline, not by the moment
  it woke up and noticed.
- ``work`` (token): leader work ran while ``leadership.is_valid`` was true, like a write
  that carries its fencing token.

A killed process logs nothing more: its term ends at the kill time the harness records.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["Interval", "TimelineReport", "check_timeline", "read_event_logs"]


@attrs.frozen
class Interval:
    """One term as the logs show it, on the shared monotonic clock."""

    participant: str
    token: int
    start: float
    end: float  # math.inf while still leading at the end of the logs
    ended_by: str  # "lost", "killed" or "open"


@attrs.frozen
class TimelineReport:
    intervals: list[Interval]
    problems: list[str]
    #: Seconds without a leader between consecutive terms.
    gaps: list[float]

    @property
    def ok(self) -> bool:
        return not self.problems

    def assert_ok(self) -> None:
        """Raise `AssertionError` listing every overlap and token problem."""
        if self.problems:
            raise AssertionError("leadership timeline is unsafe:\n  " + "\n  ".join(self.problems))

    def describe(self) -> str:
        lines = [
            f"{i.participant} token={i.token} {i.start:.3f}..{i.end:.3f} ({i.ended_by})"
            for i in self.intervals
        ]
        return "\n".join(lines)


def read_event_logs(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Read and merge JSON-lines logs in time order (a torn last line is skipped)."""
    records: list[dict[str, Any]] = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            continue
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the writer was killed mid-line
            if isinstance(record, dict) and "t" in record:
                records.append(record)
    records.sort(key=lambda r: float(r["t"]))
    return records


def check_timeline(
    records: Iterable[Mapping[str, Any]],
    *,
    kills: Mapping[str, Iterable[float]] | None = None,
) -> TimelineReport:
    """Build the terms from merged *records* and look for anything unsafe.

    *kills* maps a participant to the times it was SIGKILLed. Problems reported: two terms
    that overlap in time, a term whose token is not greater than every earlier term's, and
    leader work stamped with a token after work with a newer token had already run.
    """
    kill_times = {p: sorted(ts) for p, ts in (kills or {}).items()}
    open_terms: dict[str, tuple[int, float]] = {}
    intervals: list[Interval] = []
    problems: list[str] = []
    newest_work: tuple[int, float, str] | None = None
    for record in sorted(records, key=lambda r: float(r["t"])):
        who, event, t = str(record["participant"]), record.get("event"), float(record["t"])
        token = record.get("token")
        if who in open_terms:
            killed = [k for k in kill_times.get(who, []) if open_terms[who][1] <= k <= t]
            if killed:
                start_token, start = open_terms.pop(who)
                intervals.append(Interval(who, start_token, start, killed[0], "killed"))
        if event == "acquired" and token is not None:
            open_terms[who] = (int(token), t)
        elif event == "lost" and who in open_terms:
            start_token, start = open_terms.pop(who)
            valid_until = record.get("valid_until")
            end = min(t, float(valid_until)) if valid_until is not None else t
            intervals.append(Interval(who, start_token, start, end, "lost"))
        elif event == "work" and token is not None:
            if newest_work is not None and int(token) < newest_work[0]:
                problems.append(
                    f"{who} did leader work with token {token} at {t:.3f}, after "
                    f"{newest_work[2]} had worked with token {newest_work[0]} at "
                    f"{newest_work[1]:.3f}"
                )
            if newest_work is None or int(token) >= newest_work[0]:
                newest_work = (int(token), t, who)
    for who, (token, start) in open_terms.items():
        killed = [k for k in kill_times.get(who, []) if k >= start]
        if killed:
            intervals.append(Interval(who, token, start, killed[0], "killed"))
        else:
            intervals.append(Interval(who, token, start, math.inf, "open"))
    intervals.sort(key=lambda i: i.start)
    gaps: list[float] = []
    for a, b in itertools.pairwise(intervals):
        if b.start < a.end:
            problems.append(
                f"overlap: {a.participant} (token {a.token}) led until {a.end:.3f} but "
                f"{b.participant} (token {b.token}) led from {b.start:.3f}"
            )
        else:
            gaps.append(b.start - a.end)
        if b.token <= a.token:
            problems.append(
                f"token did not increase: {a.participant} had {a.token}, then "
                f"{b.participant} got {b.token}"
            )
    return TimelineReport(intervals=intervals, problems=problems, gaps=gaps)
