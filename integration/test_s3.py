"""`S3Provider` against a real S3 server (moto, in a child process): what only a server shows.

The shared contract and fault suite run on this backend through ``harness/fixtures_s3.py``;
here: that the conditional headers really reach the server (a race that fails if they are
ever lost, and proof that the same race does fail without them), observed-time expiry for
a provider that has never seen the object, watch timing, and the store operations of an
idle follower.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from harness import BaseServer
from multilock.core import LeaderElection, LeaderInfo, ProviderError, from_url
from multilock.s3 import S3Provider
from multilock.s3._store import Store

LEASE = 1.0
ROUNDS = 8
CANDIDATES = 20


def fresh(prefix: str = "s3") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def url(s3_server: BaseServer) -> str:
    """The server's URL with a key prefix of this test's own."""
    parts = urlsplit(s3_server.url)
    return parts._replace(path=f"{parts.path.rstrip('/')}/{fresh('t')}/").geturl()


@pytest.fixture
async def wide_executor() -> AsyncIterator[None]:
    """Enough worker threads that all candidates of a race really send at once."""
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=CANDIDATES + 4)
    loop.set_default_executor(executor)
    yield
    executor.shutdown(wait=True)


def make(url: str, **kwargs: Any) -> S3Provider:
    provider = from_url(url, **kwargs)
    assert isinstance(provider, S3Provider)
    return provider


async def race(providers: list[S3Provider], group: str, *, strict: bool = True) -> list[str]:
    """Let every provider try to take *group* at once; return the winners.

    With ``strict=False`` a candidate whose call failed is simply not a winner (moto can
    answer 500 to unconditional PUTs racing on one key).
    """
    results = await asyncio.gather(
        *(p.try_acquire(group, f"c{i}", LEASE * 20, {}) for i, p in enumerate(providers)),
        return_exceptions=not strict,
    )
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, ProviderError):
            raise result
    return [r.participant_id for r in results if isinstance(r, LeaderInfo)]


@pytest.fixture
def unconditional() -> Iterator[None]:
    """Make every provider send its PUTs without If-Match / If-None-Match."""
    original = Store._send

    def send(self: Store, method: str, key: str, *args: Any, **kwargs: Any) -> Any:
        headers = kwargs.get("headers") or (args[1] if len(args) > 1 else None)
        if headers:
            headers.pop("If-None-Match", None)
            headers.pop("If-Match", None)
        return original(self, method, key, *args, **kwargs)

    Store._send = send  # type: ignore[method-assign]
    try:
        yield
    finally:
        Store._send = original  # type: ignore[method-assign]


async def test_exactly_one_of_20_candidates_wins_every_round(url: str, wide_executor: None) -> None:
    providers = [make(url) for _ in range(CANDIDATES)]
    try:
        for round_ in range(ROUNDS):
            group = fresh("race")
            winners = await race(providers, group)
            assert len(winners) == 1, f"round {round_}: {len(winners)} winners: {winners}"
            leader = await providers[0].get_leader(group)
            assert leader is not None
            assert leader.participant_id == winners[0]
    finally:
        for provider in providers:
            await provider.aclose()


async def test_the_race_detects_a_lost_condition(
    url: str, wide_executor: None, unconditional: None
) -> None:
    """Without the headers the race above fails: it can catch a condition that is lost."""
    providers = [make(url) for _ in range(CANDIDATES)]
    try:
        counts = [len(await race(providers, fresh("lost"), strict=False)) for _ in range(ROUNDS)]
    finally:
        for provider in providers:
            await provider.aclose()
    assert max(counts) > 1, f"unconditional writes still had one winner per round: {counts}"


async def test_conditions_reach_the_server(url: str) -> None:
    """If-None-Match on an existing key and a stale If-Match both get refused (412)."""
    provider = make(url)
    store = provider._store
    key = f"{provider._prefix}{fresh('raw')}.json"
    try:
        first = await asyncio.to_thread(store.put, key, {"n": 1})
        assert first is not None
        assert await asyncio.to_thread(store.put, key, {"n": 2}) is None  # exists already
        second = await asyncio.to_thread(store.put, key, {"n": 3}, if_match=first)
        assert second is not None
        assert second != first
        assert await asyncio.to_thread(store.put, key, {"n": 4}, if_match=first) is None
        found = await asyncio.to_thread(store.get, key)
        assert found == (second, {"n": 3})
    finally:
        await provider.aclose()


async def test_a_foreign_object_is_a_provider_error(url: str) -> None:
    provider = make(url)
    group = fresh()
    key = f"{provider._prefix}{group}.json"
    try:
        assert await asyncio.to_thread(provider._store.put, key, {"token": "x"}) is not None
        with pytest.raises(ProviderError, match="not a multilock record"):
            await provider.get_leader(group)
        with pytest.raises(ProviderError, match="not a multilock record"):
            await provider.try_acquire(group, "p1", LEASE, {})
    finally:
        await provider.aclose()


async def test_a_fresh_provider_observes_a_full_lease_before_calling_it_expired(
    url: str,
) -> None:
    holder, fresh_eyes = make(url), make(url)
    group = fresh()
    try:
        info = await holder.try_acquire(group, "p1", LEASE, {})
        assert info is not None
        # The holder stops renewing (a crash). Wait well past its lease before looking.
        await asyncio.sleep(LEASE * 1.5)
        first_look = time.monotonic()
        leader = await fresh_eyes.get_leader(group)
        assert leader is not None, "a provider that never saw the object called it expired"
        assert leader.token == info.token
        assert await fresh_eyes.try_acquire(group, "p2", LEASE, {}) is None
        while (leader := await fresh_eyes.get_leader(group)) is not None:
            assert time.monotonic() - first_look < LEASE * 3, "never judged expired"
            await asyncio.sleep(0.02)
        observed = time.monotonic() - first_look
        assert LEASE <= observed <= LEASE + 0.5, f"judged expired after {observed:.3f} s"
        taken = await fresh_eyes.try_acquire(group, "p2", LEASE, {})
        assert taken is not None
        assert taken.token == info.token + 1
        assert not await holder.renew(group, "p1", info.token, LEASE, {})  # its If-Match: 412
    finally:
        await holder.aclose()
        await fresh_eyes.aclose()


async def test_watch_yields_at_observed_expiry_not_on_renewals(url: str) -> None:
    leader, follower = make(url), make(url, poll_interval=0.1)
    group = fresh()
    info = await leader.try_acquire(group, "p1", LEASE, {})
    assert info is not None
    woke: list[float] = []
    changed = asyncio.Event()

    async def follow() -> None:
        async for _ in follower.watch(group):
            woke.append(time.monotonic())
            changed.set()

    following = asyncio.ensure_future(follow())
    try:
        async with asyncio.timeout(5):
            await changed.wait()  # the first read always yields
        renewals = 0
        end = time.monotonic() + LEASE * 2
        while time.monotonic() < end:
            assert await leader.renew(group, "p1", info.token, LEASE, {})
            stopped = time.monotonic()  # the leader's last write has come back
            renewals += 1
            await asyncio.sleep(LEASE / 4)
        assert renewals >= 6
        assert len(woke) == 1, f"the watch yielded {len(woke) - 1} times on mere renewals"
        deadline = time.monotonic() + LEASE * 3
        while len(woke) < 2:
            assert time.monotonic() < deadline, "the watch never announced the expiry"
            await asyncio.sleep(0.01)
        waited = woke[1] - stopped
        assert LEASE * 0.9 <= waited <= LEASE + 0.3, f"expiry announced after {waited:.3f} s"
        assert await follower.get_leader(group) is None
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        await leader.aclose()
        await follower.aclose()


async def test_crashed_leader_is_replaced_within_one_to_two_leases(url: str) -> None:
    crashed, successor_provider = make(url), make(url, poll_interval=0.25)
    group = fresh()
    info = await crashed.try_acquire(group, "dead", LEASE, {})
    assert info is not None
    last_write = time.monotonic()
    election = LeaderElection(
        successor_provider,
        group=group,
        participant_id="heir",
        lease_duration=LEASE,
        renew_interval=LEASE / 4,
        retry_interval=LEASE,
    )
    try:
        async with election:
            async with asyncio.timeout(LEASE * 4):
                leadership = await election.wait_until_leader()
            took = time.monotonic() - last_write
        assert leadership.token == info.token + 1
        assert LEASE <= took <= 2 * LEASE, f"took over {took:.3f} s after the last write"
    finally:
        await crashed.aclose()
        await successor_provider.aclose()


async def test_idle_follower_store_operations(url: str) -> None:
    poll = 0.5
    leader_provider, follower_provider = make(url), make(url, poll_interval=poll)
    group = fresh()
    options: dict[str, Any] = {"group": group, "lease_duration": LEASE * 3}
    leader = LeaderElection(leader_provider, participant_id="leader", **options)
    follower = LeaderElection(follower_provider, participant_id="follower", **options)
    try:
        async with leader:
            async with asyncio.timeout(10):
                await leader.wait_until_leader()
            async with follower:
                await asyncio.sleep(0.5)  # let it settle into following
                before, started = follower_provider.requests_sent, time.monotonic()
                await asyncio.sleep(4.0)
                ops = follower_provider.requests_sent - before
                rate = ops / (time.monotonic() - started)
                assert leader.is_leader
                assert not follower.is_leader
        # Expected: one GET per poll, plus the election's own try every lease.
        expected = 1 / poll + 1 / (LEASE * 3)
        print(f"\nidle follower: {ops} requests in 4 s = {rate:.2f}/s (model {expected:.2f}/s)")
        assert 0.5 * expected <= rate <= expected + 0.75, f"{rate:.2f} requests/s"
    finally:
        await leader_provider.aclose()
        await follower_provider.aclose()
