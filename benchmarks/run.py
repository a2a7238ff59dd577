"""Benchmark multilock's backends and write a Markdown report.

    python benchmarks/run.py [--backends memory,filesystem,redis,redlock,postgres,etcd,
                                         s3,azure_blob,zookeeper]
                             [--handoffs 100] [--kills 5] [--idle-leases 20]
                             [--lease 1.0] [--out benchmarks/REPORT.md]

Starts its own throwaway servers (redis-server, postgres, etcd, moto's S3, Azurite,
ZooKeeper) with the integration harness and stops them, by the PID it started, whatever
happens. Azure Blob leases last 15 to 60 s, so azure_blob runs with a 15 s lease and
fewer samples (see `LIMITS`). Three measurements per backend:

1. graceful handoff latency: ``resign()`` of the leader until the other election's ACQUIRED
   event, two elections in this process, each with its own provider on the same URL;
2. crash failover: a 3-process `Cluster`, SIGKILL the leader, time until the next
   ``acquired`` log line (both on ``time.monotonic``);
3. the store operations caused by one idle follower (its provider wrapped in
   `FaultyProvider`), and for Redis the server's own command counts as a cross-check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration"))

from harness.backends import redlock_url  # noqa: E402
from harness.fixtures_azure_blob import AzuriteServer  # noqa: E402
from harness.fixtures_etcd import EtcdServer  # noqa: E402
from harness.fixtures_s3 import S3Server  # noqa: E402
from harness.fixtures_zookeeper import ZooKeeperServer  # noqa: E402
from harness.servers import PostgresServer, RedisServer, Server  # noqa: E402
from multilock.core import EventKind, LeaderElection, from_url  # noqa: E402
from multilock.core.testing import Cluster, FaultyProvider  # noqa: E402

S = TypeVar("S", bound=Server)
ALL_BACKENDS = [
    "memory",
    "filesystem",
    "redis",
    "redlock",
    "postgres",
    "etcd",
    "s3",
    "azure_blob",
    "zookeeper",
]
#: Backends that cannot run here, and why (listed in the report as not measured).
NOT_MEASURED = {
    "consul": "no Consul server can be installed on this machine (not in Debian, PyPI or "
    "npm) and no Docker engine answers",
    "sqlserver": "no SQL Server engine can be installed on this machine (only the client "
    "stack installs) and no Docker engine answers",
}
#: Azure Blob leases last 15..60 whole seconds: its own lease, and caps on the sample counts
#: that keep the whole run bounded (a crash failover alone takes about one lease).
LIMITS: dict[str, dict[str, float]] = {
    "azure_blob": {"lease": 15.0, "handoffs": 20, "kills": 3, "idle_leases": 4},
}
#: Azure's polling watch defaults to 2 s, longer than the hold-off below; S3's harness URL
#: already polls every 0.2 s, so Azure gets the same.
AZURE_POLL = 0.2
#: Backends whose watch polls the store itself (seconds between reads, not provider calls).
WATCH_POLLS = {"s3": 0.2, "azure_blob": AZURE_POLL}
#: The resigner holds off for retry_interval; the waiting election must win within it.
HANDOFF_RETRY = 0.25
#: The filesystem's watch polls os.stat; it must poll well within the hold-off above.
FILE_POLL = 0.1


def say(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plan(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The lease and sample counts for backend *name*: the command line's, within `LIMITS`."""
    limits = LIMITS.get(name, {})
    return {
        "lease": limits.get("lease", args.lease),
        "handoffs": min(args.handoffs, int(limits.get("handoffs", args.handoffs))),
        "kills": min(args.kills, int(limits.get("kills", args.kills))),
        "idle_leases": min(args.idle_leases, int(limits.get("idle_leases", args.idle_leases))),
    }


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


# --------------------------------------------------------------------------- servers
class Backends:
    """Starts the servers the chosen backends need; `close()` stops each by its PID."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.servers: list[Server] = []
        self.redis: RedisServer | None = None
        self.urls: dict[str, str] = {}
        self._tmp: str | None = None

    def start(self) -> None:
        for name in self.names:
            if name == "memory":
                self.urls[name] = "memory://bench"
            elif name == "filesystem":
                self._tmp = tempfile.mkdtemp(prefix="multilock-bench-fs-")
                self.urls[name] = f"file://{self._tmp}?poll_interval={FILE_POLL}"
            elif name == "redis":
                self.redis = self._add(RedisServer())
                self.urls[name] = self.redis.url
            elif name == "redlock":
                nodes = [self._add(RedisServer()) for _ in range(3)]
                self.urls[name] = redlock_url(nodes)
            elif name == "postgres":
                self.urls[name] = self._add(PostgresServer()).url
            elif name == "etcd":
                self.urls[name] = self._add(EtcdServer()).url  # ?min_lease=1
            elif name == "s3":
                self.urls[name] = self._add(S3Server()).url  # poll_interval=0.2
            elif name == "azure_blob":
                url = self._add(AzuriteServer()).url
                self.urls[name] = f"{url}&poll_interval={AZURE_POLL:g}"
            elif name == "zookeeper":
                self.urls[name] = self._add(ZooKeeperServer()).url
            else:
                raise SystemExit(f"unknown backend {name!r}; known: {', '.join(ALL_BACKENDS)}")

    def _add(self, server: S) -> S:
        self.servers.append(server)
        server.start()
        return server

    def close(self) -> None:
        for server in reversed(self.servers):
            with contextlib.suppress(Exception):
                server.close()  # signals only the PID it started
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


# --------------------------------------------------------------------------- 1. handoff
async def _wait(predicate: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def measure_handoff(url: str, count: int, lease: float) -> dict[str, Any]:
    providers = [from_url(url), from_url(url)]
    elections = [
        LeaderElection(
            provider,
            group="bench-handoff",
            participant_id=f"handoff-{i}",
            lease_duration=lease,
            retry_interval=HANDOFF_RETRY,
        )
        for i, provider in enumerate(providers)
    ]
    acquired: list[asyncio.Queue[float]] = [asyncio.Queue(), asyncio.Queue()]

    async def pump(i: int) -> None:
        async for _event in elections[i].events(EventKind.ACQUIRED):
            acquired[i].put_nowait(time.perf_counter())

    def ready(i: int) -> Callable[[], bool]:
        # A follower has made a campaign round since its last term (or start).
        before = elections[i].statistics().acquire_attempts
        return lambda: elections[i].statistics().acquire_attempts > before

    latencies: list[float] = []
    failures = 0
    pumps = [asyncio.create_task(pump(i)) for i in (0, 1)]
    try:
        for election in elections:
            await election.start()
        if not await _wait(lambda: any(e.is_leader for e in elections), lease * 10):
            raise RuntimeError("no leader at all")
        # Let the follower settle on its watch: a polling watch (S3, Azure) takes its
        # baseline with its first read, and a release before that read goes unseen.
        await _wait(lambda: all(e.statistics().acquire_attempts for e in elections), lease * 5)
        await asyncio.sleep(HANDOFF_RETRY + 1.0)
        for _ in range(count):
            leader = 0 if elections[0].is_leader else 1
            other = 1 - leader
            for queue in acquired:
                while not queue.empty():
                    queue.get_nowait()
            back = ready(leader)
            started = time.perf_counter()
            await elections[leader].resign()
            try:
                won = await asyncio.wait_for(acquired[other].get(), lease * 3)
            except TimeoutError:
                failures += 1
                await _wait(lambda: any(e.is_leader for e in elections), lease * 5)
                continue
            latencies.append(won - started)
            # The resigner comes back after its hold-off, sees the new leader, follows.
            await _wait(back, HANDOFF_RETRY + lease * 3)
            await asyncio.sleep(0.02)
    finally:
        for election in elections:
            await election.stop()
        for task in pumps:
            task.cancel()
        for provider in providers:
            await provider.aclose()
    ms = [x * 1000 for x in latencies]
    return {
        "count": len(ms),
        "failures": failures,
        "p50": pct(ms, 50) if ms else None,
        "p95": pct(ms, 95) if ms else None,
        "max": max(ms) if ms else None,
        "mean": statistics.fmean(ms) if ms else None,
    }


# --------------------------------------------------------------------------- 2. crash
def _acquired_at(cluster: Cluster, token: int) -> float:
    for record in cluster.records():
        if record["event"] == "acquired" and int(record["token"]) == token:
            return float(record["t"])
    raise RuntimeError(f"no acquired line for token {token}")


def _started(cluster: Cluster, name: str, after: float) -> bool:
    return any(
        r["event"] == "started" and r["participant"] == name and float(r["t"]) >= after
        for r in cluster.records()
    )


def measure_crash(url: str, kills: int, lease: float) -> dict[str, Any]:
    rng = random.Random(7)
    failovers: list[float] = []
    with Cluster(url, "bench-crash", size=3, lease=lease) as cluster:
        member, token, _ = cluster.wait_for_leader(timeout=30 + lease * 5)
        time.sleep(lease)  # everyone started and following
        for _ in range(kills):
            time.sleep(rng.uniform(0.05, lease / 3))  # a random point of the renew cycle
            killed_at = cluster.kill(member)
            new, new_token, _ = cluster.wait_for_leader(timeout=lease * 10 + 10, newer_than=token)
            failovers.append(_acquired_at(cluster, new_token) - killed_at)
            relaunched_at = time.monotonic()
            cluster.launch(member)
            deadline = time.monotonic() + 30
            while not _started(cluster, member.name, relaunched_at):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{member.name} did not restart:\n{cluster.tail()}")
                time.sleep(0.02)
            time.sleep(0.2)  # its first campaign round
            member, token = new, new_token
        report = cluster.check()
    return {
        "count": len(failovers),
        "mean": statistics.fmean(failovers),
        "max": max(failovers),
        "min": min(failovers),
        "timeline_ok": report.ok,
        "problems": report.problems[:3],
    }


# --------------------------------------------------------------------------- 3. idle
class RedisCounter:
    """``INFO commandstats`` of one Redis server, minus the INFO calls themselves."""

    def __init__(self, url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=5)

    def snapshot(self) -> Counter[str]:
        stats = self._client.info("commandstats")
        return Counter(
            {
                k.removeprefix("cmdstat_"): v["calls"]
                for k, v in stats.items()
                if k != "cmdstat_info"
            }
        )

    def close(self) -> None:
        self._client.close()


async def measure_idle(
    name: str, url: str, leases: int, lease: float, redis_url: str | None
) -> dict[str, Any]:
    leader_provider = from_url(url)
    follower_provider = FaultyProvider(from_url(url))
    leader = LeaderElection(
        leader_provider, group="bench-idle", participant_id="idle-leader", lease_duration=lease
    )
    follower = LeaderElection(
        follower_provider, group="bench-idle", participant_id="idle-follower", lease_duration=lease
    )
    counter = RedisCounter(redis_url) if redis_url else None
    result: dict[str, Any] = {}
    try:
        await leader.start()
        await asyncio.wait_for(leader.wait_until_leader(), lease * 10)
        if counter is not None:
            await asyncio.sleep(lease)
            alone_base = await asyncio.to_thread(counter.snapshot)
            alone = leases / 2 * lease
            await asyncio.sleep(alone)
            result["server_leader_only"] = _per_second(
                await asyncio.to_thread(counter.snapshot), alone_base, alone
            )
        await follower.start()
        await asyncio.sleep(lease * 2)  # past start-up: subscribe, first rounds
        before = Counter(follower_provider.calls)
        base = await asyncio.to_thread(counter.snapshot) if counter is not None else None
        began = time.monotonic()
        await asyncio.sleep(leases * lease)
        elapsed = time.monotonic() - began
        calls = Counter(follower_provider.calls)
        calls.subtract(before)
        if counter is not None and base is not None:
            result["server_with_follower"] = _per_second(
                await asyncio.to_thread(counter.snapshot), base, elapsed
            )
        result.update(
            seconds=elapsed,
            calls={k: v for k, v in calls.items() if v},
            still_leader=leader.is_leader and not follower.is_leader,
        )
    finally:
        await follower.stop()
        await leader.stop()
        await follower_provider.aclose()
        await leader_provider.aclose()
        if counter is not None:
            counter.close()
    say(
        f"{name}: idle follower {dict(result.get('calls', {}))} in {result.get('seconds', 0):.1f} s"
    )
    return result


def _per_second(after: Counter[str], before: Counter[str], seconds: float) -> dict[str, float]:
    delta = Counter(after)
    delta.subtract(before)
    return {k: v / seconds for k, v in sorted(delta.items()) if v > 0}


# --------------------------------------------------------------------------- machine
def machine() -> list[str]:
    model, cpus = "unknown", 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                cpus += 1
    lines = [
        f"- CPU: {cpus} x {model}",
        f"- OS: {platform.platform()}",
        f"- Python: {platform.python_implementation()} {platform.python_version()}",
        f"- Load average (1/5/15 min) when the report was written: "
        f"{' / '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine: other "
        "jobs may have run during the measurements)",
    ]
    for label, argv in _server_version_commands():
        with contextlib.suppress(Exception):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
            text = (out.stdout.strip() or out.stderr.strip()).splitlines()
            lines.append(f"- {label}: {text[0] if text else 'unknown'}")
    from importlib.metadata import version

    for dist in ("redis", "psycopg", "filelock", "aetcd", "minio", "moto"):
        with contextlib.suppress(Exception):
            lines.append(f"- {'server' if dist == 'moto' else 'driver'} {dist}: {version(dist)}")
    for dist in ("azure-storage-blob", "kazoo"):
        with contextlib.suppress(Exception):
            lines.append(f"- driver {dist}: {version(dist)}")
    return lines


def _server_version_commands() -> Iterator[tuple[str, list[str]]]:
    from harness.install import postgres_bindir, redis_server_binary

    redis_bin = redis_server_binary()
    if redis_bin is not None:
        yield "redis-server", [str(redis_bin), "--version"]
    pg = postgres_bindir()
    if pg is not None:
        yield "PostgreSQL", [str(pg / "postgres"), "--version"]
    from harness.fixtures_azure_blob import find_azurite
    from harness.install import etcd_binary

    etcd = etcd_binary()
    if etcd is not None:
        yield "etcd", [str(etcd), "--version"]
    azurite = find_azurite()
    if azurite is not None:
        yield "Azurite", [str(azurite), "--version"]
    java = shutil.which("java")
    if java is not None:
        main_class = "org.apache.zookeeper.version.VersionInfoMain"
        yield "ZooKeeper", [java, "-cp", "/usr/share/java/zookeeper.jar", main_class]


# --------------------------------------------------------------------------- report
def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**NOT met**"


def write_report(args: argparse.Namespace, results: dict[str, dict[str, Any]], wall: float) -> str:
    lease = args.lease
    out = [
        "# multilock benchmark report",
        "",
        f"Written by `python benchmarks/run.py` in one run on {time.strftime('%Y-%m-%d %H:%M %Z')}"
        f" ({wall:.0f} s wall clock). See `benchmarks/README.md` for what each number means.",
        "",
        "## Machine",
        "",
        *machine(),
        "",
        "## Settings (the same for every backend unless stated)",
        "",
        f"- lease_duration {lease:g} s, renew_interval {lease / 3:.3g} s (default: a third)",
        f"- handoff: retry_interval {HANDOFF_RETRY:g} s (the resigner's hold-off), "
        f"{args.handoffs} handoffs, roles alternating",
        f"- crash: 3-process Cluster, default retry_interval, {args.kills} SIGKILLs of the leader",
        f"- idle follower: default retry_interval, {args.idle_leases} leases observed",
        *_exceptions(results, args),
        f"- servers started locally: Redis (no persistence), Redlock on 3 Redis nodes, "
        f"PostgreSQL (fsync=off), etcd (one member, --unsafe-no-fsync, heartbeat 10 ms, "
        f"election 100 ms, URL min_lease=1), moto's S3 server (in memory, URL "
        f"poll_interval=0.2 s), Azurite (in memory, poll_interval={AZURE_POLL:g} s added "
        f"to its URL: the default 2 s would outlast the hold-off), ZooKeeper standalone "
        f"(tickTime 500 ms; the session timeout follows the lease); filesystem on a local "
        f"temp dir with poll_interval={FILE_POLL:g} s (the default 0.5 s would outlast the "
        "hold-off)",
        *_not_measured(results),
        "",
        "## 1. Graceful handoff latency (resign() to the other's ACQUIRED)",
        "",
        "| backend | lease s | handoffs | failed | p50 ms | p95 ms | mean ms | max ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        h = r.get("handoff")
        if h is None:
            out.append(f"| {name} | error: {r.get('handoff_error', 'skipped')} ||||||")
            continue
        out.append(
            f"| {name} | {r['plan']['lease']:g} | {h['count']} | {h['failures']} | "
            f"{fmt(h['p50'], 2)} | {fmt(h['p95'], 2)} | {fmt(h['mean'], 2)} | {fmt(h['max'], 2)} |"
        )
    out += [
        "",
        "## 2. Crash failover (SIGKILL of the leader to the next `acquired` line)",
        "",
        "| backend | lease s | kills | mean s | max s | mean / lease | max / lease "
        "| timeline check |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        c = r.get("crash")
        lease = r["plan"]["lease"]
        if c is None:
            out.append(f"| {name} | {r.get('crash_error', 'n/a')} |||||||")
            continue
        out.append(
            f"| {name} | {lease:g} | {c['count']} | {c['mean']:.3f} | {c['max']:.3f} | "
            f"{c['mean'] / lease:.2f} | {c['max'] / lease:.2f} | "
            f"{'ok' if c['timeline_ok'] else c['timeline_ok']} |"
        )
    out += [
        "",
        "## 3. Store operations caused by one idle follower",
        "",
        "Counted on the follower's provider (`FaultyProvider.calls`); `watch` is the number of "
        "wake-ups its watch delivered. Operations done inside a watch (Redis pub/sub, "
        "PostgreSQL LISTEN, etcd's watch stream, ZooKeeper's watches, the filesystem's "
        "stat() polling, and the GET that the S3 and Azure Blob watches send every "
        "poll_interval) are not provider calls and are not in these columns.",
        "",
        "| backend | lease s | seconds | get_leader | try_acquire | watch wakes | provider ops/s "
        "| provider ops/lease | wakes/lease |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        i = r.get("idle")
        lease = r["plan"]["lease"]
        if i is None:
            out.append(f"| {name} | error: {r.get('idle_error', 'n/a')} ||||||||")
            continue
        calls, secs = i["calls"], i["seconds"]
        ops = sum(v for k, v in calls.items() if k != "watch")
        n_leases = secs / lease
        out.append(
            f"| {name} | {lease:g} | {secs:.1f} | {calls.get('get_leader', 0)} | "
            f"{calls.get('try_acquire', 0)} | {calls.get('watch', 0)} | {ops / secs:.2f} | "
            f"{ops / n_leases:.2f} | {calls.get('watch', 0) / n_leases:.2f} |"
        )
    redis_idle = results.get("redis", {}).get("idle") or {}
    if "server_with_follower" in redis_idle:
        alone = redis_idle["server_leader_only"]
        both = redis_idle["server_with_follower"]
        out += [
            "",
            "Redis server-side cross-check (`INFO commandstats`, commands per second, INFO "
            "itself excluded):",
            "",
            "| command | leader only | leader + idle follower | follower's share |",
            "|---|---|---|---|",
        ]
        for cmd in sorted(set(alone) | set(both)):
            a, b = alone.get(cmd, 0.0), both.get(cmd, 0.0)
            out.append(f"| {cmd} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
        a_total, b_total = sum(alone.values()), sum(both.values())
        out.append(
            f"| **total** | {a_total:.2f} | {b_total:.2f} | {b_total - a_total:+.2f} "
            f"({(b_total - a_total) * results['redis']['plan']['lease']:.2f} per lease) |"
        )
    out += ["", "## Targets", ""]
    out += targets(results)
    out += ["", "## How to read these numbers", "", *NOTES]
    out.append("")
    return "\n".join(out)


NOTES = [
    "- Handoff: `resign()` cancels the term, releases (one store write), and the waiting "
    "election hears of it through its watch (Redis pub/sub, PostgreSQL NOTIFY, etcd's "
    "watch stream, ZooKeeper's child watch, the in-memory store's condition; the "
    "filesystem, S3 and Azure Blob poll), then runs one campaign round (get_leader + "
    "try_acquire). The polling backends are bounded by their poll_interval (about half "
    "of it on average, plus a few HTTP round trips for S3 and Azure); the others by a few "
    "round trips (Redlock: to a majority of 3 nodes). A failed handoff is one where the "
    "other election did not take over within 3 leases; with a polling watch, the "
    "resigner's hold-off (retry_interval, 0.25 s) is only a little longer than "
    "poll_interval plus the follower's campaign round (0.2 s plus HTTP round trips on S3 "
    "and Azure), so a slow poll can let the resigner take the lease back, and the "
    "handoff then does not happen at all.",
    "- Crash failover: a SIGKILLed leader cannot release, so the store keeps its lease until "
    "it expires, lease_duration after its last renew. The kill lands at a random point of "
    "the renew cycle, so the floor is between lease - renew_interval and lease; the rest is "
    "detection (the followers' watches wake at the observed expiry) plus one campaign round.",
    "- Idle follower: a follower runs a campaign round (get_leader) when its watch wakes it "
    "and, as a safety net, when 2 x lease_duration (jittered down by up to a quarter) "
    "passes without a wake, as long as its watch works (retry_interval otherwise); each "
    "wake restarts that timer. A watch that wakes at every lease expiry it observes "
    "(memory, Redis, Redlock, PostgreSQL) gives about one round per lease and the safety "
    "net never fires; a watch that sees renewals and so stays quiet while the leader "
    "lives (filesystem, etcd, S3, Azure Blob, ZooKeeper) leaves only the safety net: "
    "about one round per two leases (0.5 to 0.6 per lease with the jitter).",
    "- Wakes differ by watch: the in-memory watch wakes at each expiry it observes, which "
    "can be as little as lease - renew_interval away (so up to about 1.5 wakes per lease "
    "at the default renew_interval); the filesystem watch follows renewals (it "
    "re-reads the record when stat() changes) so it wakes only on a new term or a real "
    "expiry, but it pays a stat() every poll_interval and a read per renewal inside the "
    "watch, which these counts do not see. The S3 and Azure Blob watches poll the object "
    "every poll_interval (0.2 s here) inside the watch and wake on a new holder or at the "
    "lease expiry they observe; etcd and ZooKeeper are pushed changes by the server.",
    "- The Redis cross-check counts every command the server ran (INFO excluded), so it "
    "includes what the watch does; the leader-only and leader-plus-follower windows are "
    "taken one after the other, so small differences in the leader's own commands "
    "(EVALSHA/HSET/PEXPIRE) are sampling noise.",
]


def _exceptions(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = []
    for name, r in results.items():
        p = r["plan"]
        if name in LIMITS:
            lines.append(
                f"- **{name} differs**: lease_duration {p['lease']:g} s (Azure Blob leases "
                f"last 15 to 60 s), {p['handoffs']} handoffs, {p['kills']} SIGKILLs, "
                f"{p['idle_leases']} idle leases, to keep the run bounded"
            )
    return lines


def _not_measured(results: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"- not measured: {name} ({why})"
        for name, why in NOT_MEASURED.items()
        if name not in results
    ]


def targets(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    for name in ("redis", "postgres", "zookeeper", "etcd"):
        h = results.get(name, {}).get("handoff")
        if h is None or h["p50"] is None:
            lines.append(f"- Handoff p50 < 10 ms on {name}: not measured")
            continue
        lines.append(
            f"- Handoff p50 < 10 ms on {name}: {verdict(h['p50'] < 10)} "
            f"(p50 {h['p50']:.2f} ms, p95 {h['p95']:.2f} ms)"
        )
    for name, r in results.items():
        c = r.get("crash")
        if c is None:
            continue
        limit = r["plan"]["lease"] + 0.5
        lines.append(
            f"- Crash failover < lease + 0.5 s ({limit:g} s) on {name}: "
            f"{verdict(c['max'] < limit)} (mean {c['mean']:.3f} s, max {c['max']:.3f} s)"
        )
    for name, r in results.items():
        i = r.get("idle")
        if i is None:
            continue
        calls, n_leases = i["calls"], i["seconds"] / r["plan"]["lease"]
        ops = sum(v for k, v in calls.items() if k != "watch") / n_leases
        wakes = calls.get("watch", 0) / n_leases
        reads = calls.get("get_leader", 0) / n_leases
        # The target: about one wake per lease expiry, and no polling beyond it, i.e.
        # about one campaign round (a get_leader; no try_acquire while a leader lives).
        if wakes <= 1.25 and ops <= 1.25:
            state = "**met**"
        elif wakes <= 1.25:
            state = "**partly met** (wakes yes, reads no)"
        else:
            state = "**NOT met**"
        polled = ""
        if name in WATCH_POLLS:
            per_lease = r["plan"]["lease"] / WATCH_POLLS[name]
            polled = (
                f"; but its polling watch also sends a GET every {WATCH_POLLS[name]:g} s, "
                f"{per_lease:.0f} per lease, which these counts leave out"
            )
            if state == "**met**":
                state = "**partly met** (wakes and provider reads yes, watch polling no)"
        lines.append(
            f"- Idle follower costs about one wake per lease on {name}: {state} "
            f"({wakes:.2f} wakes, {reads:.2f} get_leader and "
            f"{calls.get('try_acquire', 0) / n_leases:.2f} try_acquire per lease{polled})"
        )
    return lines


# --------------------------------------------------------------------------- main
async def run_async(
    urls: dict[str, str], args: argparse.Namespace, results: dict[str, dict[str, Any]]
) -> None:
    for name, url in urls.items():
        p = plan(name, args)
        say(f"{name}: {p['handoffs']} handoffs, lease {p['lease']:g} s")
        try:
            results[name]["handoff"] = await measure_handoff(url, p["handoffs"], p["lease"])
        except Exception as exc:
            results[name]["handoff_error"] = repr(exc)
        say(f"{name}: handoff {results[name].get('handoff') or results[name].get('handoff_error')}")


async def run_idle(
    urls: dict[str, str],
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    redis_url: str | None,
) -> None:
    say(f"idle follower on {', '.join(urls)} at once")
    names = list(urls)
    plans = {n: plan(n, args) for n in names}
    outcomes = await asyncio.gather(
        *(
            measure_idle(
                n,
                urls[n],
                plans[n]["idle_leases"],
                plans[n]["lease"],
                redis_url if n == "redis" else None,
            )
            for n in names
        ),
        return_exceptions=True,
    )
    for name, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            results[name]["idle_error"] = repr(outcome)
        else:
            results[name]["idle"] = outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(ALL_BACKENDS))
    parser.add_argument("--handoffs", type=int, default=100)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--idle-leases", type=int, default=20)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "REPORT.md"))
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]

    # SIGTERM/SIGINT: unwind through the finally below, which stops the servers.
    def interrupted(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, interrupted)
    began = time.monotonic()
    backends = Backends(names)
    results: dict[str, dict[str, Any]] = {n: {"plan": plan(n, args)} for n in names}
    try:
        say(f"starting servers for {', '.join(names)}")
        backends.start()
        asyncio.run(run_async(backends.urls, args, results))
        for name, url in backends.urls.items():
            if name == "memory":
                results[name]["crash_error"] = "n/a (the store lives in one process)"
                continue
            p = plan(name, args)
            say(f"{name}: crash failover, {p['kills']} kills, lease {p['lease']:g} s")
            try:
                results[name]["crash"] = measure_crash(url, p["kills"], p["lease"])
            except Exception as exc:
                results[name]["crash_error"] = f"error: {exc!r}"[:300]
            say(f"{name}: crash {results[name].get('crash') or results[name].get('crash_error')}")
        redis_url = backends.redis.url if backends.redis is not None else None
        asyncio.run(run_idle(backends.urls, args, results, redis_url))
        wall = time.monotonic() - began
        text = write_report(args, results, wall)
    finally:
        backends.close()
    Path(args.out).write_text(text)
    say(f"wrote {args.out} after {time.monotonic() - began:.0f} s")
    print(text[text.index("## Targets") :])
    return 0


if __name__ == "__main__":
    sys.exit(main())
