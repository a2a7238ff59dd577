"""The ``etcd://`` URL, the members it names, and the gRPC channel settings: what
`EtcdProvider` decides before I/O."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from multilock.core.provider import ConfigurationError, check_url_options, redact_url, url_seconds

__all__ = ["CHANNEL_OPTIONS", "DEFAULT_PORT", "format_endpoint", "parse_endpoint", "parse_url"]

DEFAULT_PORT = 2379

#: The options an ``etcd://`` URL's query may carry (numbers of seconds).
_OPTIONS = ("timeout", "min_lease")

_FORM = "etcd://[user:pass@]host[:port][,host[:port]...][/prefix]"

#: gRPC waits up to 120 s between reconnects by default: far longer than a lease. Retry
#: within a second, and ping idle streams so a silently cut watch breaks in ~15 s. Each
#: channel connects on its own: gRPC otherwise shares connections between the channels
#: of a process, and a new client of a member would inherit the failure (and the wait
#: before the next attempt) of a client closed when the provider moved on.
CHANNEL_OPTIONS = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
}


def parse_endpoint(text: str) -> tuple[str, int]:
    """Host and port of ``host``, ``host:port`` or ``[IPv6 address]:port`` (port 2379 if
    none). Raise `ValueError` saying what is wrong, never quoting *text* (in a URL it may
    be part of a password cut short by an unencoded '/')."""
    host, port = text, None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 address goes in brackets, as in [::1]:2379")
        port = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ValueError("an IPv6 address goes in brackets, as in [::1]:2379")
    elif ":" in text:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError("no host")
    if port is None:
        return host, DEFAULT_PORT
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError("bad port (1 to 65535)")
    return host, int(port)


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_url(url: str) -> tuple[list[str], dict[str, Any]]:
    """The members (``host:port`` each, in the URL's order) and the keywords of
    ``etcd://[user:pass@]host[:port][,host[:port]...][/prefix][?query]``."""
    try:
        parts = urlsplit(url)
    except ValueError:  # urllib's "Invalid IPv6 URL" (it never quotes the URL)
        raise ConfigurationError(
            f"an IPv6 address goes in brackets, as in [::1]:2379, in the etcd URL; "
            f"the form is {_FORM}"
        ) from None
    if parts.scheme != "etcd":
        raise ConfigurationError(f"an etcd URL is {_FORM}, not {redact_url(url)}")
    hosts = parts.netloc.rpartition("@")[2]
    items = hosts.split(",")
    endpoints: list[str] = []
    for number, item in enumerate(items, 1):
        where = f", member {number} of {len(items)}" if len(items) > 1 else ""
        try:
            endpoint = format_endpoint(*parse_endpoint(item))
        except ValueError as exc:
            # Never the URL's text: an unencoded '/' in a password makes the rest of it
            # the "port" (and urllib's own error quoted it).
            hint = " (percent-encode a password: '/' as %2F, '?' as %3F, '#' as %23)"
            problem = f"{exc} in the etcd URL{where}{hint if 'port' in str(exc) else ''}"
        else:
            if endpoint not in endpoints:
                endpoints.append(endpoint)
                continue
            first = endpoints.index(endpoint) + 1
            problem = f"member {number} of the etcd URL repeats member {first}"
        raise ConfigurationError(f"{problem}; the form is {_FORM}")
    if parts.fragment:  # after the members: a '#' in a password makes a bad port of them
        raise ConfigurationError(f"an etcd URL is {_FORM}, not {redact_url(url)}")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    check_url_options((name for name, _ in pairs), _OPTIONS, scheme="etcd")
    options: dict[str, Any] = {name: url_seconds(name, value) for name, value in pairs}
    if parts.path.strip("/"):
        options["prefix"] = unquote(parts.path)
    if parts.username is not None:
        options["username"] = unquote(parts.username)
        options["password"] = unquote(parts.password or "")
    return endpoints, options
