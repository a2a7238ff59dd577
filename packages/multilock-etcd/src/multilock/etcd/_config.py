"""The ``etcd://`` URL and the gRPC channel settings: what `EtcdProvider` decides before I/O."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from multilock.core.provider import ConfigurationError, check_url_options, redact_url

__all__ = ["CHANNEL_OPTIONS", "parse_url"]

#: The options an ``etcd://`` URL's query may carry (numbers of seconds).
_OPTIONS = ("timeout", "min_lease")

#: gRPC waits up to 120 s between reconnects by default: far longer than a lease. Retry
#: within a second, and ping idle streams so a silently cut watch breaks in ~15 s.
CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
}


def parse_url(url: str) -> tuple[str, int, dict[str, Any]]:
    """Host, port and keywords of ``etcd://[user:pass@]host[:port][/prefix][?query]``."""
    parts = urlsplit(url)
    try:
        port: int | None = parts.port or 2379
    except ValueError:
        port = None
    if port is None:
        # Neither the URL nor urllib's error (raised outside its handler, so it is not this
        # error's context): an unencoded '/' in a password makes the rest of it the "port".
        raise ConfigurationError(
            "bad port in the etcd URL (percent-encode a password: '/' as %2F, '@' as %40)"
        )
    if parts.scheme != "etcd" or not parts.hostname or parts.fragment:
        raise ConfigurationError(
            f"an etcd URL is etcd://[user:pass@]host[:port][/prefix], not {redact_url(url)}"
        )
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    check_url_options((name for name, _ in pairs), _OPTIONS, scheme="etcd")
    options: dict[str, Any] = {}
    for name, value in pairs:
        try:
            options[name] = float(value)
        except ValueError:
            raise ConfigurationError(f"etcd URL parameter {name} is not a number") from None
    if parts.path.strip("/"):
        options["prefix"] = unquote(parts.path)
    if parts.username is not None:
        options["username"] = unquote(parts.username)
        options["password"] = unquote(parts.password or "")
    return parts.hostname, port, options
