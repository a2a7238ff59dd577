"""Why a store call failed, read from the exception chain: `FailureReason` and `classify`.

Drivers wrap the operating system's errors in their own (redis-py's ``ConnectionError``
around a ``ConnectionRefusedError``, urllib3's ``NewConnectionError`` around a
``socket.gaierror``...), and providers wrap those in `ProviderError`. The root cause is
somewhere in the ``__cause__``/``__context__`` chain, so the chain is walked and every
exception in it is judged by its type, then by its class name (drivers' authentication
errors share no base class), then by its text (a provider may have dropped a chain that
held a secret, keeping only a scrubbed message). When several reasons appear, the most
specific wins: a rejected password beats the broken connection that followed it.
"""

from __future__ import annotations

import enum
import re
import socket
import ssl
from collections.abc import Iterator

__all__ = ["FailureReason", "chain", "classify", "endpoint", "host_name"]


class FailureReason(enum.StrEnum):
    """What went wrong talking to the store, for code that branches on it."""

    #: The store's host name does not resolve (a typo, or DNS is down).
    NAME_NOT_RESOLVED = "name_not_resolved"
    #: Nothing listens at host:port (the server is down, or the port is wrong).
    CONNECTION_REFUSED = "connection_refused"
    #: The store refused the credentials (password, user, token or key).
    AUTHENTICATION = "authentication"
    #: The TLS handshake failed (certificate, host name or protocol mismatch).
    TLS = "tls"
    #: The store did not answer in time (a firewall dropping packets, an overloaded server).
    TIMEOUT = "timeout"
    #: Anything else: the message names the driver's error.
    OTHER = "other"


#: Most specific first: the first reason found in this order is the chain's reason.
_PRIORITY = (
    FailureReason.AUTHENTICATION,
    FailureReason.TLS,
    FailureReason.NAME_NOT_RESOLVED,
    FailureReason.CONNECTION_REFUSED,
    FailureReason.TIMEOUT,
)

#: Authentication errors by class name: redis-py AuthenticationError, kazoo AuthFailedError
#: and NoAuthError, aetcd UnauthenticatedError, azure-core ClientAuthenticationError,
#: psycopg InvalidPassword and InvalidAuthorizationSpecification, consul ACLPermissionDenied.
_AUTH_CLASS = re.compile(
    r"Authenticat|AuthFailed|NoAuth|Unauthenticated|Unauthorized|InvalidPassword|"
    r"InvalidAuthorizationSpecification|ACLPermissionDenied"
)
_AUTH_TEXT = re.compile(
    r"WRONGPASS|NOAUTH|invalid username-password|invalid password|"
    r"password authentication failed|no password supplied|authentication failed|"
    r"authentication required|login failed for user|InvalidAccessKeyId|SignatureDoesNotMatch|"
    r"InvalidClientTokenId|AuthenticationFailed|invalid auth token|ACL not found|"
    r"\bunauthenticated\b|401 unauthorized",
    re.IGNORECASE,
)
_TLS_TEXT = re.compile(
    r"certificate verify failed|\bSSL: |\bSSL error|\bTLS handshake|SSL handshake|"
    r"wrong version number|handshake failure|self[- ]signed certificate",
    re.IGNORECASE,
)
_NAME_TEXT = re.compile(
    r"name or service not known|nodename nor servname|temporary failure in name resolution|"
    r"no address associated with hostname|getaddrinfo failed|could not translate host name|"
    r"failed to resolve host|dns resolution failed|name resolution",
    re.IGNORECASE,
)
_REFUSED_TEXT = re.compile(
    r"connection refused|connect call failed|actively refused|ECONNREFUSED|\[Errno 111\]",
    re.IGNORECASE,
)
_TIMEOUT_CLASS = re.compile(r"Time[dD]?[oO]ut(Error)?$|TimeoutExpired$")
_TIMEOUT_TEXT = re.compile(
    r"timed out|timeout expired|deadline exceeded|no answer within|did not answer within",
    re.IGNORECASE,
)


def chain(exc: BaseException) -> Iterator[BaseException]:
    """*exc*, then every exception in its ``__cause__``/``__context__`` chain, once each."""
    seen: set[int] = set()
    pending = [exc]
    while pending and len(seen) < 32:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]


def _status(exc: BaseException) -> int | None:
    for name in ("status_code", "status"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _reasons_of(exc: BaseException) -> set[FailureReason]:
    """Every reason *exc* alone shows, by type, class name, status and text."""
    found: set[FailureReason] = set()
    names = " ".join(cls.__name__ for cls in type(exc).__mro__)
    text = f"{exc} {type(exc).__name__}"
    if _AUTH_CLASS.search(names) or _AUTH_TEXT.search(text) or _status(exc) == 401:
        found.add(FailureReason.AUTHENTICATION)
    if isinstance(exc, ssl.SSLError | ssl.CertificateError) or _TLS_TEXT.search(text):
        found.add(FailureReason.TLS)
    if isinstance(exc, socket.gaierror | socket.herror) or _NAME_TEXT.search(text):
        found.add(FailureReason.NAME_NOT_RESOLVED)
    if isinstance(exc, ConnectionRefusedError) or _REFUSED_TEXT.search(text):
        found.add(FailureReason.CONNECTION_REFUSED)
    # By the exception's own class name only: urllib3's NewConnectionError derives from
    # ConnectTimeoutError, yet reports a refusal or an unknown host.
    if (
        isinstance(exc, TimeoutError)
        or _TIMEOUT_CLASS.search(type(exc).__name__)
        or _TIMEOUT_TEXT.search(str(exc))
    ):
        found.add(FailureReason.TIMEOUT)
    return found


def classify(exc: BaseException) -> FailureReason:
    """The most specific `FailureReason` shown anywhere in *exc*'s chain."""
    found: set[FailureReason] = set()
    for each in chain(exc):
        found |= _reasons_of(each)
    return next((reason for reason in _PRIORITY if reason in found), FailureReason.OTHER)


_ENDPOINTS = (
    re.compile(r"\('([^']+)', (\d+)(?:, \d+, \d+)?\)"),  # asyncio: ('127.0.0.1', 6379)
    re.compile(r"server at \"([^\"]+)\"(?: \([^)]*\))?, port (\d+)"),  # libpq
    re.compile(r"(?:connecting|connect|connection) to ([\w.\-]+|\[[0-9a-fA-F:.]+\]):(\d+)"),
    re.compile(r"@([\w.\-]+|\[[0-9a-fA-F:.]+\]):(\d+)"),  # a (redacted) URL's netloc
)
_HOSTS = (
    re.compile(r"host(?: name)? \"([^\"]+)\""),  # libpq: could not translate host name "x"
    re.compile(r"(?:connecting|connect|connection) to ([\w.\-]+|\[[0-9a-fA-F:.]+\])"),
    re.compile(r"://(?:[^@/\s]*@)?([\w.\-]+|\[[0-9a-fA-F:.]+\])"),  # a URL's host
)


def _texts(exc: BaseException) -> list[str]:
    """The chain's messages, innermost (the operating system's) first."""
    return [str(e) for e in reversed(list(chain(exc)))]


def endpoint(exc: BaseException) -> str | None:
    """The ``host:port`` a connection error in *exc*'s chain names, if any does."""
    for text in _texts(exc):
        for pattern in _ENDPOINTS:
            match = pattern.search(text)
            if match:
                host = match.group(1)
                if ":" in host and not host.startswith("["):
                    host = f"[{host}]"  # an IPv6 address
                return f"{host}:{match.group(2)}"
    return None


def host_name(exc: BaseException) -> str | None:
    """The host name a resolution error in *exc*'s chain names, if any does."""
    for text in _texts(exc):
        for pattern in _HOSTS:
            match = pattern.search(text)
            if match:
                return match.group(1)
    return None
