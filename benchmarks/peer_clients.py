"""The peers multilock is benchmarked against, behind one small thread-based interface.

- `ToozCandidate`: tooz's leader election (``watch_elected_as_leader`` + ``run_watchers``
  polled every *poll* seconds, as tooz's tutorial does in its loop), on the drivers that
  implement it here: ``redis`` and ``zookeeper``.
- `KazooCandidate`: kazoo's ``Election`` recipe (``client.Election(path, id).run(func)``):
  the leader is whoever runs ``func``; it gives leadership up when ``func`` returns.
- `MultilockCandidate`: multilock's sync facade, for the measurements that must treat
  every system alike (the idle follower's server-side cost).

Each candidate calls ``on_elected()`` the moment its library says it leads. ``stand_down()``
gives leadership up and stops campaigning until ``resume()``. Run as a program, this
module is one participant process for `peers.PeerCluster`, logging in the format of
``multilock.core.testing.participant`` (``started``, ``acquired``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

PEERS = ("tooz", "kazoo")


class Candidate(Protocol):
    def start(self, on_elected: Callable[[], object]) -> None: ...
    def stand_down(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...
    def in_line(self) -> bool | None: ...


def whole_seconds(lease: float) -> int:
    """tooz takes its timeouts as whole seconds."""
    return max(1, math.ceil(lease))


def tooz_url(url: str, lease: float) -> str:
    """multilock's redis:// or zookeeper:// URL as tooz's, with every timeout = lease."""
    parts = urlsplit(url)
    seconds = whole_seconds(lease)
    if parts.scheme == "redis":
        query = f"timeout={seconds}&lock_timeout={seconds}&membership_timeout={seconds}"
        return f"redis://{parts.netloc}?{query}"
    if parts.scheme == "zookeeper":
        return f"zookeeper://{parts.netloc}?timeout={seconds}"
    raise ValueError(f"tooz's election runs on redis and zookeeper here, not {parts.scheme}")


class _Threaded:
    """A daemon thread running ``self._loop()``, and the flags every candidate keeps."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.campaigning = threading.Event()
        self.campaigning.set()
        self.on_elected: Callable[[], object] = lambda: None
        self._thread: threading.Thread | None = None

    def _spawn(self, on_elected: Callable[[], object]) -> None:
        self.on_elected = on_elected
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        raise NotImplementedError

    def resume(self) -> None:
        self.campaigning.set()

    def in_line(self) -> bool | None:
        """Whether this candidate waits in line behind the leader; None: no line (tooz)."""
        return None

    def _join(self) -> None:
        self.closed.set()
        self.campaigning.set()
        if self._thread is not None:
            self._thread.join(10)


class ToozCandidate(_Threaded):
    """A tooz coordinator that joins *group* and runs for its leadership.

    tooz runs election callbacks only from ``run_watchers()``, which the caller must poll;
    here a thread polls it every *poll* seconds. The coordinator's heart thread renews
    the leader's lock (tooz's own pace: half the lock timeout). Standing down uses
    ``stand_down_group_leader`` where the driver has it (zookeeper); the redis driver
    does not implement it, so there the leader stops its coordinator, which releases its
    locks, and starts a new session on `resume()`.
    """

    def __init__(self, url: str, group: str, member: str, lease: float, poll: float) -> None:
        super().__init__()
        from tooz import coordination

        self._coordination = coordination
        self.url, self.poll = tooz_url(url, lease), poll
        self.group, self.member = group.encode(), member.encode()
        self.coordinator = coordination.get_coordinator(self.url, self.member)
        self._lock = threading.Lock()  # run_watchers vs stand_down/stop

    def start(self, on_elected: Callable[[], object]) -> None:
        self._join_group()
        self._spawn(on_elected)

    def _join_group(self) -> None:
        c, coordination = self.coordinator, self._coordination
        c.start(start_heart=True)
        with contextlib.suppress(coordination.GroupAlreadyExist):
            c.create_group(self.group).get()
        with contextlib.suppress(coordination.MemberAlreadyExist):
            c.join_group(self.group).get()
        c.watch_elected_as_leader(self.group, self._elected)

    def _loop(self) -> None:
        while not self.closed.is_set():
            self.campaigning.wait()
            with self._lock:
                if self.campaigning.is_set() and self.coordinator.is_started:
                    self.coordinator.run_watchers()
            self.closed.wait(self.poll)

    def stand_down(self) -> None:
        import tooz

        with self._lock:
            self.campaigning.clear()
            try:
                self.coordinator.stand_down_group_leader(self.group)
            except tooz.NotImplemented:
                self.coordinator.unwatch_elected_as_leader(self.group, self._elected)
                self.coordinator.stop()

    def _elected(self, event: Any) -> None:
        self.on_elected()

    def resume(self) -> None:
        with self._lock:
            if not self.coordinator.is_started:
                self._join_group()
        super().resume()

    def close(self) -> None:
        self._join()
        with self._lock:
            if self.coordinator.is_started:
                self.coordinator.stop()


class KazooCandidate(_Threaded):
    """kazoo's ``Election`` recipe; the ZooKeeper session timeout is the lease."""

    def __init__(self, url: str, path: str, member: str, lease: float) -> None:
        super().__init__()
        from kazoo.client import KazooClient

        self.client = KazooClient(hosts=urlsplit(url).netloc, timeout=lease)
        self.path, self.member = path, member
        self._leading_done = threading.Event()
        self._election: Any = None

    def start(self, on_elected: Callable[[], object]) -> None:
        self.client.start(timeout=30)
        self._spawn(on_elected)

    def _lead(self) -> None:
        self.on_elected()
        self._leading_done.wait()  # leadership ends when this function returns
        self._leading_done.clear()

    def _loop(self) -> None:
        while not self.closed.is_set():
            self.campaigning.wait()
            if self.closed.is_set():
                return
            self._election = self.client.Election(self.path, self.member)
            self._election.run(self._lead)

    def stand_down(self) -> None:
        self.campaigning.clear()
        self._leading_done.set()

    def in_line(self) -> bool | None:
        # Two lock nodes: the leader's and this candidate's, queued behind it.
        return len(self.client.get_children(self.path)) >= 2

    def close(self) -> None:
        self.closed.set()
        self._leading_done.set()
        if self._election is not None:
            self._election.cancel()
        self._join()
        self.client.stop()
        self.client.close()


class MultilockCandidate(_Threaded):
    """multilock's sync facade: an election that owns its provider (made from the URL)."""

    def __init__(self, url: str, group: str, member: str, lease: float) -> None:
        super().__init__()
        from multilock.core.sync import LeaderElection

        self.election = LeaderElection(
            url, group=group, participant_id=member, lease_duration=lease
        )

    def start(self, on_elected: Callable[[], object]) -> None:
        self.election.start()
        self._spawn(on_elected)

    def _loop(self) -> None:
        from multilock.core import EventKind

        for _event in self.election.events(EventKind.ACQUIRED):
            self.on_elected()

    def stand_down(self) -> None:
        self.election.resign()

    def close(self) -> None:
        self.election.close()
        self._join()


def make_candidate(
    peer: str, url: str, group: str, member: str, lease: float, poll: float
) -> Candidate:
    if peer == "tooz":
        return ToozCandidate(url, group, member, lease, poll)
    if peer == "kazoo":
        return KazooCandidate(url, f"/{group}", member, lease)
    if peer == "multilock":
        return MultilockCandidate(url, group, member, lease)
    raise ValueError(f"unknown peer {peer!r}")


# --------------------------------------------------------------------------- the program
def main(argv: list[str] | None = None) -> int:
    """One participant process: log ``started``, then ``acquired`` with a term id."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--peer", choices=PEERS, required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--poll", type=float, default=0.25)
    args = parser.parse_args(argv)
    url = os.environ["MULTILOCK_PARTICIPANT_URL"]
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(event: str, **fields: Any) -> None:
        record = {"t": time.monotonic(), "participant": args.id, "event": event, **fields}
        os.write(fd, (json.dumps(record) + "\n").encode())

    # The peers have no fencing token: the term id is the acquisition time in µs on the
    # machine's monotonic clock, which rises across processes as tokens do.
    def elected() -> None:
        log("acquired", token=time.monotonic_ns() // 1000)

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    candidate = make_candidate(args.peer, url, args.group, args.id, args.lease, args.poll)
    candidate.start(elected)
    log("started", pid=os.getpid())
    done.wait()
    candidate.close()
    log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
