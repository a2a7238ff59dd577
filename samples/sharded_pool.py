"""A sharded worker pool: every process works on the shards it owns, each shard on one.

    python samples/sharded_pool.py --seconds 5             # one process owns every shard
    export MULTILOCK_URL=file://$PWD/leases                # or redis://localhost:6379/0
    python samples/sharded_pool.py                         # in two or three terminals:
                                                           # the shards spread out

The work is split into ``--shards`` shards (say, customers by ``hash(id) % shards``).
``async with Shards(...)`` joins the pool; each shard has at most one owner at any
instant, with a fencing token of its own, and the live participants share the shards out
evenly: when one joins, the others release their surplus to it; when one stops, it
releases its shards and the others take them at once; when one is killed, its shards are
taken over as their leases expire. ``run_for_each(work)`` runs ``work(shard)`` for each
shard this process owns, and cancels it the moment that shard is lost or handed over.

Stop with Ctrl-C or ``--seconds``; stopping releases every shard.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from datetime import datetime

from multilock.core import (
    LeadershipLost,
    MultilockError,
    ShardLeadership,
    Shards,
    from_url,
    redact_url,
)


def say(text: str) -> None:
    print(f"{datetime.now():%H:%M:%S.%f}"[:-3] + f" [{os.getpid()}] {text}", flush=True)


async def work(shard: ShardLeadership, interval: float) -> None:
    """The work of one shard, for as long as this process owns it (one term).

    A real worker would fetch the shard's items (``WHERE hash(id) % shards = shard.shard``)
    and pass ``shard.token`` with every write, so a store can refuse a late write of an
    owner that lost the shard.
    """
    say(f"shard {shard.shard}: work started with token {shard.token}")
    batches = 0
    try:
        while True:
            shard.check()  # raises LeadershipLost once the shard's term has ended
            batches += 1  # one batch of the shard's items
            await asyncio.sleep(interval)
    except LeadershipLost:
        pass  # the term ended just before the cancellation came: end this term's work
    finally:  # cancelled: the shard was lost, handed over, or the pool is stopping
        say(f"shard {shard.shard}: work stopped after {batches} batches")


async def report(shards: Shards) -> None:
    """Print the share and the shards this process owns, as they change."""
    last_owned, last_share = None, (0, 0)
    while True:
        owned, share = sorted(shards.owned), (shards.live_participants, shards.share)
        if all(share) and share != last_share:  # once counted, and a member
            say(f"{share[0]} live participant(s): share {share[1]} of {shards.count} shards")
        if owned != last_owned:
            say(f"owns {owned}")
        last_owned, last_share = owned, share
        await shards.wait_changed()


async def run(
    url: str, name: str, count: int, lease: float, interval: float, seconds: float | None
) -> None:
    provider = from_url(url)
    async with provider:  # whoever builds the provider closes it
        shards = Shards(provider, name, count, lease_duration=lease)
        say(f"{shards.participant_id} joins {name!r} ({count} shards) on {redact_url(url)}")
        async with shards:  # on exit: stop the work, release every shard
            reporter = asyncio.create_task(report(shards))
            try:
                async with asyncio.timeout(seconds):  # None: until Ctrl-C
                    await shards.run_for_each(functools.partial(work, interval=interval))
            except TimeoutError:
                say(f"{seconds:g} s are up, leaving")
            finally:
                reporter.cancel()
        say("left: every shard released")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/sharded_pool.py")
    parser.add_argument(
        "--url",
        default=os.environ.get("MULTILOCK_URL", "memory://"),
        help="backend URL (default: $MULTILOCK_URL, else memory://)",
    )
    parser.add_argument("--name", default="orders", help="pool name")
    parser.add_argument("--shards", type=int, default=8, help="number of shards (default 8)")
    parser.add_argument("--lease", type=float, default=3.0, help="lease seconds (default 3)")
    parser.add_argument(
        "--interval", type=float, default=0.5, help="seconds per batch (default 0.5)"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="leave after this long (default: on Ctrl-C)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(run(args.url, args.name, args.shards, args.lease, args.interval, args.seconds))
    except KeyboardInterrupt:
        say("interrupted: every shard released")
    except MultilockError as exc:  # bad URL or options, or the store failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
