"""What `SqlServerProvider` decides without a server: names, URLs, redaction, the SQL.

No SQL Server runs here. The behaviour around the driver (threads, retries, errors) is
checked on a stand-in pyodbc module that records what the provider asks of it; the tests
against a real server live in ``integration/test_sqlserver.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sys
import threading
import time
import types
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.sqlserver import SqlServerProvider
from multilock.sqlserver import _provider as provider_module
from multilock.sqlserver._connstr import ConnString, format_pairs, parse_odbc, parse_url
from multilock.sqlserver._provider import load_pyodbc, pick_driver
from multilock.sqlserver._sql import Statements, quote_identifier, validate_identifier

SECRET = "s3cr3t-Pw"
URL = f"mssql://sa:{SECRET}@db.example:1433/app?TrustServerCertificate=yes"


# -- a stand-in for pyodbc ------------------------------------------------------------------


class FakeError(Exception):
    """pyodbc.Error: args are (SQLSTATE, message)."""


class FakeCursor:
    def __init__(self, conn: FakeConnection) -> None:
        self.conn = conn
        self.description: Any = None
        self._rows: list[tuple[Any, ...]] = []

    def execute(self, sql: str, *params: Any) -> None:
        driver = self.conn.driver
        driver.executed.append((sql, params))
        if driver.failures:
            raise driver.failures.pop(0)
        self._rows = driver.answer(sql, params)
        self.description = [("c",)]

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._rows

    def close(self) -> None:
        pass


class FakeConnection:
    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver
        self.timeout = 0
        self.closed = False

    def cursor(self) -> FakeCursor:
        if self.closed:
            raise FakeError("08003", "connection closed")
        return FakeCursor(self)

    def close(self) -> None:
        self.closed = True


class FakeDriver:
    """Records connects and statements; answers each statement with *answer*."""

    def __init__(self, installed: list[str] | None = None) -> None:
        self.installed = installed or [
            "ODBC Driver 17 for SQL Server",
            "ODBC Driver 18 for SQL Server",
        ]
        self.connects: list[tuple[str, dict[str, Any]]] = []
        self.connections: list[FakeConnection] = []
        self.executed: list[tuple[str, tuple[Any, ...]]] = []
        self.failures: list[BaseException] = []
        self.answer: Callable[[str, tuple[Any, ...]], list[tuple[Any, ...]]] = lambda s, p: []
        self.module = types.SimpleNamespace(
            Error=FakeError, drivers=lambda: list(self.installed), connect=self.connect
        )

    def connect(self, text: str, **kwargs: Any) -> FakeConnection:
        self.connects.append((text, kwargs))
        conn = FakeConnection(self)
        self.connections.append(conn)
        return conn

    def statements(self) -> list[str]:
        return [sql for sql, _ in self.executed if not sql.startswith("SET NOCOUNT")]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    driver = FakeDriver()
    monkeypatch.setattr(provider_module, "load_pyodbc", lambda: driver.module)
    return driver


@pytest.fixture
def no_pyodbc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import pyodbc`` fail, as it does where unixODBC is missing."""
    monkeypatch.setitem(sys.modules, "pyodbc", None)


# -- loading pyodbc -------------------------------------------------------------------------


def test_a_missing_pyodbc_is_a_clear_error_at_construction(no_pyodbc: None) -> None:
    with pytest.raises(ProviderError, match="unixODBC") as err:
        SqlServerProvider(URL)
    assert isinstance(err.value.__cause__, ImportError)
    assert "apt-get install unixodbc" in str(err.value)
    assert SECRET not in str(err.value)


def test_bad_arguments_are_configuration_errors_even_without_pyodbc(no_pyodbc: None) -> None:
    with pytest.raises(ConfigurationError, match="table"):
        SqlServerProvider(URL, table="x]; DROP TABLE users; --")
    with pytest.raises(ConfigurationError, match="scheme"):
        SqlServerProvider("postgresql://h/db")


def test_the_package_imports_wherever_pyodbc_does_not() -> None:
    # This module imported multilock.sqlserver at the top; pyodbc may or may not load here.
    try:
        module = load_pyodbc()
    except ProviderError:
        assert "pyodbc" not in sys.modules or sys.modules["pyodbc"] is None
    else:
        assert hasattr(module, "connect")


# -- identifiers ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dbo", "multilock_leases", "MixedCase", "_x", "a" * 128])
def test_valid_identifiers_are_kept_and_bracket_quoted(fake: FakeDriver, name: str) -> None:
    assert validate_identifier(name, "table") == name
    provider = SqlServerProvider(URL, schema=name, table=name)
    assert f"table={name}.{name}>" in repr(provider)
    assert Statements(name, name).table == f"[{name}].[{name}]"


@pytest.mark.parametrize(
    "name",
    [
        "",
        "1abc",
        "has space",
        "dash-ed",
        "br]acket",
        "[dbo]",
        "x]; DROP TABLE users; --",
        "quo'te",
        'quo"te',
        "semi;colon",
        "a" * 129,
        "ünï",
        "x\0y",
        "#temp",
        "@var",
    ],
)
def test_invalid_identifiers_are_rejected(name: str) -> None:
    with pytest.raises(ConfigurationError, match="schema"):
        SqlServerProvider(URL, schema=name)
    with pytest.raises(ConfigurationError, match="table"):
        SqlServerProvider(URL, table=name)


def test_non_string_identifiers_are_rejected() -> None:
    with pytest.raises(ConfigurationError, match="must be a str"):
        SqlServerProvider(URL, table=42)  # type: ignore[arg-type]


def test_quoting_doubles_the_closing_bracket() -> None:
    assert quote_identifier("a]b") == "[a]]b]"
    assert quote_identifier("x]; DROP TABLE t; --") == "[x]]; DROP TABLE t; --]"
    # Even a name the pattern refuses cannot close the quoted identifier early.
    quoted = quote_identifier("]]")
    assert quoted == "[]]]]]"
    assert re.fullmatch(r"\[(?:[^\]]|\]\])*\]", quoted)


# -- URLs and ODBC strings --------------------------------------------------------------------


def test_url_becomes_an_odbc_string() -> None:
    pairs, options = parse_url(
        "mssql://app:p%40ss%3Bw@db.example:1433/leases"
        "?driver=ODBC+Driver+18+for+SQL+Server&TrustServerCertificate=yes&table=T&schema=S"
    )
    assert dict(pairs) == {
        "DRIVER": "ODBC Driver 18 for SQL Server",
        "SERVER": "tcp:db.example,1433",
        "DATABASE": "leases",
        "UID": "app",
        "PWD": "p@ss;w",
        "TrustServerCertificate": "yes",
    }
    assert options == {"table": "T", "schema": "S"}
    text = format_pairs(pairs)
    assert "PWD={p@ss;w}" in text
    assert dict(parse_odbc(text)) == dict(pairs)


def test_url_without_port_driver_or_database() -> None:
    pairs, _ = parse_url("sqlserver://db.example")
    assert pairs == (("SERVER", "tcp:db.example"),)
    pairs, _ = parse_url("mssql://[::1]:1433/x")
    assert dict(pairs)["SERVER"] == "tcp:[::1],1433"
    pairs, _ = parse_url("mssql://h/x?server=h%5Cnamed")
    assert dict(pairs)["SERVER"] == "h\\named"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("mysql://h/db", "mssql://"),
        ("mssql:///db", "no host"),
        ("mssql://h/db/extra", "more than a database"),
        ("mssql://h/db?bad%3Dkey=1", "ODBC keyword"),
        ("mssql://h:99999/db", "invalid"),
    ],
)
def test_invalid_urls_are_rejected(url: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        ConnString.parse(url)


def test_odbc_strings_parse_braces_and_escapes() -> None:
    pairs = parse_odbc("Driver={ODBC Driver 18 for SQL Server}; Server=tcp:h,1433;PWD={a}}b;c};")
    assert pairs == (
        ("Driver", "ODBC Driver 18 for SQL Server"),
        ("Server", "tcp:h,1433"),
        ("PWD", "a}b;c"),
    )
    assert format_pairs(pairs) == (
        "Driver=ODBC Driver 18 for SQL Server;Server=tcp:h,1433;PWD={a}}b;c}"
    )


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        (f"Server=h;{SECRET}", "no '='"),
        (f"Server=h;PWD={{{SECRET}", "unclosed"),
        (f"Server=h;PWD={{{SECRET}}}x", "after"),
        (f"Database=app;PWD={SECRET}", "SERVER"),
        (f"Server=h;=value{SECRET}", "bad key"),
    ],
)
def test_invalid_odbc_strings_do_not_echo_the_password(text: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match) as err:
        ConnString.parse(text)
    assert SECRET not in str(err.value)


def test_connect_string_adds_driver_and_defaults_only_when_missing() -> None:
    conn, _ = ConnString.parse("Server=h;ConnectRetryCount=3")
    assert conn.connect_string("X", {"ConnectRetryCount": "0", "A": "b"}) == (
        "DRIVER=X;Server=h;ConnectRetryCount=3;A=b"
    )
    conn, _ = ConnString.parse("Driver={Mine};Server=h")
    assert conn.connect_string("X", {}) == "Driver=Mine;Server=h"


@pytest.mark.parametrize(
    "text",
    [
        URL,
        "sqlserver://sa:s3cr3t%2DPw@db.example/app",
        f"mssql://db.example/app?UID=sa&PWD={SECRET}",
        f"mssql://db.example/app?Password={SECRET}",
        f"Driver={{ODBC Driver 18 for SQL Server}};Server=db.example;UID=sa;PWD={SECRET}",
        f"Server=db.example;UID=sa;PWD={{{SECRET};x}}",
        f"Server=db.example;Password={SECRET}",
    ],
)
def test_repr_never_shows_the_password(fake: FakeDriver, text: str) -> None:
    shown = repr(SqlServerProvider(text))
    assert "s3cr3t" not in shown
    assert "***" in shown
    assert "db.example" in shown


def test_both_schemes_are_registered(fake: FakeDriver) -> None:
    for scheme in ("mssql", "sqlserver"):
        assert isinstance(from_url(f"{scheme}://sa@h/db"), SqlServerProvider)


def test_url_options_and_keywords_win(fake: FakeDriver) -> None:
    url = "mssql://h/db?schema=Election&table=Leases&query_timeout=2.5"
    provider = SqlServerProvider.from_url(url)
    assert "table=Election.Leases>" in repr(provider)
    assert provider._query_timeout == 3
    assert "table=Election.Mine>" in repr(SqlServerProvider.from_url(url, table="Mine"))
    with pytest.raises(ConfigurationError, match="table"):
        SqlServerProvider.from_url("mssql://h/db?table=bad-name")
    with pytest.raises(ConfigurationError, match="login_timeout"):
        SqlServerProvider.from_url("mssql://h/db?login_timeout=soon")


def test_timeouts_are_validated_and_rounded_up(fake: FakeDriver) -> None:
    for bad in [0, -1, float("nan"), "5"]:
        with pytest.raises(ConfigurationError, match="timeout"):
            SqlServerProvider(URL, login_timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="timeout"):
            SqlServerProvider(URL, query_timeout=bad)  # type: ignore[arg-type]
    provider = SqlServerProvider(URL, login_timeout=0.2, query_timeout=timedelta(seconds=2.1))
    assert (provider._login_timeout, provider._query_timeout) == (1, 3)


def test_connection_must_be_a_string(fake: FakeDriver) -> None:
    with pytest.raises(ConfigurationError, match="must be a str"):
        SqlServerProvider(42)  # type: ignore[arg-type]


def test_pick_driver_prefers_the_newest_microsoft_driver() -> None:
    ms = ["FreeTDS", "ODBC Driver 17 for SQL Server", "ODBC Driver 18 for SQL Server"]
    assert pick_driver(ms) == "ODBC Driver 18 for SQL Server"
    assert pick_driver(["PostgreSQL", "FreeTDS"]) == "FreeTDS"
    assert pick_driver(["PostgreSQL"]) is None


# -- the SQL ------------------------------------------------------------------------------


def test_every_write_is_one_locked_statement_on_the_server_clock() -> None:
    sql = Statements("dbo", "multilock_leases")
    for statement in (sql.acquire, sql.renew, sql.release):
        assert statement.count("WITH (UPDLOCK, HOLDLOCK)") == 1
        assert statement.rstrip().endswith(";")
        assert statement.count(";") == 1
    assert sql.acquire.startswith("MERGE [dbo].[multilock_leases] WITH (UPDLOCK, HOLDLOCK)")
    for statement in (sql.acquire, sql.renew, sql.leader):
        assert "SYSUTCDATETIME()" in statement
    for statement in (sql.acquire, sql.renew, sql.release, sql.leader, sql.setup):
        for banned in ("GETDATE", "CURRENT_TIMESTAMP", "SYSDATETIME()", "%s", "{", "@group"):
            assert banned not in statement.replace("N'{}'", ""), (banned, statement)
    # Renew and release compare participant AND token; renew also needs a live lease.
    assert "t.participant_id = ? AND t.token = ? AND t.expires_at > s.now" in sql.renew
    assert "t.participant_id = ? AND t.token = ?;" in sql.release
    assert "OUTPUT inserted.token" in sql.acquire
    assert "expires_at > SYSUTCDATETIME()" in sql.leader
    # Release keeps the row (and so its token).
    assert "DELETE" not in sql.release
    assert "participant_id = NULL" in sql.release


def test_acquire_takes_only_a_free_or_expired_row() -> None:
    # A live row is refused whoever holds it, even the same participant id: the only
    # MATCHED branch is "free or expired", and it always starts a new term (token + 1).
    acquire = Statements("dbo", "multilock_leases").acquire
    assert acquire.count("WHEN MATCHED") == 1
    assert (
        " WHEN MATCHED AND (t.participant_id IS NULL OR t.expires_at <= s.now)"
        " THEN UPDATE SET token = t.token + 1, acquired_at = s.now,"
    ) in acquire
    assert acquire.count("WHEN NOT MATCHED") == 1
    assert "WHEN NOT MATCHED THEN INSERT" in acquire
    assert "VALUES (s.group_name, s.participant_id, 1, s.metadata, s.now," in acquire
    for gone in ("t.participant_id = s.participant_id", "CASE", "t.expires_at > s.now"):
        assert gone not in acquire, gone
    assert "DELETE" not in acquire
    assert "BY SOURCE" not in acquire


async def test_a_refused_acquire_is_none(fake: FakeDriver) -> None:
    provider = SqlServerProvider(URL)
    assert await provider.try_acquire("g", "p1", 5.0, {"k": "v"}) is None
    [merge] = [sql for sql in fake.statements() if sql.startswith("MERGE")]
    assert merge == Statements("dbo", "multilock_leases").acquire
    await provider.aclose()


def test_setup_is_race_safe_and_quotes_names() -> None:
    sql = Statements("Election", "Leases")
    assert "EXEC(N'CREATE SCHEMA [Election]')" in sql.setup
    assert "CREATE TABLE [Election].[Leases]" in sql.setup
    assert sql.setup.count("THROW") == 2
    assert "BEGIN CATCH IF OBJECT_ID(@table" in sql.setup
    assert "COLLATE Latin1_General_BIN2 NOT NULL PRIMARY KEY" in sql.setup


MARK = "Zq9-bound.value_"


async def test_user_values_are_only_ever_bound_parameters(fake: FakeDriver) -> None:
    now_us = 1_700_000_000_123_456
    meta_json = json.dumps({"k": MARK})
    fake.answer = lambda sql, params: (
        [(MARK + "p", 7, meta_json, now_us)] if sql.startswith("SELECT") else [(7, now_us)]
    )
    provider = SqlServerProvider(URL, schema="S", table="T")
    group, participant = MARK + "g", MARK + "p"
    info = await provider.try_acquire(group, participant, 1.25, {"k": MARK})
    assert info is not None
    assert info.token == 7
    assert info.acquired_at == datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=UTC)
    assert await provider.renew(group, participant, 7, 2**31 - 1, {"k": MARK})
    await provider.release(group, participant, 7)
    leader = await provider.get_leader(group)
    assert leader is not None
    assert leader.metadata == {"k": MARK}
    assert leader.participant_id == participant
    assert leader.token == 7
    await provider.aclose()

    setup, *ops = fake.executed
    assert setup[1] == ("S", "[S].[T]")
    assert [sql.split()[0] for sql, _ in ops] == ["MERGE", "UPDATE", "UPDATE", "SELECT"]
    expected = [
        (group, participant, meta_json, 1, 250000),
        (2**31 - 1, 0, meta_json, group, participant, 7),
        (group, participant, 7),
        (group,),
    ]
    for (sql, params), want in zip(ops, expected, strict=True):
        assert MARK not in sql
        assert params == want
        assert sql.count("?") == len(params)


async def test_bad_arguments_fail_before_any_io(fake: FakeDriver) -> None:
    provider = SqlServerProvider(URL)
    with pytest.raises(ConfigurationError):
        await provider.try_acquire("no spaces", "p1", 5.0, {})
    with pytest.raises(ConfigurationError, match="token"):
        await provider.renew("g", "p1", "1", 5.0, {})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="token"):
        await provider.release("g", "p1", True)
    with pytest.raises(ConfigurationError, match="lease_duration"):
        await provider.try_acquire("g", "p1", 0, {})
    with pytest.raises(ConfigurationError, match="lease_duration"):
        await provider.try_acquire("g", "p1", 2.0**31, {})
    assert provider.lease_bounds.maximum == 2**31 - 1
    with pytest.raises(ConfigurationError, match="metadata"):
        await provider.try_acquire("g", "p1", 5.0, {"k": 1})  # type: ignore[dict-item]
    assert fake.executed == []
    assert fake.connects == []
    assert provider.watch("g") is None


# -- the driver side ------------------------------------------------------------------------


async def test_connects_with_the_newest_driver_and_bounded_timeouts(fake: FakeDriver) -> None:
    provider = SqlServerProvider(
        "mssql://sa:pw@h:1433/db?TrustServerCertificate=yes", login_timeout=2, query_timeout=4
    )
    await provider.get_leader("g")
    await provider.get_leader("g")
    [(text, kwargs)] = fake.connects  # the second call reused the connection
    assert text.startswith("DRIVER=ODBC Driver 18 for SQL Server;SERVER=tcp:h,1433;")
    assert text.endswith(";TrustServerCertificate=yes;ConnectRetryCount=0")
    assert kwargs == {"autocommit": True, "timeout": 2}
    assert fake.connections[0].timeout == 4
    await provider.aclose()
    assert fake.connections[0].closed


async def test_freetds_gets_no_microsoft_keywords(fake: FakeDriver) -> None:
    fake.installed = ["FreeTDS"]
    provider = SqlServerProvider("mssql://h/db")
    await provider.get_leader("g")
    assert fake.connects[0][0] == "DRIVER=FreeTDS;SERVER=h;DATABASE=db;TDS_Version=7.4"
    provider = SqlServerProvider("mssql://u:pw@[::1]:1433/db?driver=FreeTDS&TDS_Version=7.3")
    await provider.get_leader("g")
    assert fake.connects[1][0] == (
        "DRIVER=FreeTDS;SERVER=[::1];Port=1433;DATABASE=db;UID=u;PWD=pw;TDS_Version=7.3"
    )


async def test_no_driver_installed_is_a_provider_error(fake: FakeDriver) -> None:
    fake.installed = []
    provider = SqlServerProvider("mssql://h/db")
    with pytest.raises(ProviderError, match="no SQL Server ODBC driver"):
        await provider.get_leader("g")


async def test_a_dead_idle_connection_is_replaced_once(fake: FakeDriver) -> None:
    provider = SqlServerProvider(URL)
    # Two idle connections, both killed by a server restart.
    await asyncio.gather(provider.get_leader("g"), provider.get_leader("g"))
    idle = len(fake.connects)
    assert idle in (1, 2)
    fake.failures = [FakeError("08S01", "Communication link failure")]
    assert await provider.get_leader("g") is None
    assert len(fake.connects) == idle + 1, "the retry did not use a new connection"
    assert all(conn.closed for conn in fake.connections[:idle])
    # A fresh connection failing is not retried, nor is a non-connection error.
    fake.failures = [FakeError("42000", "Syntax error")]
    with pytest.raises(ProviderError, match="Syntax error"):
        await provider.get_leader("g")
    assert len(fake.connects) == idle + 1


async def test_driver_errors_are_provider_errors_without_the_password(fake: FakeDriver) -> None:
    provider = SqlServerProvider(URL)
    fake.failures = [FakeError("28000", "Login failed for 'sa'")]
    with pytest.raises(ProviderError) as err:
        await provider.try_acquire("g", "p1", 5.0, {})
    assert isinstance(err.value.__cause__, FakeError)
    assert "Login failed" in str(err.value)
    assert "tcp:db.example,1433/app" in str(err.value)
    # A driver error holding the password is scrubbed, and not chained either.
    fake.failures = [FakeError("28000", f"Login failed for 'sa' with password {SECRET}")]
    with pytest.raises(ProviderError) as err:
        await provider.try_acquire("g", "p1", 5.0, {})
    assert SECRET not in str(err.value)
    assert "Login failed" in str(err.value)
    assert err.value.__cause__ is None


@pytest.mark.parametrize(
    ("text", "spellings"),
    [
        ("mssql://sa:s3cr3t%2DPw@db.example/app", [SECRET, "s3cr3t%2DPw"]),
        ("mssql://db.example/app?PWD=s3cr3t%3BPw", ["s3cr3t;Pw", "s3cr3t%3BPw", "{s3cr3t;Pw}"]),
        (f"Server=db.example;UID=sa;PWD={{{SECRET};x}}", [f"{SECRET};x", f"{{{SECRET};x}}"]),
    ],
)
async def test_every_spelling_of_the_password_is_scrubbed(
    fake: FakeDriver, text: str, spellings: list[str]
) -> None:
    provider = SqlServerProvider(text)
    fake.failures = [FakeError("28000", f"Login failed: {' '.join(spellings)}")]
    with pytest.raises(ProviderError) as err:
        await provider.get_leader("g")
    assert "s3cr3t" not in str(err.value)
    assert "Login failed" in str(err.value)


async def test_closed_provider_refuses_calls_and_aclose_is_idempotent(fake: FakeDriver) -> None:
    provider = SqlServerProvider(URL)
    await provider.get_leader("g")
    await provider.aclose()
    await provider.aclose()
    with pytest.raises(ProviderError, match="closed"):
        await provider.get_leader("g")
    assert "s3cr3t" not in repr(provider)


def gate(fake: FakeDriver) -> tuple[threading.Event, threading.Event, list[str]]:
    """Make every statement wait for *release*; *entered* is set once one is running."""
    entered, release, done = threading.Event(), threading.Event(), []

    def answer(sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        entered.set()
        assert release.wait(10), "the test never released the statement"
        done.append(sql.split()[0])
        return []

    fake.answer = answer
    return entered, release, done


async def test_a_cancelled_call_returns_once_its_statement_ended(fake: FakeDriver) -> None:
    provider = SqlServerProvider(URL)
    await provider.get_leader("g")  # setup done, so the next statement is the MERGE
    entered, release, done = gate(fake)
    task = asyncio.ensure_future(provider.try_acquire("g", "p1", 5.0, {}))
    assert await asyncio.to_thread(entered.wait, 10)
    task.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not task.done(), "the cancelled call returned while its statement still ran"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == ["MERGE"]


async def test_a_hung_call_is_a_provider_error_at_the_bound(fake: FakeDriver) -> None:
    provider = SqlServerProvider(URL)
    await provider.get_leader("g")
    entered, release, _ = gate(fake)
    provider._calls.timeout = 0.05  # the real bound is login + query timeout + 1 s
    try:
        with pytest.raises(ProviderError, match="no answer within"):
            await provider.get_leader("g")
        assert entered.is_set()
    finally:
        release.set()


# -- the real driver, when this machine has one -------------------------------------------


@pytest.fixture
def real_driver() -> None:
    try:
        pyodbc = load_pyodbc()
    except ProviderError as exc:
        pytest.skip(f"pyodbc cannot load here: {exc.__cause__}")
    if pick_driver(pyodbc.drivers()) is None:
        pytest.skip("no SQL Server ODBC driver is registered with unixODBC here")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_unreachable_server_is_a_prompt_provider_error(real_driver: None) -> None:
    url = f"mssql://sa:{SECRET}@127.0.0.1:{closed_port()}/master?TrustServerCertificate=yes"
    async with SqlServerProvider(url, login_timeout=2, query_timeout=2) as provider:
        started = time.monotonic()
        with pytest.raises(ProviderError) as err:
            await provider.try_acquire("g", "p1", 5.0, {})
        assert time.monotonic() - started < 5.0
        assert SECRET not in str(err.value)
        assert "127.0.0.1" in str(err.value)


async def test_a_silent_server_is_bounded_by_the_login_timeout(real_driver: None) -> None:
    # Accepts TCP, never answers: only the driver's login timeout can end the login.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        url = f"mssql://sa:{SECRET}@127.0.0.1:{port}/master?TrustServerCertificate=yes"
        async with SqlServerProvider(url, login_timeout=1, query_timeout=1) as provider:
            started = time.monotonic()
            with pytest.raises(ProviderError) as err:
                await provider.get_leader("g")
            took = time.monotonic() - started
        assert took < 2.5, f"the login took {took:.2f} s with login_timeout=1"
        # The driver gave up by itself (its timeout error), not our outer bound.
        assert err.value.__cause__ is not None
        assert not isinstance(err.value.__cause__, TimeoutError)
        assert SECRET not in str(err.value)
