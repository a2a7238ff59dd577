"""The fault campaign on every backend that works across processes (see harness/campaign.py).

Short mode (the default, run by the test command): each fault kind that applies to a
backend once, in a seeded random order. Long mode: ``MULTILOCK_CAMPAIGN_FAULTS=60`` throws
that many faults per backend (each kind at least once). ``MULTILOCK_CAMPAIGN_SEED`` (default
1) picks the sequence; ``MULTILOCK_CAMPAIGN_OUT`` names a JSON file for the summary, which
is also printed when the module ends: faults by kind, kinds that do not apply and why,
failovers and handoffs (count, p50, max), time without a leader, and any overlap.
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

from harness import Backend
from harness.campaign import Campaign, plan, proxied_urls
from harness.campaign_report import format_summaries, summarize
from harness.faults import SIZE, assert_safe, new_group, require_multiprocess
from multilock.core.testing import Cluster

FAULTS = int(os.environ.get("MULTILOCK_CAMPAIGN_FAULTS", "0")) or None
SEED = os.environ.get("MULTILOCK_CAMPAIGN_SEED", "1")
OUT = os.environ.get("MULTILOCK_CAMPAIGN_OUT")

#: A minute per fault is far above any backend's worst case (Azure: 15 s leases).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60 * max(FAULTS or 0, 10))]

SUMMARIES: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not SUMMARIES:
        return
    summaries = [SUMMARIES[name] for name in sorted(SUMMARIES)]
    if OUT:
        document = {"faults_per_backend": FAULTS, "seed": SEED, "backends": summaries}
        Path(OUT).write_text(json.dumps(document, indent=2) + "\n")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(format_summaries(summaries))


def test_campaign(backend: Backend, tmp_path: Path) -> None:
    require_multiprocess(backend)
    with contextlib.ExitStack() as stack:
        proxies: list[Any] | None = None
        urls: list[str] | None = None
        network: str | None = None
        try:
            proxies, urls = proxied_urls(backend, SIZE, stack)
        except ValueError as exc:
            network = str(exc)
        cluster = Cluster(
            backend.url,
            new_group("campaign"),
            size=SIZE,
            lease=backend.lease,
            log_dir=tmp_path,
            urls=urls,
        )
        stack.enter_context(cluster)
        rng = random.Random(f"{SEED}:{backend.name}")
        campaign = Campaign(backend, cluster, proxies, rng, Campaign.applicable(backend, network))
        campaign.run(plan(campaign.kinds, FAULTS, rng))
        report = assert_safe(cluster, f"{backend.name} campaign, seed {SEED}")
        SUMMARIES[backend.name] = summarize(campaign, report, SEED)
