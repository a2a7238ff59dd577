"""`PostgresProvider` on a primary and its standbys (`harness.clusters.postgres`).

It follows the primary through a failover (the URL names every node, libpq picks the
writable one), its watches listen anew on the new primary, and with synchronous
replication an acknowledged term survives the promotion, so tokens keep rising; with
asynchronous replication a term the standby had not received is lost with the primary.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

import harness.clusters  # noqa: F401
from harness.clusters.postgres import PostgresCluster
from harness.servers import NotInstalled
from multilock.core import ProviderError
from multilock.postgres import PostgresProvider

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    try:
        store = PostgresCluster("postgres-sync-test", standbys=2, synchronous=True)
    except NotInstalled as exc:
        pytest.skip(str(exc))
    with store:
        yield store


def fresh() -> str:
    return f"pgc-{uuid.uuid4().hex[:12]}"


async def next_within(watch: AsyncIterator[None], seconds: float) -> float:
    started = time.monotonic()
    async with asyncio.timeout(seconds):
        await anext(watch)
    return time.monotonic() - started


async def until(what: str, call, seconds: float = 15.0):  # type: ignore[no-untyped-def]
    """Retry *call* until it returns without ProviderError (the failover window)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await call()
        except ProviderError:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still failing after {seconds} s") from None
            await asyncio.sleep(0.05)


async def fail_over(cluster: PostgresCluster, kind: str) -> None:
    fault = cluster.store_faults()[kind](random.Random(1), cluster.lease)
    await asyncio.to_thread(fault.heal)
    await asyncio.to_thread(cluster.wait_whole, 30.0)


async def test_an_acknowledged_term_survives_a_crash_and_tokens_keep_rising(
    cluster: PostgresCluster,
) -> None:
    group = fresh()
    async with PostgresProvider.from_url(cluster.url) as provider:
        term = await provider.try_acquire(group, "p1", 30.0, {})
        assert term is not None
        old = cluster.nodes[cluster.primary].name
        await fail_over(cluster, "store-kill-leader")
        assert cluster.nodes[cluster.primary].name != old
        leader = await until("get_leader", lambda: provider.get_leader(group))
        assert leader is not None
        assert (leader.participant_id, leader.token) == ("p1", term.token)
        assert await provider.renew(group, "p1", term.token, 30.0, {})
        await provider.release(group, "p1", term.token)
        again = await provider.try_acquire(group, "p2", 30.0, {})
        assert again is not None
        assert again.token == term.token + 1


async def test_the_watch_listens_anew_on_the_promoted_primary(cluster: PostgresCluster) -> None:
    group = fresh()
    async with (
        PostgresProvider.from_url(cluster.url) as watcher,
        PostgresProvider.from_url(cluster.url) as other,
    ):
        watch = watcher.watch(group)
        await next_within(watch, 10.0)  # listening
        await fail_over(cluster, "store-failover")
        with pytest.raises(ProviderError):  # the LISTEN connection broke with the old primary
            await next_within(watch, 10.0)
        watch = watcher.watch(group)
        await next_within(watch, 10.0)  # listening again, on the new primary
        term = await until("acquire", lambda: other.try_acquire(group, "p1", 60.0, {}))
        assert term is not None
        # A 60 s lease: only the NOTIFY, sent by the new primary, can wake the watch now.
        assert await next_within(watch, 5.0) < 5.0
        await other.release(group, "p1", term.token)
        assert await next_within(watch, 5.0) < 5.0


async def test_asynchronous_replication_loses_a_term_the_standby_had_not_received() -> None:
    try:
        store = PostgresCluster("postgres-async-test", standbys=1, synchronous=False)
    except NotInstalled as exc:
        pytest.skip(str(exc))
    group = fresh()
    with store:
        standby = store.nodes[1]
        async with PostgresProvider.from_url(store.url) as provider:
            assert await provider.get_leader(group) is None  # the table, replicated:
            await asyncio.to_thread(store.wait_whole, 30.0)
            query = "SELECT to_regclass('public.multilock_leases') IS NOT NULL"
            deadline = time.monotonic() + 10.0
            while standby.sql(query) != [(True,)]:
                assert time.monotonic() < deadline, "the standby never got the table"
                await asyncio.sleep(0.05)
            link = store.peer_proxies[store.primary]
            link.blackhole("both")  # the standby hears nothing more from the primary
            term = await provider.try_acquire(group, "p1", 30.0, {})
            assert term is not None  # acknowledged: it is on the primary
            await fail_over(store, "store-kill-leader")
            link.heal()
            assert store.nodes[store.primary] is standby
            # Lost with the primary: the group is free, and the next term repeats the token.
            assert await until("get_leader", lambda: provider.get_leader(group)) is None
            again = await provider.try_acquire(group, "p2", 30.0, {})
            assert again is not None
            assert again.token == term.token
