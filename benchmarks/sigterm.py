"""A container stop: SIGTERM to a leader process, measured until another process leads.

Each round has two real processes on one group: a leader and a follower whose watch is
up. The leader gets SIGTERM; the time is taken just before the signal and again when the
follower's ACQUIRED event fires (both on the system-wide ``time.monotonic()``). With
``multilock.core.stop_on_signals()`` the leader releases its lease as it exits and the
follower is woken by the store's notification; without it (the default action of SIGTERM
kills the process where it stands) the follower waits for the lease to expire. Both run
side by side in one run, the second with fewer rounds since each costs a lease.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from common import fmt, say, summary

ROOT = Path(__file__).resolve().parents[1]

#: One participant: prints "ready" once it follows another leader, "acquired <t>" on
#: ACQUIRED (t: time.monotonic()), and handles SIGTERM gracefully only with --graceful.
PARTICIPANT = r"""
import asyncio, contextlib, sys, time
from multilock.core import EventKind, LeaderElection, from_url, stop_on_signals

url, group, lease, graceful = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"

async def report(election):
    async for event in election.events(EventKind.ACQUIRED | EventKind.LEADER_CHANGED):
        if event.kind is EventKind.ACQUIRED:
            print("acquired", time.monotonic(), flush=True)
        elif event.leader is not None and event.leader.participant_id != election.participant_id:
            print("ready", flush=True)

async def main():
    async with from_url(url) as provider:
        scope = stop_on_signals() if graceful else contextlib.nullcontext()
        async with scope, LeaderElection(
            provider, group=group, lease_duration=lease, retry_interval=lease / 2
        ) as election:
            await report(election)

asyncio.run(main())
"""


class Participant:
    def __init__(self, url: str, group: str, lease: float, graceful: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PARTICIPANT, url, group, str(lease), "1" if graceful else "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line.strip())
                self.changed.notify_all()

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"no {prefix!r} line within {timeout:g} s: {self.lines}")
                self.changed.wait(min(left, 0.5))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def measure(url: str, rounds: int, lease: float, graceful: bool) -> dict[str, Any]:
    """Handover times (ms) of *rounds* SIGTERMs of the leader; a chain of processes."""
    group = f"bench-sigterm-{os.getpid()}-{int(graceful)}-{time.monotonic_ns()}"
    leader = Participant(url, group, lease, graceful)
    handovers: list[float] = []
    exits: list[int | None] = []
    failures = 0
    try:
        leader.wait_for("acquired", 30)
        for _ in range(rounds):
            follower = Participant(url, group, lease, graceful)
            try:
                follower.wait_for("ready", 30)
                sent = time.monotonic()
                leader.proc.send_signal(signal.SIGTERM)
                acquired = follower.wait_for("acquired", lease * 3 + 10)
                handovers.append((float(acquired.split()[1]) - sent) * 1000)
                exits.append(leader.proc.wait(10))
            except (TimeoutError, subprocess.TimeoutExpired):
                failures += 1
            leader.close()
            leader = follower
    finally:
        leader.close()
    return {
        **summary(handovers, failures),
        "graceful": graceful,
        "lease": lease,
        "exit_codes": sorted({c for c in exits if c is not None}),
    }


def run(urls: dict[str, str], names: list[str], rounds: int, lease: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        if name not in urls or name == "memory":
            continue
        out[name] = {}
        for graceful, n in ((True, rounds), (False, max(2, rounds // 10))):
            label = "stop_on_signals" if graceful else "default SIGTERM"
            say(f"{name}: {n} SIGTERMs of the leader ({label}), lease {lease:g} s")
            try:
                out[name][label] = measure(urls[name], n, lease, graceful)
            except Exception as exc:
                out[name][label] = {"error": repr(exc)[:300]}
            say(f"{name}: {label} {out[name][label]}")
    return out


def report_section(result: dict[str, Any], trips: dict[str, Any]) -> list[str]:
    if not result:
        return []
    lines = [
        "## 7. SIGTERM of a leader process (a container stop)",
        "",
        "Two real processes per round, a leader and a follower with its watch up; the",
        "leader gets SIGTERM, and the time runs from just before the signal to the",
        "follower's ACQUIRED event (both on the system-wide monotonic clock). With",
        "`stop_on_signals()` the leader releases as it exits and the store notifies the",
        "follower; with SIGTERM's default action the process dies holding the lease and",
        "the follower waits for it to expire. The store round trip is section 1's.",
        "",
        "| backend | handling | rounds | p50 ms | p95 ms | max ms | failed | exit status "
        "| store round trip p50 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, modes in result.items():
        trip = (trips.get(name) or {}).get("p50")
        for label, r in modes.items():
            if "error" in r:
                lines.append(f"| {name} | {label} | error: {r['error']} | | | | | | |")
                continue
            codes = ", ".join(str(c) for c in r["exit_codes"]) or "n/a"
            lines.append(
                f"| {name} | `{label}` | {r['count']} | {fmt(r['p50'])} | {fmt(r['p95'])} "
                f"| {fmt(r['max'])} | {r['failures']} | {codes} | {fmt(trip, 3)} |"
            )
    lines.append("")
    return lines


def targets(result: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's target: on Redis a SIGTERM'd leader hands over by notification."""
    what = (
        "A SIGTERM'd leader (with `stop_on_signals`) hands over by notification on redis, "
        "never by expiry (every round under a quarter of the lease)"
    )
    r = (result.get("redis") or {}).get("stop_on_signals")
    if r is None or "error" in r or not r.get("count"):
        return [f"- {what}: not measured"]
    ok = r["failures"] == 0 and r["max"] < r["lease"] * 1000 / 4
    handoff = (results.get("redis") or {}).get("handoff") or {}
    trip = (results.get("redis") or {}).get("round_trip") or {}
    default = (result.get("redis") or {}).get("default SIGTERM") or {}
    return [
        f"- {what}: {'**met**' if ok else '**NOT met**'} (p50 {fmt(r['p50'], 2)} ms, max "
        f"{fmt(r['max'], 2)} ms over {r['count']} rounds, {r['failures']} failed; the "
        f"in-process handoff p50 {fmt(handoff.get('p50'), 2)} ms, one PING "
        f"{fmt(trip.get('p50'), 3)} ms; without it {fmt(default.get('p50'), 0)} ms, a lease "
        f"of {r['lease']:g} s)"
    ]
