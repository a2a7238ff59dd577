"""Connection strings: check them, add safe defaults, and never show their passwords."""

from __future__ import annotations

import contextlib
import functools
import math
import re
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import attrs
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import Conninfo

from multilock.core.provider import (
    ConfigurationError,
    check_url_options,
    redact_url,
    scrub,
    split_url,
    to_seconds,
)

__all__ = ["SCHEMES", "ConnInfo", "connect_bound", "host_count", "libpq_keywords", "split_options"]

SCHEMES = ("postgresql", "postgres")
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_REDACTED = "***"
#: Query parameters of a URL that are ours, not libpq's.
_OURS = ("schema", "table")


@attrs.frozen
class ConnInfo:
    """A checked connection string: what to connect with, and how to show it."""

    #: The string to connect with, with defaults added (holds the password, if any).
    conninfo: str = attrs.field(repr=False)
    #: The same, with the password replaced by ``***``.
    shown: str
    connect_timeout: float
    #: The password in every spelling a message may hold.
    secrets: tuple[str, ...] = attrs.field(repr=False, default=())
    #: How many hosts the string names (libpq tries them in turn, each within its
    #: ``connect_timeout``).
    hosts: int = 1

    @property
    def connect_bound(self) -> float:
        """How long opening a connection may take (see `connect_bound`)."""
        return connect_bound(self.connect_timeout, self.hosts)

    @classmethod
    def parse(cls, text: str, connect_timeout: float | timedelta | None) -> ConnInfo:
        """Check *text* (a URL or ``key=value`` string); raise ConfigurationError if bad.

        *connect_timeout* None takes the string's own ``connect_timeout``, else 5 s.
        """
        scheme = _URL.match(text)
        if scheme is not None and scheme.group(1).lower() not in SCHEMES:
            raise ConfigurationError(
                f"unsupported URL scheme {scheme.group(1)!r}: use postgresql:// or postgres://"
            )
        if scheme:
            # libpq would read a password cut by '/', '?' or '#' as the host or port...
            parts = split_url(text, "PostgreSQL")
            userinfo, at, hostports = parts.netloc.rpartition("@")
            if "@" in userinfo:
                # ... and it ends the user information at the first '@', where urllib (and
                # the URL of every other store) ends it at the last: libpq would take the
                # rest of a password holding one for the host, and quote it in its errors.
                netloc = f"{userinfo.replace('@', '%40')}{at}{hostports}"
                text = urlunsplit(parts._replace(netloc=netloc))
            # The constructor's URL goes to libpq as it is: schema and table are keywords.
            _check_query(text, (), also="schema and table only in from_url's URL")
        try:
            params = conninfo_to_dict(text)
        except psycopg.Error as exc:
            # libpq quotes the offending text, which may hold a password: show it only
            # for URLs, where the password can be found and scrubbed.
            detail = f": {scrub(str(exc), text)}" if scheme else ""
            raise ConfigurationError(f"invalid PostgreSQL connection string{detail}") from None
        password = str(params.get("password") or "")
        spellings = {password, quote(password, safe="")}
        if scheme:
            with contextlib.suppress(ValueError):
                spellings.add(urlsplit(text).password or "")
        if scheme:
            shown = redact_url(text)
        else:
            shown = make_conninfo(
                "", **{k: _REDACTED if k == "password" else v for k, v in params.items()}
            )
        if connect_timeout is None:
            connect_timeout = _libpq_timeout(params.get("connect_timeout"))
        seconds = to_seconds(connect_timeout, "connect_timeout")
        # Bound connecting (libpq counts whole seconds, at least 2), and let the kernel
        # find dead peers of idle connections, such as a watch's LISTEN connection.
        defaults: dict[str, str | int] = {
            "connect_timeout": max(2, math.ceil(seconds)),
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
        }
        hosts = host_count(params)
        if hosts > 1:
            # A primary and its standbys: every call writes, so only the primary will do
            # (libpq then skips a standby, and finds a promoted one after a failover).
            defaults["target_session_attrs"] = "read-write"
        return cls(
            conninfo=make_conninfo(text, **{k: v for k, v in defaults.items() if k not in params}),
            shown=shown,
            connect_timeout=seconds,
            secrets=tuple(s for s in spellings if s),
            hosts=hosts,
        )


@functools.cache
def libpq_keywords() -> tuple[str, ...]:
    """The query options libpq takes in a URL: its connection keywords (those of the
    installed libpq, so a newer one's are known too), and ``ssl``."""
    return tuple(sorted({o.keyword.decode() for o in Conninfo.get_defaults()} | {"ssl"}))


def _check_query(url: str, ours: tuple[str, ...], also: str | None = None) -> None:
    """Refuse a URL's query option that is neither *ours* nor libpq's, naming the known ones
    (libpq would say only "invalid URI query parameter")."""
    try:
        parts = urlsplit(url)
        names = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True)]
    except ValueError:
        return  # libpq reports it, without the text
    known = (*ours, *libpq_keywords())
    check_url_options(names, known, scheme=parts.scheme.lower(), also=also)


def split_options(url: str) -> tuple[str, dict[str, str]]:
    """Take ``schema`` and ``table`` out of *url*'s query; libpq would reject them."""
    parts = split_url(url, "PostgreSQL")
    if parts.scheme.lower() not in SCHEMES:
        raise ConfigurationError("a PostgreSQL URL starts with postgresql:// or postgres://")
    _check_query(url, _OURS)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _OURS}
    # quote_via=quote: libpq decodes %20 but not '+' as a space.
    rest = urlencode([(k, v) for k, v in query if k not in _OURS], quote_via=quote)
    return urlunsplit(parts._replace(query=rest)), ours


def connect_bound(connect_timeout: float, hosts: int) -> float:
    """How long opening a connection may take: *connect_timeout*, or, when several hosts
    are named, libpq's timeout for each of them in turn (a host that does not answer must
    not use up the time of the next one, which may be the primary)."""
    if hosts <= 1:
        return connect_timeout
    return hosts * max(2.0, float(math.ceil(connect_timeout)))


def host_count(params: dict[str, Any]) -> int:
    """How many hosts a parsed conninfo names (``host`` or ``hostaddr``, comma-separated)."""
    names = [str(params.get(key) or "") for key in ("host", "hostaddr")]
    return max([1, *(len(text.split(",")) for text in names if text)])


def _libpq_timeout(value: Any) -> float:
    """libpq's ``connect_timeout`` (seconds, at least 2); unset or <= 0 gives 5 here."""
    if value in (None, ""):
        return 5.0
    try:
        seconds = float(str(value))
    except ValueError:
        raise ConfigurationError(
            f"bad connect_timeout {value!r} in the connection string"
        ) from None
    return max(seconds, 2.0) if seconds > 0 else 5.0
