"""The Markdown report: machine, settings, and multilock's own three measurements.

The peer comparison, the scale run, the many-groups run, the SIGTERM run, the locks,
the shard rebalance and the plot add their sections through their modules'
``report_section``; `targets` also judges what the peers and the scale run measured.
`merge_sections` puts sections run on their own (``run.py --only``) into an earlier report.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import floor
import locks
import plot
import rebalance
import roundtrip
import scale
import sigterm
import timeline
from common import (
    AZURE_POLL,
    FILE_POLL,
    HANDOFF_RETRY,
    LIMITS,
    NOT_MEASURED,
    PINGPONG_HOLD,
    WATCH_POLLS,
    fmt,
)


def machine(loads: list[tuple[str, tuple[float, float, float]]]) -> list[str]:
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
        "- Load average (1/5/15 min) at the start of each phase (2 cores; a shared "
        "machine: other jobs ran during the measurements, and the load also counts this "
        "run's own servers and workers, e.g. the scale and many-groups workers before the "
        "plot): "
        + "; ".join(f"{phase} {' / '.join(f'{x:.2f}' for x in load)}" for phase, load in loads),
    ]
    for label, argv in _server_version_commands():
        with contextlib.suppress(Exception):
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
            text = (out.stdout.strip() or out.stderr.strip()).splitlines()
            lines.append(f"- {label}: {text[0] if text else 'unknown'}")
    from importlib.metadata import version

    for dist in ("redis", "psycopg", "aetcd", "minio", "moto"):
        with contextlib.suppress(Exception):
            lines.append(f"- {'server' if dist == 'moto' else 'driver'} {dist}: {version(dist)}")
    for dist in ("azure-storage-blob", "kazoo", "tooz", "psutil", "matplotlib"):
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


#: "p95 within a few ms of p50": a hand-back that waited out even part of a hold-off
#: (HANDOFF_RETRY) would be far outside it.
PINGPONG_SPREAD = 5.0


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**NOT met**"


def write_report(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    wall: float,
    sections: list[str],
    loads: list[tuple[str, tuple[float, float, float]]],
    extra: dict[str, Any] | None = None,
) -> str:
    lease = args.lease
    out = [
        "# multilock benchmark report",
        "",
        f"Written by `python benchmarks/run.py` in one run on {time.strftime('%Y-%m-%d %H:%M %Z')}"
        f" ({wall:.0f} s wall clock). See `benchmarks/README.md` for what each number means.",
        "",
        "## Machine",
        "",
        *machine(loads),
        "",
        "## Settings (the same for every backend unless stated)",
        "",
        f"- lease_duration {lease:g} s, renew_interval {lease / 3:.3g} s (default: a third)",
        f"- handoff: retry_interval {HANDOFF_RETRY:g} s (the resigner's hold-off), "
        f"{args.handoffs} handoffs, roles alternating; ping-pong: as many hand-backs, each "
        f"leader resigning {PINGPONG_HOLD * 1000:g} ms after it won",
        f"- crash: 3-process Cluster, default retry_interval, {args.kills} SIGKILLs of the leader",
        f"- idle follower: default retry_interval, {args.idle_leases} leases observed",
        *_exceptions(results, args),
        f"- servers started locally: Redis (no persistence), Redlock on 3 Redis nodes, "
        f"PostgreSQL (fsync=off), etcd (one member, --unsafe-no-fsync, heartbeat 10 ms, "
        f"election 100 ms, URL min_lease=1), moto's S3 server (in memory, URL "
        f"poll_interval=0.2 s), Azurite (in memory, poll_interval={AZURE_POLL:g} s added "
        f"to its URL: the default 2 s would outlast the hold-off), ZooKeeper standalone "
        f"(tickTime 500 ms, forceSync=no; session_timeout=1 in the URL, the lease's lower bound); "
        f"filesystem on a local temp dir with poll_interval={FILE_POLL:g} s in its URL (for "
        "when its watch polls: the default 0.5 s would outlast the hold-off)",
        *_not_measured(results),
        "",
        "## 1. Graceful handoff latency (resign() to the other's ACQUIRED)",
        "",
        "Handoff: the leader resigns; before the next handoff the resigner has come back "
        f"from its hold-off (retry_interval {HANDOFF_RETRY:g} s) and follows (on the "
        "polling backends: and one poll interval and a random part of another have passed, "
        "so that its watch has read the new term and the next handoff meets its polls at a "
        "random phase).",
        "",
        *_latency_table(results, "handoff", "handoffs"),
        "",
        *_round_trip_table(results),
        "",
        *_floor_table(results),
        "",
        "### Ping-pong",
        "",
        "The same two elections hand the leadership back and forth faster than "
        f"retry_interval: each new leader holds its term {PINGPONG_HOLD * 1000:g} ms "
        "(enough for the other to see it through its watch and one read) and resigns, so "
        "every hand-back goes to an election that resigned only that long ago, deep inside "
        f"its {HANDOFF_RETRY * 1000:g} ms hold-off. Seeing another participant lead ends a "
        "hold-off, so no hold-off may delay a hand-back: p95 should be within a few ms of "
        "p50, and both close to the handoff table's. A watch that polls (the watch column) "
        "seldom sees so short a term, so there the hand-back waits out the rest of the "
        "hold-off. The first hand-over, to a follower that is not holding off, is not "
        "counted.",
        "",
        *_latency_table(results, "pingpong", "hand-backs"),
    ]
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
        "notifications or polling, and the GET that the S3 and Azure Blob watches send "
        "every poll_interval) are not provider calls and are not in these columns.",
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
    out += sections
    out += ["", "## Targets", ""]
    out += targets(results, extra or {})
    out += ["", "## How to reproduce", "", *reproduce(args)]
    out += ["", "## How to read these numbers", "", *NOTES]
    out.append("")
    return "\n".join(out)


NOTES = [
    "- Handoff: `resign()` cancels the term, releases (one store write), and the waiting "
    "election hears of it through its watch (Redis pub/sub, PostgreSQL NOTIFY, etcd's "
    "watch stream, ZooKeeper's child watch, the in-memory store's condition, the "
    "filesystem's file notifications; S3 and Azure Blob poll; the watch column of "
    "section 1 gives each provider's own `notify_delay`), then runs one campaign round: "
    "woken by the store, it tries to acquire at once (a get_leader follows only if that "
    "fails). The polling backends are bounded by their poll_interval "
    "(about half "
    "of it on average, plus a few HTTP round trips for S3 and Azure); the others by a few "
    "round trips (Redlock: to a majority of 3 nodes). A failed handoff is one where the "
    "other election did not take over within 3 leases; with a polling watch, the "
    "resigner's hold-off (retry_interval, 0.25 s) is only a little longer than "
    "poll_interval plus the follower's campaign round (0.2 s plus HTTP round trips on S3 "
    "and Azure), so a slow poll can let the resigner take the lease back, and the "
    "handoff then does not happen at all.",
    "- Round trips: a handoff on a notifying store is the resigner's release, the "
    "notification, the follower's acquire, plus the core's own work (the "
    "in-memory handoff). Dividing the handoff p50 by the store's own round trip (section "
    "1) shows how much of it the store's latency explains; when the quotient is far above "
    "the number of requests on the way, the time goes to the client side (the driver, the "
    "event loop, thread hops, the provider's and the core's code).",
    "- Crash failover: a SIGKILLed leader cannot release, so the store keeps its lease until "
    "it expires, lease_duration after its last renew. The kill lands at a random point of "
    "the renew cycle, so the floor is between lease - renew_interval and lease; the rest is "
    "detection (the followers' watches wake at the observed expiry) plus one campaign round.",
    "- Idle follower: a follower runs a campaign round (get_leader) when its watch wakes it "
    "and, as a safety net, when 2 x lease_duration (jittered down by up to a quarter) "
    "passes without a wake, as long as its watch works (retry_interval otherwise); each "
    "wake restarts that timer. A watch that wakes at every lease expiry it observes "
    "gives about one round per lease and the safety net never fires; a watch that sees "
    "renewals and so stays quiet while the leader lives leaves only the safety net: "
    "about one round per two leases (0.5 to 0.6 per lease with the jitter). The wakes "
    "column tells them apart.",
    "- Wakes differ by watch: the in-memory, Redis and PostgreSQL watches wake at the "
    "expiry they observe only if the lease was not renewed meanwhile (one read there); "
    "the filesystem watch follows renewals (it re-reads the record when it changes) so it "
    "wakes only on a new term or a real expiry, but it pays a read per renewal inside the "
    "watch (and a stat() every poll_interval where it polls), which these counts do not "
    "see. The S3 and Azure Blob "
    "watches poll the object "
    "every poll_interval (0.2 s here) inside the watch and wake on a new holder or at the "
    "lease expiry they observe; etcd and ZooKeeper are pushed changes by the server.",
    "- The Redis cross-check counts every command the server ran (INFO excluded), so it "
    "includes what the watch does; the leader-only and leader-plus-follower windows are "
    "taken one after the other, so small differences in the leader's own commands "
    "(EVALSHA/HSET/PEXPIRE) are sampling noise.",
]


def _latency_table(results: dict[str, dict[str, Any]], key: str, what: str) -> list[str]:
    lines = [
        f"| backend | lease s | watch | {what} | failed | p50 ms | p95 ms | p99 ms | mean ms "
        "| max ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        h = r.get(key)
        if h is None:
            lines.append(f"| {name} | error: {r.get(f'{key}_error', 'skipped')} ||||||||")
            continue
        lines.append(
            f"| {name} | {r['plan']['lease']:g} | {_watch(h.get('notify_delay'))} | "
            f"{h['count']} | {h['failures']} | {fmt(h['p50'], 2)} | {fmt(h['p95'], 2)} | "
            f"{fmt(h.get('p99'), 2)} | {fmt(h['mean'], 2)} | {fmt(h['max'], 2)} |"
        )
    return lines


def _watch(notify_delay: float | None) -> str:
    """The provider's own word (`notify_delay`) on how its watch learns of a release."""
    if notify_delay is None:
        return "n/a"
    return "notified" if notify_delay == 0 else f"polls every {notify_delay:g} s"


def _round_trip_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each store's own round trip beside its handoff: how many round trips a handoff costs."""
    core = (results.get("memory", {}).get("handoff") or {}).get("p50")
    lines = [
        "### What a handoff is made of: the store's own round trip",
        "",
        f"One request of the cheapest kind, {roundtrip.SAMPLES} times in a row (after "
        f"{roundtrip.WARMUP} to warm up) on one connection of the driver the provider uses, "
        "timed from the event loop as the provider's calls are. The last columns divide the "
        "handoff p50 by the round-trip p50, first whole, then without the core's own share "
        "(the in-memory store's handoff p50"
        + (f", {core:.2f} ms in this run" if core is not None else ", not measured here")
        + "): about how many store round trips a handoff costs, counting everything the "
        "provider does on the way (the release, the watch's notification, the follower's "
        "read and acquire). On the file system the request is one write and fsync of a "
        "small file in a worker thread: the provider fsyncs every record it writes.",
        "",
        "| backend | request | p50 ms | p95 ms | p99 ms | handoff p50 ms "
        "| handoff p50 / round trip p50 | (handoff p50 - core's) / round trip p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        t = r.get("round_trip")
        if t is None:
            if "round_trip_error" in r:
                lines.append(f"| {name} | error: {r['round_trip_error']} |||||||")
            continue
        h = (r.get("handoff") or {}).get("p50")
        whole = "n/a" if h is None else f"{h / t['p50']:.1f}"
        beyond = "n/a" if h is None or core is None else f"{(h - core) / t['p50']:.1f}"
        lines.append(
            f"| {name} | {t['operation']} | {t['p50']:.3f} | {t['p95']:.3f} | {t['p99']:.3f} | "
            f"{fmt(h, 2)} | {whole} | {beyond} |"
        )
    return lines


def _floor_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each notified handoff beside the same steps written directly on its driver."""
    core = (results.get("memory", {}).get("handoff") or {}).get("p50")
    lines = [
        "### The driver's floor: the same handoff with no library",
        "",
        "The three steps of a notified handoff (the leader's release that notifies, the "
        "store's notification reaching the follower, the follower's acquire) written "
        "directly on the driver the provider uses (`floor.py`), as many times as the handoff "
        f"phase, each after a {floor.GAP * 1000:g} ms pause as there, both clients on one "
        "event loop. What is left between the two is the library's own work"
        + (f" (the in-memory handoff, the core alone, is {core:.2f} ms here)." if core else ".")
        + " The floor is several of the table above's round trips: those run back to back, "
        "while each handoff's steps meet a server and a client that were idle. On the file "
        "system the driver is the operating system (`os`, in worker threads as the "
        "provider's calls are), the store a local directory and the notification inotify. "
        "On ZooKeeper the follower's node already waits in line, so the floor has no acquire: "
        "the leader's delete reaching the next node's exists watch on the loop (kazoo's "
        "`Election` lists the children after that event, one more round trip).",
        "",
        "| backend | steps | handoffs | failed | floor p50 ms | floor p99 ms | multilock p50 ms "
        "| multilock p99 ms | multilock - floor (p50) ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        f = r.get("floor")
        if f is None:
            if "floor_error" in r:
                lines.append(f"| {name} | error: {r['floor_error']} ||||||||")
            continue
        h = r.get("handoff") or {}
        extra = "n/a" if h.get("p50") is None or f["p50"] is None else f"{h['p50'] - f['p50']:.2f}"
        lines.append(
            f"| {name} | {f['operation']} | {f['count']} | {f['failures']} | {fmt(f['p50'], 2)} | "
            f"{fmt(f.get('p99'), 2)} | "
            f"{fmt(h.get('p50'), 2)} | {fmt(h.get('p99'), 2)} | {extra} |"
        )
    return lines


def _exceptions(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[str]:
    lines = []
    for name, r in results.items():
        p = r["plan"]
        if name in LIMITS:
            lines.append(
                f"- **{name} differs**: lease_duration {p['lease']:g} s (Azure Blob leases "
                f"last 15 to 60 s), {p['handoffs']} handoffs, {p['kills']} SIGKILLs, "
                f"{p['idle_leases']} idle leases, to keep the run bounded; its idle-follower "
                "measurement (provider calls, mostly sleeping) ran alongside the peer, "
                "scale and plot phases, on its own server"
            )
    return lines


def _not_measured(results: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"- not measured: {name} ({why})"
        for name, why in NOT_MEASURED.items()
        if name not in results
    ]


#: The issue's handoff targets on loopback, in ms: backend -> (p50, p99 or None).
#: ZooKeeper's is relative: no slower (p50) than kazoo's Election in the same run.
HANDOFF_TARGETS: dict[str, tuple[float, float | None]] = {
    "redis": (1.5, 5.0),
    "postgres": (1.5, 5.0),
    "etcd": (3.0, None),
    "filesystem": (5.0, None),
}


def targets(results: dict[str, dict[str, Any]], extra: dict[str, Any]) -> list[str]:
    lines = [*_handoff_targets(results, extra.get("peers") or {})]
    lines += scale.targets(extra.get("scale") or {})
    lines += sigterm.targets(extra.get("sigterm") or {}, results)
    lines += locks.targets(extra.get("locks") or {})
    lines += rebalance.targets(extra.get("rebalance") or {})
    for name in ("redis", "postgres"):
        g = results.get(name, {}).get("pingpong")
        what = f"Ping-pong p95 within {PINGPONG_SPREAD:g} ms of p50 on {name}"
        if g is None or g["p50"] is None:
            lines.append(f"- {what}: not measured")
            continue
        h = results[name].get("handoff")
        handoff = "" if h is None else f"; handoff p50 {h['p50']:.2f} ms, p95 {h['p95']:.2f} ms"
        lines.append(
            f"- {what}: {verdict(g['p95'] - g['p50'] < PINGPONG_SPREAD)} (p50 {g['p50']:.2f} ms, "
            f"p95 {g['p95']:.2f} ms, max {g['max']:.2f} ms, {g['failures']} failed{handoff})"
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


def _handoff_targets(
    results: dict[str, dict[str, Any]], peers: dict[tuple[str, str], dict[str, Any]]
) -> list[str]:
    lines = []
    core = (results.get("memory", {}).get("handoff") or {}).get("p50")
    for name in ("redis", "postgres", "zookeeper", "etcd", "filesystem"):
        h = results.get(name, {}).get("handoff")
        if name == "zookeeper":
            kazoo = peers.get(("kazoo", "zookeeper"), {}).get("handoff") or {}
            what = "Handoff on zookeeper no slower than kazoo's Election (p50, same run)"
            if kazoo.get("p50") is None:
                lines.append(f"- {what}: not measured (kazoo runs with --peers all)")
                continue
            limit, limit99 = kazoo["p50"], None
            wanted = f"kazoo p50 {kazoo['p50']:.2f} ms, p95 {kazoo['p95']:.2f} ms"
        else:
            limit, limit99 = HANDOFF_TARGETS[name]
            what = f"Handoff on {name}: p50 <= {limit:g} ms" + (
                f" and p99 <= {limit99:g} ms" if limit99 is not None else ""
            )
            wanted = ""
        if h is None or h["p50"] is None:
            lines.append(f"- {what}: not measured")
            continue
        ok = h["p50"] <= limit and (limit99 is None or h["p99"] <= limit99)
        measured = f"p50 {h['p50']:.2f} ms, p95 {h['p95']:.2f} ms, p99 {h['p99']:.2f} ms"
        if wanted:
            measured += f"; {wanted}"
        bound = "" if ok else f". What bounds it: {_bound(name, h, results, core, limit)}"
        lines.append(f"- {what}: {verdict(ok)} ({measured}){bound}")
    return lines


def _bound(
    name: str, h: dict[str, Any], results: dict[str, dict[str, Any]], core: Any, limit: float
) -> str:
    """What a missed handoff target is made of: the core's share, round trips, a poll;
    and whether the driver's floor and the core's share alone already exceed *limit*."""
    parts = []
    if core is not None:
        parts.append(f"the core's own share (the in-memory handoff) p50 {core:.2f} ms")
    delay = h.get("notify_delay")
    if delay:
        parts.append(
            f"the watch polls every {delay:g} s (the provider's `notify_delay`), so a "
            f"release is seen after about half of that on average"
        )
    elif delay == 0:
        parts.append("the store notifies the watch (the provider's `notify_delay` is 0)")
    f = results.get(name, {}).get("floor")
    if f is not None and f.get("p50") is not None:
        parts.append(
            f"the same handoff written directly on the driver ({f['operation']}) takes p50 "
            f"{f['p50']:.2f} ms, p99 {f['p99']:.2f} ms here, so the store, the driver and "
            f"this machine's wake-ups leave {h['p50'] - f['p50']:.2f} ms to the library"
        )
        if core is not None:
            # Both lie on the handoff's path one after the other: the core's steps come
            # before the release, between the wake-up and the acquire, and after it.
            least = f["p50"] + core
            if least > limit:
                side = "above the target: a provider that cost nothing would miss it too"
            else:
                side = "within the target: the rest is the provider's"
            parts.append(f"the floor and the core's share add up to about {least:.2f} ms, {side}")
    t = results.get(name, {}).get("round_trip")
    if t is not None:
        rest = h["p50"] - (core or 0.0)
        parts.append(
            f"one {t['operation']} round trip p50 {t['p50']:.3f} ms, p99 {t['p99']:.3f} ms, "
            f"so the rest ({rest:.2f} ms) is {rest / t['p50']:.1f} round trips' worth"
        )
    return "; ".join(parts) or "no round trip measured"


def reproduce(args: argparse.Namespace) -> list[str]:
    return [
        "`nox -s bench` installs the servers, every package and the peers, then runs "
        "`python benchmarks/run.py` with the defaults, which wrote this report. This "
        "report's own command line:",
        "",
        "```",
        " ".join(["python benchmarks/run.py", *args.argv]),
        "```",
        "",
        "It needs the dev environment (every multilock package), the server binaries "
        "(`integration/harness/install.py`), and for the peers, the scale run and the plot: "
        "`tooz`, `kazoo`, `psutil`, `matplotlib` (see `benchmarks/README.md`).",
    ]


# --------------------------------------------------------------------------- --only
#: The sections ``run.py --only`` can measure alone: module -> the start of its target lines.
MERGEABLE = {locks: locks.TARGET, rebalance: rebalance.TARGET, timeline: timeline.TARGET}


def merge_sections(text: str, sections: list[str], extra: dict[str, Any]) -> str:
    """The report *text* of an earlier run with *sections* (of `MERGEABLE` modules) put in.

    A section of the same title is replaced, a new one goes after the last section with a
    lower number (or before Targets); the failover picture keeps the last number; in
    Targets the lines of the measured sections are replaced. Everything else, numbers
    included, stays as it was.
    """
    blocks = _blocks(text) if text.strip() else _blocks(_EMPTY)
    blocks = [
        (f"## {plot.NUMBER}. {plot.TITLE}" if h is not None and _title(h) == plot.TITLE else h, ls)
        for h, ls in blocks
    ]
    new = [b for b in _blocks("\n".join(sections)) if b[0] is not None]
    for heading, lines in new:
        title = _title(heading)
        blocks = [b for b in blocks if b[0] is None or _title(b[0]) != title]
        number = _number(heading) or 0
        lower = [i for i, (h, _) in enumerate(blocks) if h and 0 < (_number(h) or 0) < number]
        targets = [i for i, (h, _) in enumerate(blocks) if h == "## Targets"]
        at = lower[-1] + 1 if lower else (targets or [len(blocks)])[0]
        previous = blocks[at - 1][1]
        if previous and previous[-1].strip():
            previous.append("")  # a blank line before the new heading
        if at < len(blocks) and (not lines or lines[-1].strip()):
            lines = [*lines, ""]  # a blank line before the next heading
        blocks.insert(at, (heading, lines))
    measured = [m for m in MERGEABLE if m.TITLE in {_title(h) for h, _ in new}]
    fresh = [line for m in measured for line in m.targets(extra.get(m.__name__) or {})]
    for i, (heading, lines) in enumerate(blocks):
        if heading == "## Targets":
            kept = [x for x in lines if not any(x.startswith(m.TARGET) for m in measured)]
            tail = []
            while kept and not kept[-1].strip():
                tail.append(kept.pop())
            blocks[i] = (heading, [*kept, *fresh, *tail])
    out: list[str] = []
    for heading, lines in blocks:
        out += [heading, *lines] if heading is not None else lines
    return "\n".join(out) + ("\n" if text.endswith("\n") or not text else "")


_EMPTY = (
    "# multilock benchmark report\n\nSections measured on their own (`run.py --only`).\n\n"
    "## Targets\n"
)


def _blocks(text: str) -> list[tuple[str | None, list[str]]]:
    """*text* cut at its ``## `` headings: (heading or None for what precedes, lines)."""
    blocks: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in text.splitlines():
        if line.startswith("## "):
            blocks.append((line, []))
        else:
            blocks[-1][1].append(line)
    return blocks


def _number(heading: str) -> int | None:
    head = heading.removeprefix("## ").split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _title(heading: str) -> str:
    """A heading without its number, up to a colon: what stays when the numbers move."""
    rest = heading.removeprefix("## ")
    if _number(heading) is not None:
        rest = rest.split(". ", 1)[1]
    return rest.split(":", 1)[0].strip()
