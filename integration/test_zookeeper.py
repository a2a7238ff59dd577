"""`ZooKeeperProvider` against a real ZooKeeper server: what only a server can show.

The shared contract runs on every backend (test_contract.py); here: a forced session
expiry ends the leader's term at once, a server restart, ordering by sequence number
rather than by name, a create whose reply was lost, a live term left untouched by a
repeated acquire and by another provider with the same participant id, cleanup by
``aclose`` and by the refresh timer, URLs, the session timeout the server granted, and
many groups watched on one session.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from kazoo.client import KazooClient  # type: ignore[import-untyped]

from harness import BaseServer, require_control
from harness.fixtures_zookeeper import four_letter_word
from multilock.core import ConfigurationError, LeaderElection, from_url
from multilock.core.testing import Cluster
from multilock.zookeeper import ZooKeeperProvider
from multilock.zookeeper._watch import Handler, ordered

ROOT = "/multilock"


def fresh(prefix: str = "zk") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def hosts(server: BaseServer) -> str:
    return f"{server.host}:{server.port}"


async def wait_for(
    what: str, predicate: Callable[[], Awaitable[bool] | bool], within: float
) -> float:
    """Poll *predicate* until true; return the seconds it took; fail after *within*."""
    start = time.monotonic()
    while True:
        result = predicate()
        if not isinstance(result, bool):
            result = await result
        if result:
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"timed out after {within:.1f} s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def raw(zookeeper_server: BaseServer) -> AsyncIterator[KazooClient]:
    """A plain kazoo client, to look at and tamper with the tree."""
    client = KazooClient(hosts=hosts(zookeeper_server), timeout=5.0)
    await asyncio.to_thread(client.start, 10)
    yield client
    await asyncio.to_thread(client.stop)
    await asyncio.to_thread(client.close)


def sessions(server: BaseServer) -> dict[int, int]:
    """The server's open sessions (``cons``): session id -> negotiated timeout in ms."""
    found = re.findall(r"sid=0x([0-9a-f]+),.*?\bto=(\d+)", four_letter_word(server.url, "cons"))
    return {int(sid, 16): int(timeout) for sid, timeout in found}


def session_of(provider: ZooKeeperProvider) -> int:
    assert provider.client is not None
    client_id = provider.client.client_id
    assert client_id is not None
    return int(client_id[0])


def children(raw: KazooClient, group: str) -> list[str]:
    names: list[str] = raw.get_children(f"{ROOT}/{group}")
    return names


async def expire_session(server: BaseServer, client: KazooClient) -> None:
    """Expire *client*'s session: a second client with its id and password, then close it."""
    twin = KazooClient(hosts=hosts(server), client_id=client.client_id, timeout=2.0)
    await asyncio.to_thread(twin.start, 10)
    await asyncio.to_thread(twin.stop)
    await asyncio.to_thread(twin.close)


async def test_forced_session_expiry_ends_the_term_at_once(zookeeper_server: BaseServer) -> None:
    group = fresh()
    lease = 9.0  # renew every 3 s: only the watch can end the term within a second
    a = ZooKeeperProvider(hosts(zookeeper_server), session_timeout=lease)
    b = ZooKeeperProvider(hosts(zookeeper_server), session_timeout=lease)
    async with a, b:
        first = LeaderElection(a, group=group, participant_id="a", lease_duration=lease)
        second = LeaderElection(b, group=group, participant_id="b", lease_duration=lease)
        async with first:
            old = await asyncio.wait_for(first.wait_until_leader(), 10)
            async with second:
                await asyncio.sleep(0.3)  # b is following, watching the group
                assert not second.is_leader
                assert a.client is not None
                assert sessions(zookeeper_server)[session_of(a)] == lease * 1000
                started = time.monotonic()
                await expire_session(zookeeper_server, a.client)
                lost = await wait_for("a to stop leading", lambda: not first.is_leader, 5)
                assert lost < 1.5, f"the term ended {lost:.2f} s after the expiry, not at once"
                await wait_for("b to lead", lambda: second.is_leader, 5)
                took = time.monotonic() - started
                assert took < lease / 2, f"failover took {took:.2f} s"
                new = second.leadership
                assert new is not None
                assert new.token > old.token
                # a campaigns again on its new session and gets in line behind b.
                await asyncio.sleep(0.5)
                assert not first.is_leader


async def test_suspended_connection_ends_the_term_and_restart_keeps_tokens_rising(
    zookeeper_server: BaseServer,
) -> None:
    server = require_control(zookeeper_server)
    group = fresh()
    lease = 6.0
    a = ZooKeeperProvider(hosts(server), session_timeout=lease)
    async with a:
        election = LeaderElection(a, group=group, participant_id="a", lease_duration=lease)
        async with election:
            old = await asyncio.wait_for(election.wait_until_leader(), 10)
            await asyncio.to_thread(server.stop)
            try:
                lost = await wait_for("the leader to step down", lambda: not election.is_leader, 5)
                assert lost < lease / 3, f"stepped down {lost:.2f} s after the server stopped"
            finally:
                await asyncio.to_thread(server.start)
            await wait_for("a leader after the restart", lambda: election.is_leader, 20)
            new = election.leadership
            assert new is not None
            assert new.token > old.token, (old.token, new)
    # The group node survived the restart: a fresh provider's term is higher still.
    async with ZooKeeperProvider(hosts(server)) as p:
        info = await p.try_acquire(group, "c", lease, {})
        assert info is not None
        assert new is not None
        assert info.token > new.token
        await p.release(group, "c", info.token)


def test_server_restart_across_processes(zookeeper_server: BaseServer, tmp_path: Path) -> None:
    """Three participant processes; the server stops for two leases and comes back."""
    server = require_control(zookeeper_server)
    lease = 2.0
    with Cluster(server.url, fresh("restart"), size=3, lease=lease, log_dir=tmp_path) as cluster:
        leader, token, _ = cluster.wait_for_leader(30)
        server.stop()
        stopped_at = time.monotonic()
        try:
            deadline = stopped_at + lease + 5
            lost = None
            while lost is None and time.monotonic() < deadline:
                lost = next(
                    (
                        r
                        for r in cluster.records()
                        if r["participant"] == leader.name
                        and r["event"] == "lost"
                        and r["token"] == token
                    ),
                    None,
                )
                time.sleep(0.02)
            assert lost is not None, f"the leader did not step down; logs:\n{cluster.tail()}"
            assert lost["t"] - stopped_at < lease, "stepped down later than the lease"
            time.sleep(max(0.0, stopped_at + 2 * lease - time.monotonic()))
        finally:
            restarting_at = time.monotonic()
            server.start()
        during = [
            r
            for r in cluster.records()
            if r["event"] == "acquired" and stopped_at <= r["t"] <= restarting_at
        ]
        assert not during, f"terms acquired while the server was down: {during}"
        cluster.wait_for_leader(20, newer_than=token)
        report = cluster.check()
        assert report.ok, f"{report.problems}\n{report.describe()}"


async def test_candidates_are_ordered_by_sequence_not_by_name(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    group = fresh()
    path = f"{ROOT}/{group}"
    record = json.dumps({"participant_id": "manual", "metadata": {}}).encode()
    # Created first (lowest sequence), but its name sorts after every hex prefix.
    manual = raw.create(
        f"{path}/zzzz-manual-", record, ephemeral=True, sequence=True, makepath=True
    )
    async with ZooKeeperProvider(hosts(zookeeper_server)) as p:
        assert await p.try_acquire(group, "p1", 8.0, {}) is None
        leader = await p.get_leader(group)
        assert leader is not None
        assert leader.participant_id == "manual"
        raw.delete(manual)
        info = await p.try_acquire(group, "p1", 8.0, {})
        assert info is not None
        # Created after p1 (higher sequence), but its name sorts before p1's.
        later = raw.create(f"{path}/0000-manual-", record, ephemeral=True, sequence=True)
        assert sorted(children(raw, group))[0] == later.rsplit("/", 1)[1]
        assert await p.renew(group, "p1", info.token, 8.0, {})
        leader = await p.get_leader(group)
        assert leader is not None
        assert leader.participant_id == "p1"
        assert leader.token == info.token < int(later[-10:]) + 1
        await p.release(group, "p1", info.token)
        leader = await p.get_leader(group)
        assert leader is not None
        assert leader.participant_id == "manual"
        raw.delete(later)


async def test_a_create_whose_reply_was_lost_is_recognised(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    group = fresh()
    async with ZooKeeperProvider(hosts(zookeeper_server)) as p:
        info = await p.try_acquire(group, "p1", 8.0, {})
        assert info is not None
        node = p._nodes[(group, "p1")]
        # The term's record is stamped in the background; while that write is in doubt a
        # repeated acquire answers None (get_leader finds the term), so let it land first.
        await wait_for("the record stamped", lambda: node.stored is not None, 5)
        # The provider forgets what the create answered, as if the reply had been lost.
        node.name = None
        again = await p.try_acquire(group, "p1", 8.0, {})
        assert again is not None
        assert again.token == info.token
        assert len(children(raw, group)) == 1, children(raw, group)
        # A create that went through on the server while the caller was cancelled is
        # found and undone by its prefix, never left behind as a stranger.
        await p.release(group, "p1", info.token)
        assert children(raw, group) == []


async def test_a_live_term_is_never_rewritten_or_joined(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    """Two processes configured with one participant id, each with its own provider: the
    second gets None and cannot touch the first one's term; the holder's own repeated
    acquire gets its term back as stored, and writes nothing to its node."""
    group = fresh()
    async with (
        ZooKeeperProvider(hosts(zookeeper_server)) as p,
        ZooKeeperProvider(hosts(zookeeper_server)) as q,
    ):
        first = await p.try_acquire(group, "p1", 8.0, {"instance": "a"})
        assert first is not None
        (name,) = children(raw, group)
        path = f"{ROOT}/{group}/{name}"
        await wait_for("the record stamped", lambda: raw.get(path)[1].version == 1, 5)
        before = raw.get(path)
        assert await q.try_acquire(group, "p1", 8.0, {"instance": "b"}) is None
        assert not await q.renew(group, "p1", first.token, 8.0, {"instance": "b"})
        await q.release(group, "p1", first.token)
        again = await p.try_acquire(group, "p1", 8.0, {"instance": "c"})
        assert again == first
        data, stat = raw.get(path)
        assert (data, stat.version, stat.mtime) == (
            before[0],
            before[1].version,
            before[1].mtime,
        ), "a refused or repeated acquire wrote the leader's node"
        assert stat.ephemeralOwner == before[1].ephemeralOwner
        assert await q.get_leader(group) == first
        # A repeated acquire while the stored record is in doubt (a write's reply lost)
        # gets None: the election finds its term with get_leader and takes it up by renew.
        p._nodes[(group, "p1")].stored = None
        assert await p.try_acquire(group, "p1", 8.0, {"instance": "c"}) is None
        assert raw.get(path)[1].version == before[1].version
        assert await p.renew(group, "p1", first.token, 8.0, {"instance": "a"})
        assert await p.try_acquire(group, "p1", 8.0, {"instance": "c"}) == first
        await p.release(group, "p1", first.token)


async def test_a_participant_that_stops_campaigning_leaves_no_node(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    group = fresh()
    lease = 2.0
    async with ZooKeeperProvider(hosts(zookeeper_server)) as p:
        q = ZooKeeperProvider(hosts(zookeeper_server))
        leader = await p.try_acquire(group, "p1", lease * 10, {})
        assert leader is not None
        assert await q.try_acquire(group, "q1", lease, {}) is None  # q1 is now in line
        assert len(children(raw, group)) == 2
        # q1 never calls again: its node goes after one lease, though q's session lives.
        took = await wait_for("q1's node to go", lambda: len(children(raw, group)) == 1, lease * 3)
        assert took > lease * 0.5
        assert q.client is not None
        assert q.client.connected
        assert await q.try_acquire(group, "q2", lease * 10, {}) is None
        await q.aclose()  # aclose deletes at once what q had
        assert len(children(raw, group)) == 1
        await p.release(group, "p1", leader.token)


async def test_url_forms_chroot_and_root(zookeeper_server: BaseServer, raw: KazooClient) -> None:
    chroot = f"/{fresh('chroot')}"
    raw.ensure_path(chroot)
    group = fresh()
    url = f"zookeeper://{hosts(zookeeper_server)}{chroot}?root=/elect&session_timeout=4"
    provider = from_url(url)
    assert isinstance(provider, ZooKeeperProvider)
    async with provider:
        info = await provider.try_acquire(group, "p1", 8.0, {"k": "v"})
        assert info is not None
        assert sessions(zookeeper_server)[session_of(provider)] == 4000  # as the URL asks
        assert len(raw.get_children(f"{chroot}/elect/{group}")) == 1
        await provider.release(group, "p1", info.token)
    zk = from_url(f"zk://{hosts(zookeeper_server)}")
    assert isinstance(zk, ZooKeeperProvider)
    await zk.aclose()
    for bad in ["zookeeper://", "zookeeper://h:1/?nope=1", "zookeeper://h:1/a//b"]:
        with pytest.raises(ConfigurationError):
            from_url(bad)
    secret = from_url("zookeeper://user:s3cret@h:2181")
    assert "s3cret" not in repr(secret)


async def test_an_existing_client_is_used_and_not_closed(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    group = fresh()
    async with ZooKeeperProvider(raw) as p:
        info = await p.try_acquire(group, "p1", 8.0, {})
        assert info is not None
    assert raw.connected
    assert children(raw, group) == []  # aclose removed the node, but not the client
    assert not isinstance(raw.handler, Handler)  # the caller's client keeps its own threads


async def test_a_client_built_here_runs_callbacks_on_its_connection_thread(
    zookeeper_server: BaseServer,
) -> None:
    # Our callbacks only hop to the loop: kazoo's callback threads would add a thread
    # wake-up to every reply and watch event (a handoff's critical path).
    async with ZooKeeperProvider(hosts(zookeeper_server)) as p:
        assert await p.get_leader(fresh()) is None
        assert p.client is not None
        assert isinstance(p.client.handler, Handler)


async def test_session_timeout_must_not_exceed_the_lease(zookeeper_server: BaseServer) -> None:
    p = ZooKeeperProvider(hosts(zookeeper_server), session_timeout=5.0)
    with pytest.raises(ConfigurationError, match="session_timeout"):
        LeaderElection(p, group=fresh(), lease_duration=3.0)
    election = LeaderElection(p, group=fresh(), lease_duration=5.0)
    async with election:
        await asyncio.wait_for(election.wait_until_leader(), 10)
        assert sessions(zookeeper_server)[session_of(p)] == 5000  # what the lease relies on
    await p.aclose()


async def test_a_queued_follower_takes_over_with_its_own_node(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    """As kazoo's recipe: the follower's node waits behind the leader's; when the leader's
    goes, the follower's watch sees it and the queued node leads, with nothing created or
    read (its view says it is lowest); its record is stamped right after."""
    group = fresh()
    a = ZooKeeperProvider(hosts(zookeeper_server), session_timeout=4.0)
    b = ZooKeeperProvider(hosts(zookeeper_server), session_timeout=4.0)
    async with a, b:
        first = LeaderElection(a, group=group, participant_id="a", lease_duration=4.0)
        second = LeaderElection(b, group=group, participant_id="b", lease_duration=4.0)
        async with first:
            old = await asyncio.wait_for(first.wait_until_leader(), 10)
            async with second:
                await wait_for("b to queue", lambda: len(b._views.known(group) or []) == 2, 5)
                (_, queued) = ordered(children(raw, group))[1]
                await first.resign()
                new = await asyncio.wait_for(second.wait_until_leader(), 5)
                assert ordered(children(raw, group))[0] == (new.token, queued)
                assert new.token > old.token
                path = f"{ROOT}/{group}/{queued}"
                await wait_for("b's record", lambda: raw.get(path)[1].version == 1, 5)
                seen = await a.get_leader(group)
                assert seen is not None
                assert (seen.participant_id, seen.token) == ("b", new.token)
                assert seen.acquired_at == new.acquired_at


async def test_the_watched_view_follows_the_leader_node(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    """get_leader answers from the watch's view, which never keeps a node that is gone."""
    group = fresh()
    async with ZooKeeperProvider(hosts(zookeeper_server)) as p:
        q = ZooKeeperProvider(hosts(zookeeper_server))

        async def sees(pid: str | None, meta: dict[str, str] | None = None) -> bool:
            info = await p.get_leader(group)
            if info is None or pid is None:
                return info is None and pid is None
            return info.participant_id == pid and meta in (None, info.metadata)

        async def follow() -> None:
            async for _ in p.watch(group):
                pass

        task = asyncio.create_task(follow())
        try:
            info = await q.try_acquire(group, "q1", 8.0, {"k": "v"})
            assert info is not None
            await wait_for("p's view to hold q1's node", lambda: held(p, group), 5)
            assert await sees("q1", {"k": "v"})
            assert await q.renew(group, "q1", info.token, 8.0, {"k": "w"})
            await wait_for("p to see the new metadata", lambda: sees("q1", {"k": "w"}), 5)
            (name,) = children(raw, group)
            raw.delete(f"{ROOT}/{group}/{name}")  # as ZooKeeper does when q's session ends
            # The deletion is in the view (no read): nobody leads.
            await wait_for("p's view to drop the node", lambda: p._views.known(group) == [], 5)
            assert await sees(None)
            record = json.dumps({"participant_id": "manual", "metadata": {}}).encode()
            raw.create(f"{ROOT}/{group}/x-manual-", record, ephemeral=True, sequence=True)
            await wait_for("p to see the manual node lead", lambda: sees("manual"), 5)
            assert await p.try_acquire(group, "p1", 8.0, {}) is None
        finally:
            task.cancel()
            await q.aclose()


async def test_many_groups_are_watched_on_one_session(
    zookeeper_server: BaseServer, raw: KazooClient
) -> None:
    """One provider watching many groups holds one session (the server's ``cons``) for all
    of them, and each watch wakes on its own group's release, and only then."""
    count = 30
    groups = [fresh(f"many{i}") for i in range(count)]
    before = set(sessions(zookeeper_server))
    async with (
        ZooKeeperProvider(hosts(zookeeper_server)) as p,
        ZooKeeperProvider(hosts(zookeeper_server)) as q,
    ):
        terms = [await q.try_acquire(group, "q1", 8.0, {}) for group in groups]
        freed = {group: asyncio.Event() for group in groups}

        async def follow(group: str) -> None:
            async for _ in p.watch(group):
                if await p.get_leader(group) is None:
                    freed[group].set()

        tasks = [asyncio.create_task(follow(group)) for group in groups]
        try:
            await wait_for(
                "every group's view", lambda: all(held(p, group) for group in groups), 10
            )
            session = session_of(p)
            opened = set(sessions(zookeeper_server)) - before
            assert opened == {session, session_of(q)}, opened  # one session per provider
            for i, (group, term) in enumerate(zip(groups, terms, strict=True)):
                assert term is not None
                await q.release(group, "q1", term.token)
                async with asyncio.timeout(5):
                    await freed[group].wait()
                assert not any(freed[g].is_set() for g in groups[i + 1 :]), "woke too early"
            assert session_of(p) == session
            assert set(sessions(zookeeper_server)) - before == opened
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def held(p: ZooKeeperProvider, group: str) -> bool:
    line = p._views.known(group)
    return bool(line)
