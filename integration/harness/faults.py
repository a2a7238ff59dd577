"""Shared by the fault suites (test_faults, test_campaign): timing bounds and `ClusterLog`.

`ClusterLog` follows a `Cluster`'s participant logs incrementally (each poll reads only
the new lines), keeps every record, and tracks each member's open term, so waiting on a
condition stays cheap however long the cluster runs. Every wait has a deadline.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from multilock.core.testing import Cluster, Member, TimelineReport

from .backends import Backend

__all__ = [
    "HANDOFF_BOUND",
    "RECOVERY_BOUND",
    "SIZE",
    "STARTUP_TIMEOUT",
    "ClusterLog",
    "assert_safe",
    "failover_bound",
    "handoff_bound",
    "new_group",
    "require_multiprocess",
]

SIZE = 3
SLACK = 1.0
#: Stores that may free a dead holder's key later than the lease (Consul: up to 2x TTL).
EXPIRY_FACTOR = {"consul": 2.0}
#: A graceful stop or resign hands over within this long (polling backends: one poll).
HANDOFF_BOUND = {"filesystem": 1.5, "azure_blob": 2.5}
HANDOFF_DEFAULT = 0.5
#: Three interpreters importing the library on a loaded machine.
STARTUP_TIMEOUT = 30.0
#: After a server is started again, some participant leads within this long.
RECOVERY_BOUND = 5.0
POLL = 0.01

Record = dict[str, Any]


def failover_bound(backend: Backend) -> float:
    """A crashed leader's successor leads within this long of the crash."""
    retry = min(2.0, backend.lease)  # the election's default retry_interval
    return EXPIRY_FACTOR.get(backend.name, 1.0) * backend.lease + retry + SLACK


def handoff_bound(backend: Backend) -> float:
    """A graceful stop or resign hands over within this long."""
    return HANDOFF_BOUND.get(backend.name, HANDOFF_DEFAULT)


def new_group(prefix: str = "faults") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def require_multiprocess(backend: Backend) -> Backend:
    if not backend.multiprocess:
        pytest.skip(f"{backend.name}: its URL only works inside one process")
    return backend


def assert_safe(cluster: Cluster, context: str) -> TimelineReport:
    """Judge every log of *cluster*: no overlap, rising tokens; *context* goes in the error."""
    report = cluster.check()
    assert report.ok, f"{report.problems}\nterms:\n{report.describe()}\n{context}"
    return report


class ClusterLog:
    """The records of a `Cluster`'s members, read incrementally, and who leads per the logs."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.records: list[Record] = []
        self._offsets: dict[str, int] = {}
        #: Per member, its open term as (token, acquired at), or None.
        self._terms: dict[str, tuple[int, float] | None] = {}

    def poll(self) -> None:
        """Read the lines appended since the last poll (a torn last line waits for its end)."""
        batch: list[Record] = []
        for member in self.cluster.members:
            path = member.log_path
            try:
                with open(path, "rb") as log:
                    log.seek(self._offsets.get(member.name, 0))
                    data = log.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1
            self._offsets[member.name] = self._offsets.get(member.name, 0) + end
            for line in data[:end].splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a writer killed mid-line, then the next line appended to it
                if isinstance(record, dict) and "t" in record:
                    batch.append(record)
        batch.sort(key=lambda r: float(r["t"]))
        for record in batch:
            event, who = record["event"], record["participant"]
            if event == "acquired":
                self._terms[who] = (int(record["token"]), float(record["t"]))
            elif event in ("lost", "stopped"):
                self._terms[who] = None
        self.records.extend(batch)

    def find(self, predicate: Callable[[Record], bool], start: int = 0) -> Record | None:
        """The first record from index *start* on that satisfies *predicate*, or None."""
        self.poll()
        return next((r for r in self.records[start:] if predicate(r)), None)

    def wait_for(self, what: str, predicate: Callable[[Record], bool], timeout: float) -> Record:
        """The first record that satisfies *predicate*, waiting up to *timeout* seconds."""
        deadline = time.monotonic() + timeout
        start = 0
        while True:
            self.poll()
            found = next((r for r in self.records[start:] if predicate(r)), None)
            if found is not None:
                return found
            start = len(self.records)
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.1f} s; logs:\n{self.tail()}")
            time.sleep(POLL)

    def open_terms(self) -> list[tuple[Member, int, float]]:
        """Members that lead per their logs: alive, not frozen, term neither lost nor killed."""
        self.poll()
        found = []
        for member in self.cluster.members:
            term = self._terms.get(member.name)
            if term is None or not member.alive or member.frozen:
                continue
            if any(k >= term[1] for k in self.cluster.kills.get(member.name, ())):
                continue  # the term ended with a SIGKILL of its process
            found.append((member, term[0], term[1]))
        return found

    def leader(self, *, sole: bool = True) -> tuple[Member, int, float] | None:
        """Who leads per the logs: (member, token, since), the newest open term.

        With *sole*, only when no other live member's term is open: an older term shows as
        open until its member logs its end, which a hung store call can hold up past the
        term's deadline (the checker judges the term by that deadline all the same).
        """
        terms = self.open_terms()
        if not terms or (sole and len(terms) > 1):
            return None
        return max(terms, key=lambda term: term[1])

    def wait_for_leader(
        self,
        timeout: float,
        *,
        newer_than: int = 0,
        sole: bool = True,
        required: bool = True,
        after: float | None = None,
    ) -> tuple[Member, int, float] | None:
        """Wait for a leader (see `leader`) with a token above *newer_than*, or, with
        *after*, equal to it in a term that began later (a store that lost a write may
        hand the same token out twice).

        On timeout raise `AssertionError`, or return None when not *required*.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = self.leader(sole=sole)
            if found is not None and (
                found[1] > newer_than
                or (after is not None and found[1] == newer_than and found[2] > after)
            ):
                return found
            if time.monotonic() > deadline:
                if not required:
                    return None
                who = "sole leader" if sole else "leader"
                raise AssertionError(
                    f"no {who} with a token above {newer_than} within {timeout:.1f} s; "
                    f"logs:\n{self.tail()}"
                )
            time.sleep(POLL)

    def wait_started(self, members: Iterable[Member], since: float = 0.0) -> None:
        """Wait until each of *members* logged ``started`` at or after *since*."""
        for member in members:

            def started(record: Record, name: str = member.name) -> bool:
                return (
                    record["participant"] == name
                    and record["event"] == "started"
                    and float(record["t"]) >= since
                )

            self.wait_for(f"'started' from {member.name}", started, STARTUP_TIMEOUT)

    def first_leader(self) -> tuple[Member, int]:
        """Wait for every member to start and one of them to lead."""
        self.wait_started(self.cluster.members)
        found = self.wait_for_leader(STARTUP_TIMEOUT)
        assert found is not None
        return found[0], found[1]

    def acquired_at(self, member: Member, token: int) -> float:
        """When *member* logged the acquisition of *token*."""
        record = self.find(
            lambda r: (
                r["participant"] == member.name and r["event"] == "acquired" and r["token"] == token
            )
        )
        if record is None:
            raise AssertionError(f"{member.name} never logged acquiring token {token}")
        return float(record["t"])

    def tail(self) -> str:
        return self.cluster.tail()
