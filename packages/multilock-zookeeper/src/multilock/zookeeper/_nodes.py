"""Candidate nodes: names, order, records, and the kazoo client the provider builds.

A candidate node is named ``<random prefix>-<participant>-<sequence>``; ZooKeeper appends
the 10-digit sequence number. Candidates are ordered by that number only, never by
name (ordering by name, as the .NET original does, can elect two leaders). A node's data
is a JSON record: ``participant_id``, ``metadata`` and, once it leads, ``acquired_at``
unless the node led from its creation: then the node's creation time (its ``mtime`` until
its first update) is the start of the term, and no write is needed to record it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import attrs
from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.retry import KazooRetry  # type: ignore[import-untyped]

from multilock.core import LeaderInfo

__all__ = [
    "Node",
    "decode",
    "encode",
    "make_client",
    "ordered",
    "server_time",
    "token_of",
]

_DIGITS = 10


def token_of(name: str) -> int | None:
    """The token of a candidate: the sequence number ZooKeeper appended to *name*, plus one
    (so that no token is 0), or None for a child that is not a candidate."""
    tail = name[-_DIGITS:]
    return int(tail) + 1 if len(name) > _DIGITS and tail.isdigit() else None


def ordered(children: list[str]) -> list[tuple[int, str]]:
    """Candidate nodes as (token, name), lowest sequence number first."""
    return sorted((s, c) for c in children if (s := token_of(c)) is not None)


@attrs.define(eq=False)
class Node:
    """One participant's candidate node in one group, as this provider knows it."""

    group: str
    prefix: str
    name: str | None = None
    #: Its token: the sequence number plus one.
    seq: int | None = None
    #: The ZooKeeper session that owns the node: once it is gone, so is the node.
    session: int | None = None
    #: time.monotonic() after which the node is deleted unless refreshed.
    deadline: float = 0.0
    #: A create was sent: if its reply was lost, the node may exist under our prefix.
    sent: bool = False
    acquired_at: datetime | None = None
    #: The metadata in the stored record, to skip writes that change nothing.
    meta: dict[str, str] | None = None
    #: The stored record tells readers ``acquired_at`` (in its data, or as the node's
    #: mtime when it led from its creation and was never written since).
    stamped: bool = False


def encode(participant_id: str, metadata: dict[str, str], since: datetime | None) -> bytes:
    record: dict[str, Any] = {"participant_id": participant_id, "metadata": metadata}
    if since is not None:
        record["acquired_at"] = since.isoformat()
    return json.dumps(record).encode()


def server_time(ms: int) -> datetime:
    """A ZooKeeper ``ctime``/``mtime`` (milliseconds since the epoch) as a UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, UTC)


def decode(token: int, data: bytes, mtime_ms: int) -> LeaderInfo:
    """The LeaderInfo of a candidate node; ``acquired_at`` defaults to its last change."""
    record = json.loads(data.decode())
    since = record.get("acquired_at")
    return LeaderInfo(
        participant_id=record["participant_id"],
        token=token,
        metadata=record.get("metadata", {}),
        acquired_at=datetime.fromisoformat(since) if since else server_time(mtime_ms),
    )


def make_client(hosts: str, session_timeout: float, auth: str | None) -> KazooClient:
    """A kazoo client that reconnects quickly (within the session) and never retries calls."""
    return KazooClient(
        hosts=hosts,
        timeout=session_timeout,
        auth_data=[("digest", auth)] if auth else None,
        connection_retry=KazooRetry(
            max_tries=-1, delay=0.05, backoff=2, max_delay=max(0.1, session_timeout / 4)
        ),
    )
