"""`ConsulProvider` against a real Consul server: what only a server can show.

`test_contract.py` (and the fault suite) run on the ``consul://`` URL of the ``backend``
fixture; here the contract runs again under a nested key prefix, and the rest checks
what Consul itself does with the provider's requests: the session's options, the key's
record, ModifyIndex tokens, hand-off without lock-delay, a session destroyed behind the
holder's back, blocking-query wake-ups, a lost reply taken up with renew, and a server
restart.

Every test needs ``consul_server``, which skips (even in CI) when no Consul can be had:
no Consul server can run on the project's machines. Set ``MULTILOCK_TEST_CONSUL_URL``
(``consul://127.0.0.1:18500`` with ``docker compose up consul``) or start Docker.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import requests

from harness import BaseServer, require_control
from multilock.consul import ConsulProvider
from multilock.consul._config import Settings, parse_address
from multilock.core import ProviderError
from multilock.core.testing import PROVIDER_CHECKS, check_provider

LEASE = 10.0


def fresh() -> str:
    return f"consul-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def url(consul_server: BaseServer) -> str:
    return consul_server.url


@pytest.fixture
def raw(url: str) -> Any:
    """A plain py-consul client, to look at what the provider wrote."""
    client = Settings(**parse_address(url)).client()
    yield client
    client.http.session.close()


def entry_of(raw: Any, key: str) -> dict[str, Any] | None:
    _, entry = raw.kv.get(key, consistency="consistent")
    return entry if isinstance(entry, dict) else None


async def next_within(watch: AsyncIterator[None], seconds: float) -> float:
    started = time.monotonic()
    async with asyncio.timeout(seconds):
        await anext(watch)
    return time.monotonic() - started


async def wait_for(what: str, predicate: Callable[[], Awaitable[bool]], within: float) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("check", list(PROVIDER_CHECKS))
async def test_provider_contract_under_a_nested_prefix(url: str, check: str) -> None:
    prefix = f"multilock-test/{uuid.uuid4().hex[:8]}"
    await check_provider(
        lambda: ConsulProvider(url, prefix=prefix), lease_duration=LEASE, only=check
    )


async def test_session_options_and_the_key_record(url: str, raw: Any) -> None:
    group = fresh()
    async with ConsulProvider(url) as provider:
        info = await provider.try_acquire(group, "p1", 12.5, {"host": "web-1"})
        assert info is not None
        entry = entry_of(raw, f"multilock/{group}")
        assert entry is not None
        assert entry["Session"], "the key is not held by a session"
        record = json.loads(entry["Value"])
        assert record["participant"] == "p1"
        assert record["metadata"] == {"host": "web-1"}
        _, session = raw.session.info(entry["Session"])
        assert session["TTL"] == "13s", "the TTL must be the lease rounded up"
        assert session["Behavior"] == "delete"
        assert session["LockDelay"] == 0, "a lock-delay would block every successor"
        # No serfHealth: a node health flap must not end a term before its TTL.
        assert not session.get("NodeChecks")
        assert not session.get("Checks")
        await provider.release(group, "p1", info.token)
        _, gone = raw.session.info(entry["Session"])
        assert gone is None, "release did not destroy the session"


async def test_tokens_are_modify_indexes_and_rise(url: str, raw: Any) -> None:
    group, key = fresh(), None
    tokens = []
    async with ConsulProvider(url) as p, ConsulProvider(url) as q:
        key = f"{p.prefix}/{group}"
        for provider, participant in [(p, "p1"), (q, "p2"), (p, "p1")]:
            info = await provider.try_acquire(group, participant, LEASE, {})
            assert info is not None
            entry = entry_of(raw, key)
            assert entry is not None
            assert info.token == entry["ModifyIndex"]
            # New metadata is a write: ModifyIndex moves on, the term's token does not.
            assert await provider.renew(group, participant, info.token, LEASE, {"v": "2"})
            leader = await q.get_leader(group)
            assert leader is not None
            assert leader.token == info.token
            assert leader.metadata == {"v": "2"}
            tokens.append(info.token)
            await provider.release(group, participant, info.token)
    assert tokens == sorted(set(tokens)), f"tokens did not rise: {tokens}"


async def test_a_successor_takes_over_at_once_after_release(url: str) -> None:
    group = fresh()
    async with ConsulProvider(url) as p, ConsulProvider(url) as q:
        info = await p.try_acquire(group, "p1", LEASE, {})
        assert info is not None
        await p.release(group, "p1", info.token)
        started = time.monotonic()
        taken = await q.try_acquire(group, "p2", LEASE, {})
        # With Consul's default lock-delay (15 s) this acquire would fail.
        assert taken is not None, "the released key was still locked (lock-delay?)"
        assert time.monotonic() - started < 2.0


async def test_a_destroyed_session_ends_the_term_at_once(url: str, raw: Any) -> None:
    group = fresh()
    async with ConsulProvider(url) as p, ConsulProvider(url) as q:
        info = await p.try_acquire(group, "p1", LEASE, {})
        assert info is not None
        watch = q.watch(group)
        await next_within(watch, 5)
        entry = entry_of(raw, f"multilock/{group}")
        assert entry is not None
        raw.session.destroy(entry["Session"])  # what a missed TTL or an operator does
        assert await next_within(watch, 5) < 2.0
        await watch.aclose()  # type: ignore[attr-defined]
        assert entry_of(raw, f"multilock/{group}") is None, "behavior delete kept the key"
        assert await q.get_leader(group) is None
        assert not await p.renew(group, "p1", info.token, LEASE, {})
        taken = await q.try_acquire(group, "p2", LEASE, {})
        assert taken is not None
        assert taken.token > info.token


async def test_watch_wakes_within_a_round_trip(url: str) -> None:
    group = fresh()
    async with ConsulProvider(url) as p, ConsulProvider(url, watch_wait=30) as q:
        watch = q.watch(group)
        await next_within(watch, 5)
        info = await p.try_acquire(group, "p1", LEASE, {})
        assert info is not None
        assert await next_within(watch, 5) < 1.0
        await p.release(group, "p1", info.token)
        assert await next_within(watch, 5) < 1.0
        await watch.aclose()  # type: ignore[attr-defined]


async def test_a_lost_reply_to_the_acquire_is_taken_up_with_renew(url: str, raw: Any) -> None:
    """The term of an acquire whose reply was lost is found with get_leader and taken up
    with renew; no acquire joins it, the same participant id's included, or writes."""
    group = fresh()
    key = f"multilock/{group}"
    async with ConsulProvider(url) as p, ConsulProvider(url) as q:
        real_put = p._client.kv.put

        def put_then_lose_the_reply(*args: Any, **kwargs: Any) -> Any:
            result = real_put(*args, **kwargs)
            if kwargs.get("acquire"):
                p._client.kv.put = real_put
                raise requests.ConnectionError("the reply was lost")
            return result

        p._client.kv.put = put_then_lose_the_reply
        with pytest.raises(ProviderError):
            await p.try_acquire(group, "p1", LEASE, {"instance": "a"})
        held = await q.get_leader(group)
        assert held is not None
        assert (held.participant_id, held.metadata) == ("p1", {"instance": "a"})
        before = entry_of(raw, key)
        assert before is not None
        assert await p.try_acquire(group, "p1", LEASE, {"instance": "a"}) is None
        assert await q.try_acquire(group, "p1", LEASE, {"instance": "b"}) is None
        assert await q.try_acquire(group, "p2", LEASE, {}) is None
        after = entry_of(raw, key)
        assert after is not None
        assert (after["ModifyIndex"], after["Session"]) == (
            before["ModifyIndex"],
            before["Session"],
        ), "a refused acquire wrote the key"
        assert await p.renew(group, "p1", held.token, LEASE, {"instance": "a"})
        assert await q.get_leader(group) == held
        await p.release(group, "p1", held.token)
        assert await q.get_leader(group) is None


async def test_a_server_restart_fails_fast_and_tokens_keep_rising(
    consul_server: BaseServer,
) -> None:
    server = require_control(consul_server)
    group = fresh()
    async with ConsulProvider(server.url, timeout=2.0) as p:
        before = await p.try_acquire(group, "p1", LEASE, {})
        assert before is not None
        await p.release(group, "p1", before.token)
        server.stop()
        started = time.monotonic()
        with pytest.raises(ProviderError):
            await p.get_leader(group)
        assert time.monotonic() - started < 5.0
        await asyncio.to_thread(server.start)

        async def acquired() -> bool:
            try:
                return await p.try_acquire(group, "p2", LEASE, {}) is not None
            except ProviderError:
                return False

        await wait_for("an acquire after the restart", acquired, 60)
        after = await p.get_leader(group)
        assert after is not None
        assert after.token > before.token, "the restart reset the tokens"
