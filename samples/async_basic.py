"""Lead a group with asyncio: do periodic work only while leading, print every event.

    python samples/async_basic.py                          # one process, in memory
    python samples/async_basic.py --url file:///tmp/leases # run it in two terminals,
                                                           # then stop the leader (Ctrl-C)

The leader's work checks ``leadership.check()`` before each step: it raises
`LeadershipLost` once the term has ended, so a step never starts after the deadline.
The election also cancels the work the moment leadership is lost. Stop with Ctrl-C or
``--seconds``; stopping releases leadership, so another process takes over at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from datetime import datetime

from multilock.core import (
    EventKind,
    LeaderElection,
    Leadership,
    LeadershipEvent,
    LeadershipLost,
    MultilockError,
    from_url,
    redact_url,
)


def say(text: str) -> None:
    print(f"{datetime.now():%H:%M:%S.%f}"[:-3] + f" {text}", flush=True)


async def report_loop(leadership: Leadership, interval: float) -> None:
    """Fake periodic leader work: one "batch" per *interval*, each stamped with the token."""
    batch = 0
    try:
        while True:
            leadership.check()  # raises LeadershipLost once the term is over
            batch += 1
            # A real job would pass leadership.token along with every write (fencing).
            say(f"work: batch {batch} done with token {leadership.token}")
            await asyncio.sleep(interval)
    except LeadershipLost:
        say(f"work: leadership lost after {batch} batches, stopping work")
    except asyncio.CancelledError:
        say(f"work: cancelled after {batch} batches")
        raise


def describe(event: LeadershipEvent) -> str:
    if event.kind is EventKind.ACQUIRED:
        return f"event: ACQUIRED, this process leads with token {event.token}"
    if event.kind is EventKind.LOST:
        return f"event: LOST, the term with token {event.token} ended"
    if event.leader is None:
        return "event: LEADER_CHANGED, nobody leads"
    return f"event: LEADER_CHANGED, {event.leader.participant_id} leads (token {event.token})"


async def print_events(election: LeaderElection) -> None:
    async for event in election.events():  # ends when the election stops
        say(describe(event))


async def run(url: str, group: str, seconds: float | None, lease: float, interval: float) -> None:
    provider = from_url(url)
    async with provider:  # whoever builds the provider closes it
        election = LeaderElection(provider, group=group, lease_duration=lease)
        say(f"{election.participant_id} campaigns for {group!r} on {redact_url(url)}")
        printer = asyncio.create_task(print_events(election))
        try:
            async with election:  # start(); on exit stop(): cancel the work, release, LOST
                try:
                    async with asyncio.timeout(seconds):  # None: until Ctrl-C
                        await election.run_while_leader(report_loop, interval)
                except TimeoutError:
                    say(f"{seconds:g} s are up, stopping")
        finally:
            # The event stream ends once the election has stopped: print its last events.
            await asyncio.wait({printer}, timeout=1)
            printer.cancel()
        stats = election.statistics()
        say(f"stopped: {stats.terms_won} term(s) won, {stats.renewals} renewal(s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/async_basic.py")
    parser.add_argument("--url", default="memory://", help="backend URL (default memory://)")
    parser.add_argument("--group", default="async-basic", help="group name")
    parser.add_argument(
        "--seconds", type=float, default=None, help="stop after this long (default: on Ctrl-C)"
    )
    parser.add_argument("--lease", type=float, default=3.0, help="lease seconds (default 3)")
    parser.add_argument(
        "--interval", type=float, default=0.5, help="seconds between work batches (default 0.5)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(run(args.url, args.group, args.seconds, args.lease, args.interval))
    except KeyboardInterrupt:
        say("interrupted: leadership released")
    except MultilockError as exc:  # bad URL or options, or the store failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
