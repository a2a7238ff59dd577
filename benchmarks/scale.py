"""multilock at scale: N participants in one group, as asyncio elections over a few processes.

``run.py --scale N`` calls `measure` per backend, at N and at the smaller
``--scale-small`` size (Redis and PostgreSQL, to show whether the server connections
depend on the number of elections). N participants do not fit on 2 cores as N processes,
so they run as N `LeaderElection`s spread evenly over ``--scale-workers`` worker processes
(this module run as a program). Each worker shares one provider among its elections, the
way a service hosting many elections would: ``from_url``. The in-memory store lives in one
process, so memory runs one worker. Every provider is wrapped in `FaultyProvider` to
count its calls.

Before that, `probe` opens 1 and then 100 watches of as many groups on one provider and
counts the server's connections: a provider that holds a connection per watch (the
providers before issue #11) needs the old workaround (`LEGACY`), which this run then
applies by itself; one that multiplexes its watches runs as is.

Measured: time until all N elections started and to the first leader, steady-state CPU
and RSS of the workers (psutil) per participant, provider calls per second for the group,
the server's own count of operations, its connections and its CPU, and (at N) two
failovers: the leading election stopped (graceful) and, with more than one worker, the
leader's whole worker process SIGKILLed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import fmt, say

WORKER = Path(__file__).resolve()
#: Connections in the caller's psycopg pool of a legacy PostgreSQL worker.
POOL_SIZE = 10
#: Watches the probe opens on one provider: well above a bounded command pool (the first
#: read of each watch may fill the pool), far below the server's limits when each holds
#: a connection.
PROBE_WATCHES = 100
#: Connections per extra watch that mark a provider as holding one per watch (such a
#: provider shows 1 or more; one that shares its connections, its pool bound / 99 or less).
LEGACY_PER_WATCH = 0.75
#: The workaround a provider that holds a server connection per open watch (the providers
#: before issue #11) needs, per backend: the run applies it when `probe` finds one.
LEGACY = {
    "redis": "redis-py's pool limit raised through the URL (`max_connections` = 3 x "
    "elections + 50 per process; its default of 100 breaks watches and campaign rounds with "
    "`MaxConnectionsError` past about 100 elections)",
    "postgres": "the server restarted with `max_connections` = 1.2 x elections + 100 (the "
    f"harness starts it with 200), and a `psycopg_pool` pool of {POOL_SIZE} connections per "
    "process for the commands (this provider opens a connection per concurrent call)",
}


def postgres_ceiling(elections: int) -> int:
    """The server's max_connections for *elections* LISTEN connections (legacy providers)."""
    return int(elections * 1.2) + 100


# --------------------------------------------------------------------------- the worker
async def make_provider(
    backend: str, url: str, count: int, legacy: bool
) -> tuple[Any, Callable[[], Any]]:
    """The provider a worker process shares among its *count* elections, and its closer.

    Plain: ``from_url``. *legacy*: the workaround a provider with a connection per watch
    needs (`LEGACY`).
    """
    from multilock.core import from_url

    if legacy and backend == "redis":
        sep = "&" if "?" in url else "?"
        url = f"{url}{sep}max_connections={3 * count + 50}"
    if not legacy or backend != "postgres":
        provider = from_url(url)
        return provider, provider.aclose
    from psycopg_pool import AsyncConnectionPool

    from multilock.postgres import PostgresProvider

    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        url, min_size=1, max_size=POOL_SIZE, kwargs={"autocommit": True}, open=False
    )
    await pool.open(wait=True, timeout=60)
    provider = PostgresProvider(pool)

    async def close() -> None:
        await provider.aclose()
        await pool.close()

    return provider, close


async def _worker(args: argparse.Namespace) -> int:
    import psutil

    from multilock.core import LeaderElection
    from multilock.core.testing import FaultyProvider

    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    me = psutil.Process()

    def log(event: str, **fields: Any) -> None:
        record = {"t": time.monotonic(), "participant": args.name, "event": event, **fields}
        os.write(fd, (json.dumps(record) + "\n").encode())

    url = os.environ["MULTILOCK_SCALE_URL"]
    inner, close = await make_provider(args.backend, url, args.count, args.legacy)
    provider = FaultyProvider(inner)
    log("ready", rss=me.memory_info().rss)  # the base of RSS per participant
    elections = [
        LeaderElection(
            provider, group=args.group, participant_id=f"{args.name}-{i}", lease_duration=args.lease
        )
        for i in range(args.count)
    ]

    # Leaders are spotted by polling `is_leader` every millisecond while the parent's spot
    # file exists (from the start until it has seen a first leader, and around each
    # failover), not by an `events()` subscriber per election, which would add its own
    # task and queue (about 5 KB) to every participant's RSS.
    logged: set[tuple[str, int | None]] = set()

    async def spot() -> None:
        while True:
            if not os.path.exists(args.spot):  # noqa: ASYNC240 (a local stat, microseconds)
                await asyncio.sleep(0.1)
                continue
            for election in elections:
                if election.is_leader:
                    key = (election.participant_id, election.statistics().token)
                    if key not in logged:
                        logged.add(key)
                        log("acquired", who=key[0], token=key[1])
            await asyncio.sleep(0.001)

    async def stop_leader(at: float) -> None:
        for election in elections:
            if election.is_leader:
                log("stopping", at=at, who=election.participant_id)
                await election.stop()
                log("stopped_leader", who=election.participant_id)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: loop.create_task(stop_leader(time.monotonic())))
    spotter = asyncio.create_task(spot())
    for election in elections:
        await election.start()
    log("started", rss=me.memory_info().rss)
    while not stop.is_set():
        log("calls", calls=dict(provider.calls))
        try:
            async with asyncio.timeout(1.0):
                await stop.wait()
        except TimeoutError:
            pass
    spotter.cancel()
    await asyncio.gather(*(e.stop() for e in elections))
    await close()
    log("exited")
    return 0


# --------------------------------------------------------------------------- the store
class StoreStats:
    """The server's own operation count and connections (Redis, PostgreSQL), and its CPU."""

    def __init__(self, backend: str, url: str, pid: int | None) -> None:
        self.backend, self.url, self.pid = backend, url, pid

    def operations(self) -> int | None:
        if self.backend == "redis":
            from peers import RedisCounter

            counter = RedisCounter(self.url)
            try:
                return sum(counter.snapshot().values())
            finally:
                counter.close()
        if self.backend == "postgres":
            return int(self._pg("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                                "WHERE datname = current_database()"))  # fmt: skip
        return None

    def connections(self) -> int | None:
        """Client connections the server holds, the one asking not counted."""
        if self.backend == "redis":
            import redis

            with redis.Redis.from_url(self.url, socket_timeout=5) as client:
                return int(client.info("clients")["connected_clients"]) - 1
        if self.backend == "postgres":
            return int(self._pg("SELECT count(*) FROM pg_stat_activity WHERE backend_type = "
                                "'client backend' AND pid <> pg_backend_pid()"))  # fmt: skip
        return None

    def cpu_seconds(self) -> float | None:
        """CPU seconds of the server's process tree, exited children included.

        PostgreSQL forks a backend per connection: a backend that exits between two
        samples moves its time into the postmaster's children times, so those count too.
        """
        import psutil

        if self.pid is None:
            return None
        process = psutil.Process(self.pid)
        times = process.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in process.children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system + times.children_user + times.children_system
        return total

    def _pg(self, query: str) -> Any:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            row = conn.execute(query).fetchone()
        assert row is not None
        return row[0]


# --------------------------------------------------------------------------- the probe
def probe(url: str, store: StoreStats) -> dict[str, Any]:
    """The server connections one plain provider holds with 1, then `PROBE_WATCHES` watches.

    ``legacy`` in the answer: each extra watch added about a connection (`LEGACY`).
    """
    return asyncio.run(_probe(url, store))


async def _probe(url: str, store: StoreStats) -> dict[str, Any]:
    from multilock.core import from_url

    provider = from_url(url)
    streams: list[Any] = []
    tasks: list[asyncio.Task[None]] = []

    async def follow(stream: Any) -> None:
        async for _ in stream:
            pass

    counts: dict[int, int] = {}
    try:
        counts[0] = await _settled(store)
        for target in (1, PROBE_WATCHES):
            while len(streams) < target:
                stream = provider.watch(f"bench-probe-{len(streams)}")
                if stream is None:
                    return {"watches": 0, "legacy": False, "counts": counts}
                streams.append(stream)
                tasks.append(asyncio.create_task(follow(stream)))
            counts[target] = await _settled(store)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        await provider.aclose()
    per_watch = (counts[PROBE_WATCHES] - counts[1]) / (PROBE_WATCHES - 1)
    return {
        "watches": PROBE_WATCHES,
        "counts": counts,
        "per_watch": per_watch,
        "legacy": per_watch >= LEGACY_PER_WATCH,
    }


async def _settled(store: StoreStats, within: float = 5.0) -> int:
    """The server's connection count once it has not changed for 0.6 s (or *within*)."""
    deadline = time.monotonic() + within
    seen: list[int] = []
    while True:
        await asyncio.sleep(0.2)
        count = await asyncio.to_thread(store.connections)
        assert count is not None
        seen.append(count)
        if (len(seen) >= 3 and len(set(seen[-3:])) == 1) or time.monotonic() > deadline:
            return count


# --------------------------------------------------------------------------- the run
class ScaleRun:
    """The worker processes of one backend's run, and what their logs say."""

    def __init__(
        self, backend: str, url: str, n: int, workers: int, lease: float, tmp: Path, legacy: bool
    ) -> None:
        self.backend, self.n, self.lease, self.tmp, self.legacy = backend, n, lease, tmp, legacy
        workers = 1 if backend == "memory" else max(1, min(workers, n))
        self.sizes = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
        self.env = {**os.environ, "MULTILOCK_SCALE_URL": url}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.spot_file = tmp / "spot"
        self.spot_file.touch()  # spot the first leader

    def launch(self) -> float:
        began = time.monotonic()
        for i, size in enumerate(self.sizes):
            cmd = [
                sys.executable, str(WORKER), "--backend", self.backend, "--name", f"w{i}",
                "--count", str(size), "--group", f"scale-{self.backend}-{self.n}",
                "--lease", str(self.lease), "--log", str(self.tmp / f"w{i}.jsonl"),
                "--spot", str(self.spot_file), *(["--legacy"] if self.legacy else []),
            ]  # fmt: skip
            with open(self.tmp / f"w{i}.stderr", "ab") as stderr:
                self.procs.append(subprocess.Popen(cmd, env=self.env, stderr=stderr))
        return began

    def records(self) -> list[dict[str, Any]]:
        from multilock.core.testing import read_event_logs

        return read_event_logs(self.tmp / f"w{i}.jsonl" for i in range(len(self.sizes)))

    def wait(self, what: Callable[[list[dict[str, Any]]], Any], within: float) -> Any:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = what(self.records())
            if found:
                return found
            dead = [f"w{i}" for i, p in enumerate(self.procs) if p.poll() not in (None, -9)]
            if dead:
                raise RuntimeError(f"worker(s) {dead} exited early:\n{self.stderr()}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.backend}: timed out after {within:.0f} s\n{self.stderr()}")

    def stderr(self) -> str:
        return "\n".join(p.read_text()[-1500:] for p in sorted(self.tmp.glob("*.stderr")))

    def usage(self) -> tuple[float, int]:
        """CPU seconds and RSS bytes of the live workers."""
        import psutil

        cpu, rss = 0.0, 0
        for proc in self.procs:
            if proc.poll() is None:
                p = psutil.Process(proc.pid)
                times = p.cpu_times()
                cpu += times.user + times.system
                rss += p.memory_info().rss
        return cpu, rss

    def calls(self) -> int:
        """Provider calls so far (watch wake-ups excluded), per the workers' latest lines."""
        latest: dict[str, dict[str, int]] = {}
        for r in self.records():
            if r["event"] == "calls":
                latest[r["participant"]] = r["calls"]
        return sum(v for c in latest.values() for k, v in c.items() if k != "watch")

    def spot(self, on: bool) -> None:
        """Ask every worker to log new leaders within a millisecond (or to stop).

        A file, not a signal: a level that the workers poll (every 0.1 s while it is
        absent) cannot arrive out of order.
        """
        if on:
            self.spot_file.touch()
            time.sleep(0.15)  # every worker has seen it
        else:
            self.spot_file.unlink(missing_ok=True)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _leader(records: list[dict[str, Any]], after: float = 0.0) -> dict[str, Any] | None:
    acquired = [r for r in records if r["event"] == "acquired" and r["t"] > after]
    return acquired[-1] if acquired else None


def measure(
    backend: str,
    url: str,
    n: int,
    workers: int,
    lease: float,
    store: StoreStats,
    tmp: Path,
    window: float | None = None,
    legacy: bool = False,
    failovers: bool = True,
) -> dict[str, Any]:
    """One run of *n* elections; *failovers* False skips the two failovers at its end."""
    run = ScaleRun(backend, url, n, workers, lease, tmp, legacy)
    out: dict[str, Any] = {"n": n, "workers": len(run.sizes), "lease": lease, "legacy": legacy}
    try:
        launched = run.launch()

        def started(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            done = [r for r in records if r["event"] == "started"]
            return done if len(done) == len(run.sizes) else []

        done = run.wait(started, 120 + n / 10)
        first = run.wait(_leader, lease * 10 + 30)
        run.spot(False)
        records = run.records()
        ready = {r["participant"]: r["rss"] for r in records if r["event"] == "ready"}
        first_start = min(r["t"] for r in records if r["event"] == "ready")
        out["all_started_s"] = max(r["t"] for r in done) - launched
        out["first_leader_s"] = first["t"] - first_start
        time.sleep(lease * 2)  # past the start-up herd
        window = window or max(3 * lease, 10.0)
        cpu0, _ = run.usage()
        calls0, ops0, scpu0 = run.calls(), store.operations(), store.cpu_seconds()
        began = time.monotonic()
        time.sleep(window)
        cpu1, rss = run.usage()
        calls1, ops1, scpu1 = run.calls(), store.operations(), store.cpu_seconds()
        seconds = time.monotonic() - began
        out.update(
            cpu_percent=(cpu1 - cpu0) / seconds * 100,
            rss_mb=rss / 2**20,
            rss_per_participant_kb=(rss - sum(ready.values())) / n / 1024,
            provider_calls_per_s=(calls1 - calls0) / seconds,
            server_ops_per_s=None if ops0 is None or ops1 is None else (ops1 - ops0) / seconds,
            server_cpu_percent=None
            if scpu0 is None or scpu1 is None
            else (scpu1 - scpu0) / seconds * 100,
            connections=store.connections(),
            window_s=seconds,
        )
        if not failovers:
            return out
        out["graceful_s"] = _failover(run, "graceful", lease)
        if len(run.sizes) > 1:
            out["crash_s"] = _failover(run, "crash", lease)
    finally:
        run.close()
    return out


def _failover(run: ScaleRun, how: str, lease: float) -> float:
    leader = _leader(run.records())
    assert leader is not None
    worker = int(leader["participant"].removeprefix("w"))
    proc = run.procs[worker]
    run.spot(True)
    if how == "graceful":
        at = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
    else:
        proc.kill()
        proc.wait()
        at = time.monotonic()
    nxt = run.wait(lambda records: _leader(records, after=at), lease * 10 + 30)
    run.spot(False)
    say(f"{run.backend}: {how} failover {leader['who']} -> {nxt['who']}: {nxt['t'] - at:.3f} s")
    return float(nxt["t"] - at)


# --------------------------------------------------------------------------- the report
#: The issue's targets for an idle participant on Redis and PostgreSQL.
MAX_RSS_KB = 20.0
MAX_CPU_PERCENT = 0.05


def report_section(results: dict[str, dict[str, Any]], args: Any) -> list[str]:
    """Section 5; *results*: backend -> {"probe": probe(), "runs": [measure(), ...]}."""
    if not results:
        return []
    small = f" (and {args.scale_small}, on Redis and PostgreSQL)" if args.scale_small else ""
    out = [
        "",
        f"## 5. multilock at scale: {args.scale} participants in one group{small}",
        "",
        f"N `LeaderElection`s in one group, lease {args.scale_lease:g} s (renew lease/3, "
        f"retry min(2 s, lease)), spread evenly over {args.scale_workers} worker processes "
        "(memory: one process, its store lives there). Each worker shares one provider "
        "among its elections (`from_url`, unless the probe below found a connection per "
        "watch). CPU and RSS are the workers' (psutil), over a steady-state window after the "
        "start; per participant: the workers' CPU divided by N, and their RSS growth from "
        "just before the elections were created, divided by N (all but one participant are "
        "idle followers). Provider calls are counted on each worker's provider (watch "
        "wake-ups excluded); server ops are the server's own count (Redis commands, "
        "PostgreSQL transactions); connections are the server's own count of client "
        "connections at the end of the window (Redis `INFO clients` connected_clients, "
        "PostgreSQL `pg_stat_activity` client backends), the one asking excluded. The "
        "failovers run at N only.",
        "",
        "| backend | N | workers | provider | all started s | first leader s "
        "| CPU % (all workers) | CPU % per participant | RSS MB | RSS KB per participant "
        "| provider calls/s | server ops/s | server CPU % | connections | graceful failover s "
        "| crash failover s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, res in results.items():
        for r in res.get("runs", []):
            how = "legacy" if r.get("legacy") else "from_url"
            if "error" in r:
                out.append(f"| {backend} | {r.get('n', '?')} | error: {r['error']} |||||||||||||")
                continue
            out.append(
                f"| {backend} | {r['n']} | {r['workers']} | {how} | {r['all_started_s']:.2f} | "
                f"{r['first_leader_s']:.3f} | {r['cpu_percent']:.1f} | "
                f"{r['cpu_percent'] / r['n']:.4f} | {r['rss_mb']:.0f} | "
                f"{r['rss_per_participant_kb']:.1f} | {r['provider_calls_per_s']:.0f} | "
                f"{fmt(r['server_ops_per_s'], 0)} | {fmt(r['server_cpu_percent'], 1)} | "
                f"{r['connections'] if r['connections'] is not None else 'n/a'} | "
                f"{fmt(r.get('graceful_s'), 3)} | {fmt(r.get('crash_s'), 3)} |"
            )
    out += ["", *_probe_notes(results), *NOTES]
    return out


def _probe_notes(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for backend, res in results.items():
        p = res.get("probe")
        if p is None:
            continue
        if "error" in p:
            lines.append(f"- Watch probe on {backend}: error {p['error']}")
            continue
        if not p.get("watches"):
            lines.append(f"- Watch probe on {backend}: the provider has no watch")
            continue
        c = p["counts"]
        verdict = (
            f"about one connection per watch, so the run applied the old workaround "
            f'("legacy"): {LEGACY[backend]}'
            if p["legacy"]
            else "the watches share the provider's connections: the run used plain `from_url`"
        )
        lines.append(
            f"- Watch probe on {backend}: one `from_url` provider, server connections with no "
            f"watch open {c[0]}, with 1 watch {c[1]}, with {p['watches']} watches of "
            f"{p['watches']} groups {c[p['watches']]} ({p['per_watch']:.2f} per extra watch): "
            f"{verdict}."
        )
    return lines


def targets(results: dict[str, dict[str, Any]]) -> list[str]:
    """The Targets lines of the scale run: connections, and an idle participant's cost."""
    lines = []
    for backend in ("redis", "postgres"):
        runs = [r for r in results.get(backend, {}).get("runs", []) if "error" not in r]
        if not runs:
            if backend in results:
                lines.append(f"- Scale on {backend}: not measured (error)")
            continue
        runs.sort(key=lambda r: r["n"])
        big = runs[-1]
        counts = ", ".join(f"{r['n']} elections: {r['connections']}" for r in runs)
        what = f"Server connections independent of the number of elections on {backend}"
        if len(runs) < 2:
            lines.append(f"- {what}: not judged, one size only ({counts})")
        else:
            # One provider per worker: its pool may open a few more connections under a
            # larger start-up herd, up to its bound, but not one per election.
            ok = big["connections"] <= runs[0]["connections"] + big["workers"]
            lines.append(
                f"- {what}: {_verdict(ok)} ({counts}; {big['workers']} worker processes, one "
                f"provider each; met when the larger size holds at most one more per worker)"
            )
        kb, cpu = big["rss_per_participant_kb"], big["cpu_percent"] / big["n"]
        ok = kb <= MAX_RSS_KB and cpu <= MAX_CPU_PERCENT
        lines.append(
            f"- Idle participant at most {MAX_RSS_KB:g} KB and {MAX_CPU_PERCENT:g} % of a core "
            f"on {backend} ({big['n']} elections): {_verdict(ok)} ({kb:.1f} KB, {cpu:.4f} %)"
        )
    return lines


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**NOT met**"


NOTES = [
    "- Connections: a provider that multiplexes its watches holds its listening connection "
    "(a Redis pub/sub connection, a PostgreSQL LISTEN connection) plus its bounded command "
    "pool, whatever the number of elections; one that holds a connection per watch needs "
    "at least N connections for N participants (see the probe). The count is taken after "
    "the start-up herd, so it includes the pooled connections the herd opened that stay "
    "idle in the pools.",
    "- Failovers: the leading election is stopped (it releases, and the store notifies) "
    "or its whole worker is SIGKILLed (its lease must expire); the time runs to the next "
    "leader in any worker (around a failover each worker looks at its elections' "
    "`is_leader` every millisecond; they have no `events()` subscriber each, which would "
    "add about 5 KB to every participant's RSS). Every follower wakes at once and reads "
    "(`get_leader`) before one of them acquires, so at this size the time is mostly that "
    "herd: N reads queued on the workers' event loops and pools.",
    "- CPU % is of one core (100 = one core busy); the machine has 2 cores shared with "
    "other jobs (see the load averages in Machine).",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one scale worker process")
    for flag in ("--backend", "--name", "--group", "--log", "--spot"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--legacy", action="store_true", help="see LEGACY")
    return asyncio.run(_worker(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
