"""Five real processes compete for one group on lease files; the leader is SIGKILLed often.

The participants' event logs share one monotonic clock (one machine), so the checker can
prove that no two terms overlapped and that every term's token rose.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from multilock.core.testing import Cluster

LEASE = 1.0
KILLS = 4
HOLD = 2.5 * LEASE


@pytest.mark.slow
def test_sigkilled_leaders_never_overlap_and_tokens_rise(tmp_path: Path) -> None:
    leases, logs = tmp_path / "leases", tmp_path / "logs"
    leases.mkdir()
    logs.mkdir()
    with Cluster(leases.as_uri(), "mp", size=5, lease=LEASE, log_dir=logs) as cluster:
        # Generous bounds for process start-up on a busy machine.
        leader, token, seen_at = cluster.wait_for_leader(60)
        killed: list[tuple[str, int]] = []
        for _ in range(KILLS):  # 5 processes, 4 kills: the last one standing leads at the end
            # Let the term outlive its first lease (renewals keep it, nobody may take it)
            # before killing the leader.
            if not _wait_for_work(cluster, leader.name, token, seen_at + HOLD):
                cluster.check().assert_ok()  # an overlap is the likelier culprit: name it
                pytest.fail(f"{leader.name} did not keep term {token}:\n{cluster.tail()}")
            killed_at = cluster.kill(leader)
            killed.append((leader.name, token))
            successor, new_token, seen_at = cluster.wait_for_leader(30, newer_than=token)
            assert successor is not leader
            # The victim's lease runs out first; a follower wakes at the observed expiry
            # (the filesystem watch) or within its retry interval.
            assert seen_at - killed_at < 2 * LEASE + 3, cluster.tail()
            leader, token = successor, new_token

        report = cluster.check()
        assert report.ok, "\n".join([*report.problems, report.describe()])
        ended = [(i.participant, i.token) for i in report.intervals if i.ended_by == "killed"]
        assert ended == killed, report.describe()
        tokens = [i.token for i in report.intervals]
        assert tokens == sorted(set(tokens)), tokens
        assert len(report.intervals) >= KILLS + 1


def _wait_for_work(cluster: Cluster, name: str, token: int, since: float) -> bool:
    """Wait until *name* logs leader work with *token* at or after *since* (monotonic)."""
    deadline = time.monotonic() + HOLD + 10
    while time.monotonic() < deadline:
        for record in cluster.records():
            if (
                record["event"] == "work"
                and record["participant"] == name
                and record.get("token") == token
                and record["t"] >= since
            ):
                return True
        time.sleep(0.02)
    return False
