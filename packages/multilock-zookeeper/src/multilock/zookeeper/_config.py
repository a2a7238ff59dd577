"""URLs and options of `ZooKeeperProvider`, checked at the boundary; URLs shown redacted."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs

from multilock.core.provider import ConfigurationError, check_url_options, redact_url, to_seconds

__all__ = ["Settings", "parse_url"]

_KEYS = ("root", "session_timeout", "connect_timeout", "operation_timeout")
_SEGMENT = re.compile(r"[A-Za-z0-9_.\-:@+=,]{1,200}")  # no '/', printable ASCII
_HOST = re.compile(r"[A-Za-z0-9_.\-\[\]:]+")


def validate_root(value: Any, field: str = "root") -> str:
    """Return an absolute ZooKeeper path like ``/multilock`` (no trailing slash)."""
    if not isinstance(value, str) or not value.startswith("/") or value.endswith("/"):
        raise ConfigurationError(f"{field} must be an absolute path like '/multilock'")
    for segment in value[1:].split("/"):
        if not _SEGMENT.fullmatch(segment) or segment in (".", "..", "zookeeper"):
            raise ConfigurationError(f"{field} {value!r} has an invalid segment {segment!r}")
    return value


_SECONDS: Any = attrs.Converter(lambda v, f: to_seconds(v, f.name), takes_field=True)


@attrs.frozen(kw_only=True)
class Settings:
    """The options of a provider; keywords win over the URL's query string."""

    root: str = attrs.field(default="/multilock", converter=validate_root)
    #: The shortest lease; kazoo's default, so a plain ``KazooClient()`` passed in matches.
    session_timeout: float = attrs.field(default=10.0, converter=_SECONDS)  # type: ignore[misc]
    connect_timeout: float = attrs.field(default=10.0, converter=_SECONDS)  # type: ignore[misc]
    operation_timeout: float = attrs.field(default=5.0, converter=_SECONDS)  # type: ignore[misc]


def parse_url(url: str) -> tuple[str, str | None, str, dict[str, Any]]:
    """Split a URL into kazoo's hosts (with the chroot), ``user:password`` or None, the
    redacted URL, and the query string's options."""
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in ("zookeeper", "zk"):
        raise ConfigurationError(f"not a ZooKeeper URL: {shown}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    if not hosts or not all(h and _HOST.fullmatch(h) for h in hosts.split(",")):
        raise ConfigurationError(f"a ZooKeeper URL names host[:port],...: {shown}")
    chroot = parts.path.rstrip("/")
    if chroot:
        validate_root(chroot, "chroot")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    check_url_options((key for key, _ in pairs), _KEYS, scheme=parts.scheme)
    options: dict[str, Any] = {}
    for key, value in pairs:
        try:
            options[key] = value if key == "root" else float(value)
        except ValueError:
            raise ConfigurationError(f"{key} must be seconds, got {value!r}") from None
    auth = None
    if userinfo:
        user, sep, password = userinfo.partition(":")
        if not sep or not user:
            raise ConfigurationError(f"credentials in a ZooKeeper URL are user:password: {shown}")
        auth = f"{unquote(user)}:{unquote(password)}"
    return hosts + chroot, auth, shown, options
