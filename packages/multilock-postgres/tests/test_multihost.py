"""Multi-host URLs (a primary and its standbys): what the provider decides without a server.

Failing over on a real primary and standby is in the cluster campaign
(``integration/harness/clusters/postgres.py``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from multilock.core import ProviderError, from_url
from multilock.postgres import PostgresProvider
from multilock.postgres._conninfo import ConnInfo, connect_bound, host_count

SECRET = "s3cr3t-Pw"


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never says a word (a host that hangs)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def test_a_multi_host_url_goes_to_libpq_whole_and_asks_for_the_primary() -> None:
    url = f"postgresql://app:{SECRET}@db1:5432,db2:5433/app?schema=election"
    provider = PostgresProvider.from_url(url)
    assert "db1:5432,db2:5433" in repr(provider)
    assert "table=election.multilock_leases>" in repr(provider)
    assert SECRET not in repr(provider)
    info = ConnInfo.parse(url.partition("?")[0], None)
    params = conninfo_to_dict(info.conninfo)
    assert (params["host"], params["port"]) == ("db1,db2", "5432,5433")
    assert params["target_session_attrs"] == "read-write"
    assert info.hosts == 2
    assert isinstance(from_url(url), PostgresProvider)


@pytest.mark.parametrize(
    ("text", "attrs"),
    [
        ("postgresql://u@db1,db2/app?target_session_attrs=primary", "primary"),
        ("host=db1,db2 dbname=app target_session_attrs=any", "any"),
        ("postgresql://u@db1/app", None),
        ("host=db1 dbname=app", None),
    ],
)
def test_the_callers_target_session_attrs_wins_and_one_host_gets_none(
    text: str, attrs: str | None
) -> None:
    params = conninfo_to_dict(ConnInfo.parse(text, None).conninfo)
    assert params.get("target_session_attrs") == attrs


@pytest.mark.parametrize(
    ("params", "hosts"),
    [
        ({}, 1),
        ({"host": "db"}, 1),
        ({"host": "db1,db2,db3"}, 3),
        ({"hostaddr": "10.0.0.1,10.0.0.2"}, 2),
        ({"host": "/tmp/a,/tmp/b", "port": ","}, 2),
    ],
)
def test_hosts_are_counted_as_libpq_tries_them(params: dict[str, str], hosts: int) -> None:
    assert host_count(params) == hosts


def test_each_host_gets_libpqs_connect_timeout() -> None:
    assert connect_bound(5.0, 1) == 5.0
    assert connect_bound(1.5, 1) == 1.5
    assert connect_bound(5.0, 2) == 10.0
    assert connect_bound(1.0, 3) == 6.0  # libpq waits at least 2 s per host
    assert ConnInfo.parse("host=a,b connect_timeout=3", None).connect_bound == 6.0


async def test_a_hanging_first_host_does_not_use_up_the_time_of_the_next(
    silent_port: int,
) -> None:
    # The first host accepts and never answers (a machine that is gone, a firewall); libpq
    # gives it its 2 s, then must try the second, which here refuses: the error names it.
    # Were the whole connect bounded by one connect_timeout, the second would never be
    # tried and the error would be a timeout.
    refused = closed_port()
    url = f"postgresql://u:{SECRET}@127.0.0.1:{silent_port},127.0.0.1:{refused}/db"
    async with PostgresProvider(f"{url}?connect_timeout=2") as provider:
        started = time.monotonic()
        with pytest.raises(ProviderError) as err:
            await provider.get_leader("g")
        took = time.monotonic() - started
    assert 1.5 < took < 4.0
    assert isinstance(err.value.__cause__, psycopg.OperationalError)
    assert str(refused) in str(err.value.__cause__)
    assert SECRET not in str(err.value)


async def test_a_table_lost_to_a_failover_is_made_again() -> None:
    # An asynchronous standby promoted before it received the CREATE TABLE has no table:
    # the provider must not go on believing it exists (every call would fail forever).
    provider = PostgresProvider("postgresql://h/db")
    sql = provider._sql
    ran: list[bytes] = []
    table = {"exists": True}

    async def run(op: str, query: bytes, params: object = None) -> list[tuple[object, ...]]:
        ran.append(query)
        if query == sql.exists:
            return [(True, table["exists"])]
        if query == sql.create_table:
            table["exists"] = True
            return []
        if not table["exists"]:
            lost = ProviderError("postgres get_leader failed")
            lost.__cause__ = psycopg.errors.UndefinedTable('relation "multilock_leases" ...')
            raise lost
        return []

    provider._run = run  # type: ignore[method-assign]
    assert await provider.get_leader("g") is None
    table["exists"] = False  # the failover
    with pytest.raises(ProviderError) as err:
        await provider.get_leader("g")
    assert isinstance(err.value.__cause__, psycopg.errors.UndefinedTable)
    ran.clear()
    assert await provider.get_leader("g") is None
    assert ran == [sql.exists, sql.create_table, sql.leader]
