"""A node's batched calls, in virtual time against a scripted stand-in for redis-py: how
long a caller waits for the batch that answers it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from multilock.core import ProviderError
from multilock.core.testing import FakeClock
from multilock.redis._config import Settings
from multilock.redis._node import Node, _Calls

#: Each send to the stand-in server takes this long (the calls' timeout is 1 s).
SEND = 0.9


class Script:
    """A registered script: each call (one group's acquire) takes `SEND`."""

    sha = "0" * 40

    def __init__(self, sent: list[list[str]]) -> None:
        self.sent = sent

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        self.sent.append([keys[0]])
        await asyncio.sleep(SEND)
        return [b"7", b"1700000000000000"]


class Client:
    """The part of ``redis.asyncio.Redis`` a node uses to acquire: scripts only."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []

    def register_script(self, source: str) -> Script:
        return Script(self.sent)


def node(client: Client) -> Node:
    calls = _Calls("stand-in", 1.0, None, (), 4, authenticated=False)
    return Node(client, calls, owned=False, settings=Settings())  # type: ignore[arg-type]


def test_a_caller_waits_for_the_batch_after_the_one_on_its_way() -> None:
    # The second acquire is asked for while the first is on its way: it waits for that
    # one (0.9 s), then goes in its own batch (0.9 s). Each send is within the calls'
    # 1 s timeout, so it must not fail for having waited 1.8 s in all: a herd's caller
    # that gave up one timeout after asking would ask again, and the herd never ends.
    async def body() -> None:
        client = Client()
        redis = node(client)
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = asyncio.ensure_future(redis.acquire("a", "p", 1000, "{}", clock_floor=True))
        await asyncio.sleep(0)
        second = await redis.acquire("b", "p", 1000, "{}", clock_floor=True)
        assert second is not None
        assert second.token == 7
        assert loop.time() - started == pytest.approx(2 * SEND)
        assert (await first) is not None
        assert client.sent == [["multilock:{a}:lease"], ["multilock:{b}:lease"]]
        await redis.aclose()

    FakeClock().run(body())


def test_a_caller_with_a_bound_of_its_own_keeps_it() -> None:
    async def body() -> None:
        redis = node(Client())
        first = asyncio.ensure_future(redis.acquire("a", "p", 1000, "{}", clock_floor=True))
        await asyncio.sleep(0)
        with pytest.raises(ProviderError, match="no answer within"):
            await redis.acquire("b", "p", 1000, "{}", clock_floor=True, within=1.0)
        assert (await first) is not None
        await redis.aclose()

    FakeClock().run(body())
