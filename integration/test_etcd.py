"""EtcdProvider against a real etcd: what only etcd has.

`test_contract.py` runs the provider contract on it through its URL; here: lease TTL
rounding, a live term left untouched by a second process with the same participant id,
revoke on release, watch wake-ups on release and on lease expiry, server restarts
(revisions, hence tokens, keep rising) and a dead server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aetcd  # type: ignore[import-untyped]
import pytest

from harness import BaseServer, free_port, require_control
from multilock.core import LeaderInfo, ProviderError
from multilock.etcd import EtcdProvider


def group() -> str:
    return f"etcd-{uuid.uuid4().hex[:12]}"


async def wait_for(what: str, predicate: Callable[[], Awaitable[bool]], within: float) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def provider(etcd_server: BaseServer) -> AsyncIterator[EtcdProvider]:
    async with EtcdProvider.from_url(etcd_server.url, timeout=2.0) as made:
        yield made


@pytest.fixture
async def raw(etcd_server: BaseServer) -> AsyncIterator[Any]:
    """A plain etcd client, to look at keys and leases behind the provider's back."""
    parts = urlsplit(etcd_server.url)
    async with aetcd.Client(host=parts.hostname, port=parts.port, timeout=5) as client:
        yield client


async def lease_of(raw: Any, g: str) -> Any:
    kv = await raw.get(f"multilock/{g}".encode())
    assert kv is not None, f"no key for group {g}"
    return await raw.get_lease_info(kv.lease, keys=False)


async def test_lease_ttl_is_rounded_up_to_whole_seconds(provider: EtcdProvider, raw: Any) -> None:
    g = group()
    info = await provider.try_acquire(g, "p1", 1.2, {})
    assert info is not None
    assert (await lease_of(raw, g)).grantedTTL == 2
    # A longer lease on renew moves the key to a new lease; the term stays the same.
    assert await provider.renew(g, "p1", info.token, 3.5, {"k": "v"})
    assert (await lease_of(raw, g)).grantedTTL == 4
    leader = await provider.get_leader(g)
    assert leader is not None
    assert (leader.token, leader.metadata) == (info.token, {"k": "v"})


async def test_a_live_term_is_never_joined_by_the_same_participant_id(
    etcd_server: BaseServer, provider: EtcdProvider, raw: Any
) -> None:
    """Two processes configured with one participant id, each with its own provider: the
    second one's acquire gets None and leaves the key, its value and its lease as they were.
    """
    g = group()
    key = f"multilock/{g}".encode()
    first = await provider.try_acquire(g, "p1", 10.0, {"instance": "a"})
    assert first is not None
    before = await raw.get(key)
    ttl = (await raw.get_lease_info(before.lease, keys=False)).grantedTTL
    seen = ttl

    async def running_down() -> bool:  # so that a keepalive would show as a higher TTL
        nonlocal seen
        seen = (await raw.get_lease_info(before.lease, keys=False)).TTL
        return bool(0 < seen <= ttl - 2)

    await wait_for("the lease's TTL to run down", running_down, within=10.0)
    async with EtcdProvider.from_url(etcd_server.url, timeout=2.0) as twin:
        assert await twin.try_acquire(g, "p1", 10.0, {"instance": "b"}) is None
        assert await twin.try_acquire(g, "p1", 30.0, {"instance": "b"}) is None
        assert await provider.try_acquire(g, "p1", 10.0, {"instance": "c"}) is None
        after = await raw.get(key)
        assert (after.value, after.lease, after.mod_revision, after.version) == (
            before.value,
            before.lease,
            before.mod_revision,
            before.version,
        ), "a refused acquire rewrote the key"
        lease = await raw.get_lease_info(before.lease, keys=False)
        assert lease.grantedTTL == ttl
        assert 0 < lease.TTL <= seen, "a refused acquire kept the lease alive"
        assert await twin.get_leader(g) == first
    assert await provider.renew(g, "p1", first.token, 10.0, {"instance": "a"})
    await provider.release(g, "p1", first.token)


async def test_renew_fails_once_the_lease_is_gone(provider: EtcdProvider, raw: Any) -> None:
    g = group()
    info = await provider.try_acquire(g, "p1", 5.0, {})
    assert info is not None
    kv = await raw.get(f"multilock/{g}".encode())
    await raw.revoke_lease(kv.lease)  # what etcd does when the lease expires
    assert not await provider.renew(g, "p1", info.token, 5.0, {})
    assert await provider.get_leader(g) is None


async def test_release_revokes_the_lease_and_frees_the_group_at_once(
    provider: EtcdProvider, raw: Any
) -> None:
    g = group()
    first = await provider.try_acquire(g, "p1", 30.0, {})
    assert first is not None
    lease_id = (await raw.get(f"multilock/{g}".encode())).lease
    await provider.release(g, "p1", first.token)
    assert (await raw.get_lease_info(lease_id, keys=False)).TTL == -1  # revoked
    second = await provider.try_acquire(g, "p2", 30.0, {})
    assert second is not None
    assert second.token > first.token
    await provider.release(g, "p2", second.token)


async def test_release_by_a_stale_term_changes_nothing(provider: EtcdProvider) -> None:
    g = group()
    info = await provider.try_acquire(g, "p1", 30.0, {})
    assert info is not None
    await provider.release(g, "p1", info.token - 1)
    await provider.release(g, "p2", info.token)
    leader = await provider.get_leader(g)
    assert leader is not None
    assert leader.token == info.token
    await provider.release(g, "p1", info.token)


async def _woken_when_leaderless(provider: EtcdProvider, g: str, end: Callable[[], Any]) -> float:
    """Start a watch, run *end*, return the seconds until the watch saw nobody leading."""
    watch = provider.watch(g)
    subscribed = asyncio.Event()
    woke = asyncio.Event()

    async def follow() -> None:
        async for _ in watch:
            subscribed.set()  # the first wake comes once the watch is in place
            if await provider.get_leader(g) is None:
                woke.set()
                return

    follower = asyncio.ensure_future(follow())
    try:
        async with asyncio.timeout(5):
            await subscribed.wait()
        start = time.monotonic()
        await end()
        async with asyncio.timeout(5):
            await woke.wait()
        return time.monotonic() - start
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await watch.aclose()  # type: ignore[attr-defined]


async def test_watch_wakes_on_release(provider: EtcdProvider) -> None:
    g = group()
    info = await provider.try_acquire(g, "p1", 30.0, {})
    assert info is not None
    took = await _woken_when_leaderless(provider, g, lambda: provider.release(g, "p1", info.token))
    assert took < 1.0


async def test_watch_wakes_on_lease_expiry(provider: EtcdProvider) -> None:
    g = group()
    started = time.monotonic()
    info = await provider.try_acquire(g, "p1", 1.0, {})
    assert info is not None

    async def nothing() -> None:
        return None

    await _woken_when_leaderless(provider, g, nothing)
    elapsed = time.monotonic() - started
    # etcd checks lease expiry every 500 ms: the key goes within about 1 + 0.5 s.
    assert 0.9 <= elapsed < 3.0, elapsed


async def test_tokens_keep_rising_across_a_server_restart(etcd_server: BaseServer) -> None:
    server = require_control(etcd_server)
    g = group()
    async with EtcdProvider.from_url(server.url, timeout=2.0) as provider:
        before = await provider.try_acquire(g, "p1", 30.0, {})
        assert before is not None
        await provider.release(g, "p1", before.token)
        server.restart()

        after: LeaderInfo | None = None

        async def acquired() -> bool:
            nonlocal after
            with contextlib.suppress(ProviderError):
                after = await provider.try_acquire(g, "p2", 30.0, {})
                return True
            return False

        await wait_for("the first acquire after the restart", acquired, within=10.0)
        assert after is not None
        assert after.token > before.token
        await provider.release(g, "p2", after.token)


async def test_a_stopped_server_gives_provider_error_promptly(etcd_server: BaseServer) -> None:
    server = require_control(etcd_server)
    g = group()
    async with EtcdProvider.from_url(server.url, timeout=1.0) as provider:
        info = await provider.try_acquire(g, "p1", 30.0, {})
        assert info is not None
        server.stop()
        try:
            for call in (
                lambda: provider.renew(g, "p1", info.token, 30.0, {}),
                lambda: provider.get_leader(g),
                lambda: provider.try_acquire(g, "p2", 30.0, {}),
            ):
                start = time.monotonic()
                with pytest.raises(ProviderError) as caught:
                    await call()
                assert time.monotonic() - start < 2.5
                assert caught.value.__cause__ is not None
        finally:
            server.start()

        async def released() -> bool:  # gRPC reconnects within its backoff (<= 1 s)
            with contextlib.suppress(ProviderError):
                await provider.release(g, "p1", info.token)
                return True
            return False

        await wait_for("a release after the restart", released, within=10.0)
        assert await provider.get_leader(g) is None


async def test_nothing_listening_gives_provider_error_promptly() -> None:
    port = free_port()
    async with EtcdProvider("127.0.0.1", port, timeout=1.0) as provider:
        start = time.monotonic()
        with pytest.raises(ProviderError):
            await provider.get_leader(group())
        assert time.monotonic() - start < 2.5
        watch = provider.watch(group())
        with pytest.raises(ProviderError):
            await anext(watch)


async def drain(watch: AsyncIterator[None]) -> None:
    async with asyncio.timeout(10):
        async for _ in watch:
            pass


async def test_a_watch_breaks_on_restart_and_a_new_one_works(etcd_server: BaseServer) -> None:
    server = require_control(etcd_server)
    g = group()
    async with EtcdProvider.from_url(server.url, timeout=2.0) as provider:
        watch = provider.watch(g)
        await anext(watch)  # subscribed
        server.stop()
        try:
            with pytest.raises(ProviderError):
                await drain(watch)
        finally:
            server.start()
        info: LeaderInfo | None = None

        async def acquired() -> bool:
            nonlocal info
            with contextlib.suppress(ProviderError):
                info = await provider.try_acquire(g, "p1", 30.0, {})
                return True
            return False

        await wait_for("an acquire after the restart", acquired, within=10.0)
        assert info is not None
        again = provider.watch(g)
        await anext(again)
        await provider.release(g, "p1", info.token)
        async with asyncio.timeout(5):
            await anext(again)  # the release
        await again.aclose()  # type: ignore[attr-defined]


def watch_metrics(etcd_server: BaseServer) -> dict[str, float]:
    """The etcd server's own count of watch streams and watchers (its /metrics page)."""
    parts = urlsplit(etcd_server.url)
    with urllib.request.urlopen(f"http://{parts.hostname}:{parts.port}/metrics", timeout=5) as r:
        lines = r.read().decode().splitlines()
    wanted = ("etcd_debugging_mvcc_watch_stream_total", "etcd_debugging_mvcc_watcher_total")
    found = {}
    for line in lines:
        name, _, value = line.partition(" ")
        if name in wanted:
            found[name.removeprefix("etcd_debugging_mvcc_")] = float(value)
    assert set(found) == {"watch_stream_total", "watcher_total"}, found
    return found


async def test_many_watches_share_one_etcd_watch(etcd_server: BaseServer) -> None:
    """50 groups, 3 watches on one of them, on one provider: one watch stream and one
    watcher on the server; a release wakes that group's watches."""
    groups = [group() for _ in range(50)]
    before = await asyncio.to_thread(watch_metrics, etcd_server)
    async with EtcdProvider.from_url(etcd_server.url, timeout=2.0) as provider:
        info = await provider.try_acquire(groups[0], "p1", 30.0, {})
        assert info is not None
        watches = [provider.watch(g) for g in groups] + [provider.watch(groups[0]) for _ in "ab"]
        try:
            async with asyncio.timeout(10):
                for watch in watches:
                    await anext(watch)  # subscribed
            during = await asyncio.to_thread(watch_metrics, etcd_server)
            assert during["watch_stream_total"] - before["watch_stream_total"] == 1, during
            assert during["watcher_total"] - before["watcher_total"] == 1, during
            await provider.release(groups[0], "p1", info.token)
            async with asyncio.timeout(5):
                for watch in [watches[0], *watches[50:]]:
                    await anext(watch)  # the release
        finally:
            for watch in watches:
                await watch.aclose()  # type: ignore[attr-defined]

    async def all_gone() -> bool:  # the last watch closed: the server's watch ends
        now = await asyncio.to_thread(watch_metrics, etcd_server)
        return now["watcher_total"] == before["watcher_total"]

    await wait_for("the provider's watch to end on the server", all_gone, within=5.0)
