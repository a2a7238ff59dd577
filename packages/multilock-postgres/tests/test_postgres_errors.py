"""What a user reads when something is wrong: unknown URL options, a refused login, a
LISTEN connection that could not be opened. Each message is specific, names the server
once, and holds no secret.

The refused logins come from a stand-in server speaking just enough of PostgreSQL's
protocol (it asks for a password, then refuses it as the real server does), so libpq's
own error texts are what the provider reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.core.testing import error_texts as texts
from multilock.postgres import PostgresProvider
from multilock.postgres._calls import refusal
from multilock.postgres._conninfo import libpq_keywords

PASSWORD = "Corr3ct-h0rse"
_SSL_REQUEST, _GSS_REQUEST = 80877103, 80877104


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# -- unknown URL options -------------------------------------------------------------------


def test_a_mistyped_option_is_named_with_the_known_ones_and_the_closest() -> None:
    # Before: "invalid PostgreSQL connection string: invalid URI query parameter: "sslmod"".
    with pytest.raises(ConfigurationError) as caught:
        from_url(f"postgresql://u:{PASSWORD}@h/db?sslmod=require")
    known = ", ".join(sorted({"schema", "table", *libpq_keywords()}))
    assert str(caught.value) == (
        f"unknown option 'sslmod' in the postgresql URL (did you mean 'sslmode'?); known: {known}"
    )
    assert all(PASSWORD not in text for text in texts(caught.value))


def test_the_known_options_are_ours_and_libpqs() -> None:
    assert {"sslmode", "application_name", "connect_timeout", "ssl"} <= set(libpq_keywords())
    provider = PostgresProvider.from_url("postgres://h/db?schema=s&sslmode=disable&ssl=true")
    assert "table=s.multilock_leases>" in repr(provider)
    with pytest.raises(ConfigurationError, match="unknown option 'shcema' in the postgres URL"):
        PostgresProvider.from_url("postgres://h/db?shcema=s")


def test_the_constructor_says_schema_and_table_belong_to_from_url() -> None:
    with pytest.raises(ConfigurationError) as caught:
        PostgresProvider("postgresql://h/db?schema=s")
    assert str(caught.value).startswith("unknown option 'schema' in the postgresql URL; known: ")
    assert str(caught.value).endswith(", and schema and table only in from_url's URL")


# -- refused logins ------------------------------------------------------------------------


def _message(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!i", len(body) + 4) + body


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Refuse every login the way PostgreSQL does with password authentication."""
    try:
        while True:  # SSL and GSS encryption requests are declined; then the startup
            (length,) = struct.unpack("!i", await reader.readexactly(4))
            body = await reader.readexactly(length - 4)
            if struct.unpack("!i", body[:4])[0] not in (_SSL_REQUEST, _GSS_REQUEST):
                break
            writer.write(b"N")
        fields = body[4:].split(b"\0")
        user = dict(zip(fields[::2], fields[1::2], strict=False)).get(b"user", b"?")
        writer.write(_message(b"R", struct.pack("!i", 3)))  # cleartext password, please
        await writer.drain()
        await reader.readexactly(1)  # 'p': the password (a client without one hangs up)
        (length,) = struct.unpack("!i", await reader.readexactly(4))
        await reader.readexactly(length - 4)
        text = b'password authentication failed for user "' + user + b'"'
        fields_out = b"SFATAL\0VFATAL\0C28P01\0M" + text + b"\0\0"
        writer.write(_message(b"E", fields_out))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.fixture
async def refusing_server() -> AsyncIterator[int]:
    handlers: set[asyncio.Task[Any]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await _serve(reader, writer)
        finally:
            handlers.discard(task)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    async with server:
        yield port
    # Each handler closes its connection. Wait for them: a handler still running when the
    # loop closes leaves its socket to the garbage collector, whose ResourceWarning then
    # fails whichever later test it happens to run in.
    if handlers:
        _, stuck = await asyncio.wait(set(handlers), timeout=5)
        for task in stuck:
            task.cancel()
        await asyncio.gather(*stuck, return_exceptions=True)


async def _refusal(url: str) -> tuple[ProviderError, ProviderError]:
    """The errors of a call and of a watch (its LISTEN connection) against *url*."""
    async with PostgresProvider.from_url(url) as provider:
        with pytest.raises(ProviderError) as call:
            await provider.get_leader("g")
        with pytest.raises(ProviderError) as watch:
            async for _ in provider.watch("g"):
                pass
    return call.value, watch.value


async def test_a_wrong_password_is_an_authentication_failure_naming_the_server_once(
    refusing_server: int,
) -> None:
    where = f"postgresql://u:***@127.0.0.1:{refusing_server}/db"
    call, watch = await _refusal(
        f"postgresql://u:{PASSWORD}@127.0.0.1:{refusing_server}/db?connect_timeout=5"
    )
    # Before: "postgres setup failed on <url>: connection failed: connection to server at
    # ... failed: FATAL: password authentication failed ...", read as "cannot reach".
    assert str(call).startswith(
        f"postgres setup failed: the PostgreSQL server at {where}?connect_timeout=5 refused "
        'the credentials: FATAL: password authentication failed for user "u"'
    )
    assert str(call).count(f"{refusing_server}") == 1
    assert isinstance(call.__cause__, psycopg.OperationalError)
    # The watch's LISTEN connection: the same reason, kept in the message.
    assert str(watch).startswith("postgres watch failed: the PostgreSQL server at ")
    assert "refused the credentials: FATAL: password authentication failed" in str(watch)
    for error in (call, watch):
        assert all(PASSWORD not in text for text in texts(error))


async def test_a_missing_password_says_none_was_given(refusing_server: int) -> None:
    call, watch = await _refusal(f"postgresql://u@127.0.0.1:{refusing_server}/db")
    for error in (call, watch):
        assert (
            f"the PostgreSQL server at postgresql://u@127.0.0.1:{refusing_server}/db requires a "
            "password, and none was given: fe_sendauth: no password supplied"
        ) in str(error)


async def test_an_unreachable_server_is_not_called_a_refusal() -> None:
    port = closed_port()
    call, watch = await _refusal(f"postgresql://u:{PASSWORD}@127.0.0.1:{port}/db")
    for error in (call, watch):
        assert "refused the credentials" not in str(error)
        assert f"failed on postgresql://u:***@127.0.0.1:{port}/db: connection failed" in str(error)
        assert "Connection refused" in str(error)  # the watch's reason is in its message
        assert all(PASSWORD not in text for text in texts(error))


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("FATAL:  password authentication failed for user", "refused the credentials"),
        ("FATAL:  Ident authentication failed for user", "refused the credentials"),
        ("fe_sendauth: no password supplied", "requires a password, and none was given"),
        ('FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "u"', "pg_hba.conf"),
        ('FATAL:  database "nodb" does not exist', None),
        ("Connection refused", None),
    ],
)
def test_refusals_are_told_from_other_failures(text: str, said: str | None) -> None:
    found = refusal(psycopg.OperationalError(f"connection failed: {text}"))
    assert found == said or (said is not None and found is not None and said in found)
    assert refusal(OSError("password authentication failed")) is None
