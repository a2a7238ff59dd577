"""`contenders` on a real ZooKeeper: the live candidates in line, the leader first.

In one process: three elections queue in the order they joined (not by participant id,
not by node name), and when the leader stops the next in line is first. Across processes:
a SIGKILLed participant's candidate disappears once its session expires, whether it was
waiting in line or leading.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from harness import BaseServer
from harness.fixtures_zookeeper import with_session_timeout
from multilock.core import LeaderElection, contenders
from multilock.core.testing import Cluster
from multilock.zookeeper import ZooKeeperProvider

SESSION = 2.0  # seconds: the lease of every election here, and the sessions' timeout


def fresh() -> str:
    return f"contenders-{uuid.uuid4().hex[:12]}"


def hosts(server: BaseServer) -> str:
    return f"{server.host}:{server.port}"


async def wait_for(
    what: str, predicate: Callable[[], Awaitable[bool] | bool], within: float
) -> float:
    """Poll *predicate* until true; return the seconds it took; fail after *within*."""
    start = time.monotonic()
    while True:
        result = predicate()
        if result if isinstance(result, bool) else await result:
            break
        if time.monotonic() - start > within:
            raise AssertionError(f"timed out after {within:.1f} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def wait_for_line(
    observer: ZooKeeperProvider, group: str, expected: tuple[str, ...], within: float
) -> float:
    """Wait until `contenders` of *group* is exactly *expected*; say what it was if not."""
    seen: list[tuple[str, ...]] = []

    async def lined_up() -> bool:
        line = await contenders(observer, group)
        if not seen or seen[-1] != line:
            seen.append(line)
        return line == expected

    try:
        return await wait_for(f"contenders {expected}", lined_up, within)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; contenders went {seen}") from None


async def test_three_elections_line_up_and_the_next_one_leads(
    zookeeper_server: BaseServer,
) -> None:
    group = fresh()
    names = ("zed", "mid", "amy")  # joined in this order: neither sorted nor by node name
    providers = [ZooKeeperProvider(hosts(zookeeper_server), session_timeout=SESSION) for _ in names]
    elections = [
        LeaderElection(p, group=group, participant_id=name, lease_duration=SESSION)
        for p, name in zip(providers, names, strict=True)
    ]
    async with ZooKeeperProvider(hosts(zookeeper_server)) as observer:
        assert await contenders(observer, group) == ()  # nobody yet: not an error
        try:
            await elections[0].start()
            await asyncio.wait_for(elections[0].wait_until_leader(), 10)
            await wait_for_line(observer, group, names[:1], 10)
            for joined in (2, 3):  # each one once the one before it is in line
                await elections[joined - 1].start()
                await wait_for_line(observer, group, names[:joined], 10)
            leader = await observer.get_leader(group)
            assert leader is not None
            assert leader.participant_id == "zed"
            assert not elections[1].is_leader
            assert not elections[2].is_leader

            await elections[0].stop()  # releases: the next in line leads at once
            await wait_for_line(observer, group, ("mid", "amy"), SESSION)
            await wait_for("mid to lead", lambda: elections[1].is_leader, 5)
            leader = await observer.get_leader(group)
            assert leader is not None
            assert leader.participant_id == "mid"
            assert (await contenders(observer, group))[0] == "mid"
        finally:
            for election in elections:
                await election.stop()
            for provider in providers:
                await provider.aclose()
        # The providers closed: their nodes went with them.
        await wait_for_line(observer, group, (), 5)


async def test_a_killed_participant_drops_out_of_line(
    zookeeper_server: BaseServer, tmp_path: Path
) -> None:
    group = fresh()
    url = with_session_timeout(zookeeper_server.url, SESSION)
    cluster = Cluster(url, group, size=3, lease=SESSION, log_dir=tmp_path)
    first, middle, last = (m.name for m in cluster.members)
    async with ZooKeeperProvider(hosts(zookeeper_server)) as observer:
        try:
            for joined, member in enumerate(cluster.members, start=1):
                cluster.launch(member)  # one at a time: the line is the launch order
                expected = tuple(m.name for m in cluster.members[:joined])
                await wait_for_line(observer, group, expected, 30)
            await asyncio.to_thread(cluster.wait_for_leader, 10)

            # A follower killed: its node lives until its session expires, then goes.
            cluster.kill(cluster.member(middle))
            took = await wait_for_line(observer, group, (first, last), SESSION * 3 + 5)
            assert took > SESSION / 2, f"gone {took:.2f} s after a SIGKILL: not by its session"

            # The leader killed: the last one in line is now first, and leads.
            _, token, _ = await asyncio.to_thread(cluster.wait_for_leader, 5)
            cluster.kill(cluster.member(first))
            await wait_for_line(observer, group, (last,), SESSION * 3 + 5)
            leader, _, _ = await asyncio.to_thread(cluster.wait_for_leader, 10, newer_than=token)
            assert leader.name == last, cluster.tail()
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nlogs:\n{cluster.tail()}") from None
        finally:
            cluster.close()
