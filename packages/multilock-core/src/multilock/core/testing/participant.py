"""One election participant as its own process, logging every change as JSON lines.

    python -m multilock.core.testing.participant --url URL --group G --id ID --log FILE

Signals: SIGTERM stops gracefully (releases), SIGUSR1 resigns. While leading it writes a
``work`` line every ``--work-interval`` seconds, only while ``leadership.is_valid``, the
way a real leader would stamp its writes with the fencing token. `Cluster` drives many of
these and `check_timeline` judges their logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from .._election import LeaderElection
from .._types import EventKind, Leadership
from .._url import from_url


class _Log:
    def __init__(self, path: str, participant: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._participant = participant

    def write(self, event: str, **fields: Any) -> None:
        record = {"t": time.monotonic(), "participant": self._participant, "event": event}
        record.update(fields)
        os.write(self._fd, (json.dumps(record) + "\n").encode())  # one write: no torn lines


async def _main(args: argparse.Namespace) -> int:
    log = _Log(args.log, args.id)
    provider = from_url(args.url)
    election = LeaderElection(
        provider,
        group=args.group,
        participant_id=args.id,
        lease_duration=args.lease,
        **({"renew_interval": args.renew} if args.renew else {}),
        **({"retry_interval": args.retry} if args.retry else {}),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: loop.create_task(election.resign()))
    events = election.events()

    async def record_events() -> None:
        async for event in events:
            if event.kind is EventKind.ACQUIRED:
                current = election.leadership
                if current is not None and current.token == event.token:
                    terms[event.token] = current
                log.write("acquired", token=event.token)
            elif event.kind is EventKind.LOST:
                ended = terms.pop(event.token or 0, None)
                # The term ended when the election stepped down (before it released), or at
                # its deadline if the process was frozen past it: whichever came first.
                valid_until = None
                if ended is not None:
                    valid_until = min(ended.deadline, ended.ended_at or ended.deadline)
                log.write("lost", token=event.token, valid_until=valid_until)
            else:
                leader = event.leader
                log.write(
                    "leader_changed",
                    leader=None if leader is None else leader.participant_id,
                    token=None if leader is None else leader.token,
                )

    terms: dict[int, Leadership] = {}

    async def work(leadership: Leadership) -> None:
        while True:
            stamped = time.monotonic()  # before the check: a SIGSTOP between cannot post-date it
            if leadership.is_valid:
                log.write("work", token=leadership.token, t=stamped)
            await asyncio.sleep(args.work_interval)

    recorder = asyncio.create_task(record_events())
    try:
        async with provider:
            await election.start()
            log.write("started", pid=os.getpid())
            runner = asyncio.create_task(election.run_while_leader(work))
            await stop.wait()
            await election.stop()
            await runner
            await recorder
            log.write("stopped")
    finally:
        recorder.cancel()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m multilock.core.testing.participant")
    parser.add_argument(
        "--url",
        default=os.environ.get("MULTILOCK_PARTICIPANT_URL"),
        help="the store URL (default: $MULTILOCK_PARTICIPANT_URL, which keeps passwords "
        "out of the process list)",
    )
    parser.add_argument("--group", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--renew", type=float, default=None)
    parser.add_argument("--retry", type=float, default=None)
    parser.add_argument("--work-interval", type=float, default=0.02)
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("--url or MULTILOCK_PARTICIPANT_URL is required")
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
