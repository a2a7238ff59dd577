"""Limit concurrent workers across processes with a semaphore, from plain threaded code.

    python samples/semaphore_workers.py                    # one process, in memory
    export MULTILOCK_URL=file://$PWD/leases                # or redis://localhost:6379/0
    python samples/semaphore_workers.py &                  # start it two or three times:
    python samples/semaphore_workers.py                    # still --limit jobs at once

Each process starts ``--workers`` threads; each runs ``--jobs`` jobs, and each job runs
inside ``with Semaphore(...) as slot:``, which waits for one of the ``--limit`` slots
shared by every process on the store. ``slot.slot`` says which slot, ``slot.token`` is its
fencing token (rising per slot) for the writes the job makes. A job watches ``slot.lost``
(set if the lease is lost) and stops at once; leaving the block releases the slot, and
the store wakes a waiting worker, here or in another process.

Every start and end line carries the slot: no two jobs hold the same slot at once, so no
more than ``--limit`` run at once anywhere. SIGTERM or Ctrl-C releases the slots held
and exits with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from datetime import datetime

from multilock.core import MultilockError, SemaphoreSlot, redact_url
from multilock.core.sync import Semaphore, stop_on_signals


def say(text: str) -> None:
    stamp = f"{datetime.now():%H:%M:%S.%f}"[:-3]
    # One write per line: two threads printing at once cannot run their lines together.
    sys.stdout.write(f"{stamp} [{os.getpid()} {threading.current_thread().name}] {text}\n")
    sys.stdout.flush()


def do_job(slot: SemaphoreSlot, job: int, seconds: float) -> None:
    """Fake work: a real job would pass ``slot.token`` with every write it makes."""
    say(f"job {job}: started in slot {slot.slot} with token {slot.token}")
    if slot.lost.wait(seconds):  # the work itself; wakes at once if the slot is lost
        return  # leaving the block raises LeadershipLost: nothing more is done
    say(f"job {job}: finished in slot {slot.slot}")


def worker(semaphore: Semaphore, jobs: int, seconds: float, errors: list[BaseException]) -> None:
    try:
        for job in range(1, jobs + 1):
            with semaphore as slot:  # waits for a free slot, on any process
                do_job(slot, job, seconds)
    except MultilockError as exc:  # LeadershipLost (the slot was lost mid-job), the store...
        if semaphore.closed:
            return  # the program is stopping: close() released the slot
        say(f"worker stops: {exc}")
        errors.append(exc)


def run(args: argparse.Namespace) -> int:
    # One object for every thread: each `with` is a separate holder. Given a URL, it
    # builds its provider and closes it whenever no worker is inside or waiting.
    semaphore = Semaphore(args.url, args.name, args.limit, lease_duration=args.lease)
    try:
        say(
            f"{args.workers} workers share {args.name!r} (limit {args.limit}) "
            f"on {redact_url(args.url)}"
        )
        errors: list[BaseException] = []
        threads = [
            threading.Thread(
                target=worker,
                args=(semaphore, args.jobs, args.job_seconds, errors),
                name=f"worker-{i}",
                daemon=True,  # a signal ends the process even while workers wait
            )
            for i in range(1, args.workers + 1)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():  # join() with a timeout lets a signal in at once
                thread.join(0.2)
        say(f"all workers done ({len(errors)} stopped early)")
        return 1 if errors else 0
    finally:
        semaphore.close()  # releases any slot still held (after Ctrl-C)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/semaphore_workers.py")
    parser.add_argument(
        "--url",
        default=os.environ.get("MULTILOCK_URL", "memory://"),
        help="backend URL (default: $MULTILOCK_URL, else memory://)",
    )
    parser.add_argument("--name", default="encoders", help="semaphore name")
    parser.add_argument("--limit", type=int, default=2, help="jobs at once, everywhere")
    parser.add_argument("--workers", type=int, default=3, help="worker threads here")
    parser.add_argument("--jobs", type=int, default=2, help="jobs per worker (default 2)")
    parser.add_argument(
        "--job-seconds", type=float, default=0.5, help="seconds per job (default 0.5)"
    )
    parser.add_argument("--lease", type=float, default=3.0, help="lease seconds (default 3)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    # SIGTERM (a container stop) or Ctrl-C raises SystemExit in the main thread: closing
    # the semaphore releases the slots held at once, instead of leaving them to expire.
    signals = stop_on_signals()
    try:
        with signals:
            return run(args)
    except SystemExit:
        received = signals.received
        assert received is not None
        say(f"{received.name} received: slots released")
        return 128 + received
    except MultilockError as exc:  # bad URL or options, or the store failed
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
