"""Why fencing tokens matter: a deposed leader's late write must not win.

    python samples/fencing.py

Leadership alone cannot stop every stale write. Worker A leads, checks that it still
leads, and sends a write; the write is delayed in the network. Meanwhile A is cut off from
the lock store, its lease runs out and worker B takes over with a larger token and writes.
Then A's old write arrives. A store that remembers the highest token it has seen rejects
it; a store that does not lets the deposed leader overwrite the new leader's data.

Everything runs in one process on one `InMemoryProvider`; A reaches it through
`multilock.core.testing.FaultyProvider`, which makes A's calls hang on demand.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from multilock.core import EventKind, InMemoryProvider, LeaderElection
from multilock.core.testing import Fault, FaultyProvider

GROUP = "orders"


class Storage:
    """A tiny key-value store. With ``fenced`` it rejects writes older than the newest.

    Fencing is the store's job: every write carries the writer's token, and the store
    refuses a token lower than the highest it has accepted.
    """

    def __init__(self, name: str, *, fenced: bool) -> None:
        self.name = name
        self.fenced = fenced
        self.highest_token = 0
        self.data: dict[str, str] = {}

    def write(self, writer: str, token: int, key: str, value: str) -> bool:
        if self.fenced and token < self.highest_token:
            print(
                f"    {self.name}: REJECTED {key}={value} from {writer} "
                f"(token {token} < highest seen {self.highest_token})"
            )
            return False
        self.highest_token = max(self.highest_token, token)
        self.data[key] = value
        print(f"    {self.name}: accepted {key}={value} from {writer} (token {token})")
        return True


async def main_async(lease: float) -> int:
    store = InMemoryProvider()
    link_a = FaultyProvider(store)  # worker A's connection to the lock store
    a = LeaderElection(link_a, group=GROUP, participant_id="worker-a", lease_duration=lease)
    b = LeaderElection(store, group=GROUP, participant_id="worker-b", lease_duration=lease)
    storages = [Storage("fenced store", fenced=True), Storage("naive store ", fenced=False)]

    def write_everywhere(writer: str, token: int, value: str) -> list[bool]:
        return [s.write(writer, token, "total", value) for s in storages]

    a_events = a.events(EventKind.LOST)
    try:
        await a.start()
        lead_a = await a.wait_until_leader()
        print(f"1. worker-a leads with token {lead_a.token} and writes")
        write_everywhere("worker-a", lead_a.token, "100")
        await b.start()

        lead_a.check()  # still leading: the write below is legitimate when sent...
        print("2. worker-a checks it still leads, sends total=90; the network delays it")
        b_wrote = asyncio.Event()

        async def delayed_write(token: int) -> list[bool]:
            await b_wrote.wait()  # ...but it arrives after the new leader's write
            return write_everywhere("worker-a", token, "90")

        in_flight = asyncio.create_task(delayed_write(lead_a.token))

        link_a.inject(Fault.HANG)
        print("3. worker-a is cut off from the lock store: its renewals hang")
        lost = await anext(a_events)
        print(
            f"   worker-a steps down at its own deadline (LOST token {lost.token}); "
            f"is_leader={a.is_leader}"
        )
        lead_b = await b.wait_until_leader()
        print(f"4. worker-b leads with token {lead_b.token} and writes")
        write_everywhere("worker-b", lead_b.token, "120")
        b_wrote.set()

        print("5. worker-a's delayed write arrives")
        fenced_ok, naive_ok = await in_flight
        fenced, naive = storages
        print(f"fenced store: total={fenced.data['total']} (the new leader's value stands)")
        print(f"naive store:  total={naive.data['total']} (a deposed leader overwrote it)")
        if fenced_ok or not naive_ok or lead_b.token <= lead_a.token:
            print("unexpected outcome: fencing did not behave as described", file=sys.stderr)
            return 1
        print("the token told the store that the late write came from an older term")
        return 0
    finally:
        link_a.heal()
        await b.stop()
        await a.stop()
        await store.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/fencing.py")
    parser.add_argument("--lease", type=float, default=1.0, help="lease seconds (default 1)")
    args = parser.parse_args(argv)
    # Show the election's own warnings (failed renewals, stepping down) among the story.
    logging.basicConfig(level=logging.WARNING, format="   log: %(message)s", stream=sys.stdout)
    try:
        return asyncio.run(main_async(args.lease))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
