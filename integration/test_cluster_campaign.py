"""The cluster campaign: the election on stores as users deploy them, failing over.

For every clustered store of ``harness/clusters`` (etcd with three members, a ZooKeeper
ensemble, Redis behind Sentinel, Redlock over five nodes, PostgreSQL with a standby, each
node behind proxies), three members campaign while the store's leader node is killed,
cut off from the clients or from its peers, a minority restarted, or the store fails over
(Sentinel, a promoted standby), between participant faults.

Short mode (the default, run by the test command): each kind once per store. Long mode:
``MULTILOCK_CLUSTER_FAULTS=300`` faults per store (``nox -s clusters``); the summary goes
to ``MULTILOCK_CLUSTER_OUT`` (JSON) and is printed when the module ends.

A store configured to be safe (`SAFE`) must show no overlap and rising tokens; one that
may lose an acknowledged write on failover (`MAY_LOSE_WRITES`, asynchronous replication)
is measured: the summary counts the problems, and its mitigated twin must show none.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import harness.clusters  # noqa: F401  (registers the clusters)
from harness.campaign import proxied_urls
from harness.campaign_report import _stats, format_summaries, summarize
from harness.faults import SIZE, assert_safe, new_group
from harness.servers import NotInstalled
from harness.store_cluster import CLUSTERS, SAFE, ClusterCampaign, StoreCluster, plan_store
from multilock.core.testing import Cluster

FAULTS = int(os.environ.get("MULTILOCK_CLUSTER_FAULTS", "0")) or None
SEED = os.environ.get("MULTILOCK_CLUSTER_SEED", "1")
OUT = os.environ.get("MULTILOCK_CLUSTER_OUT")
ONLY = [n for n in os.environ.get("MULTILOCK_CLUSTERS", "").split(",") if n]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60 * max(FAULTS or 0, 10))]

SUMMARIES: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not SUMMARIES:
        return
    summaries = [SUMMARIES[name] for name in sorted(SUMMARIES)]
    if OUT:
        document = {"faults_per_store": FAULTS, "seed": SEED, "stores": summaries}
        Path(OUT).write_text(json.dumps(document, indent=2) + "\n")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(format_summaries(summaries))


@pytest.fixture(params=sorted(ONLY or CLUSTERS))
def store(request: pytest.FixtureRequest) -> Iterator[StoreCluster]:
    try:
        cluster = CLUSTERS[request.param]()
    except NotInstalled as exc:
        pytest.skip(str(exc))
    with cluster:
        yield cluster


def test_cluster_campaign(store: StoreCluster, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        proxies, urls = proxied_urls(store.backend(), SIZE, stack)
        cluster = Cluster(
            store.url,
            new_group("cluster"),
            size=SIZE,
            lease=store.lease,
            log_dir=tmp_path,
            urls=urls,
        )
        stack.enter_context(cluster)
        rng = random.Random(f"{SEED}:{store.name}")
        campaign = ClusterCampaign(store, cluster, proxies, rng)
        campaign.run(plan_store(campaign.kinds, campaign.store_kinds, FAULTS, rng))
        if store.promise == SAFE:
            report = assert_safe(cluster, f"{store.name} cluster campaign, seed {SEED}")
        else:
            report = cluster.check()
        summary = summarize(campaign, report, SEED)
        summary["promise"] = store.promise
        summary["store_faults"] = store_faults(campaign)
        SUMMARIES[store.name] = summary


def store_faults(campaign: ClusterCampaign) -> dict[str, Any]:
    """Per store fault kind: how many, how many the leader's term survived, and the time
    from the fault to the next term where it did not (the election's failover when the
    store itself fails over)."""
    result: dict[str, Any] = {}
    for kind in campaign.store_kinds:
        outcomes = [o for o in campaign.outcomes if o.kind == kind]
        result[kind] = {
            "count": len(outcomes),
            "kept": sum(o.kept for o in outcomes),
            "to_leader": _stats([o.to_leader for o in outcomes if not o.kept]),
        }
    return result
