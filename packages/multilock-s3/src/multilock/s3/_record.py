"""The JSON record of one group, as stored in its object, and as this provider saw it."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, NamedTuple

from multilock.core.provider import LeaderInfo

from ._store import BadResponse

__all__ = ["Seen", "check_record", "info", "make_record"]


class Seen(NamedTuple):
    """An object as read, and when this provider first saw its ETag (monotonic clock)."""

    etag: str
    record: dict[str, Any]
    since: float

    def live(self) -> bool:
        """Held, and not yet seen unchanged for a full lease."""
        if self.record.get("state") != "held":
            return False
        return time.monotonic() - self.since < float(self.record["lease"])

    def holds(self, participant_id: str, token: int) -> bool:
        return (self.record.get("participant"), self.record.get("token")) == (
            participant_id,
            token,
        )


def check_record(record: dict[str, Any]) -> dict[str, Any]:
    """Return *record* if it has the shape this provider writes, else raise `BadResponse`."""
    kinds: dict[str, type | tuple[type, ...]] = {
        "participant": str,
        "token": int,
        "lease": (int, float),
        "metadata": dict,
        "acquired_at": str,
    }
    for field, kind in kinds.items():
        value = record.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BadResponse(f"not a multilock record: {field!r} is {type(value).__name__}")
    if record.get("state") not in ("held", "free"):
        raise BadResponse(f"not a multilock record: state is {record.get('state')!r}")
    return record


def make_record(
    state: str,
    participant_id: str,
    token: int,
    lease: float,
    meta: dict[str, str],
    acquired_at: str,
) -> dict[str, Any]:
    return {
        "state": state,
        "participant": participant_id,
        "token": token,
        "lease": lease,
        "metadata": meta,
        "acquired_at": acquired_at,
    }


def info(record: dict[str, Any]) -> LeaderInfo:
    try:
        return LeaderInfo(
            participant_id=str(record["participant"]),
            token=int(record["token"]),
            metadata=dict(record["metadata"]),
            acquired_at=datetime.fromisoformat(record["acquired_at"]).astimezone(UTC),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadResponse(f"a malformed multilock record: {exc!r}") from None
