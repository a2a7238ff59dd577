"""``samples/apscheduler_job.py`` as two real replicas on the harness Redis server.

Both replicas run the same ``AsyncIOScheduler`` with a job every 0.2 s that prints
``job tick <pid> token=<n>``; only the elected one may tick. Both write their stdout to
one file opened for appending, so its lines are in the real order of the writes: if each
token belongs to one replica and tokens never go down along the file, two replicas never
ticked at the same time. Stopping the leader with SIGTERM must hand the job over well
within the lease; SIGKILL must hand it over only once the lease has expired.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from harness import BaseServer

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "apscheduler_job.py"
#: Interpreters start slowly on a loaded machine.
STARTUP = 30.0
TICK = re.compile(r"^job tick (\d+) token=(\d+)$", re.MULTILINE)
CAMPAIGNING = re.compile(r"^replica (\d+) ", re.MULTILINE)

T = TypeVar("T")


class Replicas:
    """Sample processes of one group, their stdout appended to one shared file."""

    def __init__(self, tmp_path: Path, url: str, group: str, lease: float) -> None:
        self.dir = tmp_path
        self.args = ["--url", url, "--group", group, "--lease", f"{lease:g}"]
        self.out = tmp_path / "replicas.out"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> subprocess.Popen[bytes]:
        # O_APPEND: every flushed line lands whole, after everything written before it.
        # Buffered: unbuffered, print() writes a line's text and its newline apart, and
        # the other replica's line can land between them.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
        with self.out.open("ab") as out, (self.dir / f"{name}.err").open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, str(SAMPLE), *self.args], stdout=out, stderr=err, env=env
            )
        self.procs[proc.pid] = proc
        return proc

    def ticks(self) -> list[tuple[int, int]]:
        """(pid, token) of every tick, in the order they were written."""
        return [(int(pid), int(token)) for pid, token in TICK.findall(self.output())]

    def campaigning(self) -> set[int]:
        return {int(pid) for pid in CAMPAIGNING.findall(self.output())}

    def output(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def logs(self) -> str:
        errs = "\n".join(f"--- {p.name}:\n{p.read_text()}" for p in sorted(self.dir.glob("*.err")))
        return f"--- stdout of both:\n{self.output()}\n{errs}"

    def wait_until(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        """Poll *check* until it returns a value; fail after *timeout* s or if a replica died."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            dead = {pid: p.returncode for pid, p in self.procs.items() if p.poll() is not None}
            if time.monotonic() > deadline or len(dead) == len(self.procs):
                pytest.fail(f"{what}: not within {timeout} s (exited: {dead})\n{self.logs()}")
            time.sleep(0.02)

    def assert_runs_never_overlap(self) -> list[tuple[int, int]]:
        ticks = self.ticks()
        owner: dict[int, int] = {}
        last = 0
        for pid, token in ticks:
            assert token >= last, f"token {token} of {pid} after token {last}\n{self.logs()}"
            assert owner.setdefault(token, pid) == pid, f"token {token} ticked in two replicas"
            last = token
        return ticks

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def replicas(redis_server: BaseServer, tmp_path: Path) -> Iterator[Callable[[float], Replicas]]:
    made: list[Replicas] = []

    def make(lease: float) -> Replicas:
        group = f"apscheduler-{uuid.uuid4().hex[:12]}"
        made.append(Replicas(tmp_path, redis_server.url, group, lease))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _leader_among_two(r: Replicas) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    """Start two replicas; once both campaign, only one ticks: return (leader, follower)."""
    r.start("a")
    r.start("b")
    r.wait_until("both replicas campaigning", lambda: len(r.campaigning()) == 2, STARTUP)
    before = len(r.ticks())
    ticks = r.wait_until("5 ticks", lambda: r.ticks()[before + 4 :], STARTUP)
    pids = {pid for pid, _ in r.ticks()}
    assert len(pids) == 1, f"both replicas ticked\n{r.logs()}"
    # The sample's job prints "job skipped" when it runs while not leading: the
    # follower's scheduler must not run it at all.
    assert "job skipped" not in r.output(), f"a paused scheduler ran its job\n{r.logs()}"
    leader = r.procs[ticks[0][0]]
    (follower,) = (p for p in r.procs.values() if p is not leader)
    return leader, follower


def test_only_the_leader_ticks_and_sigterm_hands_over_at_once(
    replicas: Callable[[float], Replicas],
) -> None:
    r = replicas(10)
    leader, follower = _leader_among_two(r)

    stopped_at = time.monotonic()
    leader.send_signal(signal.SIGTERM)
    assert leader.wait(STARTUP) == 128 + signal.SIGTERM, r.logs()
    r.wait_until(
        "the follower ticking within 5 s of SIGTERM (lease 10 s)",
        lambda: [pid for pid, _ in r.ticks() if pid == follower.pid],
        stopped_at + 5 - time.monotonic(),
    )
    ticks = r.assert_runs_never_overlap()
    old = {token for pid, token in ticks if pid == leader.pid}
    new = {token for pid, token in ticks if pid == follower.pid}
    assert len(old) == len(new) == 1
    assert new.pop() > old.pop()

    follower.send_signal(signal.SIGTERM)
    assert follower.wait(STARTUP) == 128 + signal.SIGTERM, r.logs()


def test_sigkill_hands_over_once_the_lease_expired(
    replicas: Callable[[float], Replicas],
) -> None:
    lease = 2.0
    r = replicas(lease)
    leader, follower = _leader_among_two(r)

    killed_at = time.monotonic()
    leader.kill()
    assert leader.wait(STARTUP) == -signal.SIGKILL
    r.wait_until(
        "the follower ticking after the lease expired",
        lambda: [pid for pid, _ in r.ticks() if pid == follower.pid],
        10,  # at most lease + retry interval (2 s) after the last renewal, plus slack
    )
    waited = time.monotonic() - killed_at
    # The last renewal was at most lease/3 before the kill: Redis keeps the lease at least
    # 2/3 of it after the kill, and nobody may tick before.
    assert waited > lease / 2, f"took over {waited:.2f} s after SIGKILL, before the lease expired"
    ticks = r.assert_runs_never_overlap()
    assert max(t for p, t in ticks if p == follower.pid) > max(
        t for p, t in ticks if p == leader.pid
    )

    follower.send_signal(signal.SIGTERM)
    assert follower.wait(STARTUP) == 128 + signal.SIGTERM, r.logs()
