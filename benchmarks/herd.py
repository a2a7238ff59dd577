"""What one handoff costs the store when several followers wait: Redis commands per handoff.

    python benchmarks/herd.py [--followers 3] [--handoffs 40] [--lease 2.0]

One process runs ``1 + followers`` elections of one group on one provider, on a
throwaway redis-server (the integration harness's). The leader resigns; every follower
is woken by the release and tries at once; one wins. After each handoff the run waits
until the others have settled (the resigner's hold-off, 0.25 s, ends first), then the
next leader resigns. The server's ``INFO commandstats`` around the run, less its own
INFO calls, gives each command's count per handoff: ``EVALSHA`` is the provider's
scripts (one release, and each try), ``HMGET`` the reads inside them and the
``get_leader`` reads. With N followers a handoff costs one release and N tries at the
least, and N - 1 reads (each beaten follower looks who won). Prints a Markdown table;
run it in two checkouts to compare two versions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import redis  # noqa: E402
from backends import Backends  # noqa: E402
from common import HANDOFF_RETRY  # noqa: E402

from multilock.core import LeaderElection  # noqa: E402
from multilock.redis import RedisProvider  # noqa: E402


def commands(client: Any) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if "info" not in k}


async def measure(url: str, followers: int, handoffs: int, lease: float) -> dict[str, Any]:
    provider = RedisProvider(url)
    elections = [
        LeaderElection(
            provider,
            group="herd",
            participant_id=f"herd-{i}",
            lease_duration=lease,
            retry_interval=HANDOFF_RETRY,
        )
        for i in range(1 + followers)
    ]
    client = redis.Redis.from_url(url)
    try:
        await elections[0].start()
        await elections[0].wait_until_leader()
        for election in elections[1:]:
            await election.start()
        await asyncio.sleep(lease / 2)  # every watch is on
        before, latencies, leader = commands(client), [], elections[0]
        for _ in range(handoffs):
            others = {
                asyncio.ensure_future(e.wait_until_leader()): e
                for e in elections
                if e is not leader
            }
            started = time.perf_counter()
            await leader.resign()
            done, pending = await asyncio.wait(
                others, timeout=3 * lease, return_when=asyncio.FIRST_COMPLETED
            )
            latencies.append((time.perf_counter() - started) * 1000)
            for task in pending:
                task.cancel()
            if not done:
                raise RuntimeError("no follower took over within 3 leases")
            leader = others[done.pop()]
            await asyncio.sleep(2 * HANDOFF_RETRY)  # the others settle, the hold-off ends
        after = commands(client)
    finally:
        for election in elections:
            await election.stop()
        await provider.aclose()
        client.close()
    per = {name: (after[name] - before.get(name, 0)) / handoffs for name in after}
    return {"p50": statistics.median(latencies), "per": {k: v for k, v in per.items() if v}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--followers", type=int, default=3)
    parser.add_argument("--handoffs", type=int, default=40)
    parser.add_argument("--lease", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.followers < 1 or args.handoffs < 1:
        parser.error("--followers and --handoffs must be at least 1")
    servers = Backends(["redis"])
    try:
        servers.start()
        url = servers.urls["redis"]
        result = asyncio.run(measure(url, args.followers, args.handoffs, args.lease))
    finally:
        servers.close()
    print(f"{args.followers} followers, {args.handoffs} handoffs, lease {args.lease:g} s;")
    print(
        f"handoff p50 {result['p50']:.2f} ms (resign() to the next leader's wait_until_leader).\n"
    )
    print("| Redis command | per handoff |\n|---|---|")
    for name, count in sorted(result["per"].items()):
        print(f"| {name} | {count:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
