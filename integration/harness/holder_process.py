"""A process that holds one `Lock` until it is killed: the victim of test_holders' SIGKILL.

Run as a script (``python holder_process.py NAME LEASE PARTICIPANT_ID``) with the store's
URL in the environment variable ``MULTILOCK_HOLDER_URL`` (not in argv, where ``ps`` would
show a password). It prints one JSON object per line on stdout, flushed at once:

- ``{"event": "acquired", "token": T, "t": NOW, "deadline": D}`` when the lock is held;
- ``{"event": "deadline", "token": T, "t": NOW, "deadline": D}`` each time a renew moves
  the local deadline ``D``;
- ``{"event": "lost", "token": T, "t": NOW}`` if the term ends (it then exits 3).

Times are ``time.monotonic()``, which on Linux is one clock for every process, so the
parent can compare its own times with them. The last deadline printed before a kill is a
lower bound of the lease's end on the store: nobody may acquire before it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from multilock.core import LeadershipLost, Lock, from_url

ENV_URL = "MULTILOCK_HOLDER_URL"
#: How often the deadline is looked at; a renew shows within this long.
LOOK = 0.01


def say(**record: Any) -> None:
    print(json.dumps({**record, "t": time.monotonic()}), flush=True)


async def hold(url: str, name: str, lease: float, participant_id: str) -> int:
    provider = from_url(url)
    try:
        async with Lock(
            provider, name, lease_duration=lease, participant_id=participant_id
        ) as held:
            say(event="acquired", token=held.token, deadline=held.deadline)
            shown = held.deadline
            while True:  # until SIGKILL; a lost term cancels this task (LeadershipLost)
                if held.deadline != shown:
                    shown = held.deadline
                    say(event="deadline", token=held.token, deadline=shown)
                await asyncio.sleep(LOOK)
    except LeadershipLost as exc:
        say(event="lost", token=exc.token)
        return 3
    finally:
        await provider.aclose()


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(f"usage: {argv[0]} NAME LEASE PARTICIPANT_ID (URL in ${ENV_URL})", file=sys.stderr)
        return 2
    url = os.environ.get(ENV_URL, "")
    if not url:
        print(f"{ENV_URL} is not set", file=sys.stderr)
        return 2
    return asyncio.run(hold(url, argv[1], float(argv[2]), argv[3]))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
