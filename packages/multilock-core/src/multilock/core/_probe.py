"""`probe`: ask the store once, within a timeout, and say precisely why it failed.

An election whose store is unreachable campaigns on, logging a warning every few seconds,
because a store that is down now may be back soon. At start-up, though, a failure is
usually a mistake (a misspelt host, a wrong port or password), and the user wants it
named at once: `probe` makes one ``get_leader`` call and turns any failure into a
`ProviderError` whose message and `FailureReason` say which mistake it is.
"""

from __future__ import annotations

import asyncio
import logging
import re
from datetime import timedelta
from typing import Any

from ._calls import call_until
from ._errors import ConfigurationError, MultilockError, ProviderError
from ._failures import FailureReason, chain, classify, endpoint, host_name
from ._names import to_seconds, validate_name
from ._options import public_info
from ._provider import Provider
from ._types import LeaderInfo
from ._url import redact_text

__all__ = ["probe", "probe_error"]

log = logging.getLogger(__name__)

_ERRNO = re.compile(r"^\[Errno -?\d+\] ")


async def probe(
    provider: Provider,
    group: str = "default",
    *,
    timeout: float | timedelta = 10.0,  # noqa: ASYNC109 (the error message names it)
) -> LeaderInfo | None:
    """Ask the store who leads *group*, once, within *timeout* seconds; fail fast.

    Return the live leader (None: nobody leads). On failure raise `ProviderError` whose
    message says which of these went wrong, and whose ``reason`` is the matching
    `FailureReason`: the host name does not resolve, the connection was refused
    (host:port), the store refused the credentials, TLS failed, the store did not answer
    within *timeout*, or something else (named by the driver's error type). The message
    holds no secret (URLs and ``password=``-style pairs in it are redacted) and the error
    chains nothing: neither ``__cause__`` nor ``__context__``. An invalid *group* or
    *timeout* raises `ConfigurationError`.
    """
    validate_name(group, "group")
    seconds = to_seconds(timeout, "timeout")
    deadline = asyncio.get_running_loop().time() + seconds
    # Bounded by `call_until`, not `asyncio.timeout`: a driver slow to honour the cancel
    # (psycopg cancelling on the server, a worker thread) must not hold the probe past
    # its timeout. The call settles in the background, as the election's own calls do.
    call = asyncio.ensure_future(provider.get_leader(group))
    error: ProviderError | None
    try:
        info = await call_until(call, deadline)
    except ConfigurationError:
        raise
    except Exception as exc:
        # Our deadline passed (not a TimeoutError of the driver's own): say how long the
        # store was given, and nothing of call_until's wording.
        gave_up = isinstance(exc, TimeoutError) and not _raised_by(call, exc)
        error = probe_error(TimeoutError(), seconds) if gave_up else probe_error(exc)
    else:
        error = None
    if error is not None:
        raise error  # outside the handler: nothing of the driver's travels on with it
    log.debug("probe of %r: the store answered; leader %r", group, info)
    return public_info(info)


def _raised_by(call: asyncio.Future[Any], exc: BaseException) -> bool:
    """Whether *call* itself ended with *exc* (rather than being given up on)."""
    return call.done() and not call.cancelled() and call.exception() is exc


def probe_error(exc: BaseException, timed_out: float | None = None) -> ProviderError:
    """The `ProviderError` for *exc*, a failed probe; *timed_out*: the probe's own timeout
    passed after that many seconds."""
    reason = FailureReason.TIMEOUT if timed_out is not None else classify(exc)
    if reason is FailureReason.NAME_NOT_RESOLVED:
        host = host_name(exc)
        summary = (
            f"cannot reach the store: the host name {host!r} does not resolve"
            if host
            else "cannot reach the store: its host name does not resolve"
        ) + " (check the host in the URL)"
    elif reason is FailureReason.CONNECTION_REFUSED:
        where = endpoint(exc)
        summary = (
            f"cannot reach the store: the connection to {where} was refused"
            if where
            else "cannot reach the store: the connection was refused"
        ) + " (is the server running, and listening on that port?)"
    elif reason is FailureReason.AUTHENTICATION:
        summary = (
            "the store refused the credentials (authentication failed): check the user "
            "name and password, token or key"
        )
    elif reason is FailureReason.TLS:
        summary = (
            "the TLS handshake with the store failed: check the certificate, the host name "
            "it names and the TLS settings"
        )
    elif reason is FailureReason.TIMEOUT:
        summary = (
            f"the store did not answer within {timed_out:g} s"
            if timed_out is not None
            else "the store did not answer in time"
        ) + " (a wrong port, a firewall dropping packets, or an overloaded server)"
    else:
        summary = f"the store call failed with {_driver_type(exc)}"
    detail = _describe(exc)
    message = f"{summary}: {detail}" if detail else summary
    return ProviderError(redact_text(message), reason=reason)


def _driver_type(exc: BaseException) -> str:
    """The qualified type of the innermost error that is not multilock's own."""
    errors = [e for e in chain(exc) if not isinstance(e, MultilockError | asyncio.CancelledError)]
    cls = type(errors[-1] if errors else exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _describe(exc: BaseException) -> str:
    """The chain's distinct messages, outermost first (the provider's names the store)."""
    parts: list[str] = []
    for each in chain(exc):
        if isinstance(each, asyncio.CancelledError) or len(parts) == 3:
            continue
        text = str(each).strip()
        said = _ERRNO.sub("", text).rstrip(".")  # "[Errno 111] Connect call failed": said
        if said and not any(said in part for part in parts):
            parts.append(text)
    return ": ".join(parts)
