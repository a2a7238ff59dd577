"""Where `PostgresProvider` gets its connections: its own, or a caller's connection or pool.

Connections the provider opens are autocommit and carry a server-side
``statement_timeout``. At most `MAX_CONNECTIONS` of them run statements at once, however
many elections share the provider (a call beyond that waits for one to come back), and
they stay open for reuse until one breaks: the server went away, so the idle ones are
dead too and are closed. A caller's connection or pool is used as is and never closed;
its own bounds apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import sys
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from multilock.core.provider import ConfigurationError, ProviderError, to_seconds

from ._conninfo import ConnInfo, connect_bound, host_count

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

__all__ = ["MAX_CONNECTIONS", "Connection", "Connections", "Source"]

log = logging.getLogger(__name__)

Connection = psycopg.AsyncConnection[Any]
Source: TypeAlias = "str | Connection | AsyncConnectionPool[Any]"
#: Connections of its own a provider runs statements on at most, at once.
MAX_CONNECTIONS = 10


def _is_pool(obj: object) -> TypeGuard[AsyncConnectionPool[Any]]:
    module = sys.modules.get("psycopg_pool")  # a pool exists only if this was imported
    return module is not None and isinstance(obj, module.AsyncConnectionPool)


class Connections:
    """Hand out connections for one provider; see the module docstring."""

    def __init__(
        self,
        source: Source,
        connect_timeout: float | timedelta | None,
        statement_timeout: float,
    ) -> None:
        self.info: ConnInfo | None = None
        self._conn: Connection | None = None
        self._pool: AsyncConnectionPool[Any] | None = None
        if isinstance(source, str):
            self.info = ConnInfo.parse(source, connect_timeout)
            self.where = self.info.shown
            connect_timeout = self.info.connect_timeout
        elif isinstance(source, psycopg.AsyncConnection):
            if source.closed:
                raise ConfigurationError("the connection passed in is closed")
            self._conn = source
            self.where = f"connection to {source.info.host}:{source.info.port}"
        elif _is_pool(source):
            self._pool = source
            self.where = f"pool {source.name!r}"
        else:
            raise ConfigurationError(
                "connection must be a conninfo string or URL, a psycopg.AsyncConnection "
                f"or a psycopg_pool.AsyncConnectionPool, not {type(source).__name__}"
            )
        self.connect_timeout = to_seconds(
            5.0 if connect_timeout is None else connect_timeout, "connect_timeout"
        )
        self._statement_ms = f"{max(1, round(statement_timeout * 1000))}ms"
        self._idle: list[Connection] = []
        # One caller at a time on a connection passed in; MAX_CONNECTIONS on our own.
        self._slots = asyncio.Semaphore(1 if self._conn is not None else MAX_CONNECTIONS)
        self.closed = False

    @property
    def connect_bound(self) -> float:
        """How long opening one of our own connections may take (all hosts tried)."""
        return self.info.connect_bound if self.info is not None else self.connect_timeout

    @property
    def secrets(self) -> tuple[str, ...]:
        return self.info.secrets if self.info is not None else ()

    async def connect(self, conninfo: str, **kwargs: Any) -> Connection:
        """Open an autocommit connection of our own, with the statement timeout set.

        With several hosts (a primary and its standbys), libpq tries each in turn within
        its own ``connect_timeout``: the bound allows for every one of them.
        """
        hosts = host_count(conninfo_to_dict(conninfo, **kwargs))
        async with asyncio.timeout(connect_bound(self.connect_timeout, hosts)):
            conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True, **kwargs)
        try:
            await conn.execute(
                "SELECT set_config('statement_timeout', %s, false)", [self._statement_ms]
            )
        except BaseException:
            await conn.close()
            raise
        return conn

    @contextlib.asynccontextmanager
    async def _checkout(self) -> AsyncIterator[tuple[Connection, bool]]:
        """Yield a connection and whether it was used before (so it may be dead)."""
        if self._pool is not None:
            async with self._pool.connection(timeout=self.connect_timeout) as conn:
                yield conn, True
            return
        async with self._slots:
            if self._conn is not None:
                yield self._conn, False
                return
            assert self.info is not None
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self.connect(self.info.conninfo)
            ok = False
            try:
                yield conn, reused
                ok = not conn.broken and conn.info.transaction_status == TransactionStatus.IDLE
            finally:
                if ok and not self.closed:
                    self._idle.append(conn)
                else:
                    await conn.close()
                    if conn.broken:
                        await self._close_idle()

    async def run(self, query: bytes, params: Mapping[str, Any] | None) -> list[tuple[Any, ...]]:
        """Run *query* as its own transaction and return its rows.

        Retry once, on a fresh connection, only if a reused one was found dead (the server
        restarted): an acquire that had committed after all then gets None, like any
        refused one.
        """
        retried = False
        while True:
            conn: Connection | None = None
            reused = False
            try:
                async with self._checkout() as (conn, reused):
                    return await _execute(conn, query, params)
            except (psycopg.Error, OSError):
                if conn is None or not conn.broken or not reused or retried:
                    raise
                log.debug("postgres: the connection was dead; retrying once")
                retried = True

    async def listener(self) -> Connection:
        """Open a new connection of our own with the same parameters, for LISTEN."""
        if self.info is not None:
            return await self.connect(self.info.conninfo)
        if self._pool is not None:
            conninfo = await _resolve(self._pool.conninfo)
            kwargs = await _resolve(self._pool.kwargs) or {}
            kwargs = {k: v for k, v in kwargs.items() if k != "autocommit"}
            return await self.connect(conninfo or "", **kwargs)
        assert self._conn is not None
        info = self._conn.info
        return await self.connect(make_conninfo(info.dsn, password=info.password or None))

    async def _close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()

    async def aclose(self) -> None:
        """Close the idle connections we opened; those in use close when returned."""
        self.closed = True
        await self._close_idle()


async def _execute(
    conn: Connection, query: bytes, params: Mapping[str, Any] | None
) -> list[tuple[Any, ...]]:
    async with conn.cursor(row_factory=tuple_row) as cur:
        if conn.autocommit:
            await cur.execute(query, params)
        elif conn.info.transaction_status == TransactionStatus.IDLE:
            async with conn.transaction():  # commit at once, so a NOTIFY goes out at once
                await cur.execute(query, params)
        else:
            raise ProviderError(
                "the connection is inside a transaction: give multilock an autocommit "
                "connection, or one that nothing else uses"
            )
        return await cur.fetchall() if cur.description is not None else []


async def _resolve(value: Any) -> Any:
    """Pool settings may be callables, sync or async (psycopg_pool >= 3.3)."""
    if callable(value):
        value = value()
    if inspect.isawaitable(value):
        value = await value
    return value
