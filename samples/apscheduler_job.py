"""Run an APScheduler job on one replica only: the elected leader.

    python samples/apscheduler_job.py --url redis://localhost:6379/0   # in two terminals

Every replica builds the same ``AsyncIOScheduler`` with the same job, a tick every 0.2 s;
only the leader's scheduler runs it, and each tick prints the replica's pid and the
fencing token of its term. Stop the leader with Ctrl-C or SIGTERM: it releases leadership
and the other replica starts ticking at once. Kill it (``kill -9``): the other takes over
once the lease has expired.

Exit status: 0 after ``--seconds``, 128 + the signal number after SIGTERM (143) or
Ctrl-C (130), 1 when the URL or an option is wrong or the store fails.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from multilock.apscheduler import LeaderScheduler
from multilock.core import MultilockError, redact_url, stop_on_signals


async def tick(leader: LeaderScheduler) -> None:
    """The job. A real one would pass ``leadership.token`` with every write it makes."""
    leadership = leader.leadership
    if leadership is None:  # the term ended just as this run was started: do nothing
        print(f"job skipped {os.getpid()}: not leading", flush=True)
        return
    print(f"job tick {os.getpid()} token={leadership.token}", flush=True)


async def run(url: str, group: str, lease: float, interval: float, seconds: float | None) -> None:
    scheduler = AsyncIOScheduler()
    # LeaderScheduler starts the scheduler paused and resumes it while this replica leads.
    # On SIGTERM or Ctrl-C, stop_on_signals stops the election (the lease is released, so
    # another replica takes over at once), ends this block and exits with 128 + signal.
    async with (
        stop_on_signals(),
        LeaderScheduler(scheduler, url, group=group, lease_duration=lease) as leader,
    ):
        scheduler.add_job(tick, "interval", seconds=interval, args=[leader])
        print(
            f"replica {os.getpid()} ({leader.election.participant_id}) campaigns for "
            f"{group!r} on {redact_url(url)}",
            flush=True,
        )
        if seconds is None:
            await asyncio.Event().wait()  # until a signal
        else:
            await asyncio.sleep(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/apscheduler_job.py")
    parser.add_argument("--url", default="memory://", help="backend URL (default memory://)")
    parser.add_argument("--group", default="apscheduler-job", help="group name")
    parser.add_argument("--lease", type=float, default=10.0, help="lease seconds (default 10)")
    parser.add_argument(
        "--interval", type=float, default=0.2, help="seconds between ticks (default 0.2)"
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="stop after this long (default: on a signal)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(run(args.url, args.group, args.lease, args.interval, args.seconds))
    except MultilockError as exc:  # bad URL or options, or the store failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
