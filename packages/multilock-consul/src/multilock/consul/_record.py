"""The JSON record stored in a group's key, and what a KV entry says about its holder."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from multilock.core import (
    ConfigurationError,
    LeaderInfo,
    ProviderError,
    validate_metadata,
    validate_name,
)

__all__ = ["encode", "holder", "leader_info"]


def encode(record: dict[str, Any]) -> bytes:
    """The key's value: compact JSON, ASCII only (``ensure_ascii``), as bytes."""
    return json.dumps(record, separators=(",", ":")).encode()


def holder(entry: Any) -> str | None:
    """The session holding *entry*'s lock, or None when the key is missing or free."""
    if not isinstance(entry, dict):
        return None
    session = entry.get("Session")
    return session if isinstance(session, str) and session else None


def leader_info(entry: Any) -> LeaderInfo:
    """The term recorded in a key written by this provider."""
    try:
        record = json.loads(entry["Value"])
        token = record.get("token") or entry["ModifyIndex"]
        acquired_at = datetime.fromisoformat(record["acquired_at"]).astimezone(UTC)
        return LeaderInfo(
            participant_id=validate_name(record["participant"], "participant_id"),
            token=int(token),
            metadata=validate_metadata(record["metadata"]),
            acquired_at=acquired_at,
        )
    except (TypeError, ValueError, KeyError, AttributeError, ConfigurationError) as exc:
        key = entry.get("Key") if isinstance(entry, dict) else None
        raise ProviderError(
            f"the Consul key {key!r} holds a value multilock did not write"
        ) from exc
