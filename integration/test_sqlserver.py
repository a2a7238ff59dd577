"""`SqlServerProvider` against a real SQL Server: what only a server can show.

The shared contract runs here on a custom, mixed-case schema and table as well (the
default table gets it through the ``backend`` fixture); the rest covers the table layout,
refused acquires writing nothing, case-sensitive group names, race-safe creation, the
ODBC-string form, bounded calls while another session holds the row lock, and server
restarts. Without a server these skip (see ``harness/fixtures_sqlserver.py``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from harness import BaseServer, require_control
from harness.fixtures_sqlserver import odbc_connect
from multilock.core import ProviderError
from multilock.core.testing import PROVIDER_CHECKS, check_provider
from multilock.sqlserver import SqlServerProvider
from multilock.sqlserver._connstr import ConnString
from multilock.sqlserver._provider import load_pyodbc, pick_driver


def fresh(prefix: str = "mssql") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def url(sqlserver_server: BaseServer) -> str:
    return sqlserver_server.url


def query(url: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    conn = odbc_connect(url)
    try:
        cursor = conn.cursor()
        cursor.execute(statement, *params)
        return [tuple(r) for r in cursor.fetchall()] if cursor.description else []
    finally:
        conn.close()


@pytest.mark.parametrize("check", list(PROVIDER_CHECKS))
async def test_provider_contract_on_a_custom_schema_and_table(url: str, check: str) -> None:
    await check_provider(
        lambda: SqlServerProvider(url, schema="MultiLock_Test", table="Leases"),
        lease_duration=1.0,
        only=check,
    )


async def test_table_layout_and_the_row_kept_on_release(url: str) -> None:
    table = f"Leases_{uuid.uuid4().hex[:8]}"
    group = fresh()
    async with SqlServerProvider(url, table=table) as provider:
        info = await provider.try_acquire(group, "p1", 30, {"k": "v"})
        assert info is not None
        columns = query(
            url,
            "SELECT c.name, c.collation_name FROM sys.columns c"
            " WHERE c.object_id = OBJECT_ID(?) ORDER BY c.column_id",
            f"[dbo].[{table}]",
        )
        assert [c[0] for c in columns] == [
            "group_name",
            "participant_id",
            "token",
            "metadata",
            "acquired_at",
            "expires_at",
        ]
        assert columns[0][1] == "Latin1_General_BIN2"
        await provider.release(group, "p1", info.token)
        rows = query(
            url, f"SELECT participant_id, token FROM [dbo].[{table}] WHERE group_name = ?", group
        )
        assert rows == [(None, info.token)], "release must keep the row and its token"
        again = await provider.try_acquire(group, "p2", 30, {})
        assert again is not None
        assert again.token == info.token + 1
    query(url, f"DROP TABLE [dbo].[{table}]")


async def test_a_live_term_is_refused_even_to_its_participant_id_and_nothing_is_written(
    url: str,
) -> None:
    # Two processes configured with one participant id, each with its own provider: the
    # second must not join (nor extend, nor relabel) the first one's term.
    group = fresh()
    row_of = (
        "SELECT participant_id, token, metadata, acquired_at, expires_at"
        " FROM [dbo].[multilock_leases] WHERE group_name = ?"
    )
    async with SqlServerProvider(url) as p, SqlServerProvider(url) as q:
        first = await p.try_acquire(group, "p1", 30, {"multilock.instance": "a"})
        assert first is not None
        before = query(url, row_of, group)
        assert await q.try_acquire(group, "p1", 60, {"multilock.instance": "b"}) is None
        assert await p.try_acquire(group, "p1", 60, {"multilock.instance": "a"}) is None
        assert await q.try_acquire(group, "p2", 60, {}) is None
        assert query(url, row_of, group) == before, "a refused acquire wrote the row"
        assert await q.get_leader(group) == first
        # The holder takes its term up with renew, as the election does after a lost reply.
        assert await q.renew(group, "p1", first.token, 30, {"multilock.instance": "a"})
        await p.release(group, "p1", first.token)


async def test_group_names_differing_in_case_are_different_groups(url: str) -> None:
    base = fresh("Case")
    async with SqlServerProvider(url) as provider:
        upper = await provider.try_acquire(base.upper(), "p1", 30, {})
        lower = await provider.try_acquire(base.lower(), "p2", 30, {})
        assert upper is not None
        assert lower is not None, "a case-insensitive collation merged two groups"
        leader = await provider.get_leader(base.lower())
        assert leader is not None
        assert leader.participant_id == "p2"


async def test_many_providers_create_a_new_table_at_once(url: str) -> None:
    schema, table = f"Race_{uuid.uuid4().hex[:8]}", "Leases"
    group = fresh()
    providers = [SqlServerProvider(url, schema=schema, table=table) for _ in range(6)]
    try:
        results = await asyncio.gather(
            *(p.try_acquire(group, f"p{i}", 30, {}) for i, p in enumerate(providers))
        )
        winners = [r for r in results if r is not None]
        assert len(winners) == 1, f"{len(winners)} winners"
    finally:
        for p in providers:
            await p.aclose()
        query(url, f"DROP TABLE [{schema}].[{table}]; DROP SCHEMA [{schema}]")


async def test_odbc_connection_string_form(url: str) -> None:
    conn_string, _ = ConnString.parse(url)
    driver = pick_driver(load_pyodbc().drivers()) or ""
    text = conn_string.connect_string(driver, {}, freetds="freetds" in driver.lower())
    assert text.startswith("DRIVER=")
    group = fresh()
    async with SqlServerProvider(text) as provider:
        info = await provider.try_acquire(group, "p1", 30, {})
        assert info is not None
        assert "***" in repr(provider)


async def test_a_call_blocked_by_a_row_lock_is_bounded(url: str) -> None:
    group = fresh()
    async with SqlServerProvider(url, query_timeout=1, login_timeout=2) as provider:
        info = await provider.try_acquire(group, "p1", 30, {})
        assert info is not None
        blocker = odbc_connect(url, autocommit=False)
        try:
            blocker.cursor().execute(
                "UPDATE [dbo].[multilock_leases] WITH (UPDLOCK, HOLDLOCK)"
                " SET metadata = metadata WHERE group_name = ?",
                group,
            )
            started = time.monotonic()
            with pytest.raises(ProviderError):
                await provider.renew(group, "p1", info.token, 30, {})
            took = time.monotonic() - started
            assert took < 1 + 2 + 1.5, f"a blocked renew took {took:.2f} s"
        finally:
            blocker.rollback()
            blocker.close()
        # The lock is gone: the holder renews again.
        assert await provider.renew(group, "p1", info.token, 30, {})


async def test_lease_survives_a_server_restart(sqlserver_server: BaseServer) -> None:
    server = require_control(sqlserver_server)
    group = fresh()
    async with SqlServerProvider(server.url) as provider:
        info = await provider.try_acquire(group, "p1", 600, {"k": "v"})
        assert info is not None
        await asyncio.to_thread(server.restart)
        # The first call after the restart reconnects (a dead idle connection is retried).
        assert await provider.renew(group, "p1", info.token, 600, {"k": "v"})
        leader = await provider.get_leader(group)
        assert leader is not None
        assert leader.token == info.token
