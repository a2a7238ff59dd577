"""Validation of group names, participant ids and metadata, shared by options and providers."""

from __future__ import annotations

import math
import os
import re
import secrets
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ._errors import ConfigurationError

__all__ = [
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_KEY_LENGTH",
    "MAX_METADATA_VALUE_LENGTH",
    "MAX_NAME_LENGTH",
    "default_participant_id",
    "to_seconds",
    "validate_identifier",
    "validate_metadata",
    "validate_name",
]

MAX_NAME_LENGTH = 255
MAX_METADATA_ENTRIES = 100
MAX_METADATA_KEY_LENGTH = 255
MAX_METADATA_VALUE_LENGTH = 4000

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,255}")
_NOT_NAME_CHAR = re.compile(r"[^A-Za-z0-9_.\-]+")


def validate_name(value: object, field: str = "group") -> str:
    """Return *value* if it is 1..255 characters of ``[A-Za-z0-9_.-]``, else raise.

    Providers call this on every group and participant id they receive, so a name that
    would be unsafe as a key, path or SQL value never reaches the store.
    """
    if not isinstance(value, str):
        raise ConfigurationError(f"{field} must be a str, not {type(value).__name__}")
    if not _NAME.fullmatch(value):
        shown = value if len(value) <= 40 else value[:37] + "..."
        rule = f"use 1 to {MAX_NAME_LENGTH} characters of letters, digits, '_', '.' and '-'"
        bad = sorted(set("".join(_NOT_NAME_CHAR.findall(value))))
        problems = []
        if not value:
            problems.append("it is empty")
        if len(value) > MAX_NAME_LENGTH:
            problems.append(f"it has {len(value)} characters (the limit is {MAX_NAME_LENGTH})")
        if bad:
            chars = ", ".join(map(repr, bad[:5])) + (", ..." if len(bad) > 5 else "")
            problems.append(f"{chars} {'is' if len(bad) == 1 else 'are'} not allowed")
        why = " and ".join(problems)
        raise ConfigurationError(f"{field} {shown!r} is invalid: {why}; {rule}")
    return value


def validate_identifier(
    value: object, field: str, *, max_length: int, reserved_prefixes: tuple[str, ...] = ()
) -> str:
    """Return *value* if it is a safe SQL identifier (a schema or table name), else raise.

    1 to *max_length* ASCII letters, digits and ``_``, not starting with a digit, and not
    starting with a *reserved_prefixes* entry. Strict on purpose: names are still quoted
    where they are used, so their case is kept as written.
    """
    if not isinstance(value, str):
        raise ConfigurationError(f"{field} must be a str, not {type(value).__name__}")
    if not (
        1 <= len(value) <= max_length
        and value.isascii()
        and not value[0].isdigit()
        and all(c.isalnum() or c == "_" for c in value)
    ):
        raise ConfigurationError(
            f"{field} {value[:70]!r} is invalid: use 1 to {max_length} ASCII letters, digits "
            "and '_', not starting with a digit"
        )
    reserved = next((p for p in reserved_prefixes if value.startswith(p)), None)
    if reserved is not None:
        raise ConfigurationError(f"{field} {value!r} is invalid: {reserved!r} names are reserved")
    return value


def validate_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Return a plain copy of *metadata* after checking the limits every backend shares."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigurationError(
            f"metadata must be a mapping of str to str, not {type(metadata).__name__}"
        )
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise ConfigurationError(
            f"metadata has {len(metadata)} entries; at most {MAX_METADATA_ENTRIES} are allowed"
        )
    result: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigurationError(
                f"metadata must map str to str; got {type(key).__name__} -> "
                f"{type(value).__name__} for key {key!r}"
            )
        if not 1 <= len(key) <= MAX_METADATA_KEY_LENGTH:
            raise ConfigurationError(
                f"metadata key of length {len(key)} is invalid: keys are 1 to "
                f"{MAX_METADATA_KEY_LENGTH} characters"
            )
        if len(value) > MAX_METADATA_VALUE_LENGTH:
            raise ConfigurationError(
                f"metadata value for key {key!r} has {len(value)} characters; at most "
                f"{MAX_METADATA_VALUE_LENGTH} are allowed"
            )
        result[key] = value
    return result


def to_seconds(value: Any, field: str) -> float:
    """Convert float seconds or a `timedelta` to float seconds, rejecting nonsense."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(
            f"{field} must be seconds as a number or a timedelta, not {type(value).__name__}"
        )
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(f"{field} must be a positive, finite duration, got {value!r}")
    return seconds


def default_participant_id() -> str:
    """Return ``hostname-pid-random``, cleaned to the allowed characters."""
    host = _NOT_NAME_CHAR.sub("-", socket.gethostname()).strip("-") or "host"
    return f"{host[:200]}-{os.getpid()}-{secrets.token_hex(4)}"
