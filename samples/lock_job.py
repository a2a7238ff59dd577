"""Run a job under a lock, from plain threaded code: one process at a time, fenced writes.

    python samples/lock_job.py                             # once, in memory
    export MULTILOCK_URL=file://$PWD/leases                # or redis://localhost:6379/0
    python samples/lock_job.py --output report.txt &       # start it twice: the second
    python samples/lock_job.py --output report.txt         # waits, then runs after it

``with Lock(url, name) as held:`` blocks until this process holds the name, renews it in
the background and releases it when the block ends. ``held.token`` rises with each holder:
the job passes it with every write, and the output refuses a token lower than one it has
already seen, so a holder that lost the lock without noticing (a long GC pause, a frozen
VM) cannot overwrite the work of the next one. Before each step the job calls
``held.check()``, which raises `LeadershipLost` once the lease is gone.

Exit status: 0 when the job ran (or was skipped after ``--timeout``), 1 when the lock
was lost mid-job, a write was refused, or the URL or the store failed, 128 + the signal
number after SIGTERM (143) or Ctrl-C (130), which end the job and release the lock.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from multilock.core import AcquireTimeout, Leadership, LeadershipLost, MultilockError, redact_url
from multilock.core.sync import Lock, stop_on_signals


def say(text: str) -> None:
    sys.stdout.write(f"{datetime.now():%H:%M:%S.%f}"[:-3] + f" [{os.getpid()}] {text}\n")
    sys.stdout.flush()


class StaleWrite(Exception):
    """The output refused a write: a newer holder has written already."""


class FencedOutput:
    """What the job writes to: lines tagged with the writer's token, or only kept in memory.

    Fencing is the resource's job: it refuses a token lower than the highest it has
    accepted. Here that is a read then an append (enough for a sample); a database does it
    in one statement: ``UPDATE ... SET ..., token = :token WHERE token <= :token``.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines: list[str] = []  # when there is no path
        self._mutex = threading.Lock()

    def _read(self) -> list[str]:
        if self.path is None:
            return self.lines
        return self.path.read_text().splitlines() if self.path.exists() else []

    def write(self, token: int, text: str) -> None:
        with self._mutex:
            highest = max((int(line.split()[0]) for line in self._read()), default=0)
            if token < highest:
                raise StaleWrite(f"write refused: token {token} < highest seen {highest}")
            line = f"{token} {text}"
            if self.path is None:
                self.lines.append(line)
            else:
                with self.path.open("a") as out:
                    out.write(line + "\n")


def job(held: Leadership, output: FencedOutput, steps: int, step_seconds: float) -> None:
    """The protected work: *steps* writes, each checked and fenced with the token."""
    for step in range(1, steps + 1):
        held.check()  # raises LeadershipLost once the lease is gone: no write after that
        output.write(held.token, f"step {step}/{steps} by {os.getpid()}")
        say(f"job: step {step}/{steps} written with token {held.token}")
        if held.lost.wait(step_seconds):  # the work itself; wakes at once if the lease is lost
            break


def run(args: argparse.Namespace) -> int:
    output = FencedOutput(args.output)
    say(f"waiting for the lock {args.name!r} on {redact_url(args.url)}")
    started = time.monotonic()
    try:
        # Given a URL, the lock builds its provider and closes it when the block ends.
        with Lock(args.url, args.name, lease_duration=args.lease, timeout=args.timeout) as held:
            waited = time.monotonic() - started
            say(f"acquired {args.name!r} with token {held.token} after {waited:.1f} s")
            job(held, output, args.steps, args.step_seconds)
        say(f"job done; {args.name!r} released")
    except AcquireTimeout as exc:  # somebody else is running the job: skip this run
        say(f"skipped: {exc}")
    except LeadershipLost as exc:  # leaving the block reports a lease lost inside it
        say(f"lost the lock mid-job, stopped: {exc}")
        return 1
    except StaleWrite as exc:  # the output refused a stale token
        say(f"job failed: {exc}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/lock_job.py")
    parser.add_argument(
        "--url",
        default=os.environ.get("MULTILOCK_URL", "memory://"),
        help="backend URL (default: $MULTILOCK_URL, else memory://)",
    )
    parser.add_argument("--name", default="nightly-report", help="lock name")
    parser.add_argument("--lease", type=float, default=3.0, help="lease seconds (default 3)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up waiting after this long (skip)"
    )
    parser.add_argument("--steps", type=int, default=5, help="job steps (default 5)")
    parser.add_argument(
        "--step-seconds", type=float, default=0.5, help="seconds per step (default 0.5)"
    )
    parser.add_argument("--output", type=Path, default=None, help="file the job appends to")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    # SIGTERM (a container stop) or Ctrl-C raises SystemExit where the job is: the `with`
    # block ends and releases the lock at once, instead of leaving it to expire.
    signals = stop_on_signals()
    try:
        with signals:
            return run(args)
    except SystemExit:
        received = signals.received
        assert received is not None
        say(f"{received.name} received: lock released")
        return 128 + received
    except MultilockError as exc:  # bad URL or options, or the store failed
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
