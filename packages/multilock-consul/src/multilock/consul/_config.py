"""Addresses, options and keys: everything `ConsulProvider` decides before any I/O.

The ACL token never leaves this module in a message: errors and reprs name addresses
through `redact_url`, and the provider's `DriverCalls` cut it from driver messages.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, unquote

import attrs
import requests

import consul  # type: ignore[import-untyped]
from multilock.core.provider import (
    ConfigurationError,
    LeaseBounds,
    check_url_options,
    redact_url,
    split_url,
    to_seconds,
    url_flag,
    url_seconds,
)

__all__ = [
    "DEFAULT_PREFIX",
    "LEASE_BOUNDS",
    "MAX_TTL",
    "MIN_TTL",
    "check_ttl",
    "failures",
    "Settings",
    "key_for",
    "parse_address",
    "session_ttl",
    "validate_prefix",
]

DEFAULT_PREFIX = "multilock"
#: Consul's limits on a session TTL, in seconds.
MIN_TTL = 10
MAX_TTL = 86400
#: The leases a session can hold: the TTL is the lease rounded up, so the same range.
LEASE_BOUNDS = LeaseBounds(
    minimum=MIN_TTL, maximum=MAX_TTL, reason="a Consul session TTL is 10 s to 24 h"
)
_SEGMENT = re.compile(r"[A-Za-z0-9_.\-]{1,255}")
_DEFAULT_PORTS = {"http": 8500, "https": 8501}
#: Query parameters a ``consul://`` URL may carry (keywords of `ConsulProvider`).
_QUERY_KEYS = frozenset({"token", "dc", "prefix", "timeout", "watch_wait", "tls", "verify"})


def validate_prefix(prefix: object) -> str:
    """Return *prefix* if it is ``/``-separated segments of ``[A-Za-z0-9_.-]``, else raise.

    Segments made only of dots are refused: HTTP clients collapse ``.`` and ``..`` in paths.
    """
    if not isinstance(prefix, str):
        raise ConfigurationError(f"prefix must be a str, not {type(prefix).__name__}")
    segments = prefix.split("/")
    if len(prefix) > 200 or not all(_SEGMENT.fullmatch(s) and s.strip(".") for s in segments):
        raise ConfigurationError(
            f"prefix {prefix[:60]!r} is invalid: use '/'-separated segments of letters, "
            "digits, '_', '.' and '-' (not only dots), at most 200 characters in all"
        )
    return prefix


def key_for(prefix: str, group: str) -> str:
    """The KV key of *group*: ``<prefix>/<group>``.

    A group made only of dots (``.``, ``..``) is valid but would be collapsed by HTTP
    clients as a path segment, so it becomes ``~<group>``; ``~`` is never part of a valid
    group name, so distinct groups keep distinct keys.
    """
    return f"{prefix}/{group if group.strip('.') else '~' + group}"


def session_ttl(lease_duration: float) -> int:
    """The session TTL for a lease: whole seconds, never shorter than the lease.

    Consul never invalidates a session before its TTL (it may wait up to twice as long),
    so a TTL of at least the lease means the store cannot free the key before the
    holder's own deadline (which ends before ``lease_duration``) has passed. The election
    keeps leases within `LEASE_BOUNDS`, so the TTL is one Consul accepts.
    """
    return math.ceil(lease_duration)


def parse_address(url: str) -> dict[str, Any]:
    """Split ``consul://[:TOKEN@]host[:port][?query]`` (or ``http(s)://``) into keywords.

    The ACL token goes in the password part (``consul://:TOKEN@host``) or the ``token``
    query parameter. ``tls=true`` selects HTTPS for ``consul://``; ``verify=false`` (or a
    CA bundle path) sets certificate checks. The default port is 8500 (8501 with TLS).
    """
    if not isinstance(url, str):
        raise ConfigurationError(f"address must be a str, not {type(url).__name__}")
    shown = redact_url(url)
    parts = split_url(url, "Consul", "a token")
    port = parts.port
    scheme = parts.scheme.lower()
    if scheme not in ("consul", "http", "https"):
        raise ConfigurationError(
            f"invalid Consul address {shown}: use consul://, http:// or https://"
        )
    if not parts.hostname:
        raise ConfigurationError(f"invalid Consul address {shown}: no host")
    if parts.path not in ("", "/") or parts.fragment:
        raise ConfigurationError(
            f"invalid Consul address {shown}: no path is allowed (use ?prefix=... for keys)"
        )
    if parts.username and parts.password is None:
        # redact_url shows user names: this one is probably the token, so show no userinfo.
        raise ConfigurationError(
            f"invalid Consul address {scheme}://{parts.hostname}: put the ACL token in the "
            "password part (consul://:TOKEN@host) or in ?token=, where it is never shown"
        )
    found: dict[str, Any] = {"host": parts.hostname}
    if parts.password:
        found["token"] = unquote(parts.password)
    tls = scheme == "https"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    check_url_options((key for key, _ in pairs), _QUERY_KEYS, scheme=scheme)
    for key, value in pairs:
        if key == "tls":
            if scheme != "consul":
                raise ConfigurationError(f"tls= only goes with consul:// ({shown})")
            tls = url_flag(key, value)
        elif key == "verify":
            try:
                found[key] = url_flag(key, value)
            except ConfigurationError:
                found[key] = value  # a CA bundle's path
        elif key in ("timeout", "watch_wait"):
            found[key] = url_seconds(key, value)
        else:
            found[key] = value
    found["scheme"] = "https" if tls else "http"
    found["port"] = port if port is not None else _DEFAULT_PORTS[found["scheme"]]
    return found


def _timeout(value: float | timedelta) -> float:
    return to_seconds(value, "timeout")


def _watch_wait(value: float | timedelta) -> float:
    return to_seconds(value, "watch_wait")


def _dc(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not _SEGMENT.fullmatch(value):
        raise ConfigurationError(f"dc {value!r} is invalid")
    return value


def _token(value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigurationError(f"token must be a str, not {type(value).__name__}")
    return value


@attrs.frozen(kw_only=True)
class Settings:
    """Where the Consul agent is and how to talk to it; validated at construction."""

    host: str
    port: int
    scheme: str = "http"
    token: str | None = attrs.field(default=None, converter=_token, repr=False)
    dc: str | None = attrs.field(default=None, converter=_dc)
    prefix: str = attrs.field(default=DEFAULT_PREFIX, converter=validate_prefix)
    #: Bound on each HTTP request (connect and read), in seconds.
    timeout: float = attrs.field(default=5.0, converter=_timeout)
    #: How long one blocking query of ``watch`` waits for a change, in seconds.
    watch_wait: float = attrs.field(default=15.0, converter=_watch_wait)
    verify: bool | str = True
    cert: Any = None

    def __attrs_post_init__(self) -> None:
        if self.scheme not in _DEFAULT_PORTS:
            raise ConfigurationError(f"scheme must be http or https, got {self.scheme!r}")
        if not isinstance(self.port, int) or not 0 < self.port < 65536:
            raise ConfigurationError(f"port must be 1..65535, got {self.port!r}")

    @property
    def where(self) -> str:
        """The agent's address, without credentials."""
        return f"{self.scheme}://{self.host}:{self.port}"

    def client(self) -> Any:
        """A new blocking py-consul client: no retries, every request bounded by ``timeout``.

        An explicit token wins over ``CONSUL_HTTP_TOKEN`` (py-consul prefers the variable).
        """

        client = consul.Consul(
            host=self.host,
            port=self.port,
            scheme=self.scheme,
            dc=self.dc,
            verify=self.verify,
            cert=self.cert,
            connections_timeout=self.timeout,
        )
        if self.token is not None:
            client.token = self.token
        return client


def failures() -> tuple[type[BaseException], ...]:
    return (consul.ConsulException, requests.RequestException, OSError, ValueError)


def check_ttl(ttl: int, session_ttl: int) -> None:
    # Ending the term here would free the key while its holder still leads: refuse.
    if ttl > session_ttl:
        raise ConfigurationError(
            f"lease_duration grew to {ttl} s during a term whose session TTL is "
            f"{session_ttl} s; Consul cannot lengthen a session"
        )
