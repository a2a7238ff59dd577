"""`Cluster` gives each member its own store URL when asked (a proxy per member, say)."""

from __future__ import annotations

from pathlib import Path

import pytest

from multilock.core.testing import Cluster

STARTUP = 60.0  # interpreters starting on a busy machine; the waits end as soon as they can


def test_urls_must_name_one_url_per_member(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 URL"):
        Cluster("memory://", "g", size=3, urls=["memory://", "memory://"], log_dir=tmp_path)


def test_urls_default_to_the_cluster_url(tmp_path: Path) -> None:
    cluster = Cluster("memory://", "g", size=2, log_dir=tmp_path)
    assert [m.url for m in cluster.members] == [None, None]


@pytest.mark.slow
def test_each_member_runs_on_its_own_url(tmp_path: Path) -> None:
    # The cluster URL names a scheme nobody provides: no member may fall back to it.
    urls = ["memory://", "unknown-b://somewhere"]
    with Cluster("unknown-a://", "g", size=2, lease=1.0, log_dir=tmp_path, urls=urls) as cluster:
        good, bad = cluster.members
        leader, _, _ = cluster.wait_for_leader(STARTUP)
        assert leader is good
        assert bad.process is not None
        bad.process.wait(STARTUP)
        assert bad.process.returncode != 0
        stderr = bad.log_path.with_suffix(".stderr").read_text()  # complete: it has exited
        assert "unknown-b" in stderr
        assert "unknown-a" not in stderr
