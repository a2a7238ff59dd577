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
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import Backend, BaseServer, require_control
from multilock.core.testing import Cluster, Member

pytestmark = pytest.mark.slow

SIZE = 3
#: The lease of the server-restart tests (the others use each backend's own lease).
LEASE = 1.0
SLACK = 1.0
#: Stores that may free a dead holder's key later than the lease (Consul: up to 2x TTL).
EXPIRY_FACTOR = {"consul": 2.0}


def failover_bound(backend: Backend) -> float:
    """A crashed leader's successor leads within this long of the kill."""
    retry = min(2.0, backend.lease)  # the election's default retry_interval
    return EXPIRY_FACTOR.get(backend.name, 1.0) * backend.lease + retry + SLACK


#: A graceful stop or resign hands over within this long (filesystem followers poll).
HANDOFF_BOUND = {"filesystem": 1.5, "azure_blob": 2.5}  # polling backends: one poll
HANDOFF_DEFAULT = 0.5
#: Three interpreters importing the library on a loaded machine.
STARTUP_TIMEOUT = 30.0
#: After a server is started again, some participant leads within this long.
RECOVERY_BOUND = 5.0

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


def new_group() -> str:
    return f"faults-{uuid.uuid4().hex[:12]}"


def multiprocess(backend: Backend) -> Backend:
    if not backend.multiprocess:
        pytest.skip(f"{backend.name}: its URL only works inside one process")
    return backend


def cluster_on(url: str, tmp_path: Path, lease: float = LEASE) -> Cluster:
    return Cluster(url, new_group(), size=SIZE, lease=lease, log_dir=tmp_path)


def wait_for_record(
    cluster: Cluster,
    what: str,
    predicate: Callable[[dict[str, Any]], bool],
    timeout: float,
) -> dict[str, Any]:
    """The first log record that satisfies *predicate*, waiting up to *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for record in cluster.records():
            if predicate(record):
                return record
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.1f} s; logs:\n{cluster.tail()}")
        time.sleep(0.02)


def wait_started(cluster: Cluster, members: list[Member], since: float = 0.0) -> None:
    """Wait until each of *members* logged ``started`` after *since*."""
    for member in members:

        def started(record: dict[str, Any], name: str = member.name) -> bool:
            return (
                record["participant"] == name
                and record["event"] == "started"
                and float(record["t"]) >= since
            )

        wait_for_record(cluster, f"'started' from {member.name}", started, STARTUP_TIMEOUT)


def acquired_at(cluster: Cluster, member: Member, token: int) -> float:
    """When *member* logged the acquisition of *token*."""
    for record in cluster.records():
        if (
            record["participant"] == member.name
            and record["event"] == "acquired"
            and record["token"] == token
        ):
            return float(record["t"])
    raise AssertionError(f"{member.name} never logged acquiring token {token}")


def first_leader(cluster: Cluster) -> tuple[Member, int]:
    wait_started(cluster, cluster.members)
    leader, token, _ = cluster.wait_for_leader(STARTUP_TIMEOUT)
    return leader, token


def assert_safe(cluster: Cluster, times: str) -> None:
    report = cluster.check()
    assert report.ok, f"{report.problems}\nterms:\n{report.describe()}\ntimes: {times}"


# -- 1. SIGKILL of the leader --------------------------------------------------------------


def test_kill_leader_twice(backend: Backend, tmp_path: Path) -> None:
    multiprocess(backend)
    measured: list[float] = []
    with cluster_on(backend.url, tmp_path, backend.lease) as cluster:
        leader, token = first_leader(cluster)
        for _ in range(2):
            killed_at = cluster.kill(leader)
            new, new_token, _ = cluster.wait_for_leader(
                failover_bound(backend) + 10, newer_than=token
            )
            took = acquired_at(cluster, new, new_token) - killed_at
            measured.append(took)
            _record_time(backend.name, "kill -9 failover", took)
            assert new is not leader
            assert took <= failover_bound(backend), (
                f"{backend.name}: failover took {took:.3f} s > {failover_bound(backend)} s "
                f"(measured so far {measured}); logs:\n{cluster.tail()}"
            )
            relaunched_at = time.monotonic()
            cluster.launch(leader)
            wait_started(cluster, [leader], since=relaunched_at)
            leader, token = new, new_token
        assert_safe(cluster, f"failovers {measured}")


# -- 2. SIGSTOP of the leader past its lease ------------------------------------------------


def test_frozen_leader_steps_down(backend: Backend, tmp_path: Path) -> None:
    multiprocess(backend)
    with cluster_on(backend.url, tmp_path, backend.lease) as cluster:
        frozen, token = first_leader(cluster)
        frozen_at = cluster.freeze(frozen)
        new, new_token, _ = cluster.wait_for_leader(failover_bound(backend) + 10, newer_than=token)
        new_since = acquired_at(cluster, new, new_token)
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
        lost = wait_for_record(
            cluster,
            f"'lost' of token {token} from the thawed {frozen.name}",
            lambda r: (
                r["participant"] == frozen.name and r["event"] == "lost" and r["token"] == token
            ),
            backend.lease + 10,
        )
        # Let it run a while after waking, then judge everything it logged.
        deadline = thawed_at + backend.lease
        wait_for_record(
            cluster,
            "a log line after the observation window",
            lambda r: r["t"] >= deadline,
            backend.lease + 10,
        )
        stale = [
            r
            for r in cluster.records()
            if r["participant"] == frozen.name
            and r["event"] == "work"
            and r["token"] == token
            and r["t"] >= new_since
        ]
        assert not stale, f"{frozen.name} worked with its old token {token} after takeover"
        assert lost["valid_until"] is not None
        assert lost["valid_until"] <= new_since, (
            f"the frozen leader's term ran until {lost['valid_until']:.3f}, past the new "
            f"leader's acquisition at {new_since:.3f}"
        )
        current = cluster.current_leader()
        assert current is not None, f"nobody leads after the thaw; logs:\n{cluster.tail()}"
        assert current[0] is not frozen, (
            f"the thawed {frozen.name} leads again: {current}; logs:\n{cluster.tail()}"
        )
        assert current[1] >= new_token
        assert_safe(cluster, f"SIGSTOP failover {took:.3f}")


# -- 3. Graceful stop and resign --------------------------------------------------------------


def test_graceful_stop_hands_over(backend: Backend, tmp_path: Path) -> None:
    multiprocess(backend)
    bound = HANDOFF_BOUND.get(backend.name, HANDOFF_DEFAULT)
    with cluster_on(backend.url, tmp_path, backend.lease) as cluster:
        leader, token = first_leader(cluster)
        sent = time.monotonic()
        cluster.terminate(leader)
        new, new_token, _ = cluster.wait_for_leader(failover_bound(backend) + 10, newer_than=token)
        took = acquired_at(cluster, new, new_token) - sent
        _record_time(backend.name, "SIGTERM handoff", took)
        assert new is not leader
        assert leader.process is not None
        assert leader.process.returncode == 0, (
            f"{leader.name} exited with {leader.process.returncode}; logs:\n{cluster.tail()}"
        )
        wait_for_record(
            cluster,
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
    multiprocess(backend)
    bound = HANDOFF_BOUND.get(backend.name, HANDOFF_DEFAULT)
    with cluster_on(backend.url, tmp_path, backend.lease) as cluster:
        leader, token = first_leader(cluster)
        sent = cluster.resign(leader)
        new, new_token, _ = cluster.wait_for_leader(failover_bound(backend) + 10, newer_than=token)
        new_since = acquired_at(cluster, new, new_token)
        took = new_since - sent
        _record_time(backend.name, "resign handoff", took)
        assert new is not leader
        assert took <= bound, (
            f"{backend.name}: handoff after resign took {took:.3f} s > {bound} s; "
            f"logs:\n{cluster.tail()}"
        )
        wait_for_record(
            cluster,
            f"'lost' of token {token} from {leader.name}",
            lambda r: r["participant"] == leader.name and r["event"] == "lost",
            backend.lease + 10,
        )
        stale = [
            r
            for r in cluster.records()
            if r["participant"] == leader.name
            and r["event"] == "work"
            and r["token"] == token
            and r["t"] >= new_since
        ]
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
    with cluster_on(server.url, tmp_path) as cluster:
        leader, token = first_leader(cluster)
        server.stop()
        stopped_at = time.monotonic()
        try:
            lost = wait_for_record(
                cluster,
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
        during = [
            r
            for r in cluster.records()
            if r["event"] == "acquired" and stopped_at <= r["t"] <= restarting_at
        ]
        assert not during, f"{label}: terms acquired while the server was down: {during}"
        new, new_token, _ = cluster.wait_for_leader(RECOVERY_BOUND + 10, newer_than=token)
        took = acquired_at(cluster, new, new_token) - restarting_at
        _record_time(label, "restart -> new leader", took)
        assert took <= RECOVERY_BOUND, (
            f"{label}: no leader until {took:.3f} s after the server came back; "
            f"logs:\n{cluster.tail()}"
        )
        assert_safe(cluster, f"lost {lost_late:.3f} after stop, leader {took:.3f} after start")
