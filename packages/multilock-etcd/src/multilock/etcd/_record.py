"""The JSON record a group's key holds, and the term a key's value and revision describe."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from multilock.core.provider import LeaderInfo

__all__ = ["decode", "encode"]

log = logging.getLogger(__name__)


def encode(participant_id: str, metadata: Mapping[str, str], at: datetime) -> bytes:
    """The key's value: compact, sorted JSON."""
    body = {"participant_id": participant_id, "metadata": metadata, "acquired_at": at.isoformat()}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode(kv: Any) -> LeaderInfo | None:
    """The term *kv* records (its token: the key's create revision), or None if not ours."""
    try:
        body = json.loads(kv.value)
        acquired_at = datetime.fromisoformat(body["acquired_at"]).astimezone(UTC)
        return LeaderInfo(
            participant_id=body["participant_id"],
            token=int(kv.create_revision),
            metadata=dict(body["metadata"]),
            acquired_at=acquired_at,
        )
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed multilock record in etcd key %r", kv.key)
        return None
