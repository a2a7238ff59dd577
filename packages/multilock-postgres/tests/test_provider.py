"""What `PostgresProvider` decides without a server: names, URLs, redaction, errors, SQL.

The tests against a real PostgreSQL live in ``integration/test_postgres.py``.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.postgres import PostgresProvider
from multilock.postgres._conninfo import ConnInfo, split_options
from multilock.postgres._sql import Statements, channel_name, validate_identifier

SECRET = "s3cr3t-Pw"


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.mark.parametrize("name", ["public", "multilock_leases", "MixedCase", "_x", "a" * 63])
def test_valid_identifiers_are_kept_as_written(name: str) -> None:
    assert validate_identifier(name, "table") == name
    provider = PostgresProvider("postgresql://h/db", schema=name, table=name)
    assert f"table={name}.{name}>" in repr(provider)


@pytest.mark.parametrize(
    "name",
    ["", "1abc", "has space", "dash-ed", 'quo"te', "semi;colon", "a" * 64, "ünï", "x\0y"],
)
def test_invalid_identifiers_are_rejected(name: str) -> None:
    with pytest.raises(ConfigurationError, match="schema"):
        PostgresProvider("postgresql://h/db", schema=name)
    with pytest.raises(ConfigurationError, match="table"):
        PostgresProvider("postgresql://h/db", table=name)


def test_reserved_schema_and_non_strings_are_rejected() -> None:
    with pytest.raises(ConfigurationError, match="reserved"):
        PostgresProvider("postgresql://h/db", schema="pg_catalog")
    with pytest.raises(ConfigurationError, match="must be a str"):
        PostgresProvider("postgresql://h/db", table=42)  # type: ignore[arg-type]


def test_bad_names_are_rejected_before_connecting() -> None:
    # Nothing listens on the port: had the provider tried to connect, this would be slow
    # or a ProviderError. It is a ConfigurationError raised by the constructor.
    url = f"postgresql://u:{SECRET}@127.0.0.1:{closed_port()}/db"
    with pytest.raises(ConfigurationError):
        PostgresProvider(url, table='leases"; DROP TABLE users; --')


def test_one_channel_per_table_that_fits() -> None:
    names = {
        channel_name("public", "multilock_leases"),
        channel_name("other", "multilock_leases"),
        channel_name("public", "other"),
    }
    assert len(names) == 3
    longest = channel_name("S" * 63, "T" * 63)
    assert len(longest.encode()) <= 63
    assert longest == channel_name("S" * 63, "T" * 63)


def test_acquire_takes_only_a_free_or_expired_row() -> None:
    # A live row is refused whoever holds it, even the same participant id; a row taken
    # always starts a new term. Behaviour on a server: integration/test_postgres.py.
    sql = Statements("Election", "Leases")
    channel = channel_name("Election", "Leases")
    one, many = sql.acquire.decode(), sql.acquire_many.decode()
    assert one.startswith('INSERT INTO "Election"."Leases" AS t ')
    assert ' taken AS (INSERT INTO "Election"."Leases" AS t ' in many
    assert " FROM (SELECT clock_timestamp() AS now) AS c, r ORDER BY r.n" in many
    for acquire in (one, many):
        assert " ON CONFLICT (group_name) DO UPDATE SET token = t.token + 1," in acquire
        assert " acquired_at = excluded.acquired_at," in acquire
        assert (
            " WHERE t.participant_id IS NULL OR t.expires_at <= excluded.acquired_at"
            " RETURNING t.group_name, t.token, t.acquired_at"
        ) in acquire
    assert one.endswith(f" pg_notify('{channel}', %(payload)s)::text")
    assert many.endswith(
        f" pg_notify('{channel}', r.payload)::text FROM taken JOIN r USING (group_name)"
    )
    for acquire in (one, many):
        assert "CASE" not in acquire
        assert "excluded.participant_id AND" not in acquire
        assert "t.participant_id = excluded.participant_id" not in acquire


def test_only_acquire_and_release_notify() -> None:
    sql = Statements("public", "multilock_leases")
    channel = channel_name("public", "multilock_leases")
    assert sql.listen.decode() == f'LISTEN "{channel}"'
    assert f"pg_notify('{channel}', group_name)" in sql.release.decode()
    assert f"pg_notify('{channel}', group_name)" in sql.release_many.decode()
    assert f"pg_notify('{channel}', r.payload)" in sql.acquire_many.decode()
    for quiet in (sql.renew, sql.renew_many, sql.leader, sql.expires_in):
        assert b"notify" not in quiet


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_both_schemes_are_registered(scheme: str) -> None:
    provider = from_url(f"{scheme}://u@127.0.0.1:5432/db")
    assert isinstance(provider, PostgresProvider)


@pytest.mark.parametrize("text", ["mysql://h/db", "redis://h:6379/0", "http://h/db"])
def test_other_schemes_are_rejected(text: str) -> None:
    with pytest.raises(ConfigurationError, match="postgres"):
        PostgresProvider(text)
    with pytest.raises(ConfigurationError, match="postgres"):
        PostgresProvider.from_url(text)


def test_url_may_name_schema_and_table_and_keywords_win() -> None:
    url = "postgresql://h/db?schema=Election&table=Leases&sslmode=disable"
    assert "table=Election.Leases>" in repr(PostgresProvider.from_url(url))
    assert "table=Election.Mine>" in repr(PostgresProvider.from_url(url, table="Mine"))
    with pytest.raises(ConfigurationError, match="table"):
        PostgresProvider.from_url("postgresql://h/db?table=bad-name")


def test_split_url_keeps_libpq_parameters_intact() -> None:
    url, ours = split_options("postgresql://h/db?options=-c%20search_path%3Dx&schema=s")
    assert ours == {"schema": "s"}
    assert psycopg.conninfo.conninfo_to_dict(url)["options"] == "-c search_path=x"


@pytest.mark.parametrize(
    "text",
    [
        f"postgresql://user:{SECRET}@db.example:5432/app",
        "postgresql://user:s3cr3t%40Pw@db.example/app",
        f"postgres://db.example/app?user=u&password={SECRET}",
        f"host=db.example user=u password={SECRET} dbname=app",
        f"host=db.example password='{SECRET}'",
    ],
)
def test_repr_never_shows_the_password(text: str) -> None:
    shown = repr(PostgresProvider(text))
    assert "s3cr3t" not in shown
    assert "***" in shown
    assert "db.example" in shown


def test_invalid_connection_strings_do_not_echo_the_password() -> None:
    with pytest.raises(ConfigurationError) as kv:
        PostgresProvider(f"host=h password {SECRET}")
    with pytest.raises(ConfigurationError) as url:
        PostgresProvider(f"postgresql://u:{SECRET}@h/db?no_such_param=1")
    for err in (kv, url):
        assert SECRET not in str(err.value)
    assert "no_such_param" in str(url.value)


def test_connection_must_be_a_string_connection_or_pool() -> None:
    with pytest.raises(ConfigurationError, match="AsyncConnection"):
        PostgresProvider(42)  # type: ignore[arg-type]


def test_timeouts_are_validated_and_read_from_the_conninfo() -> None:
    for bad in [0, -1, float("nan"), "5"]:
        with pytest.raises(ConfigurationError, match="timeout"):
            PostgresProvider("postgresql://h/db", connect_timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="timeout"):
            PostgresProvider("postgresql://h/db", statement_timeout=bad)  # type: ignore[arg-type]
    PostgresProvider("postgresql://h/db", connect_timeout=timedelta(seconds=2))
    assert ConnInfo.parse("host=h connect_timeout=7", None).connect_timeout == 7.0
    assert ConnInfo.parse("host=h connect_timeout=1", None).connect_timeout == 2.0  # as libpq
    assert ConnInfo.parse("host=h connect_timeout=0", None).connect_timeout == 5.0
    assert ConnInfo.parse("host=h connect_timeout=7", 3).connect_timeout == 3.0
    assert "connect_timeout=3" in ConnInfo.parse("host=h", 2.5).conninfo


async def test_unreachable_server_raises_provider_error_promptly_without_password() -> None:
    url = f"postgresql://u:{SECRET}@127.0.0.1:{closed_port()}/db"
    async with PostgresProvider(url, connect_timeout=2) as provider:
        started = time.monotonic()
        with pytest.raises(ProviderError) as err:
            await provider.try_acquire("g", "p1", 5.0, {})
        assert time.monotonic() - started < 3.0
        assert isinstance(err.value.__cause__, psycopg.OperationalError)
        assert SECRET not in str(err.value)
        assert "127.0.0.1" in str(err.value)
        with pytest.raises(ProviderError):
            await provider.get_leader("g")
        watch = provider.watch("g")
        with pytest.raises(ProviderError):
            await anext(watch)


async def test_invalid_arguments_raise_configuration_error_without_io() -> None:
    provider = PostgresProvider(f"postgresql://127.0.0.1:{closed_port()}/db")
    with pytest.raises(ConfigurationError):
        provider.watch("no spaces allowed")
    with pytest.raises(ConfigurationError, match="token"):
        await provider.renew("g", "p1", "1", 5.0, {})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="token"):
        await provider.release("g", "p1", True)
    with pytest.raises(ConfigurationError, match="lease_duration"):
        await provider.try_acquire("g", "p1", 0, {})
    await provider.aclose()


async def test_closed_provider_refuses_calls_and_aclose_is_idempotent() -> None:
    provider = PostgresProvider(f"postgresql://127.0.0.1:{closed_port()}/db")
    await provider.aclose()
    await provider.aclose()
    with pytest.raises(ProviderError, match="closed"):
        await provider.get_leader("g")


def test_a_url_s_user_and_password_may_hold_an_unencoded_at_sign() -> None:
    # libpq ends a URL's user information at its first '@' (urllib at the last): it read
    # "postgresql://app:p@ss@db/x" as the password "p" and the host "ss@db", and quoted
    # that host, the password's tail, in its "failed to resolve host" error.
    info = ConnInfo.parse("postgresql://app@corp:p@ss@127.0.0.1:5432/x", None)
    params = conninfo_to_dict(info.conninfo)
    assert (params["user"], params["password"], params["host"]) == ("app@corp", "p@ss", "127.0.0.1")
    assert info.shown == "postgresql://app%40corp:***@127.0.0.1:5432/x"
    assert "p@ss" in info.secrets
