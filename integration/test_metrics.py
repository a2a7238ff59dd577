"""``samples/metrics_service.py``: two replicas on Redis, each scraped over HTTP.

Each replica is a real process serving ``/metrics`` (prometheus_client's server on a port
the system picks, which it prints). The leader's scrape shows ``multilock_is_leader`` 1
and one term won, the follower's 0 and none. SIGTERM makes the leader release its lease
and exit 143 (``stop_on_signals``); the follower's scrape must then show it leading well
before the 10 s lease could have expired, with one ``multilock_failover_seconds``
observation: from being told of the release to winning the group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import BaseServer

pytestmark = pytest.mark.slow

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "metrics_service.py"
#: Interpreters start slowly on a loaded machine.
STARTUP = 30.0
LEASE = 10.0
TICK = "leader tick "

T = TypeVar("T")


class Replica:
    """One ``metrics_service.py`` process; its output goes to a file read on demand."""

    def __init__(self, name: str, url: str, group: str, logs: Path) -> None:
        self.name, self.group = name, group
        self.out = logs / f"{name}.out"
        argv = [
            sys.executable, str(SAMPLE), "--group", group, "--metrics-port", "0",
            "--lease", f"{LEASE:g}", "--interval", "0.2",
        ]  # fmt: skip
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**os.environ, "MULTILOCK_URL": url},  # not in the process list
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def port(self) -> int | None:
        found = (re.fullmatch(r"metrics on port (\d+)", line) for line in self.lines())
        return next((int(m.group(1)) for m in found if m), None)

    def scrape(self) -> dict[str, float]:
        """This group's ``multilock_*`` samples, buckets left out, by sample name."""
        url = f"http://127.0.0.1:{self.port()}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels == {"group": self.group}
        }

    def participant_id(self) -> str | None:
        found = (re.match(r"(\S+) campaigns for ", line) for line in self.lines())
        return next((m.group(1) for m in found if m), None)

    def saw_leader(self, participant_id: str) -> bool:
        return f"leader is {participant_id}" in self.lines()

    def ticked(self) -> bool:
        return any(line.startswith(TICK) for line in self.lines())

    def report(self) -> str:
        return f"--- {self.name} output (tail):\n" + "\n".join(self.lines()[-20:])


def wait_for(what: str, check: Callable[[], T | None], replicas: list[Replica]) -> T:
    """Poll *check* until it returns something not None (errors count as not yet)."""
    deadline = time.monotonic() + STARTUP
    while True:
        try:
            result = check()
        except OSError:  # not serving yet
            result = None
        if result is not None:
            return result
        if time.monotonic() >= deadline:
            pytest.fail(f"{what} within {STARTUP} s\n" + "\n".join(r.report() for r in replicas))
        for replica in replicas:
            if replica.proc.poll() is not None:
                pytest.fail(f"{replica.name} exited early\n{replica.report()}")
        time.sleep(0.05)


@pytest.fixture
def replicas(redis_server: BaseServer, tmp_path: Path) -> Iterator[list[Replica]]:
    group = f"metrics-{uuid.uuid4().hex[:12]}"
    started = [Replica(name, redis_server.url, group, tmp_path) for name in ("a", "b")]
    yield started
    for replica in started:
        if replica.proc.poll() is None:
            replica.proc.kill()
        replica.proc.wait()


def test_scrapes_show_the_leader_and_a_fast_failover(replicas: list[Replica]) -> None:
    def leading() -> Replica | None:
        ticking = [r for r in replicas if r.ticked()]
        assert len(ticking) <= 1, "two leaders:\n" + "\n".join(r.report() for r in replicas)
        return ticking[0] if ticking else None

    leader = wait_for("a replica to print leader ticks", leading, replicas)
    follower = next(r for r in replicas if r is not leader)

    def settled() -> tuple[dict[str, float], dict[str, float]] | None:
        both = leader.scrape(), follower.scrape()
        return both if both[0].get("multilock_is_leader") == 1 and both[1] else None

    on_leader, on_follower = wait_for("both scrapes", settled, replicas)
    assert on_leader["multilock_terms_won_total"] == 1, on_leader
    assert on_follower["multilock_is_leader"] == 0, on_follower
    assert on_follower["multilock_terms_won_total"] == 0, on_follower
    assert on_follower["multilock_failover_seconds_count"] == 0, on_follower
    assert not follower.ticked(), "two leaders"
    # The follower has seen the leader: it follows, so a release is news to it. (Stopped
    # before its first round, the leader would leave it a free group to win at once,
    # never seen vacant: no failover to observe.)
    leader_id = leader.participant_id()
    assert leader_id is not None, leader.report()
    wait_for(
        "the follower to see the leader", lambda: follower.saw_leader(leader_id) or None, replicas
    )

    leader.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()

    def took_over() -> dict[str, float] | None:
        scrape = follower.scrape()
        return scrape if scrape.get("multilock_is_leader") == 1 else None

    after = wait_for("the follower's scrape to show it leading", took_over, [follower])
    # The leader released its lease on SIGTERM: a takeover by the lease's expiry would
    # take about LEASE seconds.
    assert time.monotonic() - sent < LEASE / 2, after
    assert leader.proc.wait(STARTUP) == 128 + signal.SIGTERM, leader.report()
    assert after["multilock_terms_won_total"] == 1, after
    assert after["multilock_failover_seconds_count"] == 1, after
    # From seeing the group vacant (told of the release) to winning it: one round trip.
    assert after["multilock_failover_seconds_sum"] < LEASE / 10, after
    wait_for("the new leader's ticks", lambda: follower.ticked() or None, [follower])

    follower.proc.send_signal(signal.SIGTERM)
    assert follower.proc.wait(STARTUP) == 128 + signal.SIGTERM, follower.report()
