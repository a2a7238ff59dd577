"""`PostgresProvider`: leases in one PostgreSQL table; followers woken by LISTEN/NOTIFY.

Guarantees: one row per group; every write is one autocommit statement that compares and
acts at once (``INSERT .. ON CONFLICT DO UPDATE .. WHERE``, ``UPDATE .. WHERE``), so row
locks decide races and exactly one of many concurrent acquires wins. Expiry is judged
only by the server's clock. A new term gets ``token + 1`` in the statement that takes
it; release keeps the row and its token, so tokens rise across release, expiry and
server restarts (as long as the table is not dropped or edited). Acquire never joins a
live term, whoever holds it, even the caller's own participant id: it returns None and
writes nothing (no row change, no NOTIFY). A term whose acquire reply was lost is found
by the election with ``get_leader`` (the metadata comes back exactly as written, with its
instance nonce) and taken up with ``renew``, which compares participant id and token.
Acquire and release ``pg_notify`` a per-group channel in the same statement (delivered at
commit); ``watch`` listens on a connection of its own and also wakes when the lease it
saw is due to expire.

Failure modes: a driver error or timeout raises `ProviderError` (the driver's error as
``__cause__``, the password scrubbed). Connections the provider opened are dropped when
they break and reopened by the next call; a call that failed only because a reused idle
connection was dead (the server restarted) is retried once on a fresh one (an acquire
that had committed after all then gets None, like any refused one). Calls are
bounded by ``connect_timeout``, by ``statement_timeout`` on the server, and by their sum
plus one second in the client (psycopg may take a few more seconds to cancel a query it
was interrupted in). A connection or pool passed in is never closed or reconnected here.
A watch raises `ProviderError` when its connection breaks; the next ``watch`` opens anew.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, timedelta
from typing import Any

import psycopg
from psycopg import errors, sql
from psycopg.types.json import Jsonb

from multilock.core import (
    ConfigurationError,
    LeaderInfo,
    Provider,
    ProviderError,
    validate_name,
)
from multilock.core._names import to_seconds

from ._connections import Connection, Connections, Query, Source, execute
from ._conninfo import split_url
from ._sql import Statements, channel_name, validate_identifier

__all__ = ["PostgresProvider"]

log = logging.getLogger(__name__)

_EXPIRY_SLACK = 0.002  # wake just after the lease's end, so the server agrees it ended
#: What two processes creating the same schema or table at the same moment may get.
_CREATE_RACE = (
    errors.UniqueViolation,
    errors.DuplicateTable,
    errors.DuplicateObject,
    errors.DuplicateSchema,
)
_FAILURES = (psycopg.Error, OSError, TimeoutError)


class PostgresProvider(Provider):
    """Keep leases in ``schema.table`` of a PostgreSQL database (created if missing).

    *connection* is a conninfo string or URL (``postgresql://user:pass@host:5432/db``),
    a `psycopg.AsyncConnection` or a `psycopg_pool.AsyncConnectionPool`; the provider
    closes only the connections it opened itself. Durations are float seconds or a
    `timedelta`; ``connect_timeout`` defaults to the connection string's own, else 5 s.
    """

    def __init__(
        self,
        connection: Source,
        /,
        *,
        schema: str = "public",
        table: str = "multilock_leases",
        connect_timeout: float | timedelta | None = None,
        statement_timeout: float | timedelta = 5.0,
    ) -> None:
        self._schema = validate_identifier(schema, "schema")
        self._table = validate_identifier(table, "table")
        statement_seconds = to_seconds(statement_timeout, "statement_timeout")
        self._connections = Connections(connection, connect_timeout, statement_seconds)
        self._call_timeout = self._connections.connect_timeout + statement_seconds + 1.0
        self._sql = Statements(self._schema, self._table)
        self._setup_lock = asyncio.Lock()
        self._ready = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> PostgresProvider:
        """Build from a ``postgresql://`` or ``postgres://`` URL.

        Its ``schema`` and ``table`` query parameters are read here (keywords win); every
        other query parameter goes to libpq.
        """
        url, ours = split_url(url)
        return cls(url, **{**ours, **kwargs})

    def __repr__(self) -> str:
        return f"<PostgresProvider {self._connections.where} table={self._schema}.{self._table}>"

    def _channel(self, group: str) -> str:
        return channel_name(self._schema, self._table, group)

    def _error(self, op: str, exc: BaseException) -> ProviderError:
        if isinstance(exc, TimeoutError):
            detail = "timed out"
        else:
            detail = self._connections.scrub(str(exc).strip()) or type(exc).__name__
        return ProviderError(f"postgres {op} failed on {self._connections.where}: {detail}")

    async def _run(
        self, op: str, query: Query, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        """Run one statement; retry once only if a reused connection was found dead."""
        if self._connections.closed:
            raise ProviderError(f"{self!r} is closed")
        retried = False
        while True:
            conn: Connection | None = None
            reused = False
            try:
                async with asyncio.timeout(self._call_timeout):
                    async with self._connections.checkout() as (conn, reused):
                        return await execute(conn, query, params)
            except _FAILURES as exc:
                dead = conn is not None and conn.broken and not isinstance(exc, TimeoutError)
                if dead and reused and not retried:
                    log.debug("postgres %s: the connection was dead; retrying once", op)
                    retried = True
                    continue
                raise self._error(op, exc) from exc

    async def _ensure_table(self) -> None:
        """Create the schema and table if missing: once per provider, race-safe.

        Existence is checked first, so a role without CREATE rights works on a table
        made in advance.
        """
        if self._ready:
            return
        async with self._setup_lock:
            names = {"schema": self._schema, "table": self._table}
            for _ in range(3):
                if self._ready:
                    return
                [(has_schema, has_table)] = await self._run("setup", self._sql.exists, names)
                if has_table:
                    self._ready = True
                    return
                try:
                    if not has_schema:
                        await self._run("setup", self._sql.create_schema)
                    await self._run("setup", self._sql.create_table)
                    self._ready = True
                except ProviderError as exc:
                    if not isinstance(exc.__cause__, _CREATE_RACE):
                        raise
                    # Another process created it at the same moment: look again.
            raise ProviderError(f"could not create the table {self._schema}.{self._table}")

    async def _query(self, op: str, query: Query, params: Mapping[str, Any]) -> list[Any]:
        await self._ensure_table()
        return await self._run(op, query, params)

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        lease = lease_duration
        meta = dict(metadata)
        params = {"group": group, "participant": participant_id, "lease": lease}
        params |= {"metadata": Jsonb(meta), "channel": self._channel(group)}
        rows = await self._query("try_acquire", self._sql.acquire, params)
        if not rows:
            return None
        token, acquired_at, _ = rows[0]
        return LeaderInfo(
            participant_id=participant_id,
            token=token,
            metadata=meta,
            acquired_at=acquired_at.astimezone(UTC),
        )

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        lease = lease_duration
        meta = dict(metadata)
        params = {"group": group, "participant": participant_id, "lease": lease}
        params |= {"metadata": Jsonb(meta), "token": _token(token)}
        return bool(await self._query("renew", self._sql.renew, params))

    async def release(self, group: str, participant_id: str, token: int) -> None:
        params = {"group": group, "participant": participant_id, "token": _token(token)}
        await self._query("release", self._sql.release, params | {"channel": self._channel(group)})

    async def get_leader(self, group: str) -> LeaderInfo | None:
        rows = await self._query("get_leader", self._sql.leader, {"group": group})
        if not rows:
            return None
        participant_id, token, metadata, acquired_at = rows[0]
        return LeaderInfo(
            participant_id=participant_id,
            token=token,
            metadata=metadata,
            acquired_at=acquired_at.astimezone(UTC),
        )

    def watch(self, group: str) -> AsyncIterator[None]:
        """Yield once listening, then on each acquire or release of *group*, and when the
        lease seen is due to expire (by the server's clock). Opens its own connection."""
        validate_name(group, "group")
        return self._watch(group)

    async def _watch(self, group: str) -> AsyncIterator[None]:
        await self._ensure_table()
        listen = sql.SQL("LISTEN {}").format(sql.Identifier(self._channel(group)))
        try:
            conn = await self._connections.listener()
            try:
                await conn.execute(listen)
            except BaseException:
                await conn.close()
                raise
        except _FAILURES as exc:
            raise self._error("watch", exc) from exc
        try:
            # A change made before LISTEN took effect sent no notification we can see.
            yield None
            while True:
                try:
                    async with asyncio.timeout(self._call_timeout):
                        rows = await execute(conn, self._sql.expires_in, {"group": group})
                    wait = float(rows[0][0]) + _EXPIRY_SLACK if rows else None
                    async for _ in conn.notifies(timeout=wait, stop_after=1):
                        pass
                except _FAILURES as exc:
                    raise self._error("watch", exc) from exc
                yield None
        finally:
            await conn.close()

    async def aclose(self) -> None:
        """Close the connections this provider opened; later calls raise. Idempotent."""
        await self._connections.aclose()


def _token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int):
        raise ConfigurationError(f"token must be an int, not {type(token).__name__}")
    return token
