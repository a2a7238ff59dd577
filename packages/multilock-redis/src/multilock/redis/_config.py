"""Options and URLs: what both providers accept, validated at the boundary.

Credentials never leave this module in a message: errors name URLs through `redact_url`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import attrs
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from multilock.core.provider import (
    ConfigurationError,
    check_url_options,
    redact_url,
    scrub,
    split_url,
    to_seconds,
    url_seconds,
)

if TYPE_CHECKING:
    from ._sentinel import MasterCheck

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_SOCKET_TIMEOUT",
    "check_pool_size",
    "Settings",
    "client_from_url",
    "driver_url_options",
    "parse_hosts",
    "redlock_targets",
    "sentinel_client",
    "split_options",
]

DEFAULT_KEY_PREFIX = "multilock:"
DEFAULT_SOCKET_TIMEOUT = 2.0
#: Connections of a client this package builds (one of them listens while a watch is open);
#: more calls than that wait for a free one. ``?max_connections=`` in the URL changes it.
DEFAULT_MAX_CONNECTIONS = 10
#: Options of ours that a URL may carry in its query string (redis-py gets the rest).
OWN_QUERY_KEYS = (
    "key_prefix",
    "socket_timeout",
    "socket_connect_timeout",
    "node_timeout",
    "wait_replicas",
    "wait_timeout",
)
#: The most replicas ``wait_replicas`` may ask for (a sanity bound: Redis has no limit).
MAX_WAIT_REPLICAS = 1000
_PREFIX = re.compile(r"[!-z|~]{0,200}")  # printable ASCII without spaces, '{' and '}'
#: Options of redis-py's connections that make sense as text in a URL (redis-py passes
#: every query option it does not parse itself to the connection as a str). Only those
#: the installed redis-py's connection class takes are offered.
_DRIVER_TEXT_OPTIONS = frozenset(
    {
        "client_name",
        "username",
        "password",
        "lib_name",
        "lib_version",
        "encoding",
        "encoding_errors",
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_ciphers",
        "ssl_password",
    }
)
#: Options of the blocking pool this package builds (the wait for a free connection).
_POOL_OPTIONS = frozenset({"max_connections", "timeout"})


def _from_query(key: str, value: str) -> Any:
    """A query-string value as the option's type (timeouts are numbers of seconds)."""
    if key == "key_prefix":
        return value
    if key == "wait_replicas":
        if not value.isdigit():
            raise ConfigurationError(f"wait_replicas must be a whole number, got {value!r}")
        return int(value)
    return url_seconds(key, value)


def _prefix(value: Any) -> str:
    if not isinstance(value, str) or not _PREFIX.fullmatch(value):
        raise ConfigurationError(
            f"key_prefix must be at most 200 printable ASCII characters without spaces, "
            f"'{{' or '}}', got {value!r}"
        )
    return value


def _socket_timeout(value: Any) -> float:
    return to_seconds(value, "socket_timeout")


def _connect_timeout(value: Any) -> float | None:
    return None if value is None else to_seconds(value, "socket_connect_timeout")


def _node_timeout(value: Any) -> float | None:
    return None if value is None else to_seconds(value, "node_timeout")


def _wait_replicas(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_WAIT_REPLICAS:
        raise ConfigurationError(
            f"wait_replicas must be a whole number from 0 to {MAX_WAIT_REPLICAS}, got {value!r}"
        )
    return value


def _wait_timeout(value: Any) -> float | None:
    return None if value is None else to_seconds(value, "wait_timeout")


@attrs.frozen(kw_only=True)
class Settings:
    """The options of a provider; keywords win over the URL's query string."""

    key_prefix: str = attrs.field(default=DEFAULT_KEY_PREFIX, converter=_prefix)
    socket_timeout: float = attrs.field(default=DEFAULT_SOCKET_TIMEOUT, converter=_socket_timeout)
    #: None: the same as ``socket_timeout``.
    socket_connect_timeout: float | None = attrs.field(default=None, converter=_connect_timeout)
    #: Redlock only: the bound of one node's call; None picks min(socket_timeout, lease / 5).
    node_timeout: float | None = attrs.field(default=None, converter=_node_timeout)
    #: `RedisProvider` only: replicas that must acknowledge each acquire and renew (``WAIT``);
    #: 0 waits for none.
    wait_replicas: int = attrs.field(default=0, converter=_wait_replicas)
    #: How long ``WAIT`` may block; None picks min(lease / 5, socket_timeout / 2).
    wait_timeout: float | None = attrs.field(default=None, converter=_wait_timeout)

    def __attrs_post_init__(self) -> None:
        if self.wait_timeout is None:
            return
        if not self.wait_replicas:
            raise ConfigurationError("wait_timeout needs wait_replicas (the replicas to wait for)")
        if self.wait_timeout >= self.socket_timeout:
            raise ConfigurationError(
                f"wait_timeout ({self.wait_timeout:g} s) must be shorter than socket_timeout "
                f"({self.socket_timeout:g} s), which bounds the reply of WAIT"
            )

    def wait_ms(self, lease_ms: int) -> int:
        """WAIT's timeout in milliseconds for a lease of *lease_ms* (never 0: that blocks)."""
        seconds = self.wait_timeout or min(lease_ms / 5000, self.socket_timeout / 2)
        return max(1, math.ceil(seconds * 1000))

    @property
    def connect_timeout(self) -> float:
        return self.socket_connect_timeout or self.socket_timeout

    @classmethod
    def merge(cls, query: Mapping[str, str], **kwargs: Any) -> Settings:
        """Combine the URL's options with keyword arguments (None: not given)."""
        unknown = set(kwargs) - set(OWN_QUERY_KEYS)
        if unknown:
            raise ConfigurationError(f"unknown option(s): {', '.join(sorted(unknown))}")
        given = {k: _from_query(k, v) for k, v in query.items()}
        given.update({k: v for k, v in kwargs.items() if v is not None})
        return cls(**given)

    def client_kwargs(self) -> dict[str, Any]:
        """What every data client this package builds gets: short timeouts, bounded retries.

        No socket timeout of redis-py's own: every call is bounded by the provider's
        (``socket_connect_timeout + socket_timeout``, in `DriverCalls`), and redis-py sends
        each command of a client with a socket timeout through ``asyncio.wait_for``, one
        task and one loop turn more per command, on a handoff's critical path (a release
        and an acquire). Sentinels keep it (`sentinel_client`).
        """
        return {
            "socket_timeout": None,
            "socket_connect_timeout": self.connect_timeout,
            # redis-py retries failed calls 10 times with backoff by default, longer than a
            # lease, and the election core owns retries. One immediate retry is kept for a
            # broken connection (a pooled one that a server restart closed): it fails or
            # succeeds at once. A timeout is never retried. Every script is safe to run
            # twice (a holder's acquire returns its own term), so a lost reply does no harm.
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        }


def _init_parameters(cls: type) -> frozenset[str]:
    """The keyword parameters of *cls*'s ``__init__`` and of those it passes ``**kwargs`` to."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        names.update(p.name for p in parameters if p.kind is p.KEYWORD_ONLY)
        names.update(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return frozenset(names - {"self"})


@functools.cache
def driver_url_options(scheme: str) -> tuple[str, ...]:
    """The query options redis-py takes in a URL of *scheme* (its own and its connections').

    ``redis://`` and ``redlock://`` (whose nodes are ``redis://``) get a plain connection,
    ``rediss://`` a TLS one; a Sentinel URL takes none (give ``sentinel_kwargs``).
    """
    if scheme == "redis+sentinel":
        return ()
    accepted = _init_parameters(SSLConnection if scheme == "rediss" else Connection)
    offered = (set(URL_QUERY_ARGUMENT_PARSERS) | _DRIVER_TEXT_OPTIONS) & accepted
    return tuple(sorted(offered | _POOL_OPTIONS))


def check_pool_size(limit: object) -> None:
    """Refuse a pool of fewer than two connections: a watch's pub/sub subscription keeps
    one for as long as it listens, and every command would wait for it in vain."""
    if isinstance(limit, int) and limit < 2:
        raise ConfigurationError(
            f"max_connections must be at least 2, got {limit}: the watch's pub/sub "
            "subscription keeps one connection, and the commands need another"
        )


def _check_pool_option(key: str, value: str) -> None:
    """Refuse a value of a pool option that redis-py takes but no election can work with."""
    if key == "max_connections":
        if not (value.isascii() and value.isdigit()):
            raise ConfigurationError(f"max_connections must be a whole number, got {value!r}")
        check_pool_size(int(value))
    elif key == "timeout":
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigurationError(
                "timeout (how long a command waits for a free connection) must be a "
                f"positive number of seconds, got {value!r}"
            )


def split_options(url: str, schemes: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """Return *url* without our own query options, and those options.

    Every query option must be ours or one redis-py takes: a typo is refused here, with
    the known names, rather than by redis-py's connection as an unexpected argument.
    """
    if not isinstance(url, str):
        raise ConfigurationError(f"url must be a str, not {type(url).__name__}")
    parts = split_url(url, "Redlock" if url.lower().startswith("redlock:") else "Redis")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as exc:
        raise ConfigurationError(f"invalid URL {redact_url(url)}: {exc}") from None
    if parts.scheme.lower() not in schemes:
        raise ConfigurationError(
            f"URL {redact_url(url)} must start with one of: "
            + ", ".join(f"{s}://" for s in schemes)
        )
    scheme = parts.scheme.lower()
    known = (*OWN_QUERY_KEYS, *driver_url_options(scheme))
    check_url_options((k for k, _ in pairs), known, scheme=scheme)
    for key, value in pairs:
        _check_pool_option(key, value)
    own = {k: v for k, v in pairs if k in OWN_QUERY_KEYS}
    rest = urlencode([(k, v) for k, v in pairs if k not in OWN_QUERY_KEYS])
    return urlunsplit((parts.scheme.lower(), parts.netloc, parts.path, rest, "")), own


def parse_hosts(url: str, default_port: int) -> tuple[str, list[tuple[str, int]], str]:
    """Split ``scheme://[userinfo@]h1[:p1],h2[:p2]/path`` into userinfo, hosts and path."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)(?::(\d{1,5}))?", item)
        if match is None:
            raise ConfigurationError(
                f"URL {redact_url(url)} has an invalid host {item!r}: use host[:port],..."
            )
        port = int(match.group(2)) if match.group(2) else default_port
        if not 0 < port < 65536:
            raise ConfigurationError(f"URL {redact_url(url)} has an invalid port {port}")
        hosts.append((match.group(1), port))
    if len(set(hosts)) != len(hosts):
        raise ConfigurationError(f"URL {redact_url(url)} names a server twice")
    return userinfo, hosts, parts.path


def _db(text: str, url: str) -> int:
    if text in ("", "/"):
        return 0
    if not re.fullmatch(r"/?\d{1,5}", text):
        raise ConfigurationError(f"URL {redact_url(url)}: the database must be a number")
    return int(text.strip("/"))


def check_url(url: str) -> None:
    """Refuse a ``redis://`` URL without a host, with a bad port or a bad database."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"invalid URL {redact_url(url)}: {exc}") from None
    if not parts.hostname:
        raise ConfigurationError(f"URL {redact_url(url)} has no host")
    if port == 0:
        raise ConfigurationError(f"URL {redact_url(url)} has an invalid port 0")
    _db(parts.path, url)


class _Condition(asyncio.Condition):
    """asyncio's Condition, but a notify never goes to a waiter that leaves instead.

    Before Python 3.13 (CPython gh-112202), a task notified and then cancelled before it
    resumes swallows the notify: in redis-py's `BlockingConnectionPool`, a connection
    released while its callers' calls time out can then stay idle while another task waits
    for one until the pool's timeout. A waiter leaving by an exception passes one notify on,
    as Python 3.13 does; a spurious wake-up only checks the pool again.
    """

    async def wait(self) -> Literal[True]:
        try:
            return await super().wait()
        except BaseException:
            if self.locked():  # re-acquired on the way out, as `wait` always does
                self.notify(1)
            raise


class _Pool(BlockingConnectionPool):
    """redis-py's blocking pool, with `_Condition` where Python's loses a notify."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if sys.version_info < (3, 13):
            self._condition = _Condition()


def client_from_url(url: str, settings: Settings) -> Redis:
    """Build a client for one ``redis://`` or ``rediss://`` URL (query options go to redis-py)."""
    check_url(url)
    try:
        # A bounded pool that waits for a free connection, so a thousand elections on one
        # provider share a few connections instead of failing with MaxConnectionsError or
        # opening one each. The wait is bounded like the call it is part of (the URL's
        # ``timeout=`` and ``max_connections=`` win). No task waits for a connection that
        # is free (`_Condition`).
        pool = _Pool.from_url(
            url,
            max_connections=DEFAULT_MAX_CONNECTIONS,
            timeout=settings.connect_timeout + settings.socket_timeout,
            **settings.client_kwargs(),
        )
        pool.connection_class(**pool.connection_kwargs)  # unknown options fail here, not later
        return Redis.from_pool(pool)
    except (ValueError, TypeError, RedisError) as exc:  # RedisError: a bad protocol=
        # redis-py names the offending option, never its value.
        error = ConfigurationError(f"invalid URL {redact_url(url)}: {scrub(str(exc), url)}")
    raise error  # outside the handler: redis-py's error is not its context


def sentinel_client(
    url: str, settings: Settings, sentinel_kwargs: Mapping[str, Any] | None
) -> tuple[Redis, Callable[[], Any], MasterCheck]:
    """Build a client of the master a Sentinel URL names, the closer of its sentinels, and
    the check that makes the client follow the master the sentinels name (`MasterCheck`).

    ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...][/service[/db]]``: the
    password is the master's; give the sentinels' own credentials in *sentinel_kwargs*.
    """
    from redis.asyncio.sentinel import Sentinel

    from ._sentinel import FollowMasterPool, MasterCheck

    userinfo, hosts, path = parse_hosts(url, 26379)
    service, _, db = path.strip("/").partition("/")
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{0,255}", service):
        raise ConfigurationError(f"URL {redact_url(url)} has an invalid service name")
    user, has_password, password = userinfo.partition(":")
    kwargs = settings.client_kwargs()
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        hosts,
        sentinel_kwargs={
            **kwargs,
            "socket_timeout": settings.socket_timeout,
            **(sentinel_kwargs or {}),
        },
        **kwargs,
    )
    client: Redis = sentinel.master_for(
        service or "mymaster",
        connection_pool_class=FollowMasterPool,
        username=unquote(user) or None,
        password=unquote(password) if has_password else None,
        db=_db(db, url),
    )
    pool = client.connection_pool
    assert isinstance(pool, FollowMasterPool)
    return client, sentinel.aclose, MasterCheck(pool)


def _address(target: str | Redis) -> tuple[str, int, str]:
    """Host, port and database of a node, to refuse counting one server twice."""
    if isinstance(target, Redis):
        kwargs = target.connection_pool.connection_kwargs
        host, port, db = kwargs.get("host"), kwargs.get("port", 6379), kwargs.get("db", 0)
        return str(host).lower(), int(port), str(db)
    parts = urlsplit(target)
    return (parts.hostname or "").lower(), parts.port or 6379, parts.path.strip("/") or "0"


def redlock_targets(nodes: object) -> tuple[list[str | Redis], dict[str, str]]:
    """The nodes of a Redlock provider as URLs and clients, and the URL's own options.

    *nodes* is ``redlock://[[user]:password@]h1[:p1],h2[:p2],.../db[?options]`` (one
    ``redis://`` URL per host, each with the credentials, database and redis-py options
    of the whole), or a sequence of ``redis://``/``rediss://`` URLs and clients.
    """
    query: dict[str, str] = {}
    targets: list[str | Redis] = []
    if isinstance(nodes, str):
        stripped, query = split_options(nodes, ("redlock",))
        userinfo, hosts, path = parse_hosts(stripped, 6379)
        rest = urlsplit(stripped).query
        at = f"{userinfo}@" if userinfo else ""
        targets.extend(urlunsplit(("redis", f"{at}{h}:{p}", path, rest, "")) for h, p in hosts)
    elif isinstance(nodes, Sequence) and nodes:
        for target in nodes:
            if isinstance(target, str):
                url, own = split_options(target, ("redis", "rediss"))
                if own:
                    raise ConfigurationError(
                        f"give {', '.join(own)} to RedlockProvider, not in the URL of a node "
                        f"({redact_url(url)})"
                    )
                check_url(url)
                targets.append(url)
            elif isinstance(target, Redis):
                targets.append(target)
            else:
                raise ConfigurationError(
                    f"a node must be a URL or a redis.asyncio.Redis, not {type(target).__name__}"
                )
    else:
        raise ConfigurationError("nodes must be a redlock:// URL or a non-empty sequence")
    if len({_address(t) for t in targets}) != len(targets):
        raise ConfigurationError("the nodes name the same server twice")
    return targets, query
