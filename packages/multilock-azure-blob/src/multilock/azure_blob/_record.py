"""The blob's content, and the lease arithmetic Azure imposes."""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime

import attrs

from multilock.core.provider import ConfigurationError, LeaderInfo, to_seconds

__all__ = ["MAX_LEASE", "MIN_LEASE", "Record", "lease_seconds", "tag"]

MIN_LEASE = 15
MAX_LEASE = 60


def lease_seconds(lease_duration: float) -> int:
    """Azure's lease for *lease_duration*: whole seconds rounded up; -1 (infinite) past 60."""
    seconds = to_seconds(lease_duration, "lease_duration")
    if seconds < MIN_LEASE:
        raise ConfigurationError(
            f"lease_duration={seconds:g} s is too short for Azure Blob: blob leases last "
            f"{MIN_LEASE} to {MAX_LEASE} s"
        )
    whole = math.ceil(seconds)
    return whole if whole <= MAX_LEASE else -1


@attrs.frozen
class Record:
    """The blob's content, plus what the read that found it saw."""

    participant: str | None = None
    token: int = 0
    metadata: dict[str, str] = attrs.field(factory=dict)
    acquired_at: str | None = None
    lease: str | None = None  # a hash of the lease id it was written under
    lease_duration: float = 0.0
    etag: str | None = None  # None: no blob yet
    locked: bool = False  # whether the blob was leased when read

    def dumps(self) -> bytes:
        body = attrs.asdict(self, filter=lambda a, _: a.name not in ("etag", "locked"))
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    def info(self) -> LeaderInfo:
        assert self.participant is not None
        assert self.acquired_at is not None
        return LeaderInfo(
            participant_id=self.participant,
            token=self.token,
            metadata=self.metadata,
            acquired_at=datetime.fromisoformat(self.acquired_at),
        )


def tag(lease_id: str) -> str:
    """What the record keeps of a lease id: enough to recognise it, not to use it."""
    return hashlib.sha256(lease_id.encode()).hexdigest()[:16]
