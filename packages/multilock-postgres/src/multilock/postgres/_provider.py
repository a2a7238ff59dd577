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

Batches (`Batches`): acquires and releases go at once when none of their kind is on its
way, and those asked for meanwhile together after it; renewals go once per loop turn.
A batch of one (a handoff's acquire or release, a leader's renewal) runs the plain
statement; a larger one is one statement over arrays, its rows sorted by group (no
deadlock between two processes' batches), a group at most once per acquire batch.

Watching: acquire and release ``pg_notify`` the table's one channel in the same statement
(delivered at commit), with the group (and a new lease's duration) as the payload. A
provider LISTENs on one connection of its own for all its watches, of every group, while
at least one is open; a watch wakes on its group's notifications and when the lease it
saw is due to end and was not renewed (renewals send nothing, so they wake nobody). The
lease a notification announces is timed from the notification itself; only a wake at a
lease's end reads the row.

Failure modes: a driver error or timeout raises `ProviderError` (the driver's error as
``__cause__`` unless it holds the password, which is scrubbed from every message); a
refused login says the server refused the credentials, not that it cannot be reached.
Connections the provider opened are dropped when they break and reopened by the next
call; a call that failed only because a reused idle connection was dead (the server
restarted) is retried once on a fresh one. Calls are bounded by ``connect_timeout``, by
``statement_timeout`` on the server, and by their sum plus one second in the client
(psycopg may take a few more seconds to cancel a query it was interrupted in; a call in
a batch, by twice that: the batch on its way when it was asked for, then its own). A
connection or pool passed in is never closed or reconnected here. When the LISTEN
connection breaks, every open watch raises `ProviderError`; the next ``watch`` listens anew.

A primary and its standbys: a URL or conninfo naming several hosts goes to libpq whole,
with ``target_session_attrs=read-write`` added unless it says otherwise, so every
connection, the LISTEN one included, goes to the node that accepts writes, and after a
failover to the promoted standby (the old primary's connections break; the calls and the
watches reconnect as above). Connecting is bounded by ``connect_timeout`` per host named,
as libpq tries them in turn. A table lost in a failover (created just before it) is
created again. What survives the failover is the replication's business: see the README.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import errors

from multilock.core.provider import (
    Batches,
    LeaderInfo,
    Notifications,
    Provider,
    ProviderError,
    to_seconds,
)

from ._calls import PostgresCalls
from ._connections import Connections, Source
from ._conninfo import split_options
from ._sql import Statements, validate_identifier

#: One acquire for `_acquire_many`: group, participant, lease seconds, metadata JSON, payload.
_Acquire = tuple[str, str, float, str, str]
#: A term taken: token, acquired_at (as the server's clock read it).
_Taken = tuple[int, datetime]
#: One renewal for `_renew_many`: group, participant, token, lease seconds, metadata JSON.
_Renewal = tuple[str, str, int, float, str]
#: One release for `_release_many`: group, participant, token.
_Release = tuple[str, str, int]

__all__ = ["PostgresProvider"]

#: What two processes creating the same schema or table at the same moment may get.
_CREATE_RACE = (
    errors.UniqueViolation,
    errors.DuplicateTable,
    errors.DuplicateObject,
    errors.DuplicateSchema,
)


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
        self._calls = PostgresCalls(
            "postgres",
            self._connections.where,
            timeout=self._connections.connect_bound + statement_seconds + 1.0,
            failures=(psycopg.Error, OSError),
            secrets=self._connections.secrets,
        )
        self._sql = Statements(self._schema, self._table)
        self._notifications = Notifications(
            self._listen, name=repr(self), expires_in=self._expires_in
        )
        #: group -> when its lease ends (loop time; None: free), as last notified.
        self._notified: dict[str, float | None] = {}
        self._setup_lock = asyncio.Lock()
        self._ready = False
        #: An acquire goes at once; those asked for while one is on its way (a process
        #: starting many elections) go together after it, in one statement.
        self._acquires: Batches[_Acquire, _Taken | None] = Batches(
            self._acquire_many, timeout=self._calls.timeout, eager=True
        )
        #: Renewals asked for in one loop turn go in one statement.
        self._renewals: Batches[_Renewal, bool] = Batches(
            self._renew_many, timeout=self._calls.timeout
        )
        #: A release goes at once; those asked for while one is on its way (a process
        #: stopping with many groups) go together after it, in one statement.
        self._releases: Batches[_Release, None] = Batches(
            self._release_many, timeout=self._calls.timeout, eager=True
        )

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> PostgresProvider:
        """Build from a ``postgresql://`` or ``postgres://`` URL.

        Its ``schema`` and ``table`` query parameters are read here (keywords win); every
        other query parameter goes to libpq.
        """
        url, ours = split_options(url)
        return cls(url, **{**ours, **kwargs})

    def __repr__(self) -> str:
        return f"<PostgresProvider {self._connections.where} table={self._schema}.{self._table}>"

    async def _run(
        self, op: str, query: bytes, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        return await self._calls.call(op, self._connections.run(query, params))

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

    async def _query(self, op: str, query: bytes, params: Mapping[str, Any]) -> list[Any]:
        await self._ensure_table()
        try:
            return await self._run(op, query, params)
        except ProviderError as exc:
            if isinstance(exc.__cause__, errors.UndefinedTable):
                # The table is gone: dropped, or lost with the last commits of a primary
                # that failed over to a standby it had not reached. Make it again next call.
                self._ready = False
            raise

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        payload = f"{group} {lease_duration!r}"
        acquire = (group, participant_id, lease_duration, json.dumps(dict(metadata)), payload)
        taken = await self._calls.batched("try_acquire", self._acquires(acquire))
        if taken is None:
            return None
        token, acquired_at = taken
        return LeaderInfo(
            participant_id=participant_id,
            token=token,
            metadata=metadata,
            acquired_at=acquired_at.astimezone(UTC),
        )

    async def _acquire_many(self, acquires: list[_Acquire]) -> list[_Taken | None]:
        """Acquire a batch in one statement (`Batches`): each group once (a row can be
        taken once per statement; a later ask for the same group comes after the first,
        which either took the row or found it live, so it gets None), in group order."""
        first: dict[str, _Acquire] = {}
        for acquire in acquires:
            first.setdefault(acquire[0], acquire)
        names = ("group", "participant", "lease", "metadata", "payload")
        statements = (self._sql.acquire, self._sql.acquire_many)
        rows = await self._run_many(statements, names, list(first.values()))
        taken = {group: (token, at) for group, token, at, _ in rows}
        return [taken.get(a[0]) if first[a[0]] is a else None for a in acquires]

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        sent = asyncio.get_running_loop().time()
        renewal = (group, participant_id, token, lease_duration, json.dumps(dict(metadata)))
        renewed = await self._calls.batched("renew", self._renewals(renewal))
        if renewed:
            # A renewal notifies nobody: note the lease's new end (no earlier than this)
            # for the watches here, the leader's own among them, which would else read
            # the row once per lease when the end they last heard of comes.
            self._notified[group] = sent + lease_duration
        return renewed

    async def _renew_many(self, renewals: list[_Renewal]) -> list[bool]:
        """Renew a batch in one statement; whether each was renewed (`Batches`)."""
        names = ("group", "participant", "token", "lease", "metadata")
        rows = await self._run_many((self._sql.renew, self._sql.renew_many), names, renewals)
        renewed = {tuple(row) for row in rows}
        return [(g, p, t) in renewed for g, p, t, _, _ in renewals]

    async def release(self, group: str, participant_id: str, token: int) -> None:
        await self._calls.batched("release", self._releases((group, participant_id, token)))

    async def _release_many(self, releases: list[_Release]) -> list[None]:
        """Release a batch in one statement (`Batches`): each row by its participant and
        token, and a NOTIFY for each row released."""
        statements = (self._sql.release, self._sql.release_many)
        await self._run_many(statements, ("group", "participant", "token"), releases)
        return [None] * len(releases)

    async def _run_many(
        self,
        statements: tuple[bytes, bytes],
        names: tuple[str, ...],
        items: Sequence[tuple[Any, ...]],
    ) -> list[tuple[Any, ...]]:
        """Run a batch as one statement: *statements* are the one on plain values for a
        single item (a little cheaper) and the one over arrays. Field *i* of
        the items is the parameter *names[i]*. The items go sorted by their first field,
        the group, so that batches from any number of processes lock the rows they share
        in one order (no deadlock). Its errors stay the driver's, for `Batches` to give
        each caller (then `DriverCalls`)."""
        await self._ensure_table()
        items = sorted(items, key=lambda item: item[0])  # by group: rows locked in one order
        one, many = statements
        if len(items) == 1:
            query, params = one, dict(zip(names, items[0], strict=True))
        else:
            query = many
            params = {name: [item[i] for item in items] for i, name in enumerate(names)}
        try:
            return await self._connections.run(query, params)
        except errors.UndefinedTable:
            self._ready = False  # dropped, or lost in a failover: made again next call
            raise

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
        lease seen is due to end (by the server's clock). All watches share one connection."""
        return self._notifications.watch(group)

    async def _listen(self, notifications: Notifications) -> None:
        """LISTEN on one connection for every watch of this provider, until cancelled."""
        self._notified.clear()  # what was notified before may have been missed since
        conn = await self._calls.call("watch", self._connections.listener())
        failure: BaseException | None = None
        try:
            await self._calls.call("watch", conn.execute(self._sql.listen))
            notifications.ready()
            clock = asyncio.get_running_loop().time
            watched = 0
            async for note in conn.notifies():
                group, _, lease = note.payload.partition(" ")
                try:
                    self._notified[group] = clock() + float(lease) if lease else None
                except ValueError:  # not ours: the row will tell
                    self._notified.pop(group, None)
                notifications.notify(group)
                if len(self._notified) > 2 * watched + 64:  # forget the unwatched groups
                    groups = notifications.groups
                    self._notified = {g: t for g, t in self._notified.items() if g in groups}
                    watched = len(groups)
        except self._calls.failures as exc:
            failure = exc  # raised below, outside the handler: no secret rides as context
        finally:
            await conn.close()
        if failure is not None:
            self._calls.fail("watch", failure)

    async def _expires_in(self, group: str) -> float | None:
        """Seconds the group's lease has left (None: no lease), read only when needed.

        Right after a notification or a renewal sent from here, its own news answers;
        at a lease's end (was it renewed elsewhere?) and after (re)subscribing, the row
        is read.
        """
        if group in self._notified:
            ends = self._notified[group]
            if ends is None:
                return None
            left = ends - asyncio.get_running_loop().time()
            if left > 0:
                return left
        rows = await self._query("watch", self._sql.expires_in, {"group": group})
        return float(rows[0][0]) if rows else None

    async def aclose(self) -> None:
        """Close the connections this provider opened; later calls raise. Idempotent."""
        self._calls.closed = True
        await self._acquires.aclose()
        await self._renewals.aclose()
        await self._releases.aclose()
        await self._notifications.aclose()
        await self._connections.aclose()
