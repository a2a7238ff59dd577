"""Lead a group from plain threaded code (no asyncio): work only while leading.

    python samples/sync_basic.py                          # one process, in memory
    python samples/sync_basic.py --url file:///tmp/leases # run it in two terminals,
                                                          # then stop the leader (Ctrl-C)

`multilock.core.sync.LeaderElection` runs the election on an event loop in a background
thread. ``run_while_leader(fn)`` calls ``fn(leadership)`` in a worker thread in each term;
a thread cannot be cancelled, so the work watches ``leadership.lost`` (a
`threading.Event`, set the moment the term ends) and returns soon after. Stop with Ctrl-C
or ``--seconds``; stopping releases leadership, so another process takes over at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from datetime import datetime

from multilock.core import EventKind, Leadership, LeadershipEvent, MultilockError, redact_url
from multilock.core.sync import EventIterator, LeaderElection


def say(text: str) -> None:
    stamp = f"{datetime.now():%H:%M:%S.%f}"[:-3]
    # One write per line: print() writes the text and its newline separately, so lines
    # printed by two threads at once could run together.
    sys.stdout.write(f"{stamp} [{threading.current_thread().name}] {text}\n")
    sys.stdout.flush()


def report_loop(leadership: Leadership, interval: float) -> None:
    """Fake periodic leader work, in a worker thread: one "batch" per *interval*."""
    batch = 0
    while True:
        leadership.check()  # raises LeadershipLost once the term is over: that ends the run
        batch += 1
        # A real job would pass leadership.token along with every write (fencing).
        say(f"work: batch {batch} done with token {leadership.token}")
        if leadership.lost.wait(interval):  # sleeps, but wakes at once when the term ends
            say(f"work: leadership ended after {batch} batches, returning")
            return


def describe(event: LeadershipEvent) -> str:
    if event.kind is EventKind.ACQUIRED:
        return f"event: ACQUIRED, this process leads with token {event.token}"
    if event.kind is EventKind.LOST:
        return f"event: LOST, the term with token {event.token} ended"
    if event.leader is None:
        return "event: LEADER_CHANGED, nobody leads"
    return f"event: LEADER_CHANGED, {event.leader.participant_id} leads (token {event.token})"


def print_events(events: EventIterator) -> None:
    for event in events:  # blocks; ends when the election stops
        say(describe(event))


def run(url: str, group: str, seconds: float | None, lease: float, interval: float) -> None:
    # Given a URL, the election builds the provider itself and closes it in close().
    election = LeaderElection(url, group=group, lease_duration=lease)
    printer: threading.Thread | None = None
    try:
        say(f"{election.participant_id} campaigns for {group!r} on {redact_url(url)}")
        printer = threading.Thread(
            target=print_events, args=(election.events(),), name="events", daemon=True
        )
        printer.start()
        timer = None
        if seconds is not None:

            def time_up() -> None:
                say(f"{seconds:g} s are up, stopping")
                election.stop()

            timer = threading.Timer(seconds, time_up)
            timer.daemon = True
        with election:  # start(); on exit stop(): end the work, release, LOST
            if timer is not None:
                timer.start()
            try:
                election.run_while_leader(report_loop, interval)  # returns once stopped
            finally:
                if timer is not None:
                    timer.cancel()
        printer.join(timeout=5)  # the event stream ends once the election has stopped
        stats = election.statistics()
        say(f"stopped: {stats.terms_won} term(s) won, {stats.renewals} renewal(s)")
    finally:
        election.close()
        if printer is not None:
            printer.join(timeout=1)  # on Ctrl-C too: print the last events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/sync_basic.py")
    parser.add_argument("--url", default="memory://", help="backend URL (default memory://)")
    parser.add_argument("--group", default="sync-basic", help="group name")
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
        run(args.url, args.group, args.seconds, args.lease, args.interval)
    except KeyboardInterrupt:
        say("interrupted: leadership released")
    except MultilockError as exc:  # bad URL or options, or the store failed
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
