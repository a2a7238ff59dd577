"""URLs and options of `ZooKeeperProvider`, validated at the boundary.

Credentials never leave this module in a message: URLs are shown through `redact_url`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs

from multilock.core import ConfigurationError, redact_url
from multilock.core._names import to_seconds

__all__ = ["DEFAULT_ROOT", "SCHEMES", "Settings", "Target", "merge", "parse_url", "validate_root"]

DEFAULT_ROOT = "/multilock"
SCHEMES = ("zookeeper", "zk")
_OWN_KEYS = ("root", "session_timeout", "connect_timeout", "operation_timeout")
#: ZooKeeper path segments: no empty segments, no '.'/'..', printable ASCII only.
_SEGMENT = re.compile(r"[A-Za-z0-9_.\-:@+=,]{1,200}")
_HOST = re.compile(r"[A-Za-z0-9_.\-\[\]:]+")


def validate_root(value: Any, field: str = "root") -> str:
    """Return an absolute ZooKeeper path like ``/multilock`` (no trailing slash)."""
    if not isinstance(value, str) or not value.startswith("/") or value.endswith("/"):
        raise ConfigurationError(f"{field} must be an absolute path like '/multilock'")
    for segment in value[1:].split("/"):
        if not _SEGMENT.fullmatch(segment) or segment in (".", "..", "zookeeper"):
            raise ConfigurationError(f"{field} {value!r} has an invalid segment {segment!r}")
    return value


def _session_timeout(value: float | timedelta | None) -> float | None:
    return None if value is None else to_seconds(value, "session_timeout")


def _connect_timeout(value: float | timedelta) -> float:
    return to_seconds(value, "connect_timeout")


def _operation_timeout(value: float | timedelta) -> float:
    return to_seconds(value, "operation_timeout")


@attrs.frozen(kw_only=True)
class Settings:
    """The options of a provider; keywords win over the URL's query string."""

    root: str = attrs.field(default=DEFAULT_ROOT, converter=validate_root)
    #: None: follow the lease (see the provider's docstring).
    session_timeout: float | None = attrs.field(default=None, converter=_session_timeout)
    connect_timeout: float = attrs.field(default=10.0, converter=_connect_timeout)
    operation_timeout: float = attrs.field(default=5.0, converter=_operation_timeout)


@attrs.frozen
class Target:
    """What a URL names: kazoo's hosts string (with chroot) and digest credentials."""

    hosts: str
    auth: str | None
    shown: str


def _query_value(key: str, value: str) -> Any:
    if key == "root":
        return value
    try:
        return float(value)
    except ValueError:
        raise ConfigurationError(f"{key} must be seconds, got {value!r}") from None


def parse_url(url: str) -> tuple[Target, dict[str, Any]]:
    """Split ``zookeeper://[user:pass@]h1:2181,h2:2181[/chroot][?options]``.

    Return the target and the options of the query string (``root``, ``session_timeout``,
    ``connect_timeout``, ``operation_timeout``); any other query key is an error.
    """
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigurationError(f"not a ZooKeeper URL: {shown}")
    netloc = parts.netloc
    userinfo, _, hostlist = netloc.rpartition("@")
    hosts = hostlist.split(",")
    if not hostlist or not all(h and _HOST.fullmatch(h) for h in hosts):
        raise ConfigurationError(f"a ZooKeeper URL names host[:port],...: {shown}")
    chroot = parts.path.rstrip("/")
    if chroot:
        validate_root(chroot, "chroot")
    options: dict[str, Any] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _OWN_KEYS:
            raise ConfigurationError(
                f"unknown option {key!r} in {shown}; known: {', '.join(_OWN_KEYS)}"
            )
        options[key] = _query_value(key, value)
    auth = None
    if userinfo:
        user, sep, password = userinfo.partition(":")
        if not sep or not user:
            raise ConfigurationError(f"credentials in a ZooKeeper URL are user:password: {shown}")
        auth = f"{unquote(user)}:{unquote(password)}"
    return Target(hostlist + chroot, auth, shown), options


def merge(url_options: Mapping[str, Any], kwargs: Mapping[str, Any]) -> Settings:
    """Settings from the URL's options overridden by keywords."""
    return Settings(**{**url_options, **kwargs})
