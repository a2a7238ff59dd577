"""What every command shares: exit codes, one-line errors, the store probe, leader records.

Every error the user can cause (a bad option, URL or name, an unreachable store) ends the
process with exactly one line on stderr, ``multilock: error: ...``, with the URL's
credentials redacted, and the exit code 2.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re
import sys
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import Any

import click

from multilock.core import (
    ConfigurationError,
    LeaderInfo,
    Provider,
    ProviderError,
    from_url,
    redact_url,
)
from multilock.core import probe as core_probe
from multilock.core.provider import scrub  # the same scrubbing core applies to driver errors

__all__ = [
    "SIGNAL_BASE",
    "CliError",
    "ExitCode",
    "close_quietly",
    "configure_logging",
    "error_line",
    "leader_record",
    "logging_restored",
    "open_provider",
    "parse_metadata",
    "probe",
    "status_document",
]

log = logging.getLogger("multilock.cli")

#: A process killed by signal N is reported as 128 + N, as shells do.
SIGNAL_BASE = 128


class ExitCode(enum.IntEnum):
    """The exit codes of ``multilock`` (besides the command's own, which ``run`` passes on)."""

    OK = 0
    #: ``status``: nobody leads the group (like grep's "no match").
    NO_LEADER = 1
    #: Bad usage, option, name or URL; or the store did not answer the first call.
    USAGE = 2
    #: ``run``: leadership was lost (or about to be) and the command was stopped (EX_TEMPFAIL).
    LOST = 75
    #: ``run``: the command exists but cannot be executed (as in POSIX shells).
    CANNOT_EXECUTE = 126
    #: ``run``: the command was not found (as in POSIX shells).
    NOT_FOUND = 127


class CliError(Exception):
    """End the command with one line on stderr and *exit_code*."""

    def __init__(
        self, message: str, exit_code: int = ExitCode.USAGE, *, url: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        #: The store URL the message may mention: its secrets are scrubbed when printed.
        self.url = url


def error_line(message: str, url: str | None = None) -> str:
    """``multilock: error: <message>`` on one line, with *url*'s secrets scrubbed."""
    if url is not None:
        message = scrub(message.replace(url, redact_url(url)), url)
    return "multilock: error: " + re.sub(r"\s*\n\s*", " ", message.strip())


def _describe(exc: BaseException) -> str:
    """The error and its causes, innermost last: driver errors often hide in ``__cause__``."""
    parts: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(parts) < 4:
        text = str(current) or type(current).__name__
        if not any(text in p for p in parts):
            parts.append(text)
        current = current.__cause__
    return ": ".join(parts)


def open_provider(url: str) -> Provider:
    """`from_url`, with a bad URL turned into a `CliError` (exit 2)."""
    try:
        return from_url(url)
    except ConfigurationError as exc:
        raise CliError(error_text(exc, url), url=url) from None


def error_text(exc: BaseException, url: str) -> str:
    """A scrubbed description of *exc* (a store or configuration error about *url*)."""
    return scrub(_describe(exc), url)


async def probe(provider: Provider, group: str, url: str, seconds: float) -> LeaderInfo | None:
    """Ask the store for the group's leader once, within *seconds*: proves it is reachable.

    `multilock.core.probe` says what failed (unknown host, refused, credentials, TLS, no
    answer); this adds the redacted URL where the message does not show it already.
    """
    try:
        return await core_probe(provider, group, timeout=seconds)
    except ConfigurationError as exc:
        raise CliError(error_text(exc, url), url=url) from None
    except ProviderError as exc:
        message, shown = scrub(str(exc), url), redact_url(url)
        if shown not in message:
            message = message.replace("the store", f"the store at {shown}", 1)
        raise CliError(message, url=url) from None


async def close_quietly(provider: Provider) -> None:
    """Close *provider*; a failure to close is only logged (the command is ending anyway)."""
    try:
        await provider.aclose()
    except Exception as exc:
        log.debug("closing the provider failed: %r", exc)


def parse_metadata(pairs: Iterable[str]) -> dict[str, str]:
    """``["k=v", ...]`` to a dict; the limits are checked later by `ElectionOptions`."""
    metadata: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="'--metadata'")
        if key in metadata:
            raise click.BadParameter(f"the key {key!r} is given twice", param_hint="'--metadata'")
        metadata[key] = value
    return metadata


def leader_record(info: LeaderInfo, now: datetime | None = None) -> dict[str, Any]:
    """The JSON fields of a leader: id, token, metadata, acquired_at (ISO), age_seconds.

    The age compares this host's wall clock with the time the store or the leader recorded,
    so it is approximate; it is never negative.
    """
    now = now or datetime.now(UTC)
    age = max(0.0, (now - info.acquired_at).total_seconds())
    return {
        "id": info.participant_id,
        "token": info.token,
        # Keys under "multilock." are the library's own (the election's instance nonce).
        "metadata": {k: v for k, v in info.metadata.items() if not k.startswith("multilock.")},
        "acquired_at": info.acquired_at.isoformat(),
        "age_seconds": round(age, 3),
    }


def status_document(group: str, info: LeaderInfo | None) -> dict[str, Any]:
    """``{"group": G, "leader": null}`` or ``{"group": G, "leader": {id, token, ...}}``."""
    return {"group": group, "leader": None if info is None else leader_record(info)}


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"multilock: {record.levelname.lower()}: {text}"


_LOGGERS = ("multilock", "multilock.core")


def configure_logging(verbosity: int) -> None:
    """Log to stderr: warnings by default, ``-v`` adds what the supervisor does, ``-vv`` all."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter("%(message)s"))
    top = logging.getLogger("multilock")
    top.addHandler(handler)
    top.setLevel(level)
    # -v is about the supervisor; the library's own chatter (renewals...) needs -vv.
    logging.getLogger("multilock.core").setLevel(logging.WARNING if verbosity < 2 else level)


@contextlib.contextmanager
def logging_restored() -> Iterator[None]:
    """Undo `configure_logging` afterwards, for callers that run the CLI in-process."""
    saved = [
        (logger, logger.level, list(logger.handlers)) for logger in map(logging.getLogger, _LOGGERS)
    ]
    try:
        yield
    finally:
        for logger, level, handlers in saved:
            logger.setLevel(level)
            logger.handlers[:] = handlers
