"""`AzureBlobProvider` against Azurite: what only a server can show.

The shared contract runs through the ``backend`` fixture (lease 15 s, Azure's minimum).
Here: lease limits, a stale record is never a leader, tokens across release and expiry,
Azure refusing writes without the lease id, lost replies, the watch's wake-ups and the
store operations of an idle follower. Expiry tests wait one real 15 s lease each.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from azure.core.exceptions import HttpResponseError
from azure.storage.blob.aio import BlobClient

from harness import BaseServer
from multilock.azure_blob import AzureBlobProvider
from multilock.core import ConfigurationError, LeaderElection, ProviderError, from_url

LEASE = 15.0


def fresh(prefix: str = "az") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def url(azure_blob_server: BaseServer) -> str:
    return azure_blob_server.url


@pytest.fixture
async def provider(url: str) -> AsyncIterator[AzureBlobProvider]:
    p = from_url(url)
    assert isinstance(p, AzureBlobProvider)
    try:
        yield p
    finally:
        await p.aclose()


def raw_blob(p: AzureBlobProvider, group: str) -> BlobClient:
    """The group's blob through the provider's own client, for what the API hides."""
    return p._store.blob(group)


async def raw_record(p: AzureBlobProvider, group: str) -> dict[str, Any]:
    stream = await raw_blob(p, group).download_blob()
    data: dict[str, Any] = json.loads(await stream.readall())
    return data


async def wait_for(what: str, predicate: Callable[[], Awaitable[bool]], within: float) -> float:
    started = time.monotonic()
    while not await predicate():
        if time.monotonic() - started > within:
            raise AssertionError(f"timed out after {within:g} s waiting for {what}")
        await asyncio.sleep(0.2)
    return time.monotonic() - started


async def test_lease_limits_are_refused(provider: AzureBlobProvider) -> None:
    for bad in [1.0, 14.9, 60.5, 61, 120]:
        with pytest.raises(ConfigurationError, match="15 to 60"):
            LeaderElection(provider, group=fresh(), lease_duration=bad)
    for good in [15, 30.2, 60]:
        LeaderElection(provider, group=fresh(), lease_duration=good)  # no error
    for short in [0.5, 14.99]:
        with pytest.raises(ConfigurationError, match="too short"):
            await provider.try_acquire(fresh(), "p1", short, {})
    # 30.2 s is held as a 31 s lease: never shorter than asked for.
    group = fresh()
    info = await provider.try_acquire(group, "p1", 30.2, {})
    assert info is not None
    props = await raw_blob(provider, group).get_blob_properties()
    assert props.lease.duration == "fixed"
    assert (await raw_record(provider, group))["lease_duration"] == 30.2
    await provider.release(group, "p1", info.token)


async def test_stale_record_is_no_leader_and_tokens_keep_rising(url: str) -> None:
    group = fresh()
    tokens = []
    async with from_url(url) as p, from_url(url) as q:
        first = await p.try_acquire(group, "p1", LEASE, {"k": "v"})
        assert first is not None
        tokens.append(first.token)
        await p.release(group, "p1", first.token)
        assert await q.get_leader(group) is None
        assert isinstance(p, AzureBlobProvider)
        record = await raw_record(p, group)
        assert record["participant"] is None
        assert record["token"] == first.token

        second = await q.try_acquire(group, "p2", LEASE, {})
        assert second is not None
        tokens.append(second.token)
        started = time.monotonic()

        async def nobody() -> bool:
            return await p.get_leader(group) is None

        # p2 never renews: its lease ends, while its record still names it.
        await wait_for("the lease to expire", nobody, LEASE + 10)
        assert time.monotonic() - started >= LEASE * 0.9, "the lease ended early"
        stale = await raw_record(p, group)
        assert stale["participant"] == "p2", "the record was not left stale: test is void"
        assert not await q.renew(group, "p2", second.token, LEASE, {}), "expired lease renewed"
    # A new provider (new lease ids) continues the count kept in the blob.
    async with from_url(url) as r:
        third = await r.try_acquire(group, "p1", LEASE, {})
        assert third is not None
        tokens.append(third.token)
        await r.release(group, "p1", third.token)
    assert len(tokens) == 3, tokens
    assert tokens[0] < tokens[1] < tokens[2], tokens


async def test_writing_without_the_lease_id_is_refused(provider: AzureBlobProvider) -> None:
    group = fresh()
    info = await provider.try_acquire(group, "p1", LEASE, {})
    assert info is not None
    blob = raw_blob(provider, group)
    forged = json.dumps({"participant": "intruder", "token": 999}).encode()
    with pytest.raises(HttpResponseError) as caught:
        await blob.upload_blob(forged, overwrite=True)
    assert caught.value.status_code == 412
    with pytest.raises(HttpResponseError) as caught:
        await blob.upload_blob(forged, overwrite=True, lease=str(uuid.uuid4()))
    assert caught.value.status_code == 412
    leader = await provider.get_leader(group)
    assert leader is not None
    assert (leader.participant_id, leader.token) == ("p1", info.token)
    await provider.release(group, "p1", info.token)


async def test_metadata_round_trip_and_release_clears_it(url: str) -> None:
    group = fresh()
    meta = {"host": "web-1", "unicode": "ünïcødé ✓", "quote": '"}{', "long": "x" * 4000}
    async with from_url(url) as p, from_url(url) as q:
        assert isinstance(p, AzureBlobProvider)
        info = await p.try_acquire(group, "p1", LEASE, meta)
        assert info is not None
        assert dict(info.metadata) == meta
        seen = await q.get_leader(group)
        assert seen is not None
        assert dict(seen.metadata) == meta
        assert seen.acquired_at == info.acquired_at
        assert await p.renew(group, "p1", info.token, LEASE, {"v": "2"})
        seen = await q.get_leader(group)
        assert seen is not None
        assert dict(seen.metadata) == {"v": "2"}
        await p.release(group, "p1", info.token)
        assert (await raw_record(p, group))["metadata"] == {}


class LoseReplies:
    """A response hook that drops the reply of chosen requests after the server acted."""

    def __init__(self) -> None:
        self.armed: Callable[[Any], bool] | None = None

    def __call__(self, response: Any) -> None:
        request = response.http_request
        if self.armed is not None and self.armed(request):
            self.armed = None
            raise OSError("reply lost (test)")


def lease_put(request: Any) -> bool:
    return bool(request.method == "PUT" and "comp=lease" in request.url)


def record_put(request: Any) -> bool:
    # A conditional write of the record (the blob's creation sends If-None-Match).
    return bool(request.method == "PUT" and "If-Match" in request.headers)


async def test_a_term_whose_lease_reply_was_lost_is_found_and_renewed(url: str) -> None:
    group = fresh()
    hook = LoseReplies()
    async with from_url(url, raw_response_hook=hook) as p, from_url(url) as q:
        assert isinstance(p, AzureBlobProvider)
        hook.armed = lease_put
        with pytest.raises(ProviderError, match="reply lost"):
            await p.try_acquire(group, "p1", LEASE, {"instance": "a"})
        assert hook.armed is None, "the hook did not fire"
        # The server gave p1 the lease: it leads, though it does not know it yet.
        leader = await q.get_leader(group)
        assert leader is not None
        assert leader.participant_id == "p1"
        assert dict(leader.metadata) == {"instance": "a"}
        before = (await raw_blob(p, group).get_blob_properties()).etag
        # A retried acquire never joins the live term, not even the one p1 itself took,
        # and writes nothing; neither does another provider with the same participant id.
        assert await p.try_acquire(group, "p1", LEASE, {"instance": "b"}) is None
        assert await q.try_acquire(group, "p1", LEASE, {"instance": "c"}) is None
        assert (await raw_blob(p, group).get_blob_properties()).etag == before
        assert await q.get_leader(group) == leader
        # The election's recovery: the term found by its metadata is renewed with its token,
        # by the provider that took it (only it proposes that lease id).
        assert not await q.renew(group, "p1", leader.token, LEASE, {"instance": "a"})
        assert await p.renew(group, "p1", leader.token, LEASE, {"instance": "a"})
        await p.release(group, "p1", leader.token)
        assert await q.get_leader(group) is None


async def test_acquire_after_a_lost_record_reply_leaves_nothing_held(url: str) -> None:
    group = fresh()
    hook = LoseReplies()
    async with from_url(url, raw_response_hook=hook) as p, from_url(url) as q:
        hook.armed = record_put
        with pytest.raises(ProviderError, match="reply lost"):
            await p.try_acquire(group, "p1", LEASE, {})
        assert hook.armed is None, "the hook did not fire"
        # The record was written, the lease never taken: nobody leads, and the token
        # written for the term that never began is not handed out again.
        assert await q.get_leader(group) is None
        assert isinstance(p, AzureBlobProvider)
        written = (await raw_record(p, group))["token"]
        info = await q.try_acquire(group, "p2", LEASE, {})
        assert info is not None
        assert info.token > written
        await q.release(group, "p2", info.token)


async def test_watch_wakes_when_the_lease_is_due_to_expire(url: str) -> None:
    group = fresh()
    # A long poll interval: the only wake-up left is the one at the lease's end.
    async with from_url(url) as p, from_url(url, poll_interval=120) as q:
        info = await p.try_acquire(group, "p1", LEASE, {})
        assert info is not None
        watch = q.watch(group)
        await anext(watch)
        started = time.monotonic()
        async with asyncio.timeout(LEASE + 10):
            await anext(watch)
        woke = time.monotonic() - started
        assert LEASE * 0.95 <= woke <= LEASE + 2, woke
        assert await q.get_leader(group) is None
        await watch.aclose()  # type: ignore[attr-defined]


async def test_idle_follower_makes_few_store_operations(url: str) -> None:
    group = fresh()
    requests: list[str] = []

    def count(request: Any) -> None:
        requests.append(f"{request.http_request.method} {request.http_request.url}")

    leader_provider = from_url(url)
    follower_provider = from_url(url, raw_request_hook=count)
    options: dict[str, Any] = {"group": group, "lease_duration": LEASE}
    async with (
        leader_provider,
        follower_provider,
        LeaderElection(leader_provider, participant_id="leader", **options) as leader,
    ):
        async with asyncio.timeout(10):
            await leader.wait_until_leader()
        async with LeaderElection(follower_provider, participant_id="idle", **options) as f:
            await asyncio.sleep(1.0)  # startup: a campaign round and the first poll
            before = len(requests)
            await asyncio.sleep(LEASE)
            during = requests[before:]
            assert leader.is_leader
            assert not f.is_leader
    # Per lease: the watch polls every poll_interval (2 s: 8), plus one campaign round
    # (1-2 reads) and maybe a wake at the lease's observed end; a spinner makes hundreds.
    assert 1 <= len(during) <= LEASE / 2.0 + 4, "\n".join(during)


async def test_provider_repr_and_errors_hide_the_key(url: str) -> None:
    from harness.fixtures_azure_blob import KEY

    p = from_url(url)
    try:
        assert KEY not in repr(p)
        assert "***" not in repr(p)
        assert "devstoreaccount1" in repr(p)
    finally:
        await p.aclose()
    dead = from_url(url.replace(url.split("@")[1].split("/")[0], "127.0.0.1:9"), timeout=2)
    try:
        with pytest.raises(ProviderError) as caught:
            await dead.get_leader(fresh())
        assert KEY not in str(caught.value)
    finally:
        await dead.aclose()


async def test_a_release_raced_by_its_own_terms_renew_still_frees_the_group(url: str) -> None:
    group = fresh()
    async with from_url(url) as p:
        assert isinstance(p, AzureBlobProvider)
        info = await p.try_acquire(group, "p1", LEASE, {})
        assert info is not None
        original = p._store.read
        raced: list[str] = []

        async def read_then_renew(name: str) -> Any:
            record = await original(name)
            if not raced:  # the release has read; the term's renew lands before its write
                raced.append(name)
                assert await p.renew(group, "p1", info.token, LEASE, {})
            return record

        p._store.read = read_then_renew  # type: ignore[method-assign]
        try:
            await p.release(group, "p1", info.token)
        finally:
            p._store.read = original  # type: ignore[method-assign]
        assert raced
        assert await p.get_leader(group) is None, "the raced release left the lease held"
        taken = await p.try_acquire(group, "p2", LEASE, {})
        assert taken is not None
        assert taken.token == info.token + 1
        await p.release(group, "p2", taken.token)
