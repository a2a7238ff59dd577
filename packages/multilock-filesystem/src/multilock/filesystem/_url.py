"""The file URL: ``file:///absolute/path[?poll_interval=0.5&lock_timeout=5&notify=true]``."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit
from urllib.request import url2pathname

from multilock.core.provider import (
    ConfigurationError,
    check_url_options,
    redact_url,
    url_flag,
    url_seconds,
)

__all__ = ["parse_url"]

_SECONDS = ("lock_timeout", "poll_interval")
_OPTIONS = (*_SECONDS, "notify")


def parse_url(url: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Split a file URL into the directory and `FileSystemProvider` keywords (*kwargs* too)."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme.lower() != "file":
        raise ConfigurationError(f"{shown!r} is not a file:// URL")
    if parts.netloc not in ("", "localhost"):
        # The host only: the netloc may hold user:password, which no message may carry.
        raise ConfigurationError(
            f"file URL {shown!r} names the host {parts.hostname or ''!r}: a file URL takes "
            "an absolute path after three slashes, file:///absolute/path; relative paths "
            "and remote hosts are not supported"
        )
    path = url2pathname(parts.path)
    if parts.fragment or not path or not os.path.isabs(path):
        raise ConfigurationError(
            f"file URL {shown!r} needs an absolute directory path: file:///absolute/path"
        )
    options = dict(kwargs)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    check_url_options((k for k, _ in pairs), _OPTIONS, scheme="file")
    for key, value in pairs:
        if key in kwargs:
            raise ConfigurationError(f"{key} is given both in the URL and as a keyword")
        options[key] = _option(key, value)
    return path, options


def _option(key: str, value: str) -> float | bool:
    return url_flag(key, value) if key == "notify" else url_seconds(key, value)
