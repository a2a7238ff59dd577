"""Celery beat with `multilock.celery.LeaderScheduler`: real processes on the harness Redis.

Two or three ``celery beat`` replicas of ``samples/celery_app.py`` (each with its own
schedule file) campaign for one fresh group; one ``celery worker --pool solo`` runs what
they send and logs, for every ``tick``, the sending beat's pid and the time it sent (the
sample computes both in beat at send time). Redis is the multilock store (db 0) and the broker
(a db of each test's own, its queue emptied first); ticks are told apart by the pids of
this test's beats.

What is checked, from the worker's log:

- While all replicas run, every tick comes from one of them.
- SIGTERM the leader (three replicas): it releases its lease while closing, and one other
  sends its first tick well within the lease (10 s lease, 5 s allowed; one 0.5 s interval
  of that is the new leader restarting its schedule, ``multilock_reset_on_acquire``).
  The third replica, a follower waiting in its tick, then stops cleanly on SIGTERM.
- SIGKILL the leader (2 s lease): the other sends only once the lease has expired, and
  within ``lease + retry_interval`` plus the interval and slack.
- At each handoff the old leader's last tick precedes the new leader's first by at least
  one interval, so no half-second slot holds ticks of both leaders (measured: none, with
  gaps of 0.53 s after SIGTERM and 2.35 s after SIGKILL; without the schedule restart on
  acquire, one slot after SIGTERM, the two ticks 42 ms apart). The gaps are printed.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import pytest
from redis import Redis

from harness import BaseServer

pytestmark = pytest.mark.slow

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
#: Interpreters and Celery start slowly on a loaded machine.
STARTUP = 45.0
#: The sample's beat entry runs every half second.
EVERY = 0.5
TICK = re.compile(r"tick sent by beat \S+:(\d+) at (\d+\.\d+)")


@dataclass(frozen=True)
class Tick:
    pid: int
    sent_at: float


class Deployment:
    """A worker and two beat replicas of the sample app, each logging to its own file."""

    def __init__(self, tmp_path: Path, broker: str, store: str, lease: float) -> None:
        self.tmp_path = tmp_path
        self.env = {
            **os.environ,
            "CELERY_BROKER_URL": broker,
            "MULTILOCK_URL": store,
            "MULTILOCK_GROUP": f"celery-{uuid.uuid4().hex[:12]}",
            "MULTILOCK_LEASE": f"{lease:g}",
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "celery", "-A", "samples.celery_app", *args]
        with (self.tmp_path / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs[name] = proc
        return proc

    def start_beat(self, name: str) -> subprocess.Popen[bytes]:
        schedule = str(self.tmp_path / f"{name}-schedule")
        return self.start(
            name, "beat", "-S", "multilock.celery:LeaderScheduler",
            "--schedule", schedule, "--pidfile=", "-l", "info",
        )  # fmt: skip

    def start_worker(self) -> subprocess.Popen[bytes]:
        return self.start(
            "worker", "worker", "--pool", "solo", "-l", "info", "-n", f"{uuid.uuid4().hex[:8]}@%h",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
        )  # fmt: skip

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {name}.log:\n{self.log(name)[-4000:]}" for name in self.procs)

    def ticks(self, pids: set[int]) -> list[Tick]:
        """The ticks the worker ran that these beats sent, in the order they were sent."""
        found = (Tick(int(m[1]), float(m[2])) for m in TICK.finditer(self.log("worker")))
        return sorted((t for t in found if t.pid in pids), key=lambda t: t.sent_at)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_for(what: str, check: Callable[[], T | None], timeout: float, dep: Deployment) -> T:
    """Poll *check* until it returns something other than None; fail after *timeout* s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value is not None:
            return value
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout:g} s\n{dep.logs()}")


def at_least(count: int, ticks: list[Tick]) -> list[Tick] | None:
    return ticks if len(ticks) >= count else None


def broker_url(server: BaseServer, db: int) -> str:
    """The server's URL on database *db*, its queue emptied."""
    parts = urlsplit(server.url)
    url = urlunsplit(parts._replace(path=f"/{db}"))
    client = Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url


@pytest.fixture
def deploy(redis_server: BaseServer, tmp_path: Path) -> Iterator[Callable[..., Deployment]]:
    made: list[Deployment] = []

    def deploy(db: int, lease: float) -> Deployment:
        dep = Deployment(tmp_path, broker_url(redis_server, db), redis_server.url, lease)
        made.append(dep)
        return dep

    yield deploy
    for dep in made:
        dep.stop()


def elect(dep: Deployment, names: tuple[str, ...]) -> tuple[str, list[str]]:
    """Start a worker and beats *names*; return the leader and the followers.

    Every tick of a 3 s window must come from one beat. The window opens once all of
    them campaign, so the followers truly compete in it.
    """
    dep.start_worker()
    beats = {name: dep.start_beat(name) for name in names}
    pids = {proc.pid for proc in beats.values()}

    def campaigning() -> bool | None:
        return all("beat campaigns for group" in dep.log(n) for n in beats) or None

    wait_for("all beats campaigning", campaigning, STARTUP, dep)
    opened = time.time()
    window = wait_for(
        "seven ticks after all beats campaign",
        lambda: at_least(7, [t for t in dep.ticks(pids) if t.sent_at > opened]),
        STARTUP,
        dep,
    )
    senders = {t.pid for t in window}
    assert len(senders) == 1, f"ticks from {senders} while all ran\n{dep.logs()}"
    leader = next(n for n, p in beats.items() if p.pid in senders)
    followers = [n for n in names if n != leader]
    for name, proc in beats.items():
        assert proc.poll() is None, f"beat {name} exited\n{dep.logs()}"
    assert "ACQUIRED: beat leads group" in dep.log(leader)
    for name in followers:
        assert "ACQUIRED" not in dep.log(name), dep.logs()
    return leader, followers


def handoff(dep: Deployment, old: str, followers: list[str], after: float) -> tuple[str, Tick]:
    """Wait for three ticks sent after *after* by the followers; return the new leader.

    Check that one follower sent them all, that all of *old*'s ticks precede them, and
    that no half-second slot holds ticks of both leaders.
    """
    candidates = {dep.procs[name].pid for name in followers}
    three = wait_for(
        "three ticks of a new leader",
        lambda: at_least(3, [t for t in dep.ticks(candidates) if t.sent_at > after]),
        STARTUP,
        dep,
    )
    senders = {t.pid for t in three}
    assert len(senders) == 1, f"two followers sent after the handoff: {three}\n{dep.logs()}"
    new = next(name for name in followers if dep.procs[name].pid in senders)
    old_pid, new_pid = dep.procs[old].pid, dep.procs[new].pid
    ticks = dep.ticks(candidates | {old_pid})
    assert {t.pid for t in ticks} == {old_pid, new_pid}, f"a third sender: {ticks}"
    last_old = max(t.sent_at for t in ticks if t.pid == old_pid)
    first_new = min(t.sent_at for t in ticks if t.pid == new_pid)
    assert last_old < first_new, f"the two leaders interleaved\n{ticks}"
    slots: dict[int, set[int]] = {}
    for t in ticks:
        slots.setdefault(math.floor(t.sent_at / EVERY), set()).add(t.pid)
    shared = sum(1 for senders in slots.values() if len(senders) > 1)
    # The new leader restarts its schedule when its term begins (after the old one's last
    # tick), so its first tick comes a whole interval later: no slot is shared. Without
    # the restart (multilock_reset_on_acquire=False) one is, after SIGTERM: the survivor's
    # file says the entry is due and it sends at once, ~40 ms after the old leader did.
    assert first_new - last_old >= EVERY - 0.02, f"no interval between the leaders: {ticks}"
    assert shared == 0, f"{shared} half-second slots hold ticks of both leaders"
    print(
        f"handoff: last tick of the old leader {last_old - after:+.3f} s, first of the new "
        f"{first_new - after:+.3f} s after the signal; slots shared: {shared}"
    )
    assert "ACQUIRED: beat leads group" in dep.log(new)
    return new, three[0]


def test_sigterm_hands_over_at_once(deploy: Callable[..., Deployment]) -> None:
    dep = deploy(db=1, lease=10)
    leader, followers = elect(dep, ("a", "b", "c"))

    signalled = time.time()
    dep.procs[leader].send_signal(signal.SIGTERM)
    new, first = handoff(dep, leader, followers, signalled)
    latency = first.sent_at - signalled
    assert latency < 5.0, f"the follower took {latency:.3f} s to send after a graceful stop"
    assert dep.procs[leader].wait(STARTUP) == 0, dep.logs()
    assert "LOST: beat no longer leads group" in dep.log(leader)

    # A follower, blocked in its tick waiting for a term, stops cleanly and at once.
    (idle,) = (name for name in followers if name != new)
    stopping = time.monotonic()
    dep.procs[idle].send_signal(signal.SIGTERM)
    assert dep.procs[idle].wait(STARTUP) == 0, dep.logs()
    assert time.monotonic() - stopping < 5.0
    assert "ACQUIRED" not in dep.log(idle)
    dep.procs[new].send_signal(signal.SIGTERM)
    assert dep.procs[new].wait(STARTUP) == 0, dep.logs()


def test_sigkill_hands_over_after_the_lease_expires(deploy: Callable[..., Deployment]) -> None:
    lease = 2.0
    dep = deploy(db=2, lease=lease)
    leader, followers = elect(dep, ("a", "b"))

    killed = time.time()
    dep.procs[leader].kill()
    _, first = handoff(dep, leader, followers, killed)
    latency = first.sent_at - killed
    # The lease was last renewed about renew_interval (lease / 3) before the kill at the
    # earliest: the follower may not lead before it expires (and, restarting its schedule,
    # sends one interval later still: that is slack for a late renewal).
    renew_interval = lease / 3
    assert latency >= lease - renew_interval, f"sent {latency:.3f} s after SIGKILL"
    retry_interval = min(2.0, lease)
    assert latency < lease + retry_interval + EVERY + 3.0, f"took {latency:.3f} s"
    assert dep.procs[leader].wait(STARTUP) == -signal.SIGKILL
