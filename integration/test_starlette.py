"""``samples/fastapi_service.py``: two uvicorn replicas on Redis elect one leader.

Each replica is a real process serving HTTP on a free port. Exactly one prints leader
ticks; both answer ``/health`` 200; ``/metrics`` shows ``multilock_is_leader`` 1 on the
leader and 0 on the follower. SIGTERM makes uvicorn run the lifespan shutdown, which
releases the lease: the follower must lead within a deadline well under the lease, so a
takeover by expiry would fail the test. SIGKILL runs nothing: the follower leads only
once the lease has expired.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import BaseServer, free_port

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "fastapi_service.py"
#: Interpreters start slowly on a loaded machine.
STARTUP = 30.0
TICK = "leader work tick "

T = TypeVar("T")


class Replica:
    """One ``fastapi_service.py`` process; its stdout lines are collected as they come."""

    def __init__(self, name: str, url: str, group: str, lease: float, logs: Path) -> None:
        self.name = name
        self.port = free_port()
        self.log = logs / f"{name}.err"
        self.lines: list[str] = []
        argv = [
            sys.executable, str(SAMPLE), "--group", group, "--port", str(self.port),
            "--lease", f"{lease:g}", "--interval", "0.1", "--id", name,
        ]  # fmt: skip
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, "MULTILOCK_URL": url},  # not in ps
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def ticks(self) -> list[str]:
        return [line for line in list(self.lines) if line.startswith(TICK)]

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.port}{path}", timeout=5.0)

    def is_leader_metric(self, group: str) -> float | None:
        text = self.get("/metrics/").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "multilock_is_leader" and sample.labels.get("group") == group:
                    return sample.value
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def report(self) -> str:
        stdout = "\n".join(self.lines[-20:])
        return (
            f"--- {self.name} stdout (tail):\n{stdout}\n--- {self.name} stderr:\n"
            + (self.log.read_text()[-4000:])
        )


def wait_for(
    what: str,
    check: Callable[[], T | None],
    timeout: float,
    replicas: list[Replica],
) -> T:
    """Poll *check* until it returns something not None (errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except (httpx.HTTPError, OSError):
            result = None
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} within {timeout} s\n" + "\n".join(r.report() for r in replicas))
        for replica in replicas:
            if replica.proc.poll() is not None and replica.proc.returncode not in (0, -15):
                pytest.fail(f"{replica.name} exited early\n{replica.report()}")
        time.sleep(0.02)


@pytest.fixture
def start(redis_server: BaseServer, tmp_path: Path) -> Iterator[Callable[..., list[Replica]]]:
    replicas: list[Replica] = []

    def start(group: str, lease: float) -> list[Replica]:
        for name in ("a", "b"):
            replicas.append(Replica(name, redis_server.url, group, lease, tmp_path))
        return replicas

    yield start
    for replica in replicas:
        replica.stop()


def elect(replicas: list[Replica]) -> tuple[Replica, Replica]:
    """Wait for both replicas to serve and one to lead; return (leader, follower)."""

    def serving() -> bool | None:
        return all(r.get("/health").status_code == 200 for r in replicas) or None

    wait_for("both replicas did not answer /health 200", serving, STARTUP, replicas)

    def ticking() -> Replica | None:
        return next((r for r in replicas if len(r.ticks()) >= 3), None)

    leader = wait_for("no replica ticked three times", ticking, STARTUP, replicas)
    follower = next(r for r in replicas if r is not leader)
    assert follower.ticks() == [], "both replicas ran the leader work"
    assert all(line.startswith(f"{TICK}{leader.name} token=") for line in leader.ticks())
    return leader, follower


def token_of(line: str) -> int:
    return int(line.rsplit("token=", 1)[1])


def test_one_leader_health_metrics_and_handoff_on_sigterm(start: Any) -> None:
    group = f"fastapi-{uuid.uuid4().hex[:12]}"
    lease = 10.0
    leader, follower = elect(start(group, lease))
    replicas = [leader, follower]

    for replica in replicas:
        answer: dict[str, Any] = replica.get("/leader").json()
        assert (answer["group"], answer["leader"]) == (group, leader.name)
        assert (answer["me"], answer["is_leader"]) == (replica.name, replica is leader)
        health = replica.get("/health")
        assert health.status_code == 200, health.text
        assert health.json()["is_leader"] is (replica is leader)

    def metrics() -> tuple[float | None, float | None] | None:
        values = (leader.is_leader_metric(group), follower.is_leader_metric(group))
        return values if values == (1.0, 0.0) else None

    wait_for("multilock_is_leader was not 1 on the leader and 0 on the follower",
             metrics, 10, replicas)  # fmt: skip

    old_token = token_of(leader.ticks()[-1])
    leader.proc.send_signal(signal.SIGTERM)
    # Well under the 10 s lease: only a released lease is taken over this fast.
    line = wait_for("the follower did not lead soon after SIGTERM",
                    lambda: next(iter(follower.ticks()), None), 5.0, replicas)  # fmt: skip
    assert token_of(line) > old_token
    code = leader.proc.wait(STARTUP)
    # uvicorn re-raises the signal after a clean shutdown: -SIGTERM, or 0 on older versions.
    assert code in (0, -signal.SIGTERM), leader.report()
    stderr = leader.log.read_text()
    assert "Application shutdown complete" in stderr, leader.report()
    assert "Traceback" not in stderr, leader.report()

    def follower_leads() -> bool | None:
        return follower.is_leader_metric(group) == 1.0 or None

    wait_for("multilock_is_leader did not turn 1 on the new leader", follower_leads, 10, replicas)
    assert follower.get("/leader").json()["leader"] == follower.name


def test_takeover_after_the_lease_when_the_leader_is_killed(start: Any) -> None:
    group = f"fastapi-{uuid.uuid4().hex[:12]}"
    lease = 2.0
    leader, follower = elect(start(group, lease))

    old_token = token_of(leader.ticks()[-1])
    leader.proc.kill()  # no shutdown runs: the lease stays until it expires
    killed = time.monotonic()
    line = wait_for("the follower did not lead after the lease expired",
                    lambda: next(iter(follower.ticks()), None), 15.0, [follower])  # fmt: skip
    took = time.monotonic() - killed
    assert token_of(line) > old_token
    # The lease lives lease_duration from the last renew, sent about renew_interval
    # (lease / 3) or less before the kill; a release would be taken over in milliseconds.
    assert took > 0.5, f"took over {took:.3f} s after SIGKILL: the lease cannot be gone yet"
    assert leader.proc.wait(STARTUP) == -signal.SIGKILL
    assert follower.get("/health").status_code == 200
