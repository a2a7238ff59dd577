"""RedisProvider and RedlockProvider against real redis-server processes.

`test_contract.py` runs the provider contract on both through their URLs; here it runs on
the other ways to build them (a caller's client, a list of node URLs, Sentinel, Redlock
with a node down), and on what only Redis has: what a refused acquire leaves on each
server, Redlock's undo after lost replies, restarts, frozen and dead servers, token
seeding, pub/sub and expiry wake-ups.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from harness import BaseServer, Server, require_control
from harness.leading import lead_through
from multilock.core import ProviderError
from multilock.core.testing import PROVIDER_CHECKS, check_provider
from multilock.redis import RedisProvider, RedlockProvider
from multilock.redis._config import DEFAULT_MAX_CONNECTIONS, Settings, client_from_url

LEASE = 1.0
CHECKS = list(PROVIDER_CHECKS)


def group() -> str:
    return f"redis-{uuid.uuid4().hex[:12]}"


async def wait_for(what: str, predicate: Callable[[], Awaitable[bool]], within: float) -> None:
    deadline = time.monotonic() + within
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def frozen(server: BaseServer) -> Iterator[None]:
    """SIGSTOP the server: it keeps its connections but never answers (a hang)."""
    require_control(server)
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def stopped(*servers: BaseServer) -> Iterator[None]:
    for server in servers:
        require_control(server)
        server.stop()
    try:
        yield
    finally:
        for server in servers:
            server.start()


async def next_wake(watch: AsyncIterator[None], within: float) -> float:
    started = time.monotonic()
    async with asyncio.timeout(within):
        await anext(watch)
    return time.monotonic() - started


async def close_watches(
    waiting: list[asyncio.Future[None]], watches: list[AsyncIterator[None]]
) -> None:
    """Cancel the tasks *waiting* on watches, then close the *watches*."""
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for w in watches:
        await w.aclose()  # type: ignore[attr-defined]


# -- the contract, built the other ways --------------------------------------------------


@pytest.mark.parametrize("check", CHECKS)
async def test_contract_redis_on_a_callers_client(redis_server: BaseServer, check: str) -> None:
    clients: list[Redis] = []

    def make() -> RedisProvider:
        clients.append(Redis.from_url(redis_server.url))
        return RedisProvider(clients[-1], key_prefix="client-test:")

    try:
        await check_provider(make, lease_duration=LEASE, only=check)
    finally:
        for client in clients:
            await client.aclose()


@pytest.mark.parametrize("check", CHECKS)
async def test_contract_redlock_on_a_list_of_urls(
    redis_servers: list[BaseServer], check: str
) -> None:
    urls = [server.url for server in redis_servers]
    await check_provider(lambda: RedlockProvider(urls), lease_duration=LEASE, only=check)


@pytest.fixture(scope="class")
def first_node_stopped(redis_servers: list[BaseServer]) -> Iterator[list[BaseServer]]:
    """The Redlock servers with the first one (the one asked first) stopped."""
    with stopped(redis_servers[0]):
        yield redis_servers


class TestRedlockWithTheFirstNodeStopped:
    """One of three servers down: every rule of the contract still holds."""

    @pytest.mark.parametrize("check", CHECKS)
    async def test_contract(self, first_node_stopped: list[BaseServer], check: str) -> None:
        urls = [server.url for server in first_node_stopped]
        await check_provider(lambda: RedlockProvider(urls), lease_duration=LEASE, only=check)


@pytest.fixture(scope="module")
def sentinel(redis_server: BaseServer) -> Iterator[BaseServer]:
    """A Redis Sentinel watching ``redis_server`` as ``mymaster``."""
    binary = getattr(redis_server, "binary", None)  # the harness's RedisServer has one
    if binary is None or redis_server.pid is None:
        pytest.skip("a Sentinel needs a local redis-server binary and a local master")

    class Sentinel(Server):
        kind = "redis-sentinel"

        def prepare(self) -> None:
            (self.dir / "sentinel.conf").write_text(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor mymaster {redis_server.host} {redis_server.port} 1\n"
            )

        def command(self) -> list[str]:
            return [str(binary), str(self.dir / "sentinel.conf"), "--sentinel"]

        @property
        def url(self) -> str:
            return f"redis+sentinel://127.0.0.1:{self.port}/mymaster/0"

        def probe(self) -> None:
            import redis

            client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)
            try:
                assert client.sentinel_master("mymaster")["port"] == redis_server.port
            finally:
                client.close()

    server = Sentinel()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("check", CHECKS)
async def test_contract_through_sentinel(sentinel: BaseServer, check: str) -> None:
    await check_provider(lambda: RedisProvider(sentinel.url), lease_duration=LEASE, only=check)


# -- fixtures for the rest: both providers, fresh each test ---------------------------------


@pytest.fixture(params=["redis", "redlock"])
async def provider(
    request: pytest.FixtureRequest,
) -> AsyncIterator[RedisProvider | RedlockProvider]:
    if request.param == "redis":
        made: RedisProvider | RedlockProvider = RedisProvider(
            request.getfixturevalue("redis_server").url
        )
    else:
        made = RedlockProvider([s.url for s in request.getfixturevalue("redis_servers")])
    async with made:
        yield made


def servers_of(request: pytest.FixtureRequest, provider: object) -> list[BaseServer]:
    if isinstance(provider, RedlockProvider):
        servers: list[BaseServer] = request.getfixturevalue("redis_servers")
        return servers
    return [request.getfixturevalue("redis_server")]


# -- Redlock: majority and bounded rounds ---------------------------------------------------


async def test_redlock_is_refused_with_two_of_three_down(redis_servers: list[BaseServer]) -> None:
    async with RedlockProvider([s.url for s in redis_servers]) as p:
        g = group()
        held = await p.try_acquire(g, "p1", 30.0, {})
        assert held is not None
        with stopped(*redis_servers[:2]):
            for call in [
                lambda: p.try_acquire(group(), "p2", LEASE, {}),
                lambda: p.renew(g, "p1", held.token, 30.0, {}),
                lambda: p.get_leader(g),
            ]:
                started = time.monotonic()
                with pytest.raises(ProviderError, match="redlock"):
                    await call()
                assert time.monotonic() - started < 2.0
        # The surviving node kept the lease, but one node is not a majority: after the
        # restart (which forgot the other two), nobody holds the group.
        assert await p.get_leader(g) is None
        taken = await p.try_acquire(g, "p2", LEASE, {})
        assert taken is not None
        assert taken.token > held.token
        await p.release(g, "p2", taken.token)


@pytest.mark.parametrize("which", [0, 1])
async def test_redlock_round_with_a_frozen_node_stays_within_the_lease(
    redis_servers: list[BaseServer], which: int
) -> None:
    async with RedlockProvider([s.url for s in redis_servers]) as p:
        assert await p.get_leader(group()) is None  # connect to every node first
        g = group()
        with frozen(redis_servers[which]):
            started = time.monotonic()
            info = await p.try_acquire(g, "p1", 2.0, {})
            # The frozen node costs one per-node timeout (a fifth of the lease), no more.
            assert time.monotonic() - started < 2.0 / 5 + 0.3
            assert info is not None
            started = time.monotonic()
            assert await p.renew(g, "p1", info.token, 2.0, {})
            assert time.monotonic() - started < 2.0 / 5 + 0.3
            started = time.monotonic()
            assert await p.get_leader(g) is not None
            assert time.monotonic() - started < 0.3  # a majority answered: no wait
            assert await p.try_acquire(g, "p2", 2.0, {}) is None
        await p.release(g, "p1", info.token)


# -- a live term is never joined -----------------------------------------------------------


def lease_key(g: str) -> str:
    return f"multilock:{{{g}}}:lease"


#: One server's lease record of a group and its PTTL (-2: no lease).
LeaseState = tuple[dict[Any, Any], int]


async def lease_state(servers: list[BaseServer], g: str) -> list[LeaseState]:
    """Each server's lease record of *g* and its PTTL."""
    state = []
    for server in servers:
        async with Redis.from_url(server.url) as client:
            state.append((await client.hgetall(lease_key(g)), await client.pttl(lease_key(g))))
    return state


def assert_untouched(before: list[LeaseState], after: list[LeaseState]) -> None:
    """The same records, and no PTTL raised: nothing rewrote or extended a lease."""
    for (record, ttl), (record_after, ttl_after) in zip(before, after, strict=True):
        assert record
        assert record_after == record
        assert 0 < ttl_after <= ttl


def lose_replies(
    monkeypatch: pytest.MonkeyPatch, provider: RedlockProvider, index: int, *, sent: bool
) -> list[object]:
    """Make node *index* lose its acquire replies: its script runs (if *sent*), then the
    caller gets `ProviderError`, as after a timeout or a dropped connection. Returns the
    list the lost replies go to."""
    node = provider._nodes[index]
    acquire, lost = node.acquire, list[object]()

    async def lossy(*args: Any, **kwargs: Any) -> None:
        if sent:
            lost.append(await acquire(*args, **kwargs))
        raise ProviderError(f"the reply of node {index} was lost")

    monkeypatch.setattr(node, "acquire", lossy)
    return lost


@pytest.mark.parametrize("kind", ["redis", "redlock"])
async def test_the_same_participant_id_never_joins_a_live_term(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Two processes configured with one participant id: the second is refused, and so is
    a repeat by the holder, and neither extends the lease or rewrites its metadata."""
    if kind == "redis":
        servers: list[BaseServer] = [request.getfixturevalue("redis_server")]
    else:
        servers = request.getfixturevalue("redis_servers")
    urls = [s.url for s in servers]

    def make() -> RedisProvider | RedlockProvider:
        return RedisProvider(urls[0]) if kind == "redis" else RedlockProvider(urls)

    g = group()
    async with make() as p, make() as q:
        first = await p.try_acquire(g, "p1", 5.0, {"instance": "a"})
        assert first is not None
        before = await lease_state(servers, g)
        # A longer lease and other metadata than the term's: writing either would show.
        assert await q.try_acquire(g, "p1", 60.0, {"instance": "b"}) is None
        assert await p.try_acquire(g, "p1", 60.0, {"instance": "c"}) is None
        assert_untouched(before, await lease_state(servers, g))
        # How the election takes up a term whose reply it lost: get_leader, then renew.
        leader = await q.get_leader(g)
        assert leader is not None
        assert (leader.participant_id, leader.token) == ("p1", first.token)
        assert leader.metadata == {"instance": "a"}
        assert await p.renew(g, "p1", first.token, 5.0, {"instance": "a"})
        await p.release(g, "p1", first.token)


async def test_redlock_majority_refuses_the_same_participant_id(
    redis_servers: list[BaseServer],
) -> None:
    """Node 0 lost the lease (a restart without data): the second provider gets node 0,
    the majority that holds the term refuses it and writes nothing, and the undo frees
    node 0 again."""
    urls = [s.url for s in redis_servers]
    g = group()
    async with RedlockProvider(urls) as p, RedlockProvider(urls) as q:
        first = await p.try_acquire(g, "p1", 5.0, {"instance": "a"})
        assert first is not None
        async with Redis.from_url(urls[0]) as client:
            assert await client.delete(lease_key(g)) == 1
        before = await lease_state(redis_servers[1:], g)
        assert await q.try_acquire(g, "p1", 60.0, {"instance": "b"}) is None
        assert_untouched(before, await lease_state(redis_servers[1:], g))
        assert await lease_state(redis_servers[:1], g) == [({}, -2)]
        leader = await p.get_leader(g)
        assert leader is not None
        assert (leader.token, leader.metadata) == (first.token, {"instance": "a"})
        assert await p.renew(g, "p1", first.token, 5.0, {"instance": "a"})
        await p.release(g, "p1", first.token)


async def test_redlock_undo_after_a_lost_reply_spares_a_lease_of_the_same_id(
    redis_servers: list[BaseServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The undo cannot tell from a lost reply whether the node refused: it must delete
    only this attempt's lease, never the term that the same participant id holds there,
    whatever the tokens (node 0 came back from an old snapshot: no lease, a counter far
    behind, so this attempt's tokens are below the term's)."""
    urls = [s.url for s in redis_servers]
    g = group()
    async with RedlockProvider(urls) as p, RedlockProvider(urls) as q:
        first = await p.try_acquire(g, "p1", 30.0, {"instance": "a"})
        assert first is not None
        async with Redis.from_url(urls[0]) as client:
            await client.delete(lease_key(g))
            await client.set(f"multilock:{{{g}}}:token", first.token - 1000)
        before = await lease_state(redis_servers[1:], g)
        lost = lose_replies(monkeypatch, q, 1, sent=True)
        assert await q.try_acquire(g, "p1", 30.0, {"instance": "b"}) is None
        assert lost == [None], "node 1 should have refused (its reply then lost)"
        assert_untouched(before, await lease_state(redis_servers[1:], g))
        assert await lease_state(redis_servers[:1], g) == [({}, -2)]
        assert await p.renew(g, "p1", first.token, 30.0, {"instance": "a"})
        await p.release(g, "p1", first.token)


async def test_redlock_undoes_a_lease_whose_reply_was_lost(
    redis_servers: list[BaseServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node granted but its reply was lost: after a won round the stray lease there is
    undone in the background (it would otherwise block that node for a whole lease),
    and the term stays on the majority that confirmed it."""
    urls = [s.url for s in redis_servers]
    g = group()
    async with RedlockProvider(urls) as p:
        lost = lose_replies(monkeypatch, p, 1, sent=True)
        info = await p.try_acquire(g, "p1", 30.0, {"instance": "a"})
        assert info is not None
        assert len(lost) == 1
        assert lost[0] is not None, "node 1 should have granted"

        async def stray_undone() -> bool:
            return (await lease_state(redis_servers[1:2], g)) == [({}, -2)]

        await wait_for("the stray lease on node 1 to be undone", stray_undone, 2.0)
        for record, ttl in await lease_state(redis_servers[::2], g):
            assert record[b"token"] == str(info.token).encode()
            assert ttl > 0
        leader = await p.get_leader(g)
        assert leader is not None
        assert leader.token == info.token
        await p.release(g, "p1", info.token)


async def test_redlock_undoes_every_lease_of_a_failed_round(
    redis_servers: list[BaseServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 granted and its reply was lost, node 2 never got the request: no majority,
    so the round raises, and nothing of it is left on any node."""
    urls = [s.url for s in redis_servers]
    g = group()
    async with RedlockProvider(urls) as p:
        lost = lose_replies(monkeypatch, p, 1, sent=True)
        lose_replies(monkeypatch, p, 2, sent=False)
        with pytest.raises(ProviderError, match="majority"):
            await p.try_acquire(g, "p1", 30.0, {})
        assert len(lost) == 1
        assert lost[0] is not None, "node 1 should have granted"
        assert await lease_state(redis_servers, g) == [({}, -2)] * 3


async def test_redlock_wakes_once_per_event_at_its_majority_and_takes_it_past_a_laggard(
    redis_servers: list[BaseServer],
) -> None:
    """The holder's release runs on node 0 last (Redis orders commands per connection,
    not across clients). The watch wakes once per event, when a majority of the nodes
    has published it, never at the first copy; and the follower it wakes then takes a
    majority although node 0, the first it asks, still refuses."""
    urls = [s.url for s in redis_servers]
    g, marker = group(), group()
    async with RedlockProvider(urls) as p, RedlockProvider(urls) as q:
        notified: list[str] = []
        notify = q._notifications.notify

        def record(name: str) -> None:
            notified.append(name)
            notify(name)

        q._notifications.notify = record  # type: ignore[method-assign]
        watch = q.watch(g)
        await next_wake(watch, 5.0)  # subscribed on every node

        async def heard(*nodes: int) -> None:
            """Wait until the listener has read all that *nodes* published so far: a
            message with no attempt id, published after it, notifies at every copy."""
            expected = notified.count(marker) + len(nodes)
            for i in nodes:
                async with Redis.from_url(urls[i]) as client:
                    await client.publish(f"multilock:{{{marker}}}:changed", "released")

            async def done() -> bool:
                return notified.count(marker) == expected

            await wait_for("the marker messages", done, 5.0)

        first = await p.try_acquire(g, "p1", 30.0, {})
        assert first is not None
        await heard(0, 1, 2)
        assert notified.count(g) == 1, "the acquire, on three nodes, notifies once"
        await p._nodes[1].release(g, "p1", first.token)
        await heard(1)
        assert notified.count(g) == 1, "a release on one node of three is no event yet"
        await p._nodes[2].release(g, "p1", first.token)
        await heard(2)
        assert notified.count(g) == 2, "the release shows on a majority: wake up"
        second = await q.try_acquire(g, "q1", 30.0, {})
        assert second is not None, "nodes 1 and 2 are free: node 0's refusal must not stop it"
        assert second.token > first.token
        [(record0, _)] = await lease_state(redis_servers[:1], g)
        assert record0[b"participant"] == b"p1"  # node 0 still has the old lease
        await heard(0, 1, 2)
        assert notified.count(g) == 3
        await p._nodes[0].release(g, "p1", first.token)  # the laggard's copy, at last
        await heard(0)
        assert notified.count(g) == 3
        leader = await p.get_leader(g)
        assert leader is not None
        assert (leader.participant_id, leader.token) == ("q1", second.token)
        await watch.aclose()  # type: ignore[attr-defined]
        await q.release(g, "q1", second.token)


# -- tokens across restarts ------------------------------------------------------------------


async def token_key_exists(server: BaseServer, g: str) -> bool:
    async with Redis.from_url(server.url) as client:
        return bool(await client.exists(f"multilock:{{{g}}}:token"))


@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "appendonly"])
async def test_tokens_keep_rising_across_a_restart(
    request: pytest.FixtureRequest, persistent: bool
) -> None:
    server: BaseServer = request.getfixturevalue(
        "redis_persistent_server" if persistent else "redis_server"
    )
    require_control(server)
    g = group()
    async with RedisProvider(server.url) as p:
        tokens = []
        for participant in ["p1", "p2"]:
            info = await p.try_acquire(g, participant, 30.0, {})
            assert info is not None
            tokens.append(info.token)
            await p.release(g, participant, info.token)
        held = await p.try_acquire(g, "p3", 30.0, {})
        assert held is not None
        tokens.append(held.token)
        server.restart()
        # Without persistence the lease and the counter are gone; with it both are kept.
        assert await token_key_exists(server, g) is persistent
        leader = await p.get_leader(g)
        assert (leader is not None and leader.token == held.token) is persistent
        if persistent:
            await p.release(g, "p3", held.token)
        info = await p.try_acquire(g, "p4", 30.0, {})
        assert info is not None
        tokens.append(info.token)
        await p.release(g, "p4", info.token)
    assert tokens == sorted(set(tokens)), f"tokens did not strictly rise: {tokens}"


@pytest.mark.parametrize("restart", [1, 2, 3])
async def test_redlock_tokens_keep_rising_when_nodes_restart(
    redis_servers: list[BaseServer], restart: int
) -> None:
    """A minority restarting keeps the counters of a majority; a majority restarting
    reseeds from the servers' clocks (one machine here, so they agree)."""
    g = group()
    async with RedlockProvider([s.url for s in redis_servers]) as p:
        first = await p.try_acquire(g, "p1", 30.0, {})
        assert first is not None
        await p.release(g, "p1", first.token)
        for server in redis_servers[:restart]:
            require_control(server).restart()
        tokens = [first.token]
        for participant in ["p2", "p3"]:
            info = await p.try_acquire(g, participant, 30.0, {})
            assert info is not None
            tokens.append(info.token)
            await p.release(g, participant, info.token)
    assert tokens == sorted(set(tokens)), f"tokens did not strictly rise: {tokens}"


# -- watch --------------------------------------------------------------------------------------


async def test_watch_wakes_when_the_lease_expires(
    provider: RedisProvider | RedlockProvider,
) -> None:
    g = group()
    acquired = time.monotonic()
    assert await provider.try_acquire(g, "p1", LEASE, {}) is not None
    watch = provider.watch(g)
    try:
        while await provider.get_leader(g) is not None:
            await next_wake(watch, LEASE + 1.0)
            assert time.monotonic() - acquired < LEASE + 0.5, "woke late"
        assert time.monotonic() - acquired >= LEASE * 0.9, "the lease ended early"
    finally:
        await watch.aclose()  # type: ignore[attr-defined]


async def test_watch_wakes_on_a_new_term_and_on_release(
    provider: RedisProvider | RedlockProvider,
) -> None:
    g = group()
    watch = provider.watch(g)
    try:
        await next_wake(watch, 2.0)  # subscribed
        wake = asyncio.ensure_future(anext(watch))
        await asyncio.sleep(0.2)
        assert not wake.done(), "woke with nothing to report"
        info = await provider.try_acquire(g, "p1", 30.0, {})
        assert info is not None
        async with asyncio.timeout(1.0):
            await wake
        await provider.release(g, "p1", info.token)
        released = time.monotonic()
        while await provider.get_leader(g) is not None:
            await next_wake(watch, 1.0)
        assert time.monotonic() - released < 1.0
    finally:
        await watch.aclose()  # type: ignore[attr-defined]


async def test_closing_the_watch_unsubscribes(
    request: pytest.FixtureRequest, provider: RedisProvider | RedlockProvider
) -> None:
    clients = [Redis.from_url(s.url) for s in servers_of(request, provider)]

    async def patterns() -> list[int]:
        return [await c.pubsub_numpat() for c in clients]

    try:
        before = await patterns()
        watch = provider.watch(group())
        await next_wake(watch, 2.0)

        async def subscribed() -> bool:
            return await patterns() == [n + 1 for n in before]

        await wait_for("the watch to subscribe", subscribed, 2.0)
        await watch.aclose()  # type: ignore[attr-defined]

        async def unsubscribed() -> bool:
            return await patterns() == before

        await wait_for("the watch to unsubscribe", unsubscribed, 2.0)
    finally:
        for client in clients:
            await client.aclose()


async def drain(wake: Awaitable[None], watch: AsyncIterator[None]) -> None:
    """Await the pending wake, then any later ones, for at most 3 s."""
    async with asyncio.timeout(3.0):
        await wake
        while True:
            await anext(watch)


async def test_a_broken_subscription_raises_provider_error(redis_server: BaseServer) -> None:
    require_control(redis_server)
    async with RedisProvider(redis_server.url) as p:
        watch = p.watch(group())
        await next_wake(watch, 2.0)
        wake = asyncio.ensure_future(anext(watch))
        try:
            with stopped(redis_server):
                started = time.monotonic()
                # The listener breaks, or the lease read that follows a wake-up fails first.
                with pytest.raises(ProviderError, match=r"subscription|listener|pttl failed"):
                    await drain(wake, watch)
                assert time.monotonic() - started < 2.0
        finally:
            await watch.aclose()  # type: ignore[attr-defined]


# -- one provider, many elections: a constant number of connections ----------------------------


def named(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}client_name={name}"


async def connections(client: Redis, name: str) -> tuple[int, int]:
    """The server's connections named *name*: all of them, and those subscribed."""
    mine = [c for c in await client.client_list() if c.get("name") == name]
    return len(mine), sum(1 for c in mine if int(c["sub"]) + int(c["psub"]) > 0)


@pytest.mark.parametrize("kind", ["redis", "redlock"])
async def test_watches_of_many_groups_share_one_connection_per_server(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """55 watches (50 groups, 5 more on one) use one subscription per server; a release
    wakes the watches of its group, a renewal wakes none."""
    servers: list[BaseServer] = (
        [request.getfixturevalue("redis_server")]
        if kind == "redis"
        else request.getfixturevalue("redis_servers")
    )
    name = f"watch-{uuid.uuid4().hex[:8]}"
    urls = [named(s.url, name) for s in servers]
    watcher = RedisProvider(urls[0]) if kind == "redis" else RedlockProvider(urls)
    other = (
        RedisProvider(servers[0].url)
        if kind == "redis"
        else RedlockProvider([s.url for s in servers])
    )
    admins = [Redis.from_url(s.url, decode_responses=True) for s in servers]
    groups = [group() for _ in range(50)]
    held, quiet = groups[0], groups[1]
    watches: list[AsyncIterator[None]] = []
    woken: list[asyncio.Future[None]] = []
    try:
        info = await other.try_acquire(held, "p1", 30.0, {})
        assert info is not None
        for g in [*groups, *[held] * 5]:
            watches.append(watcher.watch(g))
        async with asyncio.timeout(5.0):  # every watch subscribed and made its first read
            await asyncio.gather(*(anext(w) for w in watches))
        # Redlock's watches are ready once a quorum of nodes is subscribed: the last node
        # may still be connecting (the CI run of this test once saw it so, under load).
        async with asyncio.timeout(5.0):
            while not all([(await connections(a, name))[1] for a in admins]):
                await asyncio.sleep(0.01)
        for admin in admins:
            total, subscribed = await connections(admin, name)
            assert subscribed == 1, f"{subscribed} subscribed connections for 55 watches"
            assert total <= 1 + DEFAULT_MAX_CONNECTIONS, f"{total} connections"
        of_held = [w for g, w in zip([*groups, *[held] * 5], watches, strict=True) if g == held]
        woken += [asyncio.ensure_future(anext(w)) for w in of_held]
        assert await other.renew(held, "p1", info.token, 30.0, {})
        # The messages of one connection arrive in order: once a later release of another
        # group has woken its watch, a message of the renewal would have arrived too.
        quiet_info = await other.try_acquire(quiet, "p1", 30.0, {})
        assert quiet_info is not None
        await next_wake(watches[1], 2.0)
        await asyncio.sleep(0.1)
        assert not any(t.done() for t in woken), "a renewal woke a watch"
        await other.release(held, "p1", info.token)
        async with asyncio.timeout(2.0):
            await asyncio.gather(*woken)
    finally:
        await close_watches(woken, watches)
        await watcher.aclose()
        await other.aclose()
        for admin in admins:
            await admin.aclose()


def pttls_sent(provider: RedisProvider) -> list[list[str]]:
    """Record the keys of each PTTL read *provider* sends from now on: one alone, or a
    pipeline's."""
    client, sent = provider._node.client, []
    single, pipeline = client.pttl, client.pipeline

    def pttl(key: str) -> Any:
        sent.append([key])
        return single(key)

    def piped(*args: Any, **kwargs: Any) -> Any:
        pipe = pipeline(*args, **kwargs)
        execute = pipe.execute

        async def counted(*args: Any, **kwargs: Any) -> Any:
            keys = [c[0][1] for c in pipe.command_stack if c[0][0] == "PTTL"]
            if keys:
                sent.append(keys)
            return await execute(*args, **kwargs)

        pipe.execute = counted  # type: ignore[method-assign]
        return pipe

    client.pttl, client.pipeline = pttl, piped  # type: ignore[method-assign]
    return sent


async def test_watches_opening_at_once_read_their_leases_in_one_pipeline(
    redis_server: BaseServer,
) -> None:
    # A process starting 10,000 elections opens 10,000 watches, and each reads once how
    # long its group's lease has left (PTTL): the first read goes at once, alone; those
    # asked for while it is on its way go together after it, in one pipeline.
    groups = [group() for _ in range(20)]
    watches: list[AsyncIterator[None]] = []
    waiting: list[asyncio.Future[None]] = []
    async with RedisProvider(redis_server.url) as holder, RedisProvider(redis_server.url) as p:
        for g in groups:
            assert await holder.try_acquire(g, "h", 30.0, {}) is not None
        reads = pttls_sent(p)
        try:
            watches += [p.watch(g) for g in groups]
            async with asyncio.timeout(5.0):  # subscribed: each watch yields once at once
                await asyncio.gather(*(anext(w) for w in watches))
            # Then each reads when its lease ends, and waits for that (or a message).
            waiting += [asyncio.ensure_future(anext(w)) for w in watches]
            await wait_for("the reads", lambda: asyncio.sleep(0, sum(map(len, reads)) == 20), 5)
            assert [len(r) for r in reads] == [1, 19], "not the first alone, then the rest"
            assert sorted(k for r in reads for k in r) == sorted(lease_key(g) for g in groups)
            await asyncio.sleep(0.1)
            assert not any(w.done() for w in waiting), "a watch woke with its lease live"
        finally:
            await close_watches(waiting, watches)


@pytest.mark.parametrize("kind", ["redis", "redlock"])
async def test_a_watch_closed_while_it_subscribes_stops_its_listener_at_once(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Close a watch after 0, 1, 2... turns of the loop, through its connect and subscribe.

    Before: cancelled just as redis-py's subscribe call finished, the listener went on
    waiting for messages (Python 3.11's ``wait_for`` swallowed the cancellation), so the
    provider's ``aclose`` waited 5 s for it and left it running with its connection.
    """
    servers: list[BaseServer] = (
        [request.getfixturevalue("redis_server")]
        if kind == "redis"
        else request.getfixturevalue("redis_servers")
    )
    slow: list[int] = []
    for turns in range(40):
        provider = (
            RedisProvider(servers[0].url)
            if kind == "redis"
            else RedlockProvider([s.url for s in servers])
        )
        watch = provider.watch(group())
        first = asyncio.ensure_future(anext(watch))
        for _ in range(turns):
            await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        try:
            async with asyncio.timeout(2.0):
                await watch.aclose()  # type: ignore[attr-defined]
                await provider.aclose()
        except TimeoutError:
            slow.append(turns)
    assert not slow, f"closing after these loop turns waited for the listener: {slow}"


async def test_many_concurrent_calls_share_a_bounded_pool(redis_server: BaseServer) -> None:
    name = f"pool-{uuid.uuid4().hex[:8]}"
    admin = Redis.from_url(redis_server.url, decode_responses=True)
    async with RedisProvider(named(redis_server.url, name)) as p:
        try:
            calls = [p.get_leader(group()) for _ in range(300)]
            assert await asyncio.gather(*calls) == [None] * 300
            total, _ = await connections(admin, name)
            assert 0 < total <= DEFAULT_MAX_CONNECTIONS
        finally:
            await admin.aclose()


def pttl_reads(node: Any) -> list[str]:
    """The groups whose lease *node* reads from now on (its PTTL reads, counted)."""
    reads: list[str] = []
    read = node._pttl

    async def counted(group: str) -> float | None:
        reads.append(group)
        return await read(group)

    node._pttl = counted
    return reads


async def test_a_leaders_renewals_spare_its_own_watch_the_expiry_reads(
    redis_server: BaseServer,
) -> None:
    # A leader's own election watches its group too. Renewals publish nothing, so without
    # a note of them that watch would read the lease's PTTL once per lease, when the
    # expiry it last heard of came: a read per lease per group, a quarter of all calls
    # of a process leading many groups. A successful renewal notes the new expiry.
    async with RedisProvider(redis_server.url) as provider:
        node = provider._node
        reads = pttl_reads(node)
        await lead_through(provider, group(), leases=3)
        assert len(reads) <= 1, f"the leader's watch read the lease {len(reads)} times"


async def test_a_cancelled_renewal_notes_no_new_end(redis_server: BaseServer) -> None:
    # A renewal cancelled while the server holds it (its outcome unknown) must not note
    # the end it asked for: the watches here would trust a lease the store may not have.
    # The next expiry question reads PTTL, and the connection serves the next call.
    name = group()
    async with (
        RedisProvider(redis_server.url) as provider,
        Redis.from_url(redis_server.url) as admin,
    ):
        node = provider._node
        info = await provider.try_acquire(name, "a", 5.0, {})
        assert info is not None
        await admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
        try:
            renewal = asyncio.ensure_future(provider.renew(name, "a", info.token, 60.0, {}))
            deadline = time.monotonic() + 5
            while int((await admin.info("clients"))["blocked_clients"]) < 1:
                assert time.monotonic() < deadline, "the renewal never reached the server"
                assert not renewal.done(), renewal
                await asyncio.sleep(0.01)
            renewal.cancel()
            with pytest.raises(asyncio.CancelledError):
                await renewal
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        assert name not in node._hints, f"a cancelled renewal noted {node._hints[name]}"
        reads = pttl_reads(node)
        left = await node.expires_in(name)
        assert reads == [name], "the expiry was answered without asking the store"
        assert left is not None, "the lease, live for 5 s, was not found"
        assert await provider.renew(name, "a", info.token, 5.0, {}) is True


async def test_a_connection_freed_for_a_waiter_that_left_goes_to_the_next(
    redis_server: BaseServer,
) -> None:
    # Two tasks wait for a connection of a full pool; one is freed, and the task it was
    # meant for is cancelled (its call timed out) before it resumes. The other must get
    # it now, not wait for the pool's timeout (Python before 3.13 loses that notify).
    client = client_from_url(f"{redis_server.url}?max_connections=2", Settings())
    pool = client.connection_pool
    held = [await pool.get_connection(), await pool.get_connection()]
    first = asyncio.ensure_future(pool.get_connection())
    second = asyncio.ensure_future(pool.get_connection())
    try:
        for _ in range(100):  # a few loop turns until both wait in the pool
            if len(pool._condition._waiters) == 2:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0)
        assert len(pool._condition._waiters) == 2  # type: ignore[attr-defined]
        await pool.release(held.pop())  # notifies the first waiter...
        first.cancel()  # ...which leaves before it resumes
        assert pool.timeout > 2
        got = await asyncio.wait_for(second, 2)
        held.append(got)
        assert first.cancelled()
    finally:
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        for connection in held:
            await pool.release(connection)
        await client.aclose()


async def test_renewals_of_one_loop_turn_share_one_pipeline(redis_server: BaseServer) -> None:
    """40 renewals asked for at once reach the server on one connection; one cancelled
    before its turn ends is not sent, and one with a stale token is refused alone."""
    name = f"renew-{uuid.uuid4().hex[:8]}"
    admin = Redis.from_url(redis_server.url, decode_responses=True)
    try:
        async with RedisProvider(redis_server.url) as first:  # its own connection
            groups = [group() for _ in range(40)]
            terms = await asyncio.gather(*(first.try_acquire(g, "a", 10.0, {}) for g in groups))
        tokens = [t.token for t in terms if t is not None]
        assert len(tokens) == 40
        async with RedisProvider(named(redis_server.url, name)) as p:
            renewals = [
                asyncio.ensure_future(p.renew(g, "a", t + (i == 1), 30.0, {"n": str(i)}))
                for i, (g, t) in enumerate(zip(groups, tokens, strict=True))
            ]
            renewals[0].cancel()  # before the loop turn that sends them ends
            done = await asyncio.gather(*renewals[1:])
            assert done == [False] + [True] * 38
            assert renewals[0].cancelled()
            total, _ = await connections(admin, name)
            assert total == 1, f"{total} connections for one turn's renewals"
            lease = [await admin.pttl(lease_key(g)) for g in groups]
            assert 0 < lease[0] <= 10_000, "cancelled: not sent"
            assert 0 < lease[1] <= 10_000, "a stale token: refused"
            assert min(lease[2:]) > 10_000, "renewed to 30 s"
    finally:
        await admin.aclose()


def pipelines_sent(provider: RedisProvider) -> list[list[str]]:
    """Record the groups of each pipeline of acquires or releases *provider* sends from
    now on (a call that goes alone runs its script, not a pipeline)."""
    node = provider._node
    sent: list[list[str]] = []
    pipeline = node._pipeline

    async def counted(script: Any, calls: list[tuple[list[str], list[str | int]]]) -> list[Any]:
        if script in (node._acquire, node._release):
            sent.append([keys[0].split("{", 1)[1].rsplit("}", 1)[0] for keys, _ in calls])
        return await pipeline(script, calls)

    node._pipeline = counted  # type: ignore[method-assign]
    return sent


async def announced(pubsub: Any, marker: str) -> list[tuple[str, str]]:
    """The (channel, message) pairs *pubsub* got before *marker* was published."""
    got: list[tuple[str, str]] = []
    async with asyncio.timeout(5):
        while True:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
            if message is None:
                continue
            channel, data = message["channel"].decode(), message["data"].decode()
            if data == marker:
                return got
            got.append((channel, data))


async def test_acquires_asked_for_while_one_is_on_its_way_share_one_pipeline(
    redis_server: BaseServer,
) -> None:
    # A process starting many elections: the first acquire goes at once, alone; those
    # asked for while it is on its way go together after it, in one pipeline, on the
    # same connection. A second ask for a group in the batch gets None, as it would right
    # after the first; a group led elsewhere is neither taken nor announced.
    name = f"acquire-{uuid.uuid4().hex[:8]}"
    groups = [group() for _ in range(20)]
    async with (
        RedisProvider(named(redis_server.url, name)) as provider,
        RedisProvider(redis_server.url) as other,
        Redis.from_url(redis_server.url) as admin,
    ):
        held = await other.try_acquire(groups[3], "elsewhere", 30.0, {})
        assert held is not None
        pubsub = admin.pubsub()
        await pubsub.psubscribe("multilock:{*}:changed")
        sent = pipelines_sent(provider)
        asks = [(g, "p1") for g in groups] + [(groups[7], "p2")]
        terms = await asyncio.gather(
            *(provider.try_acquire(g, who, 30.0, {"who": who}) for g, who in asks)
        )
        assert sent == [[g for g, _ in asks[1:]]], "not the first alone, then the rest at once"
        total, _ = await connections(admin, name)
        assert total == 1, f"{total} connections for one process's acquires"
        won = {g: term for (g, _), term in zip(asks, terms, strict=True) if term is not None}
        assert sorted(won) == sorted(g for g in groups if g != groups[3])
        assert terms[-1] is None, "a second ask for a group in one batch took it too"
        for g, term in won.items():
            assert (term.participant_id, term.metadata) == ("p1", {"who": "p1"})
            assert await other.get_leader(g) == term
        assert await other.get_leader(groups[3]) == held
        await admin.publish("multilock:{marker}:changed", "marker")
        got = await announced(pubsub, "marker")
        assert sorted(got) == sorted((f"multilock:{{{g}}}:changed", "acquired 30000") for g in won)
        await pubsub.aclose()


async def test_releases_asked_for_while_one_is_on_its_way_share_one_pipeline(
    redis_server: BaseServer,
) -> None:
    # A process stopping with many groups: the first release goes at once, alone; those
    # asked for while it is on its way go together after it, each by its own token (a
    # stale one releases nothing), and every group released is announced.
    groups = [group() for _ in range(20)]
    async with (
        RedisProvider(redis_server.url) as provider,
        Redis.from_url(redis_server.url) as admin,
    ):
        terms = await asyncio.gather(*(provider.try_acquire(g, "p1", 30.0, {}) for g in groups))
        tokens = [t.token for t in terms if t is not None]
        assert len(tokens) == 20
        pubsub = admin.pubsub()
        await pubsub.psubscribe("multilock:{*}:changed")
        sent = pipelines_sent(provider)
        stale = tokens[5] - 1
        await asyncio.gather(
            *(
                provider.release(g, "p1", stale if i == 5 else t)
                for i, (g, t) in enumerate(zip(groups, tokens, strict=True))
            )
        )
        assert sent == [groups[1:]], "not the first alone, then the rest at once"
        assert await provider.get_leader(groups[5]) == terms[5], "a stale token released it"
        for g in groups[:5] + groups[6:]:
            assert await provider.get_leader(g) is None
        await admin.publish("multilock:{marker}:changed", "marker")
        got = await announced(pubsub, "marker")
        released = groups[:5] + groups[6:]
        assert sorted(got) == sorted((f"multilock:{{{g}}}:changed", "released") for g in released)
        await pubsub.aclose()


async def test_a_renewal_whose_caller_left_before_a_connection_freed_is_not_sent(
    redis_server: BaseServer,
) -> None:
    # Its pipeline waits for the one command connection, held by a call the paused server
    # holds; the renewal's caller gives up meanwhile. Sent later, it would extend a lease
    # its election no longer counts on (and keep others out for nothing).
    name, other = group(), group()
    async with (
        RedisProvider(f"{redis_server.url}?max_connections=2") as provider,
        Redis.from_url(redis_server.url) as admin,
    ):
        info = await provider.try_acquire(name, "a", 5.0, {})
        assert info is not None
        await admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
        try:
            holding = asyncio.ensure_future(provider.try_acquire(other, "a", 5.0, {}))
            deadline = time.monotonic() + 5
            while int((await admin.info("clients"))["blocked_clients"]) < 1:
                assert time.monotonic() < deadline, "the acquire never reached the server"
                await asyncio.sleep(0.01)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(provider.renew(name, "a", info.token, 60.0, {}), 0.2)
            sending = list(provider._node._renewals._sending)
            assert sending, "no pipeline waits for the connection"
        finally:
            await admin.execute_command("CLIENT", "UNPAUSE")
        assert await holding is not None
        await asyncio.wait_for(asyncio.gather(*sending), 5)
        assert 0 < await admin.pttl(lease_key(name)) <= 5_000, "the renewal was sent"


async def test_renewals_reload_their_script_after_a_flush(redis_server: BaseServer) -> None:
    """A server with an empty script cache (a restart, a failover) still renews a batch."""
    async with RedisProvider(redis_server.url) as p:
        groups = [group() for _ in range(5)]
        terms = await asyncio.gather(*(p.try_acquire(g, "a", 10.0, {}) for g in groups))
        admin = Redis.from_url(redis_server.url)
        try:
            await admin.script_flush()
        finally:
            await admin.aclose()
        renewing = (
            p.renew(g, "a", t.token, 10.0, {}) for g, t in zip(groups, terms, strict=True) if t
        )
        assert await asyncio.gather(*renewing) == [True] * 5


async def test_a_failed_pipeline_fails_each_of_its_renewals(redis_server: BaseServer) -> None:
    require_control(redis_server)
    async with RedisProvider(redis_server.url, socket_timeout=0.5) as p:
        groups = [group() for _ in range(5)]
        terms = await asyncio.gather(*(p.try_acquire(g, "a", 10.0, {}) for g in groups))
        with frozen(redis_server):
            renewing = (
                p.renew(g, "a", t.token, 10.0, {}) for g, t in zip(groups, terms, strict=True) if t
            )
            results = await asyncio.gather(*renewing, return_exceptions=True)
        assert [type(r) for r in results] == [ProviderError] * 5
        assert len({id(r.__cause__) for r in results}) == 5, "each caller its own error"


# -- dead and frozen servers, clients ----------------------------------------------------------


async def test_a_dead_server_gives_provider_error_quickly(redis_server: BaseServer) -> None:
    async with RedisProvider(redis_server.url) as p:
        assert await p.get_leader(group()) is None
        with stopped(redis_server):
            for call in [
                lambda: p.try_acquire(group(), "p1", LEASE, {}),
                lambda: p.get_leader("g"),
            ]:
                started = time.monotonic()
                with pytest.raises(ProviderError):
                    await call()
                assert time.monotonic() - started < 2.0
        # Back on the same port: the provider reconnects by itself.
        info = await p.try_acquire(group(), "p1", LEASE, {})
        assert info is not None


async def test_a_frozen_server_gives_provider_error_after_socket_timeout(
    redis_server: BaseServer,
) -> None:
    async with RedisProvider(redis_server.url, socket_timeout=0.5) as p:
        assert await p.get_leader(group()) is None
        with frozen(redis_server):
            started = time.monotonic()
            with pytest.raises(ProviderError, match="redis acquire"):
                await p.try_acquire(group(), "p1", LEASE, {})
            assert time.monotonic() - started < 1.5


async def test_a_callers_client_stays_open(
    redis_server: BaseServer, redis_servers: list[BaseServer]
) -> None:
    clients = [Redis.from_url(s.url) for s in [redis_server, *redis_servers]]
    try:
        providers: list[Any] = [RedisProvider(clients[0]), RedlockProvider(clients[1:])]
        for p in providers:
            info = await p.try_acquire(group(), "p1", LEASE, {})
            assert info is not None
            await p.aclose()
        for client in clients:
            assert await client.ping()
    finally:
        for client in clients:
            await client.aclose()
