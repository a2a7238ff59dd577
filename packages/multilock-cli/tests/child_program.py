"""A command for ``multilock run`` in tests: it logs what it sees as JSON lines.

    python child_program.py LOG [--hold S | --until FILE] [--exit N] [--ignore-term]
                                [--term-exit N]

Events: ``start`` (pid, token, group, participant id, time), ``term`` (SIGTERM arrived),
``end``. Times are ``time.monotonic()``, which every process of the machine shares.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--hold", type=float, default=None)
    parser.add_argument("--until", default=None)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--term-exit", type=int, default=None)
    args = parser.parse_args()
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(event: str) -> None:
        record = {
            "event": event,
            "t": time.monotonic(),
            "pid": os.getpid(),
            "token": int(os.environ.get("MULTILOCK_TOKEN", "0")),
            "group": os.environ.get("MULTILOCK_GROUP"),
            "id": os.environ.get("MULTILOCK_PARTICIPANT_ID"),
        }
        os.write(fd, (json.dumps(record) + "\n").encode())

    def on_term(signum: int, frame: FrameType | None) -> None:
        write("term")
        if args.term_exit is not None:
            sys.exit(args.term_exit)
        if not args.ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
    write("start")
    if args.hold is not None:
        end = time.monotonic() + args.hold
        while time.monotonic() < end:
            time.sleep(0.01)
    elif args.until is not None:
        while not Path(args.until).exists():
            time.sleep(0.01)
    else:
        while True:
            time.sleep(0.05)
    write("end")
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
