"""Shard rebalancing: *shards* shards over *participants* real processes, as one joins or dies.

Each participant is this module run as a program (``--worker``): one provider
(``from_url``, wrapped in `FaultyProvider` to count its calls) and
``async with stop_on_signals(), Shards(provider, name, shards, lease_duration=lease)``; it
prints its owned shards, with the time (``time.monotonic()``, one clock for every
process), at every change ``shards.wait_changed()`` reports, and its provider's call
counts on SIGUSR1.

The parent replays those reports in time order. Balanced over *n* live participants
means: every shard owned, and none of the *n* owning more than ``ceil(shards / n)``.
Per round, from *participants* balanced:

1. join: a new participant starts; the time from the moment it enters `Shards` (its
   ``joining`` line) until balanced over *participants* + 1 (the process start before
   that, about an interpreter's start-up and imports, is reported apart);
2. leave: that participant gets SIGTERM (``stop_on_signals``: it releases everything as it
   exits); from the signal until balanced over *participants* again;
3. kill: one of the *participants* is SIGKILLed (its leases stay until they expire); from
   the kill until balanced over *participants* - 1;
4. a new participant replaces it, and the next round starts once balanced again.

Before the rounds, with *participants* balanced for a settling time, a window of steady
state gives the store load per participant: the provider calls each participant makes
(``FaultyProvider.calls``, read by SIGUSR1 at both ends of the window) and the server's
own count (Redis ``INFO commandstats`` commands, PostgreSQL transactions from
``pg_stat_database``), divided by the participants.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

from common import fmt, pct, say

PROGRAM = Path(__file__).resolve()


# --------------------------------------------------------------------------- the worker
async def _worker(url: str, name: str, count: int, lease: float) -> None:
    from multilock.core import Shards, from_url, stop_on_signals
    from multilock.core.testing import FaultyProvider

    provider = FaultyProvider(from_url(url))

    def calls() -> None:
        print("calls", time.monotonic(), json.dumps(dict(provider.calls)), flush=True)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, calls)
    try:
        async with stop_on_signals():
            print("joining", time.monotonic(), flush=True)
            async with Shards(provider, name, count, lease_duration=lease) as shards:
                while True:
                    owned = ",".join(str(i) for i in shards.owned)
                    live, share = shards.live_participants, shards.share
                    print("owned", time.monotonic(), live, share, owned or "-", flush=True)
                    await shards.wait_changed()
    finally:
        await provider.aclose()


# --------------------------------------------------------------------------- the parent
class Participant:
    """One worker process and the reports it printed: (t, kind, fields)."""

    def __init__(self, label: str, url: str, name: str, count: int, lease: float) -> None:
        self.label = label
        self.launched = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), "--worker", url, name, str(count), str(lease)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.records: list[tuple[float, str, list[str]]] = []
        self._parsed = 0
        self._owned: list[tuple[float, frozenset[int]]] = []
        self._times: list[float] = []
        self.ended: float | None = None  # when it was told to end (SIGTERM, SIGKILL)
        self.errors: list[str] = []
        self.changed = threading.Condition()
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            kind, t, *fields = line.split(" ", 2 if line.startswith("calls") else -1)
            with self.changed:
                self.records.append((float(t), kind, [f.strip() for f in fields]))
                self.changed.notify_all()

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            self.errors.append(line.rstrip())
            del self.errors[:-20]

    def wait_for(self, kind: str, after: float, timeout: float) -> tuple[float, list[str]]:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for t, k, fields in self.records:
                    if k == kind and t >= after:
                        return t, fields
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = "\n".join(self.errors[-5:])
                    raise TimeoutError(f"{self.label}: no {kind!r} within {timeout:g} s\n{tail}")
                self.changed.wait(min(left, 0.5))

    def owned_reports(self) -> list[tuple[float, frozenset[int]]]:
        """Every ``owned`` report so far, in the order (and so the time) printed."""
        with self.changed:
            new = self.records[self._parsed :]
            self._parsed = len(self.records)
        for t, kind, f in new:
            if kind == "owned":
                shards = frozenset() if f[2] == "-" else frozenset(int(i) for i in f[2].split(","))
                self._owned.append((t, shards))
                self._times.append(t)
        return self._owned

    def owned_at(self, t: float) -> frozenset[int]:
        """What the last report at or before *t* said this participant owned (nothing
        once it was signalled to end: it may print no last report)."""
        if self.ended is not None and t >= self.ended:
            return frozenset()
        self.owned_reports()
        i = bisect.bisect_right(self._times, t)
        return self._owned[i - 1][1] if i else frozenset()

    def signal(self, signum: int) -> float:
        at = time.monotonic()
        self.proc.send_signal(signum)
        if signum in (signal.SIGTERM, signal.SIGKILL):
            self.ended = at
        return at

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _state_at(people: list[Participant], t: float) -> dict[str, frozenset[int]]:
    return {p.label: p.owned_at(t) for p in people}


def _balanced(state: dict[str, frozenset[int]], count: int) -> bool:
    if not state:
        return False
    union: set[int] = set()
    for shards in state.values():
        union |= shards
    return len(union) == count and max(len(s) for s in state.values()) <= math.ceil(
        count / len(state)
    )


def first_balanced(live: list[Participant], count: int, since: float) -> float | None:
    """The first instant at or after *since* when the reports of *live* say balanced."""
    moments = sorted({t for p in live for t, _ in p.owned_reports() if t >= since})
    for t in [since, *moments]:
        if _balanced(_state_at(live, t), count):
            return t
    return None


def wait_balanced(live: list[Participant], count: int, since: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t = first_balanced(live, count, since)
        if t is not None:
            return t
        for p in live:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.label} exited: {p.errors[-3:]}")
        time.sleep(0.05)
    state = _state_at(live, time.monotonic())
    sizes = {k: len(v) for k, v in state.items()}
    owned = len(set().union(*state.values())) if state else 0
    raise TimeoutError(f"not balanced within {timeout:g} s: {sizes}, {owned} of {count} owned")


def _overlaps(people: list[Participant], since: float, until: float) -> int:
    """Shards that two participants' reports claim at one instant (reports lag the store)."""
    moments = sorted({t for p in people for t, _ in p.owned_reports() if since <= t <= until})
    worst = 0
    for t in moments:
        seen: Counter[int] = Counter()
        for shards in _state_at(people, t).values():
            seen.update(shards)
        worst = max(worst, sum(1 for n in seen.values() if n > 1))
    return worst


class StoreOps:
    """The server's own operation count: Redis commands, or PostgreSQL transactions."""

    def __init__(self, backend: str, url: str) -> None:
        self.backend, self.url = backend, url
        self.unit = {"redis": "commands", "postgres": "transactions"}.get(backend)

    def snapshot(self) -> int | None:
        if self.backend == "redis":
            from peers import RedisCounter

            counter = RedisCounter(self.url)
            try:
                return sum(counter.snapshot().values())
            finally:
                counter.close()
        if self.backend == "postgres":
            import psycopg

            query = (
                "SELECT xact_commit + xact_rollback FROM pg_stat_database "
                "WHERE datname = current_database()"
            )
            with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
                row = conn.execute(query).fetchone()
            assert row is not None
            return int(row[0])
        return None


def _calls_at(people: list[Participant], after: float) -> dict[str, tuple[float, Counter[str]]]:
    """Each participant's first ``calls`` report after *after*: (its time, its counts)."""
    out = {}
    for p in people:
        t, fields = p.wait_for("calls", after, 10)
        out[p.label] = (t, Counter(json.loads(fields[0])))
    return out


def steady_load(
    people: list[Participant], store: StoreOps, window: float, lease: float
) -> dict[str, Any]:
    """Provider calls and server operations per participant per second over *window*.

    Each participant's calls are counted between its own two ``calls`` reports (SIGUSR1
    at both ends of the window); the server's operations between the parent's two
    samples around them.
    """
    began = time.monotonic()
    ops_before = store.snapshot()
    for p in people:
        p.signal(signal.SIGUSR1)
    before = _calls_at(people, began)
    time.sleep(window)
    mark = time.monotonic()
    for p in people:
        p.signal(signal.SIGUSR1)
    after = _calls_at(people, mark)
    ops_after = store.snapshot()
    server_seconds = time.monotonic() - began
    per: dict[str, float] = {}
    totals = []
    for label, (t0, counts0) in before.items():
        t1, counts1 = after[label]
        delta, seconds = counts1 - counts0, t1 - t0
        totals.append(sum(v for k, v in delta.items() if k != "watch") / seconds)
        for k, v in delta.items():
            per[k] = per.get(k, 0.0) + v / seconds / len(people)
    server = None
    if ops_before is not None and ops_after is not None:
        server = (ops_after - ops_before) / server_seconds / len(people)
    return {
        "window": window,
        "calls_per_participant": dict(per),
        "ops_per_participant": {"mean": sum(totals) / len(totals), "max": max(totals)},
        "server_per_participant": server,
        "server_unit": store.unit,
        "lease": lease,
    }


def measure(
    backend: str, url: str, rounds: int, count: int, size: int, lease: float, window: float
) -> dict[str, Any]:
    rng = random.Random(7)
    name = f"bench-shards-{os.getpid()}-{time.monotonic_ns()}"
    serial = 0
    people: list[Participant] = []  # every process started, for the final cleanup
    live: list[Participant] = []
    settle = lease * 10 + 30

    def launch() -> Participant:
        nonlocal serial
        serial += 1
        p = Participant(f"p{serial}", url, name, count, lease)
        people.append(p)
        return p

    joins: list[float] = []
    starts: list[float] = []  # process start to entering Shards
    leaves: list[float] = []
    kills: list[float] = []
    out: dict[str, Any] = {"shards": count, "participants": size, "lease": lease}
    try:
        began = time.monotonic()
        live = [launch() for _ in range(size)]
        for p in live:
            p.wait_for("joining", began, 60)
        out["initial"] = wait_balanced(live, count, began, settle) - began
        say(f"{backend}: {count} shards balanced over {size} after {out['initial']:.2f} s")
        time.sleep(lease * 2)  # past the start-up: every participant settled
        out["steady"] = steady_load(live, StoreOps(backend, url), window, lease)
        say(f"{backend}: steady state {out['steady']}")
        for r in range(rounds):
            newcomer = launch()
            joined, _ = newcomer.wait_for("joining", newcomer.launched, 60)
            starts.append(joined - newcomer.launched)
            live.append(newcomer)
            joins.append(wait_balanced(live, count, joined, settle) - joined)
            time.sleep(lease)
            live.remove(newcomer)
            stopped = newcomer.signal(signal.SIGTERM)
            leaves.append(wait_balanced(live, count, stopped, settle) - stopped)
            newcomer.proc.wait(30)
            time.sleep(lease)
            victim = rng.choice(live)
            live.remove(victim)
            killed = victim.signal(signal.SIGKILL)
            kills.append(wait_balanced(live, count, killed, settle) - killed)
            victim.proc.wait(10)
            say(
                f"{backend}: round {r + 1}: join {joins[-1]:.2f} s, leave {leaves[-1]:.2f} s, "
                f"kill {kills[-1]:.2f} s"
            )
            if r + 1 < rounds:
                replacement = launch()
                joined, _ = replacement.wait_for("joining", replacement.launched, 60)
                live.append(replacement)
                wait_balanced(live, count, joined, settle)
                time.sleep(lease)
        out["overlaps"] = _overlaps(people, began, time.monotonic())
    except Exception as exc:
        out["error"] = repr(exc)[:300]
    finally:
        for p in people:
            p.close()
    out.update(join=_stats(joins), leave=_stats(leaves), kill=_stats(kills), start=_stats(starts))
    return out


def _stats(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"count": 0, "p50": None, "max": None, "min": None}
    return {"count": len(samples), "p50": pct(samples, 50), "max": max(samples),
            "min": min(samples), "samples": samples}  # fmt: skip


def run(
    urls: dict[str, str],
    names: list[str],
    rounds: int,
    count: int,
    size: int,
    lease: float,
    window: float | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # A window of whole member counts (every retry_interval, the lease here at most 2 s).
    window = window if window is not None else max(10.0, lease * 5)
    for backend in names:
        if backend not in urls or backend == "memory":
            continue
        say(
            f"{backend}: {count} shards over {size} participant processes, {rounds} rounds "
            f"of join, leave and kill, lease {lease:g} s"
        )
        try:
            out[backend] = measure(backend, urls[backend], rounds, count, size, lease, window)
        except Exception as exc:
            out[backend] = {"error": repr(exc)[:300]}
        say(f"{backend}: rebalance {out[backend]}")
    return out


# --------------------------------------------------------------------------- the report
#: The section's number in the report (`report.merge_sections` finds it by its title).
NUMBER = 9
TITLE = "Shard rebalance"
#: How its lines in the report's Targets begin.
TARGET = "- Shard rebalance"


def report_section(result: dict[str, Any], note: str = "") -> list[str]:
    if not result:
        return []
    first = next(iter(result.values()))
    count, size = first.get("shards", "?"), first.get("participants", "?")
    lease = first.get("lease", 0.0)
    retry = min(2.0, lease)
    lines = [
        "",
        f"## {NUMBER}. {TITLE}: {count} shards over {size} participant processes",
        "",
        *([note, ""] if note else []),
        f"Each participant is a process: one provider (`from_url`) and `async with "
        f"stop_on_signals(), Shards(provider, name, {count}, lease_duration={lease:g})` "
        f"(renew every {lease / 3:.3g} s, retry_interval {retry:g} s: the election "
        "defaults), printing its owned shards at every change (`shards.wait_changed()`) "
        "on the machine's monotonic clock. Balanced over n live participants: all "
        f"{count} shards owned and none owning more than ceil({count} / n). Per round: "
        f"a participant joins (from entering `Shards` until balanced over {_plus(size, 1)}); "
        "it leaves by SIGTERM (`stop_on_signals` releases all it holds; from the signal "
        f"until balanced over {size}); one of the {size} is SIGKILLed (its leases run "
        f"out; from the kill until balanced over {_plus(size, -1)}); a new one replaces it.",
        "",
        "| backend | rounds | join p50 s | join max s | leave (SIGTERM) p50 s "
        "| leave max s | kill p50 s | kill max s | process start to `Shards` p50 s "
        f"| {size} started to balanced s | shards claimed twice in the reports |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, r in result.items():
        if "join" not in r:
            lines.append(f"| {backend} | error: {r.get('error')} ||||||||||")
            continue
        j, lv, k, s = r["join"], r["leave"], r["kill"], r["start"]
        error = f" (stopped: {r['error']})" if "error" in r else ""
        lines.append(
            f"| {backend} | {k['count']}{error} | {fmt(j['p50'], 2)} | {fmt(j['max'], 2)} "
            f"| {fmt(lv['p50'], 2)} | {fmt(lv['max'], 2)} | {fmt(k['p50'], 2)} "
            f"| {fmt(k['max'], 2)} | {fmt(s['p50'], 2)} | {fmt(r.get('initial'), 2)} "
            f"| {r.get('overlaps', 'n/a')} |"
        )
    lines += ["", "Every round, in order (seconds):", ""]
    for backend, r in result.items():
        if "join" in r:
            lines.append(
                f"- {backend}: "
                + "; ".join(
                    f"{what} " + ", ".join(f"{x:.2f}" for x in r[key].get("samples", []))
                    for key, what in (("join", "join"), ("leave", "leave"), ("kill", "kill"))
                )
            )
    lines += [
        "",
        f"Steady state: {size} participants balanced, over a window of "
        f"{_window(result)} s. Provider calls per participant per second "
        "(`FaultyProvider.calls`; `watch` counts the wake-ups its watches delivered, not "
        "store operations), and the server's own count divided by the participants (Redis: "
        "every command, scripts' inner commands included, `INFO commandstats`; "
        "PostgreSQL: transactions, `pg_stat_database`).",
        "",
        "| backend | get_leader/s | renew/s | try_acquire/s | release/s | watch wakes/s "
        "| provider calls/s (mean, max of participants) | server ops/s per participant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for backend, r in result.items():
        st = r.get("steady")
        if st is None:
            continue
        c = st["calls_per_participant"]
        ops = st["ops_per_participant"]
        server = st["server_per_participant"]
        unit = f" {st['server_unit']}" if st["server_unit"] else ""
        lines.append(
            f"| {backend} | {c.get('get_leader', 0):.1f} | {c.get('renew', 0):.1f} "
            f"| {c.get('try_acquire', 0):.1f} | {c.get('release', 0):.1f} "
            f"| {c.get('watch', 0):.1f} | {ops['mean']:.1f}, {ops['max']:.1f} "
            f"| {fmt(server, 1)}{unit} |"
        )
    lines += ["", *_notes(count, size, lease, retry)]
    return lines


def _plus(size: Any, n: int) -> str:
    return str(size + n) if isinstance(size, int) else "?"


def _window(result: dict[str, Any]) -> str:
    windows = [r["steady"]["window"] for r in result.values() if r.get("steady")]
    return f"{min(windows):.0f}" if windows else "n/a"


def _notes(count: Any, size: Any, lease: float, retry: float) -> list[str]:
    return [
        f"- What bounds these: each participant counts the live members (a `get_leader` "
        f"of each of the {count} member slots) every retry_interval ({retry:g} s, jittered "
        "down by up to a quarter) and balances right after. A join is seen at the "
        "others' next count: they release their surplus at once and the newcomer, "
        "campaigning for every shard it lacks, is woken by each release; so a join takes "
        "up to about one retry_interval. A graceful leave releases the member slot and the "
        "shards at once, and the others take the shards after their next count raises "
        "their share. A SIGKILLed participant's member slot and shards stay held until "
        f"their leases expire (up to the lease, {lease:g} s, after its last renewal); the "
        "next count after that raises the others' share: so a kill takes up to about a "
        "lease plus a retry_interval.",
        "- The steady-state load is mostly the member count: "
        f"{count} reads per retry_interval per participant, whatever the number of "
        f"participants; plus the renewals of its owned shards ({count} / {size} shards "
        f"and its member slot, each every {lease / 3:.3g} s).",
        "- 'Shards claimed twice in the reports': the most shards two participants' "
        "printed ownership overlapped at one instant over the whole run; reports are "
        "printed after the store acted, so this is a consistency check of the reports, "
        "not the safety check (that is the simulator's and the fault campaign's).",
    ]


def targets(result: dict[str, Any]) -> list[str]:
    """The issue asks for the rebalance times: stated as measured, not judged."""
    lines = []
    for backend, r in (result or {}).items():
        if not r.get("join") or not r["join"]["count"]:
            continue
        j, k = r["join"], r["kill"]
        st = r.get("steady") or {}
        load = ""
        if st:
            server = st.get("server_per_participant")
            unit = st.get("server_unit") or "operations"
            load = (
                f"; at steady state each participant makes "
                f"{st['ops_per_participant']['mean']:.1f} provider calls/s"
                + (f" ({server:.1f} server {unit}/s)" if server is not None else "")
            )
        lines.append(
            f"{TARGET} on {backend}, {r['shards']} shards, {r['participants']} "
            f"participants, lease {r['lease']:g} s (measured): a join balanced in "
            f"p50 {fmt(j['p50'], 2)} s, max {fmt(j['max'], 2)} s; a SIGKILL rebalanced over "
            f"the rest in p50 {fmt(k['p50'], 2)} s, max {fmt(k['max'], 2)} s "
            f"({k['count']} rounds){load}"
        )
    return lines or [f"{TARGET}: not measured"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one Shards participant (run by rebalance.run)")
    parser.add_argument("--worker", nargs=4, metavar=("URL", "NAME", "COUNT", "LEASE"))
    args = parser.parse_args(argv)
    if not args.worker:
        parser.error("run benchmarks/run.py --rebalance N; this program is its worker")
    url, name, count, lease = args.worker
    try:
        asyncio.run(_worker(url, name, int(count), float(lease)))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
