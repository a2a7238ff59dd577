"""One process leading many groups: ``run.py --groups N`` (default 10,000).

A service that owns many resources elects a leader per resource: here one worker process
(this module run as a program) holds one provider (``from_url``, wrapped in
`FaultyProvider` to count its calls) and one `LeaderElection` per group, N groups, and
nobody else campaigns, so every election leads. Its steady state is pure renewal: N renews
per renew interval (lease/3), on one provider, one event loop and the store. The phase
measures what that costs:

- the time from the first ``start()`` until all N lead;
- over a steady-state window (whole renew cycles, after one renew cycle of settling):
  provider calls per second, the store's own operations per second (Redis commands from
  ``INFO commandstats``, PostgreSQL transactions from ``pg_stat_database``), the server's
  CPU, the worker's CPU and RSS (psutil), the server's client connections, and the fewest
  groups led at any moment (a renew that came too late would show as a lost term);
- the renew latency the elections saw (``statistics().last_renew_latency``, p50 and p99
  over the groups) and their renew failures;
- the time ``stop()`` of all N took (each releases its lease).

A provider that holds a server connection per open watch (see `scale.probe`) would need N
connections: up to `LEGACY_MAX` elections the run applies `scale.LEGACY`, beyond it the
backend is skipped, with the reason in the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import fmt, pct, say
from scale import StoreStats, make_provider

WORKER = Path(__file__).resolve()
#: The most elections one process may host on a provider with a connection per watch: a
#: Redis server admits 10,000 clients; PostgreSQL forks a backend process per connection.
LEGACY_MAX = {"redis": 4000, "postgres": 1000}


# --------------------------------------------------------------------------- the worker
async def _worker(args: argparse.Namespace) -> int:
    import psutil

    from multilock.core import LeaderElection
    from multilock.core.testing import FaultyProvider

    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    me = psutil.Process()

    def log(event: str, **fields: Any) -> None:
        os.write(
            fd, (json.dumps({"t": time.monotonic(), "event": event, **fields}) + "\n").encode()
        )

    url = os.environ["MULTILOCK_GROUPS_URL"]
    inner, close = await make_provider(args.backend, url, args.count, args.legacy)
    provider = FaultyProvider(inner)
    log("ready", rss=me.memory_info().rss)
    elections = [
        LeaderElection(
            provider,
            group=f"{args.prefix}-{i:05d}",
            participant_id="lead",
            lease_duration=args.lease,
        )
        for i in range(args.count)
    ]
    for election in elections:
        await election.start()
    log("started")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # The parent marks the ends of its window: the calls counted at that very instant.
    loop.add_signal_handler(signal.SIGUSR1, lambda: log("mark", calls=dict(provider.calls)))
    all_leading, last_tick = False, 0.0
    while not stop.is_set():
        leading = sum(e.is_leader for e in elections)
        if not all_leading and leading == len(elections):
            all_leading = True
            log("all_leading")
        if time.monotonic() - last_tick >= 1.0:
            last_tick = time.monotonic()
            log("tick", leading=leading, calls=dict(provider.calls), rss=me.memory_info().rss)
        try:  # count often until all lead, then once a second (10,000 reads cost ~1 ms)
            async with asyncio.timeout(1.0 if all_leading else 0.05):
                await stop.wait()
        except TimeoutError:
            pass
    stats = [e.statistics() for e in elections]
    latencies = [s.last_renew_latency * 1000 for s in stats if s.last_renew_latency is not None]
    log(
        "stats",
        leading=sum(s.is_leader for s in stats),
        terms_won=sum(s.terms_won for s in stats),
        renewals=sum(s.renewals for s in stats),
        renew_failures=sum(s.renew_failures for s in stats),
        renew_p50_ms=pct(latencies, 50) if latencies else None,
        renew_p99_ms=pct(latencies, 99) if latencies else None,
    )
    began = time.monotonic()
    await asyncio.gather(*(e.stop() for e in elections))
    log("stopped", seconds=time.monotonic() - began)
    await close()
    return 0


# --------------------------------------------------------------------------- the run
def measure(
    backend: str,
    url: str,
    count: int,
    lease: float,
    store: StoreStats,
    tmp: Path,
    window: float | None = None,
    legacy: bool = False,
) -> dict[str, Any]:
    """Lead *count* groups from one process on *url*; see the module docstring."""
    import psutil

    log = tmp / "groups.jsonl"
    cmd = [
        sys.executable, str(WORKER), "--backend", backend, "--count", str(count),
        "--lease", str(lease), "--prefix", f"bench-groups-{count}", "--log", str(log),
        *(["--legacy"] if legacy else []),
    ]  # fmt: skip
    env = {**os.environ, "MULTILOCK_GROUPS_URL": url}
    out: dict[str, Any] = {"n": count, "lease": lease, "legacy": legacy}
    with open(tmp / "groups.stderr", "ab") as stderr:
        proc = subprocess.Popen(cmd, env=env, stderr=stderr)
    worker = psutil.Process(proc.pid)

    def records() -> list[dict[str, Any]]:
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    def wait_for(event: str, within: float) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = [r for r in records() if r["event"] == event]
            if found:
                return found[-1]
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited ({proc.returncode}):\n{_tail(tmp)}")
            time.sleep(0.1)
        raise TimeoutError(f"no {event!r} within {within:.0f} s:\n{_tail(tmp)}")

    def ticks() -> list[dict[str, Any]]:
        return [r for r in records() if r["event"] == "tick"]

    def mark() -> dict[str, Any]:
        """The worker's provider calls (watch wake-ups excluded) at this instant."""
        marks = len([r for r in records() if r["event"] == "mark"])
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = [r for r in records() if r["event"] == "mark"]
            if len(found) > marks:
                calls = sum(v for k, v in found[-1]["calls"].items() if k != "watch")
                return {"t": found[-1]["t"], "calls": calls}
            time.sleep(0.005)
        raise TimeoutError(f"the worker did not answer SIGUSR1:\n{_tail(tmp)}")

    try:
        ready = wait_for("ready", 60)
        out["deadline_s"] = 30 + count / 200
        try:
            leading = wait_for("all_leading", out["deadline_s"])
        except TimeoutError:  # measure the steady state of whatever leads by then
            out["all_leading_s"] = None
            out["leading_at_deadline"] = ticks()[-1]["leading"] if ticks() else 0
            say(f"{backend}: {out['leading_at_deadline']} of {count} groups leading after "
                f"{out['deadline_s']:.0f} s")  # fmt: skip
        else:
            out["all_leading_s"] = leading["t"] - ready["t"]
            say(f"{backend}: {count} groups all leading after {out['all_leading_s']:.1f} s")
        time.sleep(lease / 3 + 2)  # one renew cycle past the start-up herd
        # Whole renew cycles: every group renews as often in the window, however bunched
        # the renewals are (they follow the start-up herd's order).
        cycle = lease / 3
        window = window or cycle * math.ceil(15.0 / cycle)
        cpu0, mark0 = sum(worker.cpu_times()[:2]), mark()
        ops0, scpu0 = store.operations(), store.cpu_seconds()
        began = time.monotonic()
        time.sleep(window)
        cpu1, mark1 = sum(worker.cpu_times()[:2]), mark()
        ops1, scpu1 = store.operations(), store.cpu_seconds()
        seconds = time.monotonic() - began
        rss = worker.memory_info().rss
        connections = store.connections()
        in_window = [t for t in ticks() if mark0["t"] <= t["t"] <= mark1["t"]]
        out.update(
            window_s=seconds,
            provider_calls_per_s=(mark1["calls"] - mark0["calls"]) / (mark1["t"] - mark0["t"]),
            store_ops_per_s=None if ops0 is None or ops1 is None else (ops1 - ops0) / seconds,
            server_cpu_percent=None
            if scpu0 is None or scpu1 is None
            else (scpu1 - scpu0) / seconds * 100,
            client_cpu_percent=(cpu1 - cpu0) / seconds * 100,
            client_rss_mb=rss / 2**20,
            rss_per_group_kb=(rss - ready["rss"]) / count / 1024,
            connections=connections,
            fewest_leading=min((t["leading"] for t in in_window), default=None),
        )
        proc.send_signal(signal.SIGTERM)
        stopped = wait_for("stopped", 60 + count / 100)
        out["stop_s"] = stopped["seconds"]
        stats = next(r for r in records() if r["event"] == "stats")
        out.update({k: v for k, v in stats.items() if k not in ("t", "event")})
        out.pop("leading", None)
    finally:
        out["warnings"] = _warnings(tmp)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return out


#: The core's warnings, as logged to the worker's stderr, counted by kind.
WARNINGS = {
    "campaign round failed": "campaign round for ",
    "renew failed": "renew of ",
    "watch broke": "watch of ",
    "release failed": "release of ",
}


def _warnings(tmp: Path) -> dict[str, int]:
    path = tmp / "groups.stderr"
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    counts = {
        kind: sum(line.startswith(start) for line in lines) for kind, start in WARNINGS.items()
    }
    return {kind: n for kind, n in counts.items() if n}


def _tail(tmp: Path) -> str:
    path = tmp / "groups.stderr"
    return path.read_text()[-1500:] if path.exists() else ""


# --------------------------------------------------------------------------- the report
def report_section(results: dict[str, dict[str, Any]], args: Any) -> list[str]:
    if not results:
        return []
    out = [
        "",
        f"## 6. One process leading many groups: {args.groups} groups",
        "",
        f"One worker process, one provider (`from_url`), {args.groups} `LeaderElection`s, "
        f"one per group, lease {args.groups_lease:g} s (renew every "
        f"{args.groups_lease / 3:.3g} s), nobody else campaigning: every election leads, and "
        "the steady state is pure renewal, "
        f"{args.groups / (args.groups_lease / 3):.0f} renews per second expected. All "
        "leading: from the first `start()` until every election leads. The steady-state "
        "window starts one renew cycle later and lasts whole renew cycles (at least 15 s), "
        "so every group renews as often in it however bunched the renewals are. Provider "
        "calls: "
        "counted on the provider (watch wake-ups excluded). Store ops: the server's own "
        "count (Redis commands from `INFO commandstats`, INFO excluded, the commands a Lua "
        "script runs included; PostgreSQL transactions from `pg_stat_database`), the renew "
        "load these leaders put on the store. CPU % is of one core. Fewest leading: the "
        "lowest count of leading elections sampled each second in the window (a renew "
        "that came too late would lose a term; terms won above the number of groups count "
        "terms lost and won back, e.g. in the start-up herd). Renew p50/p99: each election's last "
        "renew latency, over the groups. Stop: `stop()` of every election at once (each "
        "releases its lease).",
        "",
        "| backend | groups | provider | all leading s | provider calls/s | store ops/s "
        "| server CPU % | client CPU % | client RSS MB | RSS KB per group | connections "
        "| fewest leading | terms won | renew p50 ms | renew p99 ms | renew failures | stop s "
        "| client CPU ms per call |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, r in results.items():
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            out.append(f"| {backend} | {r.get('n', '?')} | {why} ||||||||||||||||")
            continue
        if r["all_leading_s"] is None:
            all_leading = (
                f"not within {r['deadline_s']:.0f} s ({r['leading_at_deadline']} leading then)"
            )
        else:
            all_leading = f"{r['all_leading_s']:.1f}"
        out.append(
            f"| {backend} | {r['n']} | {'legacy' if r['legacy'] else 'from_url'} | "
            f"{all_leading} | {r['provider_calls_per_s']:.0f} | "
            f"{fmt(r['store_ops_per_s'], 0)} | {fmt(r['server_cpu_percent'], 1)} | "
            f"{r['client_cpu_percent']:.1f} | {r['client_rss_mb']:.0f} | "
            f"{r['rss_per_group_kb']:.1f} | {fmt(r['connections'], 0)} | "
            f"{fmt(r['fewest_leading'], 0)} | {r.get('terms_won', 'n/a')} | "
            f"{fmt(r.get('renew_p50_ms'), 2)} | "
            f"{fmt(r.get('renew_p99_ms'), 2)} | {r.get('renew_failures', 'n/a')} | "
            f"{fmt(r.get('stop_s'), 1)} | {fmt(_cpu_per_call(r), 3)} |"
        )
    for backend, r in results.items():
        if r.get("warnings"):
            logged = ", ".join(f"{kind} {n}" for kind, n in r["warnings"].items())
            out += ["", f"Warnings the elections logged on {backend}: {logged}."]
    out += ["", *NOTES]
    return out


def _cpu_per_call(r: dict[str, Any]) -> float | None:
    """Milliseconds of the worker's CPU per provider call in the window (None: no calls)."""
    calls = r["provider_calls_per_s"]
    return r["client_cpu_percent"] * 10 / calls if calls else None


NOTES = [
    "- The renew load is the interesting number for the store: each renew is one provider "
    "call, one round trip and (Redis) one script that runs a few commands inside the "
    "server, (PostgreSQL) one transaction. A client that cannot keep up shows it as a "
    "renew p99 near the renew interval, fewer leading than groups, or renew failures.",
    "- What bounds it: the worker's CPU. Client CPU ms per call is the worker's CPU time "
    "over the provider calls it made in the window; the calls it must make each second "
    "(groups / renew interval) times that cost is the share of one core the renewals "
    "need, and past one whole core they fall behind, time out and lose terms (which "
    "then cost acquires as well). The in-memory store's row, when run, is the core's own "
    "cost per call.",
    "- The in-memory store (when run) lives in the worker, so its client CPU includes the "
    "store's work and it has no server columns.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the many-groups worker process")
    for flag in ("--backend", "--prefix", "--log"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--legacy", action="store_true", help="see scale.LEGACY")
    return asyncio.run(_worker(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
