"""What every benchmark module shares: the backends, their settings, progress, percentiles."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

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
#: Ping-pong: how long each new leader holds its term before it resigns. Long enough for
#: the election that just resigned to see the term (its watch wakes on the acquire, then
#: one get_leader read: a few ms on a pushing watch), which ends its hold-off; far shorter
#: than that hold-off (HANDOFF_RETRY), so every hand-back lands inside it and would wait
#: out its rest if seeing the other leader did not end it.
PINGPONG_HOLD = 0.02
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
    """The nearest-rank *q*-th percentile: the smallest sample with q % of all at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered) / 100) - 1))]


def summary(ms: list[float], failures: int) -> dict[str, Any]:
    """Latency samples (milliseconds) as count, failures, p50, p95, p99, mean and max."""
    return {
        "count": len(ms),
        "failures": failures,
        "p50": pct(ms, 50) if ms else None,
        "p95": pct(ms, 95) if ms else None,
        "p99": pct(ms, 99) if ms else None,
        "max": max(ms) if ms else None,
        "mean": sum(ms) / len(ms) if ms else None,
    }


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
