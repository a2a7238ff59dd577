"""One member of the semaphore and shards campaign: a real process that logs every hold.

    python holder_member.py --mode semaphore|shards --name NAME --size N --lease L \\
        --member m0 --log m0.jsonl [--ignore-loss]

The store's URL comes in ``MULTILOCK_HOLDERS_URL`` (a password must not show in ``ps``).
Run as a script: it imports nothing but ``multilock.core`` (the harness runs it by path).

- ``semaphore``: a holder loop on ``Semaphore(provider, NAME, N)``: wait for a slot, hold
  it 1.5 to 3.5 leases, release, pause up to half a lease, again.
- ``shards``: a participant of ``Shards(provider, NAME, N)`` that follows ``owned``, woken
  by ``wait_changed`` and every 20 ms.

Every record is one JSON line, written with one ``os.write`` on an ``O_APPEND`` file (a
SIGKILL never leaves half a line), stamped ``t = time.monotonic()``: one clock for every
process of the machine, the election's clock too (the event loop's ``time()``). Events:

- ``started`` (pid): the process is up and joins (or waits for a slot);
- ``begin`` (unit, token, deadline; ``hold_until`` for a slot): a slot or shard is held,
  stamped as soon as this process knows it;
- ``renew`` (unit, token, deadline): a renew moved the term's local deadline, logged within
  20 ms, so that the term of a SIGKILLed process can be closed at its last deadline;
- ``end`` (unit, token, valid_until, reason): the hold is over. ``t`` is when this process
  stopped using it (release start) or noticed the loss; ``valid_until`` is
  ``min(deadline, ended_at)`` of the term, so a process frozen past its deadline is judged
  by its deadline, not by the moment it woke up. The checker ends the hold at
  ``min(t, valid_until)``;
- ``members`` (share, live): a shards participant's share or live count changed;
- ``error`` (error): an unexpected exception, after which the loop goes on;
- ``stopped``: SIGTERM was handled, everything released.

With ``--ignore-loss`` (the negative control) a slot holder ignores the loss of its slot:
it holds on until its planned end and logs that moment as its ``valid_until``, as a holder
that never checked its lease would. The checker must find the overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import signal
import sys
import time
from typing import Any

from multilock.core import (
    Leadership,
    LeadershipLost,
    Semaphore,
    Shards,
    from_url,
)

URL_VAR = "MULTILOCK_HOLDERS_URL"
#: How often a holder looks at its term's deadline (a renew is logged within this long).
POLL = 0.02
#: A slot is held this many leases (uniform), then released; then a pause of up to
#: `PAUSE` leases before waiting again.
HOLD = (1.5, 3.5)
PAUSE = 0.5


class Log:
    """JSON lines, one ``os.write`` each, every record stamped and signed."""

    def __init__(self, path: str, member: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._member, self._pid = member, os.getpid()

    def write(self, event: str, t: float | None = None, **fields: Any) -> None:
        record = {
            "t": time.monotonic() if t is None else t,
            "member": self._member,
            "pid": self._pid,
            "event": event,
            **fields,
        }
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def valid_until(held: Leadership) -> float:
    """When the term stopped being valid: its deadline, or its step-down if earlier."""
    ended = held.ended_at
    return held.deadline if ended is None else min(held.deadline, ended)


class Member:
    def __init__(self, args: argparse.Namespace, log: Log) -> None:
        self.args, self.log = args, log
        self.lease: float = args.lease
        self.stopping = False
        self.rng = random.Random()

    # -- semaphore -----------------------------------------------------------------------------

    async def semaphore(self, provider: Any) -> None:
        semaphore = Semaphore(provider, self.args.name, self.args.size, lease_duration=self.lease)
        while not self.stopping:
            try:
                async with semaphore as held:
                    await self._hold_slot(held, held.slot)
            except LeadershipLost:
                pass  # logged by _hold_slot
            except Exception as exc:  # logged, and the loop goes on
                self.log.write("error", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(self.lease)
            await asyncio.sleep(self.rng.uniform(0.0, PAUSE) * self.lease)

    async def _hold_slot(self, held: Leadership, slot: int) -> None:
        begun = time.monotonic()  # first: what this process knows from now on
        hold_until = begun + self.rng.uniform(*HOLD) * self.lease
        token, deadline = held.token, held.deadline
        self.log.write(
            "begin", t=begun, unit=slot, token=token, deadline=deadline, hold_until=hold_until
        )
        ignored: float | None = None
        try:
            while time.monotonic() < hold_until:
                try:
                    await asyncio.sleep(POLL)
                except asyncio.CancelledError:
                    if not self.args.ignore_loss or self.stopping:
                        raise
                    ignored = ignored or time.monotonic()  # the negative control holds on
                    continue
                stamped = time.monotonic()
                if held.is_valid and held.deadline != deadline:
                    deadline = held.deadline
                    self.log.write("renew", t=stamped, unit=slot, token=token, deadline=deadline)
        except asyncio.CancelledError:
            reason = "stopping" if self.stopping else "lost"
            self.log.write("end", unit=slot, token=token, valid_until=valid_until(held),
                           reason=reason)  # fmt: skip
            raise
        released = time.monotonic()  # release start: the holder stops using the slot
        if self.args.ignore_loss:  # the negative control: it held until now, it says
            lost = ignored or (None if held.is_valid else valid_until(held))
            self.log.write("end", t=released, unit=slot, token=token, valid_until=released,
                           reason="ignored-loss" if lost else "release",
                           lost_at=lost)  # fmt: skip
        else:
            self.log.write("end", t=released, unit=slot, token=token,
                           valid_until=valid_until(held), reason="release")  # fmt: skip

    # -- shards --------------------------------------------------------------------------------

    async def shards(self, provider: Any) -> None:
        count = self.args.size
        tracked: dict[tuple[int, int], tuple[Leadership, float]] = {}
        membership = (-1, -1)
        async with Shards(provider, self.args.name, count, lease_duration=self.lease) as shards:
            while not self.stopping:
                changed = asyncio.ensure_future(shards.wait_changed())
                try:
                    await asyncio.wait([changed], timeout=POLL)
                finally:
                    changed.cancel()
                self._follow(shards.owned, tracked)
                now = (shards.share, shards.live_participants)
                if now != membership:
                    membership = now
                    self.log.write("members", share=now[0], live=now[1])
        # Released (aclose returned): every term is over; log the ends not seen yet.
        self._follow({}, tracked)

    def _follow(self, owned: Any, tracked: dict[tuple[int, int], tuple[Leadership, float]]) -> None:
        """Log new shards (``begin``), moved deadlines (``renew``) and ended terms (``end``).

        A term is followed until it is no longer valid, even once ``owned`` has dropped it
        (a shard released to rebalance stays valid until its election steps down).
        """
        stamped = time.monotonic()  # before reading: no await between, nothing changes
        for index, view in owned.items():
            key = (index, view.token)
            if key not in tracked and view.is_valid:
                tracked[key] = (view, view.deadline)
                self.log.write("begin", t=stamped, unit=index, token=view.token,
                               deadline=view.deadline)  # fmt: skip
        for key, (view, deadline) in list(tracked.items()):
            if not view.is_valid:
                del tracked[key]
                why = view._term.end_reason  # for the reader: why the election stepped down
                # An election stopped while this process runs on: released to rebalance.
                released = why == "stopping" and not self.stopping
                reason = "stopping" if self.stopping else "released" if released else "lost"
                self.log.write("end", unit=key[0], token=key[1], valid_until=valid_until(view),
                               reason=reason, why=why)  # fmt: skip
            elif view.deadline != deadline:
                tracked[key] = (view, view.deadline)
                self.log.write("renew", t=stamped, unit=key[0], token=key[1],
                               deadline=view.deadline)  # fmt: skip


async def main_async(args: argparse.Namespace) -> int:
    log = Log(args.log, args.member)
    member = Member(args, log)
    provider = from_url(os.environ[URL_VAR])
    loop = asyncio.get_running_loop()
    body: asyncio.Task[None] | None = None

    def stop() -> None:
        member.stopping = True
        # A slot waiter may wait for long: cancel it (the holding block releases). A shards
        # participant sees the flag within `POLL` and leaves its block, releasing all.
        if body is not None and args.mode == "semaphore":
            body.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)
    async with provider:
        log.write("started", mode=args.mode, size=args.size, lease=args.lease)
        run = member.semaphore if args.mode == "semaphore" else member.shards
        body = asyncio.ensure_future(run(provider))
        try:
            await body
        except asyncio.CancelledError:
            if not member.stopping:
                raise
    log.write("stopped")
    return 0


class _Monotonic(logging.Filter):
    """Stamp each library log line with the logs' clock, to read it beside the records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.mono = time.monotonic()
        return True


def main(argv: list[str] | None = None) -> int:
    handler = logging.StreamHandler()  # stderr: the harness keeps it in <member>.err
    handler.addFilter(_Monotonic())
    handler.setFormatter(logging.Formatter("%(mono).6f %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger("multilock").setLevel(logging.INFO)
    parser = argparse.ArgumentParser(prog="holder_member.py")
    parser.add_argument("--mode", choices=("semaphore", "shards"), required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--size", type=int, required=True, help="the limit, or the shard count")
    parser.add_argument("--lease", type=float, required=True)
    parser.add_argument("--member", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--ignore-loss", action="store_true")
    args = parser.parse_args(argv)
    if not math.isfinite(args.lease) or args.lease <= 0:
        parser.error("--lease must be positive")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
