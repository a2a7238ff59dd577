"""`SqlServerProvider`: leases in one SQL Server table, through pyodbc in worker threads.

Guarantees: one row per group; acquire, renew and release are each one statement (a
``MERGE``, an ``UPDATE``) that reads the row ``WITH (UPDLOCK, HOLDLOCK)`` and decides by
the server's ``SYSUTCDATETIME()``, so exactly one of many concurrent acquires wins and no
client clock is ever compared with anything. A new term gets ``token + 1`` in the statement
that takes it; release clears the holder but keeps the row and its token, so tokens rise
across release, expiry and server restarts (as long as the table is not dropped or edited).
Acquire never joins a live term, whoever holds it, even the caller's own participant id:
it returns None and writes nothing. A term whose acquire reply was lost is found by the
election with ``get_leader`` (the metadata comes back exactly as written, with its
instance nonce) and taken up with ``renew``, which compares participant id and token.
Connections run in autocommit mode.

Failure modes: a driver error or timeout raises `ProviderError` (the driver's error as
``__cause__`` unless it holds a secret, which is scrubbed from every message). Every
pyodbc call runs in a worker thread (`DriverCalls.blocking`) and is bounded by the
driver's login timeout and query timeout (whole seconds, at least 1), and the awaiting
coroutine by their sum plus one second. A cancelled call waits (within that
bound) for its statement to end, so the caller resumes with the store in its final state.
Connections are dropped when a call on them fails; a call that failed only because a
reused idle connection was dead (the server restarted) is retried once on a fresh one (an
acquire that had committed after all then gets None, like any refused one).
There is no watch: followers poll at the election's ``retry_interval``. pyodbc is
imported when the first provider is built, so ``import multilock.sqlserver`` works where
pyodbc cannot load (no unixODBC).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import math
import re
import threading
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from types import ModuleType
from typing import Any

from multilock.core.provider import (
    ConfigurationError,
    DriverCalls,
    LeaderInfo,
    LeaseBounds,
    Provider,
    ProviderError,
    to_seconds,
)

from ._connstr import ConnString
from ._sql import Statements, validate_identifier

__all__ = ["SqlServerProvider", "load_pyodbc", "pick_driver"]

log = logging.getLogger(__name__)

_MAX_IDLE = 4
_MS_DRIVER = re.compile(r"ODBC Driver (\d+) for SQL Server")


def load_pyodbc() -> ModuleType:
    """Import pyodbc, or raise `ProviderError` saying what the machine lacks."""
    try:
        return importlib.import_module("pyodbc")
    except ImportError as exc:
        raise ProviderError(
            f"SqlServerProvider needs pyodbc, which cannot be loaded here ({exc}). pyodbc "
            "needs the unixODBC runtime (Debian/Ubuntu: apt-get install unixodbc) and a SQL "
            "Server ODBC driver (msodbcsql18, or FreeTDS: apt-get install tdsodbc)"
        ) from exc


def pick_driver(installed: Sequence[str]) -> str | None:
    """The newest 'ODBC Driver N for SQL Server' of *installed*, else FreeTDS, else None."""
    ms = [(int(m.group(1)), d) for d in installed if (m := _MS_DRIVER.fullmatch(d))]
    if ms:
        return max(ms)[1]
    return next((d for d in installed if "freetds" in d.lower()), None)


def _whole_seconds(value: float | timedelta, field: str) -> int:
    """ODBC timeouts are whole seconds, and 0 would mean none: round up, at least 1."""
    return max(1, math.ceil(to_seconds(value, field)))


#: DATEADD(second, ...) takes an int.
_LEASE_BOUNDS = LeaseBounds(maximum=2**31 - 1, reason="DATEADD counts seconds in an int")


def _lease(seconds: float) -> tuple[int, int]:
    """A lease as (whole seconds, microseconds), for the two DATEADDs."""
    _LEASE_BOUNDS.check(seconds, "SQL Server")  # a direct caller gets no overflow error
    micros = math.ceil(seconds * 1_000_000)
    return micros // 1_000_000, micros % 1_000_000


def _from_epoch_us(value: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=int(value))


class SqlServerProvider(Provider):
    """Keep leases in ``schema.table`` of a SQL Server database (created if missing).

    *connection* is an ODBC connection string (``DRIVER={ODBC Driver 18 for SQL Server};
    SERVER=tcp:db,1433;DATABASE=app;UID=app;PWD=...``) or a URL (``mssql://user:pass@db:1433/
    app?TrustServerCertificate=yes``; see `from_url`). With no ``DRIVER`` (or ``DSN``), the
    newest installed Microsoft driver is used, else FreeTDS. Durations are float seconds
    or a `timedelta`, rounded up to whole seconds for the driver.
    """

    def __init__(
        self,
        connection: str,
        /,
        *,
        schema: str = "dbo",
        table: str = "multilock_leases",
        login_timeout: float | timedelta = 5.0,
        query_timeout: float | timedelta = 5.0,
    ) -> None:
        self._schema = validate_identifier(schema, "schema")
        self._table = validate_identifier(table, "table")
        self._conn, _ = ConnString.parse(connection)
        self._login_timeout = _whole_seconds(login_timeout, "login_timeout")
        self._query_timeout = _whole_seconds(query_timeout, "query_timeout")
        self._sql = Statements(self._schema, self._table)
        self._pyodbc = load_pyodbc()
        self._calls = DriverCalls(
            "sqlserver",
            self._conn.where,
            timeout=self._login_timeout + self._query_timeout + 1.0,
            failures=(self._pyodbc.Error, OSError),
            secrets=self._conn.secrets,
        )
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._ready = False
        self._setup_lock = asyncio.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> SqlServerProvider:
        """Build from an ``mssql://`` or ``sqlserver://`` URL.

        ``schema``, ``table``, ``login_timeout`` and ``query_timeout`` in its query are
        read here (keywords win); ``driver`` names the ODBC driver; every other query
        parameter is passed to the driver as an ODBC keyword.
        """
        _, options = ConnString.parse(url)
        ours: dict[str, Any] = dict(options)
        for key in ("login_timeout", "query_timeout"):
            if key in ours:
                try:
                    ours[key] = float(ours[key])
                except ValueError:
                    raise ConfigurationError(f"{key} in the URL must be seconds") from None
        return cls(url, **{**ours, **kwargs})

    def __repr__(self) -> str:
        return f"<SqlServerProvider {self._conn.shown} table={self._schema}.{self._table}>"

    @property
    def lease_bounds(self) -> LeaseBounds:
        return _LEASE_BOUNDS

    # -- the blocking side: runs in worker threads ------------------------------------------

    def _connect(self) -> Any:
        pyodbc = self._pyodbc
        driver = None
        if self._conn.get("DRIVER") is None and self._conn.get("DSN") is None:
            driver = pick_driver(pyodbc.drivers())
            if driver is None:
                raise ProviderError(
                    "no SQL Server ODBC driver is registered with unixODBC (install "
                    "msodbcsql18 or tdsodbc, or name one with DRIVER=/?driver=)"
                )
        chosen = driver or self._conn.get("DRIVER") or ""
        freetds = "freetds" in chosen.lower() or "libtdsodbc" in chosen.lower()
        defaults: dict[str, str] = {}
        if "ODBC Driver" in chosen:
            # Microsoft's drivers reconnect a broken idle connection by themselves, for
            # 10 s by default: longer than a lease. The core owns retries.
            defaults["ConnectRetryCount"] = "0"
        elif freetds:
            # FreeTDS's TDS version autodetection ignores the login timeout on its
            # fallback attempt (a silent server hangs it forever): pin the version.
            defaults["TDS_Version"] = "7.4"
        text = self._conn.connect_string(driver, defaults, freetds=freetds)
        conn = pyodbc.connect(text, autocommit=True, timeout=self._login_timeout)
        conn.timeout = self._query_timeout
        return conn

    def _checkout(self, fresh: bool) -> tuple[Any, bool]:
        with self._lock:
            if self._calls.closed:
                raise ProviderError(f"{self!r} is closed")
            if not fresh and self._idle:
                return self._idle.pop(), True
            stale: list[Any] = []
            if fresh:  # after a dead one, the others are likely dead too (a restart)
                stale, self._idle = self._idle, []
        for conn in stale:
            with contextlib.suppress(self._pyodbc.Error):
                conn.close()
        return self._connect(), False

    def _checkin(self, conn: Any) -> None:
        with self._lock:
            if not self._calls.closed and len(self._idle) < _MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def _execute(self, statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Run one statement; retry once, on a new connection, only if a reused one was
        found dead (the SQLSTATE class 08: connection exceptions)."""
        retried = False
        while True:
            conn, reused = self._checkout(fresh=retried)
            try:
                cursor = conn.cursor()
                cursor.execute(statement, *params)
                rows = [tuple(r) for r in cursor.fetchall()] if cursor.description else []
                cursor.close()
            except self._pyodbc.Error as exc:
                with contextlib.suppress(self._pyodbc.Error):
                    conn.close()
                state = str(exc.args[0]) if exc.args else ""
                if reused and not retried and state.startswith("08"):
                    log.debug("sqlserver: the connection was dead (%s); retrying once", state)
                    retried = True
                    continue
                raise
            self._checkin(conn)
            return rows

    # -- the async side -----------------------------------------------------------------

    async def _query(self, op: str, statement: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        if not self._ready:
            async with self._setup_lock:
                if not self._ready:
                    setup = (self._schema, self._sql.table)
                    await self._calls.blocking("setup", self._execute, self._sql.setup, setup)
                    self._ready = True
        return await self._calls.blocking(op, self._execute, statement, params)

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        lease_s, lease_us = _lease(lease_duration)
        params = (group, participant_id, json.dumps(metadata), lease_s, lease_us)
        rows = await self._query("try_acquire", self._sql.acquire, params)
        if not rows:
            return None
        token, acquired_us = rows[0]
        return LeaderInfo(
            participant_id=participant_id,
            token=int(token),
            metadata=metadata,
            acquired_at=_from_epoch_us(acquired_us),
        )

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        lease_s, lease_us = _lease(lease_duration)
        params = (lease_s, lease_us, json.dumps(metadata), group, participant_id, token)
        return bool(await self._query("renew", self._sql.renew, params))

    async def release(self, group: str, participant_id: str, token: int) -> None:
        params = (group, participant_id, token)
        await self._query("release", self._sql.release, params)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        rows = await self._query("get_leader", self._sql.leader, (group,))
        if not rows:
            return None
        participant_id, token, metadata, acquired_us = rows[0]
        return LeaderInfo(
            participant_id=participant_id,
            token=int(token),
            metadata=json.loads(metadata),
            acquired_at=_from_epoch_us(acquired_us),
        )

    async def aclose(self) -> None:
        """Close the idle connections; later calls raise. Idempotent."""
        with self._lock:
            self._calls.closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            try:
                await asyncio.to_thread(conn.close)
            except self._pyodbc.Error as exc:
                log.debug("sqlserver: closing a connection failed: %s", self._calls.scrub(str(exc)))
