"""multilock at scale: N participants in one group, as asyncio elections over a few processes.

``run.py --scale N`` calls `measure` per backend. N participants do not fit on 2 cores as
N processes, so they run as N `LeaderElection`s spread evenly over ``--scale-workers``
worker processes (this module run as a program). Each worker shares one provider among its
elections, the way a service hosting many elections would: ``from_url`` for memory and
Redis, and for PostgreSQL a `PostgresProvider` on one ``psycopg_pool`` pool per process.
The in-memory store lives in one process, so memory runs one worker. Every provider is
wrapped in `FaultyProvider` to count its calls.

Measured: time until all N elections started and to the first leader, steady-state CPU
and RSS of the workers (psutil) per participant, provider calls per second for the group,
the server's own count of operations and its CPU, and two failovers: the leading
election stopped (graceful) and, with more than one worker, the leader's whole worker
process SIGKILLed.
"""

from __future__ import annotations

import argparse
import asyncio
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
POOL_SIZE = 10  # connections per worker's psycopg pool (PostgreSQL)


# --------------------------------------------------------------------------- the worker
async def _provider(backend: str, url: str, count: int) -> tuple[Any, Callable[[], Any]]:
    from multilock.core import from_url

    if backend == "redis":
        # redis-py's pool holds 100 connections by default, and every election's watch
        # keeps one (its pub/sub subscription) while its campaign rounds need more: room
        # for all of this worker's at once.
        sep = "&" if "?" in url else "?"
        url = f"{url}{sep}max_connections={3 * count + 50}"
    if backend != "postgres":
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

    from multilock.core import EventKind, LeaderElection
    from multilock.core.testing import FaultyProvider

    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    me = psutil.Process()

    def log(event: str, **fields: Any) -> None:
        record = {"t": time.monotonic(), "participant": args.name, "event": event, **fields}
        os.write(fd, (json.dumps(record) + "\n").encode())

    inner, close = await _provider(args.backend, os.environ["MULTILOCK_SCALE_URL"], args.count)
    provider = FaultyProvider(inner)
    elections = [
        LeaderElection(
            provider, group=args.group, participant_id=f"{args.name}-{i}", lease_duration=args.lease
        )
        for i in range(args.count)
    ]

    async def pump(election: LeaderElection, stream: Any) -> None:
        async for event in stream:
            log("acquired", who=election.participant_id, token=event.token)

    pumps = [asyncio.create_task(pump(e, e.events(EventKind.ACQUIRED))) for e in elections]
    log("ready", rss=me.memory_info().rss)
    for election in elections:
        await election.start()
    log("started", rss=me.memory_info().rss)

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
    while not stop.is_set():
        log("calls", calls=dict(provider.calls))
        try:
            async with asyncio.timeout(1.0):
                await stop.wait()
        except TimeoutError:
            pass
    await asyncio.gather(*(e.stop() for e in elections))
    for task in pumps:
        task.cancel()
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
        if self.backend == "redis":
            import redis

            with redis.Redis.from_url(self.url, socket_timeout=5) as client:
                return int(client.info("clients")["connected_clients"])
        if self.backend == "postgres":
            return int(self._pg("SELECT count(*) FROM pg_stat_activity "
                                "WHERE backend_type = 'client backend'"))  # fmt: skip
        return None

    def cpu_seconds(self) -> float | None:
        import psutil

        if self.pid is None:
            return None
        process = psutil.Process(self.pid)
        total = 0.0
        for p in [process, *process.children(recursive=True)]:
            try:
                times = p.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def _pg(self, query: str) -> Any:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            row = conn.execute(query).fetchone()
        assert row is not None
        return row[0]


# --------------------------------------------------------------------------- the run
class ScaleRun:
    """The worker processes of one backend's run, and what their logs say."""

    def __init__(self, backend: str, url: str, n: int, workers: int, lease: float, tmp: Path):
        self.backend, self.lease, self.tmp = backend, lease, tmp
        workers = 1 if backend == "memory" else max(1, min(workers, n))
        self.sizes = [n // workers + (1 if i < n % workers else 0) for i in range(workers)]
        self.env = {**os.environ, "MULTILOCK_SCALE_URL": url}
        self.procs: list[subprocess.Popen[bytes]] = []

    def launch(self) -> float:
        began = time.monotonic()
        for i, size in enumerate(self.sizes):
            cmd = [
                sys.executable, str(WORKER), "--backend", self.backend, "--name", f"w{i}",
                "--count", str(size), "--group", f"scale-{self.backend}",
                "--lease", str(self.lease), "--log", str(self.tmp / f"w{i}.jsonl"),
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
) -> dict[str, Any]:
    run = ScaleRun(backend, url, n, workers, lease, tmp)
    out: dict[str, Any] = {"n": n, "workers": len(run.sizes), "lease": lease}
    try:
        launched = run.launch()

        def started(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            done = [r for r in records if r["event"] == "started"]
            return done if len(done) == len(run.sizes) else []

        done = run.wait(started, 120 + n / 10)
        first = run.wait(_leader, lease * 10 + 30)
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
    if how == "graceful":
        at = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
    else:
        proc.kill()
        proc.wait()
        at = time.monotonic()
    nxt = run.wait(lambda records: _leader(records, after=at), lease * 10 + 30)
    say(f"{run.backend}: {how} failover {leader['who']} -> {nxt['who']}: {nxt['t'] - at:.3f} s")
    return float(nxt["t"] - at)


# --------------------------------------------------------------------------- the report
def report_section(results: dict[str, dict[str, Any]], workers: int) -> list[str]:
    if not results:
        return []
    n = next(iter(results.values())).get("n", "?")
    lease = next(iter(results.values())).get("lease", 0)
    out = [
        "",
        f"## 5. multilock at scale: {n} participants in one group",
        "",
        f"{n} `LeaderElection`s in one group, lease {lease:g} s (renew lease/3, retry "
        f"min(2 s, lease)), spread evenly over {workers} worker processes (memory: one "
        "process, its store lives there). Each worker shares one provider among its "
        "elections: `from_url` for memory and Redis; for PostgreSQL a `PostgresProvider` on "
        f"one `psycopg_pool` pool of at most {POOL_SIZE} connections per process. CPU and "
        "RSS are the workers' (psutil), over a steady-state window after the start; RSS per "
        "participant is the workers' growth from just before the elections were created. "
        "Provider calls are counted on each worker's provider (watch wake-ups excluded); "
        "server ops are the server's own count (Redis commands, PostgreSQL transactions).",
        "",
        "| backend | workers | all started s | first leader s | CPU % (all workers) "
        "| CPU % per participant | RSS MB | RSS KB per participant | provider calls/s "
        "| server ops/s | server CPU % | connections | graceful failover s "
        "| crash failover s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for backend, r in results.items():
        if "error" in r:
            out.append(f"| {backend} | error: {r['error']} |||||||||||||")
            continue
        out.append(
            f"| {backend} | {r['workers']} | {r['all_started_s']:.2f} | "
            f"{r['first_leader_s']:.3f} | {r['cpu_percent']:.1f} | "
            f"{r['cpu_percent'] / r['n']:.4f} | {r['rss_mb']:.0f} | "
            f"{r['rss_per_participant_kb']:.1f} | {r['provider_calls_per_s']:.0f} | "
            f"{fmt(r['server_ops_per_s'], 0)} | {fmt(r['server_cpu_percent'], 1)} | "
            f"{r['connections'] if r['connections'] is not None else 'n/a'} | "
            f"{r['graceful_s']:.3f} | {fmt(r.get('crash_s'), 3)} |"
        )
    return [*out, "", *NOTES]


NOTES = [
    "- Connections: every election's watch holds a connection of its own (a Redis pub/sub "
    "subscription, a PostgreSQL LISTEN connection), even when the elections share one "
    "provider, so N participants need at least N server connections. The run raises "
    "redis-py's pool limit through the URL (`max_connections` = 3 x elections + 50 per "
    "worker: with redis-py's default of 100, watches and campaign rounds fail with "
    "`MaxConnectionsError` past about 100 elections per provider, and the elections fall "
    "back to polling) and starts PostgreSQL with `max_connections` = 1.2 x N + 100 (its "
    "default is 100). The Redis count also holds the pooled connections that the start-up "
    "herd opened and that stay idle in the pools.",
    "- Failovers: the leading election is stopped (it releases, and the store notifies) "
    "or its whole worker is SIGKILLed (its lease must expire); the time runs to the next "
    "ACQUIRED in any worker. Every follower wakes at once and reads (`get_leader`) before "
    "one of them acquires, so at this size the time is mostly that herd: N reads queued "
    "on the workers' event loops and pools.",
    "- CPU % is of one core (100 = one core busy); the machine has 2 cores shared with "
    "other jobs (see the load averages in Machine).",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one scale worker process")
    for flag in ("--backend", "--name", "--group", "--log"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--lease", type=float, required=True)
    return asyncio.run(_worker(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
