"""S3 URLs and names: ``s3://[key:secret@]host[:port]/bucket[/prefix/]?option=value``."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, unquote

from multilock.core.provider import (
    ConfigurationError,
    check_url_options,
    redact_url,
    split_url,
    url_flag,
    url_seconds,
)

__all__ = ["check_bucket", "check_prefix", "parse_url"]

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX = re.compile(r"[A-Za-z0-9_.\-/]{0,512}")
_SCHEMES = {"s3": True, "s3+http": False}
_TEXT = ("region", "session_token", "ca_certs")
_SECONDS = ("timeout", "poll_interval")
_FLAGS = ("cert_check", "create_bucket")
_OPTIONS = (*_TEXT, *_SECONDS, *_FLAGS, "prefix")


def check_bucket(bucket: object) -> str:
    """Return *bucket* if it is a valid S3 bucket name, else raise `ConfigurationError`."""
    if not isinstance(bucket, str) or not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ConfigurationError(
            f"bucket must be 3..63 chars of [a-z0-9.-], starting and ending with a letter or "
            f"digit, got {bucket!r}"
        )
    return bucket


def check_prefix(prefix: object) -> str:
    """Return the key prefix if it is empty or ``[A-Za-z0-9_.-/]`` without ``//`` or ``..``."""
    if (
        not isinstance(prefix, str)
        or not _PREFIX.fullmatch(prefix)
        or prefix.startswith("/")
        or "//" in prefix
        or ".." in prefix
    ):
        raise ConfigurationError(
            f"prefix must be up to 512 chars of [A-Za-z0-9_.-/], not starting with '/' and "
            f"without '//' or '..', got {prefix!r}"
        )
    return prefix


def parse_url(url: str) -> tuple[str, str, dict[str, Any]]:
    """Split an S3 URL into ``(endpoint, bucket, keyword options)``."""
    shown = redact_url(url)
    parts = split_url(url, "S3", "a secret key: '/' as %2F, '+' as %2B")
    port = parts.port
    if parts.scheme not in _SCHEMES:
        raise ConfigurationError(f"an S3 URL starts with s3:// or s3+http://, got {shown}")
    if not parts.hostname:
        raise ConfigurationError(f"the S3 URL {shown} names no host")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    endpoint = host if port is None else f"{host}:{port}"
    bucket, _, prefix = parts.path.lstrip("/").partition("/")
    if not bucket:
        raise ConfigurationError(f"the S3 URL {shown} names no bucket (s3://host/bucket)")
    options: dict[str, Any] = {"secure": _SCHEMES[parts.scheme]}
    if prefix:
        options["prefix"] = unquote(prefix)
    if parts.username:
        options["access_key"] = unquote(parts.username)
    if parts.password:
        options["secret_key"] = unquote(parts.password)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    check_url_options((key for key, _ in pairs), _OPTIONS, scheme=parts.scheme)
    for key, value in pairs:
        options[key] = _option(key, value)
    return endpoint, bucket, options


def _option(key: str, value: str) -> Any:
    """The value of a known option (`check_url_options` refused the others)."""
    if key in _SECONDS:
        return url_seconds(key, value)
    return url_flag(key, value) if key in _FLAGS else value
