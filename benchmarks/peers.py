"""Peer comparison: tooz's leader election and kazoo's Election recipe beside multilock.

Run by ``run.py --peers`` on the servers that ``run.py`` started for multilock, with the
same lease. Per peer and backend:

1. graceful handoff: two candidates in this process (threads, one client each); the
   leader stands down and the other's elected callback fires (``time.perf_counter``);
2. crash failover: a 3-process `PeerCluster` (``peer_clients.py`` as the program),
   SIGKILL of the leader to the next ``acquired`` line, measured by ``run.measure_crash``;
3. the server-side cost of one idle follower: the server's own counters (Redis
   ``INFO commandstats``, ZooKeeper ``mntr`` packets received) with the leader alone,
   then with the leader and one follower. multilock is measured the same way here too.
"""

from __future__ import annotations

import queue
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from common import HANDOFF_RETRY, fmt, say, summary
from peer_clients import Candidate, make_candidate, whole_seconds

from multilock.core.testing import Cluster, Member

#: (system, backend) pairs compared; tooz's election exists only in its redis,
#: zookeeper and memcached drivers (etcd3gw, file, postgresql, mysql raise NotImplemented).
SETUPS = [
    ("multilock", "redis"),
    ("tooz", "redis"),
    ("multilock", "zookeeper"),
    ("tooz", "zookeeper"),
    ("kazoo", "zookeeper"),
]
NOT_RUN = {
    "tooz memcached": "tooz's memcached driver also elects leaders, but multilock has no "
    "memcached backend to compare with on the same server, and no memcached runs here",
    "tooz etcd3gw, file, postgresql, mysql": "these drivers raise NotImplemented for "
    "watch_elected_as_leader",
}
PROGRAM = Path(__file__).resolve().with_name("peer_clients.py")


# --------------------------------------------------------------------------- handoff
def measure_handoff(
    system: str, url: str, count: int, lease: float, poll: float, group: str = "peer-handoff"
) -> dict[str, Any]:
    """Stand the leader down *count* times; time until the other candidate is elected.

    The candidate that stood down campaigns again only after the other has won (tooz's
    candidates would otherwise race to re-take it at their next poll). tooz's next
    handoff starts at a random phase of its polls; kazoo's, as multilock's handoff phase,
    20 ms after the candidate that stood down is back in line."""
    events: queue.Queue[tuple[int, float]] = queue.Queue()
    candidates = [
        make_candidate(system, url, f"{group}-{system}", f"handoff-{i}", lease, poll)
        for i in (0, 1)
    ]
    latencies: list[float] = []
    failures = 0
    rng = random.Random(7)
    try:
        for i, candidate in enumerate(candidates):
            candidate.start(partial(_stamp, events, i))
        leader, _ = events.get(timeout=lease * 10 + 30)
        time.sleep(lease + poll)  # both campaigning, the follower settled
        for _ in range(count):
            other = 1 - leader
            _drain(events)
            started = time.perf_counter()
            candidates[leader].stand_down()
            try:
                who, at = events.get(timeout=lease * 3)
            except queue.Empty:
                who, at = -1, 0.0
            candidates[leader].resume()
            if who != other:
                failures += 1
                leader, _ = events.get(timeout=lease * 10)
                continue
            latencies.append((at - started) * 1000)
            resigner, leader = candidates[leader], other
            deadline = time.monotonic() + lease * 3
            while (queued := resigner.in_line()) is False and time.monotonic() < deadline:
                time.sleep(0.002)
            if queued is None:
                # No line (tooz): the resigner back to following, and a random phase
                # against the pollers.
                time.sleep(poll + 0.05 + rng.uniform(0, poll))
            else:
                # A notified peer (kazoo) is paced as multilock's handoff phase is: the
                # resigner back in line, then 20 ms. The pause weighs on the figure (a
                # machine idle longer wakes slower), so both wait alike.
                time.sleep(0.02)
    finally:
        for candidate in candidates:
            candidate.close()
    return summary(latencies, failures)


def _stamp(events: queue.Queue[tuple[int, float]], i: int) -> None:
    events.put((i, time.perf_counter()))


def _drain(events: queue.Queue[Any]) -> None:
    while not events.empty():
        events.get_nowait()


# --------------------------------------------------------------------------- crash
class PeerCluster(Cluster):
    """A `Cluster` whose members run ``peer_clients.py`` (a tooz or kazoo participant)."""

    def __init__(self, peer: str, url: str, group: str, lease: float, poll: float) -> None:
        super().__init__(url, f"{group}-{peer}", size=3, lease=lease)
        self.peer, self.poll = peer, poll

    def launch(self, member: Member) -> None:
        if member.alive:
            raise RuntimeError(f"{member.name} is already running")
        cmd = [
            sys.executable, str(PROGRAM), "--peer", self.peer, "--group", self.group,
            "--id", member.name, "--log", str(member.log_path),
            "--lease", str(self.lease), "--poll", str(self.poll),
        ]  # fmt: skip
        with open(member.log_path.with_suffix(".stderr"), "ab") as stderr:
            member.process = subprocess.Popen(cmd, env=self._env, stderr=stderr)
        member.frozen = False


# --------------------------------------------------------------------------- idle
class RedisCounter:
    """``INFO commandstats`` of one Redis server, minus the INFO calls themselves."""

    def __init__(self, url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=5)

    def snapshot(self) -> Counter[str]:
        stats = self._client.info("commandstats")
        return Counter(
            {
                k.removeprefix("cmdstat_"): v["calls"]
                for k, v in stats.items()
                if k != "cmdstat_info"
            }
        )

    def close(self) -> None:
        self._client.close()


class ZooKeeperCounter:
    """Packets the ZooKeeper server received (``mntr``), pings included."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._address = (parts.hostname or "127.0.0.1", parts.port or 2181)

    def snapshot(self) -> Counter[str]:
        with socket.create_connection(self._address, timeout=5) as sock:
            sock.sendall(b"mntr")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        for line in b"".join(chunks).decode().splitlines():
            key, _, value = line.partition("\t")
            if key == "zk_packets_received":
                return Counter({"packets": int(value)})
        raise RuntimeError("mntr gave no zk_packets_received")

    def close(self) -> None:
        pass


def counter_for(backend: str, url: str) -> RedisCounter | ZooKeeperCounter:
    return RedisCounter(url) if backend == "redis" else ZooKeeperCounter(url)


def per_second(after: Counter[str], before: Counter[str], seconds: float) -> dict[str, float]:
    delta = Counter(after)
    delta.subtract(before)
    return {k: v / seconds for k, v in delta.items() if v}


def measure_idle(
    system: str, backend: str, url: str, leases: int, lease: float, poll: float
) -> dict[str, Any]:
    """Server operations per second with the leader alone, then with one idle follower."""
    counter = counter_for(backend, url)
    group = f"peer-idle-{system}"
    window = leases * lease / 2
    elected: dict[str, float] = {}  # who was ever elected

    def candidate(name: str) -> Candidate:
        made = make_candidate(system, url, group, name, lease, poll)
        made.start(partial(elected.setdefault, name, 0.0))
        return made

    started: list[Candidate] = []
    try:
        started.append(candidate("idle-leader"))
        _wait_for(lambda: "idle-leader" in elected, lease * 10 + 30)
        time.sleep(lease)
        alone = _rate(counter, window)
        started.append(candidate("idle-follower"))
        time.sleep(lease * 2)
        both = _rate(counter, window)
    finally:
        for made in reversed(started):
            made.close()
        counter.close()
    share = sum(both.values()) - sum(alone.values())
    return {
        "window": window,
        "alone": alone,
        "both": both,
        "follower_per_second": share,
        "follower_per_lease": share * lease,
        "follower_elected": "idle-follower" in elected,
    }


def _rate(counter: RedisCounter | ZooKeeperCounter, window: float) -> dict[str, float]:
    before, began = counter.snapshot(), time.monotonic()
    time.sleep(window)
    return per_second(counter.snapshot(), before, time.monotonic() - began)


def _wait_for(predicate: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("nobody was elected")
        time.sleep(0.01)


# --------------------------------------------------------------------------- the run
CrashFn = Callable[[Cluster, int, float, bool], dict[str, Any]]


def run_all(
    urls: dict[str, str], args: Any, crash: CrashFn, results: dict[str, dict[str, Any]]
) -> dict[tuple[str, str], dict[str, Any]]:
    """Every setup whose server runs here; multilock's handoff and crash are run.py's."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for system, backend in SETUPS:
        if backend not in urls:
            continue
        url, lease, poll = urls[backend], args.lease, args.peer_poll
        r: dict[str, Any] = out.setdefault((system, backend), {})
        if system == "multilock":
            r["handoff"] = results[backend].get("handoff")
            r["crash"] = results[backend].get("crash")
        else:
            say(f"{system} on {backend}: {args.handoffs} handoffs, poll {poll:g} s")
            r["handoff"] = _attempt(
                partial(measure_handoff, system, url, args.handoffs, lease, poll)
            )
            say(f"{system} on {backend}: handoff {r['handoff']}")
            cluster = PeerCluster(system, url, "bench-crash", lease, poll)
            r["crash"] = _attempt(partial(crash, cluster, args.kills, lease, False))
            say(f"{system} on {backend}: crash {r['crash']}")
        leases = args.idle_leases
        r["idle"] = _attempt(partial(measure_idle, system, backend, url, leases, lease, poll))
        say(f"{system} on {backend}: idle follower {r['idle']}")
    return out


def _attempt(fn: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    try:
        return fn()
    except Exception as exc:
        return {"error": repr(exc)[:300]}


# --------------------------------------------------------------------------- the report
def report_section(peer: dict[tuple[str, str], dict[str, Any]], args: Any) -> list[str]:
    if not peer:
        return []
    seconds = whole_seconds(args.lease)
    out = [
        "",
        "## 4. Peer comparison: multilock, tooz, kazoo's Election (one run, same servers)",
        "",
        f"The same Redis and ZooKeeper servers as sections 1 to 3, in the same run, lease "
        f"{args.lease:g} s for everyone: multilock's `lease_duration`; tooz's `timeout`, "
        f"`lock_timeout` and `membership_timeout` ({seconds} s: tooz takes whole seconds); "
        f"the ZooKeeper session timeout ({args.lease:g} s) for tooz's zookeeper driver and "
        "kazoo. tooz runs its election callbacks only inside `run_watchers()`, which the "
        f"application must poll: here every {args.peer_poll:g} s (tooz's tutorial polls "
        "every 0.1 s; multilock's handoff benchmark uses a retry_interval of "
        f"{HANDOFF_RETRY:g} s (the resigner's hold-off), and its default at this lease is "
        f"{min(2.0, args.lease):g} s), and tooz's heart "
        "thread renews the leader's lock at its own pace (every half timeout).",
        "",
        "| system | backend | handoff p50 ms | handoff p95 ms | handoffs (failed) "
        "| crash failover mean s | crash max s | idle follower: server ops/lease "
        "| what the follower's ops are |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (system, backend), r in peer.items():
        h, c, i = r.get("handoff"), r.get("crash"), r.get("idle")
        out.append(
            f"| {system} | {backend} | {_cell(h, 'p50', 1)} | {_cell(h, 'p95', 1)} | "
            f"{_count(h)} | {_cell(c, 'mean', 3)} | {_cell(c, 'max', 3)} | "
            f"{_cell(i, 'follower_per_lease', 2)} | {_ops(i)} |"
        )
    out += ["", *PEER_NOTES, *(f"- Not run: {k}: {v}." for k, v in NOT_RUN.items())]
    return out


PEER_NOTES = [
    "- Handoff: multilock's row is section 1 (`resign()` to the other's ACQUIRED event). "
    "tooz: the leader calls `stand_down_group_leader` (zookeeper driver); the redis "
    "driver does not implement it, so the leader stops its coordinator, which releases "
    "its lock; the other is elected at its next `run_watchers()` poll, so the latency is "
    "about half the poll period on average, up to a full one. kazoo: the leader's "
    "`func` returns, the recipe deletes its lock node and the next candidate's watch "
    "fires. The candidate that stood down campaigns again only after the other has won. "
    "tooz's next handoff starts at a random phase of the polls; kazoo's, as multilock's, "
    "20 ms after that candidate is back in line (its lock node queued): how long the "
    "machine idled before a handoff weighs on it: in one side-by-side run of three rounds "
    "each, kazoo's p50 was 3.0 ms paced so and 3.5 ms with the 0.3 to 0.55 s pauses of "
    "the reports before (multilock's: 3.4 ms).",
    "- Crash failover: a 3-process cluster, SIGKILL of the leader to the next elected "
    "callback (kazoo, tooz) or ACQUIRED event (multilock), on one monotonic clock. tooz "
    "on redis: its lock expires `lock_timeout` after the last renewal, then the next "
    "poll takes it; on zookeeper, and kazoo: the session timeout, then ZooKeeper deletes "
    "the ephemeral node. The peers have no fencing token and no loss notification (a "
    "tooz leader is never told it lost its lock; kazoo's `func` keeps running unless "
    "the application watches the connection state), so their timelines cannot be "
    "checked for overlap: 'n/a' in the crash rows is that, not a failure.",
    "- Idle follower: the server's own counters (Redis `INFO commandstats`, ZooKeeper "
    "`mntr` zk_packets_received, pings included) with the leader alone, then with the "
    "leader and one idle follower, over the same windows for every system; the difference "
    "is the follower's. It therefore also holds any change in the leader's own traffic "
    "between the windows: renewal commands in a multilock Redis share (EVALSHA and the "
    "HSET, PEXPIRE and HMGET its script runs) are the leader's, which renewed more often "
    "in the second window (a multilock leader also renews at once whenever its own watch "
    "wakes, but for its own acquire's notification); the follower's own commands are its "
    "HMGET and PTTL, as in section 3's "
    "cross-check.",
]


def _cell(r: dict[str, Any] | None, key: str, digits: int) -> str:
    if r is None:
        return "n/a"
    if "error" in r:
        return f"error: {r['error']}"
    return fmt(r.get(key), digits)


def _count(h: dict[str, Any] | None) -> str:
    return "n/a" if h is None or "error" in h else f"{h['count']} ({h['failures']})"


def _ops(i: dict[str, Any] | None) -> str:
    if i is None or "error" in i:
        return "n/a"
    delta = {k: i["both"].get(k, 0.0) - i["alone"].get(k, 0.0) for k in i["both"]}
    shown = sorted(((v, k) for k, v in delta.items() if v >= 0.05), reverse=True)
    return ", ".join(f"{k} {v:.2f}/s" for v, k in shown) or "none"
