"""Faults thrown at real participant processes, on every backend that works across processes.

Each test runs a `Cluster` of three ``multilock.core.testing.participant`` processes
(lease 1 s, default renew and retry intervals) on one backend and one fresh group, throws
real faults at them (SIGKILL, SIGSTOP/SIGCONT, SIGTERM, SIGUSR1, a server stopped and
started again on its port), and then lets `check_timeline` judge the merged event logs:
no two terms overlap, tokens always rise, no leader work with an old token after work with
a newer one. Every wait is on a log condition with a deadline; timings are measured from
the fault to the ``acquired`` line of the next leader, on the one monotonic clock all the
processes share, and printed in a summary at the end of the module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import Backend, BaseServer, require_control
from harness.faults import (
    RECOVERY_BOUND,
    SIZE,
    ClusterLog,
    assert_safe,
    failover_bound,
    handoff_bound,
    new_group,
    require_multiprocess,
)
from multilock.core.testing import Cluster

pytestmark = pytest.mark.slow

#: The lease of the server-restart tests (the others use each backend's own lease).
LEASE = 1.0

#: Measured times, by backend, then by scenario: printed when the module finishes.
TIMES: dict[str, dict[str, list[float]]] = {}


def _record_time(backend: str, scenario: str, seconds: float) -> None:
    TIMES.setdefault(backend, {}).setdefault(scenario, []).append(seconds)


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not TIMES:
        return
    lines = ["", "multilock fault suite: measured times (s), fault -> next leader's acquire"]
    for backend, scenarios in sorted(TIMES.items()):
        for scenario, values in scenarios.items():
            shown = ", ".join(f"{v:.3f}" for v in values)
            lines.append(f"  {backend:<18} {scenario:<22} {shown}")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print("\n".join(lines))
        return
    with capture.global_and_fixture_disabled():
        print("\n".join(lines))


# -- helpers ------------------------------------------------------------------------------


def cluster_on(url: str, tmp_path: Path, lease: float = LEASE) -> tuple[Cluster, ClusterLog]:
    cluster = Cluster(url, new_group(), size=SIZE, lease=lease, log_dir=tmp_path)
    return cluster, ClusterLog(cluster)


def stale_work(log: ClusterLog, name: str, token: int, since: float) -> list[dict[str, Any]]:
    """Leader work *name* logged with *token* at or after *since*."""
    log.poll()
    return [
        r
        for r in log.records
        if r["participant"] == name
        and r["event"] == "work"
        and r["token"] == token
        and r["t"] >= since
    ]


# -- 1. SIGKILL of the leader --------------------------------------------------------------


def test_kill_leader_twice(backend: Backend, tmp_path: Path) -> None:
    require_multiprocess(backend)
    measured: list[float] = []
    cluster, log = cluster_on(backend.url, tmp_path, backend.lease)
    with cluster:
        leader, token = log.first_leader()
        for _ in range(2):
            killed_at = cluster.kill(leader)
            found = log.wait_for_leader(failover_bound(backend) + 10, newer_than=token)
            assert found is not None
            new, new_token, since = found
            took = since - killed_at
            measured.append(took)
            _record_time(backend.name, "kill -9 failover", took)
            assert new is not leader
            assert took <= failover_bound(backend), (
                f"{backend.name}: failover took {took:.3f} s > {failover_bound(backend)} s "
                f"(measured so far {measured}); logs:\n{cluster.tail()}"
            )
            relaunched_at = time.monotonic()
            cluster.launch(leader)
            log.wait_started([leader], since=relaunched_at)
            leader, token = new, new_token
        assert_safe(cluster, f"failovers {measured}")


# -- 2. SIGSTOP of the leader past its lease ------------------------------------------------


def test_frozen_leader_steps_down(backend: Backend, tmp_path: Path) -> None:
    require_multiprocess(backend)
    cluster, log = cluster_on(backend.url, tmp_path, backend.lease)
    with cluster:
        frozen, token = log.first_leader()
        frozen_at = cluster.freeze(frozen)
        found = log.wait_for_leader(failover_bound(backend) + 10, newer_than=token)
        assert found is not None
        new, new_token, new_since = found
        took = new_since - frozen_at
        _record_time(backend.name, "SIGSTOP failover", took)
        assert new is not frozen
        assert took <= failover_bound(backend), (
            f"{backend.name}: takeover from a frozen leader took {took:.3f} s; "
            f"logs:\n{cluster.tail()}"
        )
        # Keep it frozen for two leases in all (a fixed fault duration, not a wait).
        time.sleep(max(0.0, frozen_at + 2 * backend.lease - time.monotonic()))
        thawed_at = cluster.thaw(frozen)
        lost = log.wait_for(
            f"'lost' of token {token} from the thawed {frozen.name}",
            lambda r: (
                r["participant"] == frozen.name and r["event"] == "lost" and r["token"] == token
            ),
            backend.lease + 10,
        )
        # Let it run a while after waking, then judge everything it logged.
        deadline = thawed_at + backend.lease
        log.wait_for(
            "a log line after the observation window",
            lambda r: r["t"] >= deadline,
            backend.lease + 10,
        )
        stale = stale_work(log, frozen.name, token, new_since)
        assert not stale, f"{frozen.name} worked with its old token {token} after takeover"
        assert lost["valid_until"] is not None
        assert lost["valid_until"] <= new_since, (
            f"the frozen leader's term ran until {lost['valid_until']:.3f}, past the new "
            f"leader's acquisition at {new_since:.3f}"
        )
        current = log.leader()
        assert current is not None, f"nobody leads after the thaw; logs:\n{cluster.tail()}"
        assert current[0] is not frozen, (
            f"the thawed {frozen.name} leads again: {current}; logs:\n{cluster.tail()}"
        )
        assert current[1] >= new_token
        assert_safe(cluster, f"SIGSTOP failover {took:.3f}")


# -- 3. Graceful stop and resign --------------------------------------------------------------


def test_graceful_stop_hands_over(backend: Backend, tmp_path: Path) -> None:
    require_multiprocess(backend)
    bound = handoff_bound(backend)
    cluster, log = cluster_on(backend.url, tmp_path, backend.lease)
    with cluster:
        leader, token = log.first_leader()
        sent = time.monotonic()
        cluster.terminate(leader)
        found = log.wait_for_leader(failover_bound(backend) + 10, newer_than=token)
        assert found is not None
        new, _, since = found
        took = since - sent
        _record_time(backend.name, "SIGTERM handoff", took)
        assert new is not leader
        assert leader.process is not None
        assert leader.process.returncode == 0, (
            f"{leader.name} exited with {leader.process.returncode}; logs:\n{cluster.tail()}"
        )
        log.wait_for(
            f"'stopped' from {leader.name}",
            lambda r: r["participant"] == leader.name and r["event"] == "stopped",
            1.0,
        )
        assert took <= bound, (
            f"{backend.name}: handoff after SIGTERM took {took:.3f} s > {bound} s; "
            f"logs:\n{cluster.tail()}"
        )
        assert_safe(cluster, f"SIGTERM handoff {took:.3f}")


def test_resign_hands_over(backend: Backend, tmp_path: Path) -> None:
    require_multiprocess(backend)
    bound = handoff_bound(backend)
    cluster, log = cluster_on(backend.url, tmp_path, backend.lease)
    with cluster:
        leader, token = log.first_leader()
        sent = cluster.resign(leader)
        found = log.wait_for_leader(failover_bound(backend) + 10, newer_than=token)
        assert found is not None
        new, _, new_since = found
        took = new_since - sent
        _record_time(backend.name, "resign handoff", took)
        assert new is not leader
        assert took <= bound, (
            f"{backend.name}: handoff after resign took {took:.3f} s > {bound} s; "
            f"logs:\n{cluster.tail()}"
        )
        log.wait_for(
            f"'lost' of token {token} from {leader.name}",
            lambda r: r["participant"] == leader.name and r["event"] == "lost",
            backend.lease + 10,
        )
        stale = stale_work(log, leader.name, token, new_since)
        assert not stale, f"{leader.name} worked with token {token} after resigning: {stale}"
        assert_safe(cluster, f"resign handoff {took:.3f}")


# -- 4. Server restart on the same port ----------------------------------------------------


@pytest.mark.parametrize(
    ("label", "fixture"),
    [
        ("redis", "redis_server"),
        ("redis-persistent", "redis_persistent_server"),
        ("postgres", "postgres_server"),
    ],
)
def test_server_restart(
    label: str, fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server: BaseServer = request.getfixturevalue(fixture)
    require_control(server)
    cluster, log = cluster_on(server.url, tmp_path)
    with cluster:
        leader, token = log.first_leader()
        server.stop()
        stopped_at = time.monotonic()
        try:
            lost = log.wait_for(
                f"'lost' of token {token} from {leader.name} with the server down",
                lambda r: (
                    r["participant"] == leader.name and r["event"] == "lost" and r["token"] == token
                ),
                2 * LEASE + 10,
            )
            lost_late = lost["t"] - stopped_at
            _record_time(label, "stop -> leader lost", lost_late)
            assert lost["valid_until"] is not None
            assert lost["valid_until"] <= stopped_at + LEASE, (
                f"{label}: the leader's term ran until {lost['valid_until'] - stopped_at:.3f} s "
                f"after the server stopped (lease {LEASE} s)"
            )
            # The event itself may trail the deadline by the event loop's scheduling.
            assert lost_late <= LEASE + 0.25, (
                f"{label}: the leader logged 'lost' {lost_late:.3f} s after the server stopped"
            )
            # Down for two leases in all (a fixed fault duration, not a wait).
            time.sleep(max(0.0, stopped_at + 2 * LEASE - time.monotonic()))
        finally:
            restarting_at = time.monotonic()
            server.start()
        during = log.find(
            lambda r: r["event"] == "acquired" and stopped_at <= r["t"] <= restarting_at
        )
        assert during is None, f"{label}: a term was acquired while the server was down: {during}"
        found = log.wait_for_leader(RECOVERY_BOUND + 10, newer_than=token)
        assert found is not None
        took = found[2] - restarting_at
        _record_time(label, "restart -> new leader", took)
        assert took <= RECOVERY_BOUND, (
            f"{label}: no leader until {took:.3f} s after the server came back; "
            f"logs:\n{cluster.tail()}"
        )
        assert_safe(cluster, f"lost {lost_late:.3f} after stop, leader {took:.3f} after start")
