"""EtcdProvider on a three-member etcd (``harness.clusters.etcd``): the client's failover.

One provider is given the URL of all three members and uses the first. Its term lives in
the cluster, not in a member: when the member it talks to is killed, cut off from the
clients, or cut off from its peers (it then has no leader and, asked with etcd's
``hasleader`` header, refuses at once), a call fails, the provider moves on to the next
member, and the same term is renewed there. The election's own failover through the
store's faults is measured by the cluster campaign (``test_cluster_campaign.py``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

from harness import NotInstalled, skip_or_fail
from harness.clusters.etcd import EtcdCluster
from multilock.core import ProviderError
from multilock.etcd import EtcdProvider

LEASE = 2.0
#: Short: a read already waiting on a member that has just been cut off from its peers
#: waits for its deadline (etcd fails it only then), and must not outlast the lease.
TIMEOUT = 0.5
#: A member's failure is noticed, and the next member answers, within this long
#: (etcd elects a new leader in about a second here when the old one is cut off).
MOVE_ON = 6.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[EtcdCluster]:
    try:
        made = EtcdCluster()
    except NotInstalled as exc:
        skip_or_fail(f"no three-member etcd: {exc}")
    with made:
        yield made


def in_use(provider: EtcdProvider, cluster: EtcdCluster) -> int:
    """The index of the member the provider talks to now."""
    ports = [f"127.0.0.1:{proxy.port}" for proxy in cluster.proxies]
    return ports.index(provider._calls.where)


async def renewed_after_moving_on(provider: EtcdProvider, group: str, token: int) -> int:
    """Renew the term until a renew succeeds; return how many calls failed meanwhile."""
    deadline = time.monotonic() + MOVE_ON
    failures = 0
    while True:
        try:
            assert await provider.renew(group, "p1", token, LEASE, {}), "the term was lost"
        except ProviderError:
            failures += 1
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        else:
            return failures


@pytest.mark.parametrize("fault", ["kill", "cut-clients", "cut-peers"])
async def test_the_term_goes_on_through_another_member(cluster: EtcdCluster, fault: str) -> None:
    group = f"etcd3-{uuid.uuid4().hex[:12]}"
    async with EtcdProvider.from_url(cluster.url, timeout=TIMEOUT) as provider:
        info = await provider.try_acquire(group, "p1", LEASE, {})
        assert info is not None
        before = in_use(provider, cluster)
        member = cluster.members[before]
        if fault == "kill":
            member.kill()
            heal = member.start
        elif fault == "cut-clients":
            cluster.proxies[before].drop()
            heal = cluster.proxies[before].heal
        else:
            assert cluster.gates is not None
            cluster.gates.cut(before)
            heal = cluster.gates.heal
        try:
            failures = await renewed_after_moving_on(provider, group, info.token)
            after = in_use(provider, cluster)
            assert after != before, f"the provider stayed on m{before}"
            assert failures >= 1  # the fault was seen: the renew that moved on failed
            leader = await provider.get_leader(group)
            assert leader is not None
            assert (leader.participant_id, leader.token) == ("p1", info.token)
        finally:
            heal()
            cluster.wait_whole(30.0)
        await provider.release(group, "p1", info.token)
        assert await provider.get_leader(group) is None
