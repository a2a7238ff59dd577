"""``manage.py leader_run`` of the sample Django project, as real processes on real Redis.

Two replicas run ``leader_run GROUP --every 0.2 -- nightly_report --seconds 0.5``; the
report prints ``report tick <pid> token=<n>`` every 0.1 s while it runs. From the ticks
(stamped when read): only one replica runs the report at a time, and a later run never
has a smaller token. SIGTERM on the leader releases the group (exit 143) and the other
replica takes over long before the lease could expire; SIGKILL leaves the lease to
expire, and the other takes over only then.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from harness import BaseServer

pytestmark = pytest.mark.slow

MANAGE = Path(__file__).resolve().parents[1] / "samples" / "django_project" / "manage.py"
#: Interpreters start slowly on a loaded machine.
STARTUP = 30.0
TICK = re.compile(r"report tick (\d+) token=(\d+)")


class Replica:
    """One ``manage.py leader_run`` process; its report ticks are stamped as they are read."""

    def __init__(self, url: str, group: str, lease: float, err: Path) -> None:
        command = [
            sys.executable, str(MANAGE), "leader_run", group, "--every", "0.2",
            "--lease-duration", f"{lease:g}", "--", "nightly_report", "--seconds", "0.5",
        ]  # fmt: skip
        self.err = err
        with err.open("w") as stderr:
            self.proc = subprocess.Popen(
                command,
                env={**os.environ, "MULTILOCK_URL": url},
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.pid = self.proc.pid
        self.ticks: list[tuple[float, int, int]] = []  # (read at, pid, token)
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,))
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        with stream:
            for line in stream:
                match = TICK.fullmatch(line.strip())
                if match:
                    self.ticks.append((time.monotonic(), int(match[1]), int(match[2])))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join()


def wait_for(
    condition: str, check: Callable[[], object], timeout: float, replicas: list[Replica]
) -> None:
    """Poll *check* until true; fail with the replicas' stderr after *timeout*."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {r.err.name}:\n{r.err.read_text()}" for r in replicas)
            pytest.fail(f"{condition}: not within {timeout} s\n{logs}")
        time.sleep(0.01)


def check_ticks(replicas: list[Replica]) -> list[tuple[int, int]]:
    """Assert that runs never overlap and tokens never fall; return the terms in order."""
    ticks = sorted(tick for replica in replicas for tick in replica.ticks)
    terms: list[tuple[int, int]] = []  # (pid, token), in the order they began
    for _, pid, token in ticks:
        if not terms or terms[-1] != (pid, token):
            assert (pid, token) not in terms, f"term {(pid, token)} ran again after {terms[-1]}"
            if terms:
                assert token > terms[-1][1], f"token fell: {terms[-1]} then {(pid, token)}"
            terms.append((pid, token))
    return terms


def start_pair(redis_server: BaseServer, tmp_path: Path, lease: float) -> list[Replica]:
    group = f"dj-{uuid.uuid4().hex[:12]}"
    return [Replica(redis_server.url, group, lease, tmp_path / f"{n}.err") for n in "ab"]


def leader_after_runs(replicas: list[Replica]) -> tuple[Replica, Replica]:
    """Wait for a replica to tick through more than one run; return (leader, other)."""
    wait_for(
        "a replica runs the report twice",
        lambda: any(len(r.ticks) >= 8 for r in replicas),
        STARTUP,
        replicas,
    )
    leader = max(replicas, key=lambda r: len(r.ticks))
    other = replicas[1] if leader is replicas[0] else replicas[0]
    return leader, other


def test_sigterm_hands_over_at_once(redis_server: BaseServer, tmp_path: Path) -> None:
    replicas = start_pair(redis_server, tmp_path, lease=10)
    try:
        leader, other = leader_after_runs(replicas)
        assert other.ticks == [], "both replicas ran the report"
        assert len({token for _, _, token in leader.ticks}) == 1  # --every: one term, many runs

        sent = time.monotonic()
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(timeout=5) == 128 + signal.SIGTERM, leader.err.read_text()
        # Released on SIGTERM: far sooner than the 10 s lease could expire.
        wait_for("the other replica takes over", lambda: other.ticks, 5, replicas)
        assert other.ticks[0][0] - sent < 5
        leader.stop()
        terms = check_ticks(replicas)
        assert [pid for pid, _ in terms] == [leader.pid, other.pid]
    finally:
        for replica in replicas:
            replica.stop()
    check_ticks(replicas)


def test_sigkill_hands_over_after_the_lease(redis_server: BaseServer, tmp_path: Path) -> None:
    lease = 2.0
    replicas = start_pair(redis_server, tmp_path, lease=lease)
    try:
        leader, other = leader_after_runs(replicas)
        killed = time.monotonic()
        leader.proc.kill()  # no release: the lease must expire first
        leader.stop()
        wait_for("the other replica takes over", lambda: other.ticks, STARTUP, replicas)
        waited = other.ticks[0][0] - killed
        # A release hands over in milliseconds; here the lease must expire first, and it
        # was renewed about renew_interval (lease / 3) or less before the kill.
        assert waited > lease / 2, f"took over {waited:.2f} s after SIGKILL: before expiry"
        assert waited < 2 * lease + 5, f"took over only {waited:.2f} s after SIGKILL"
        terms = check_ticks(replicas)
        assert [pid for pid, _ in terms] == [leader.pid, other.pid]
    finally:
        for replica in replicas:
            replica.stop()
