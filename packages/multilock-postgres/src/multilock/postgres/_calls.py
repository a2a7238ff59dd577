"""`PostgresCalls`: `DriverCalls` that say when the server refused the credentials.

libpq reports a refused password as an ``OperationalError`` like any unreachable server
(without its SQLSTATE, which is lost when connecting), so the cause is read from the
text. A refused login then says so, names the server once, and tells a missing password
from a wrong one and from a ``pg_hba.conf`` rule that refuses the user or host.
"""

from __future__ import annotations

import re

import psycopg
from psycopg import errors

from multilock.core.provider import DriverCalls, ProviderError

__all__ = ["PostgresCalls", "refusal"]

#: libpq's and the server's words for each refusal (English, as the server sends them
#: unless its lc_messages says otherwise), and what this provider says for each.
_REFUSALS = (
    ("no password supplied", "requires a password, and none was given"),
    ("pg_hba.conf", "does not let this user connect from this host (pg_hba.conf)"),
    ("authentication failed", "refused the credentials"),
)
#: libpq's prefix before the server's own words, which names the host and port again.
_PREFIX = re.compile(r"^(connection failed: )?(connection to server (at|on) .*? failed: )?")


def refusal(exc: BaseException) -> str | None:
    """What the server refused, if *exc* is a refused login, else None."""
    if isinstance(exc, errors.InvalidAuthorizationSpecification | errors.InvalidPassword):
        return "refused the credentials"
    if not isinstance(exc, psycopg.OperationalError):
        return None
    text = str(exc).lower()
    return next((said for words, said in _REFUSALS if words in text), None)


class PostgresCalls(DriverCalls):
    """`DriverCalls` for psycopg: a refused login is an authentication failure, not an
    unreachable server."""

    def error(self, op: str, exc: BaseException) -> ProviderError:
        error = super().error(op, exc)
        what = refusal(exc)
        if what is None:
            return error
        detail = _PREFIX.sub("", " ".join(self.scrub(str(exc)).split())) or type(exc).__name__
        specific = ProviderError(
            f"{self.store} {op} failed: the PostgreSQL server at {self.where} {what}: {detail}"
        )
        specific.__cause__ = error.__cause__  # None if the driver's error held a secret
        specific.__suppress_context__ = True
        return specific
