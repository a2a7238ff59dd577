"""SQL Server for the integration suite: a server named by URL, or a container.

No SQL Server engine runs from local binaries here, so the order is: (1)
``MULTILOCK_TEST_SQLSERVER_URL`` (``mssql://sa:pass@127.0.0.1:11433/master``, the
docker-compose service); ``TrustServerCertificate=yes`` is added when the URL names neither
it nor ``Encrypt``, since test servers use self-signed certificates; (2) a
``mcr.microsoft.com/mssql/server:2022-latest`` container when a Docker engine answers;
(3) otherwise every SQL Server test skips, in CI too, because no SQL Server engine can run
on these machines. Either way the client side needs pyodbc, unixODBC and a SQL Server ODBC
driver (see the package README).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Self
from urllib.parse import parse_qsl, urlsplit

import pytest

from .backends import Backend, register_backend
from .containers import ContainerServer, ContainerSpec, docker_available
from .resolve import hold
from .servers import START_TIMEOUT, BaseServer, ExternalServer, ServerError

__all__ = ["sqlserver_server"]

ENV_VAR = "MULTILOCK_TEST_SQLSERVER_URL"
SKIP_REASON = (
    "no SQL Server engine can run on this machine: set MULTILOCK_TEST_SQLSERVER_URL or start Docker"
)
SA_PASSWORD = "Multilock-Test-1"
#: SQL Server needs 20-60 s to start in a container.
CONTAINER_START_TIMEOUT = max(START_TIMEOUT, 180.0)

SPEC = ContainerSpec(
    image="mcr.microsoft.com/mssql/server:2022-latest",
    port=1433,
    url=f"mssql://sa:{SA_PASSWORD}@{{host}}:{{port}}/master?TrustServerCertificate=yes",
    env={"ACCEPT_EULA": "Y", "MSSQL_SA_PASSWORD": SA_PASSWORD, "MSSQL_PID": "Developer"},
)


def with_trusted_certificate(url: str) -> str:
    """Add ``TrustServerCertificate=yes`` unless *url* says how to handle encryption."""
    keys = {k.lower() for k, _ in parse_qsl(urlsplit(url).query)}
    if keys & {"trustservercertificate", "encrypt"}:
        return url
    return f"{url}{'&' if '?' in url else '?'}TrustServerCertificate=yes"


def odbc_connect(url: str, timeout: int = 5, autocommit: bool = True) -> Any:
    """A pyodbc connection to *url*, made exactly as the provider makes its own."""
    from multilock.sqlserver import SqlServerProvider

    provider = SqlServerProvider(url, login_timeout=timeout, query_timeout=timeout)
    conn = provider._connect()
    conn.autocommit = autocommit
    return conn


def probe_sqlserver(url: str) -> None:
    """Log in and run ``SELECT 1``."""
    conn = odbc_connect(url, timeout=2)
    try:
        row = conn.cursor().execute("SELECT 1").fetchone()
        if row is None or row[0] != 1:
            raise ServerError(f"SELECT 1 returned {row!r}")
    finally:
        conn.close()


class ExternalSqlServer(ExternalServer):
    """The server of ``MULTILOCK_TEST_SQLSERVER_URL``: probed, never restarted or stopped."""

    def __init__(self, url: str) -> None:
        super().__init__("sqlserver", with_trusted_certificate(url), ENV_VAR)

    def probe(self) -> None:
        probe_sqlserver(self.url)


class SqlServerContainer(ContainerServer):
    """SQL Server 2022 (Developer edition) in a container; restart keeps its port and data."""

    def __init__(self) -> None:
        super().__init__("sqlserver", SPEC)

    def probe(self) -> None:
        probe_sqlserver(self.url)

    def start(self, timeout: float = CONTAINER_START_TIMEOUT) -> Self:
        return super().start(timeout)

    def restart(self, timeout: float = CONTAINER_START_TIMEOUT) -> None:
        super().restart(timeout)


def _client_missing() -> str | None:
    """Why this machine cannot talk to SQL Server (pyodbc, unixODBC, driver), or None."""
    from multilock.core import ProviderError

    try:
        from multilock.sqlserver._provider import load_pyodbc, pick_driver
    except ImportError:
        return "multilock-sqlserver is not installed"
    try:
        pyodbc = load_pyodbc()
    except ProviderError as exc:
        return str(exc)
    if pick_driver(pyodbc.drivers()) is None:
        return "no SQL Server ODBC driver is registered with unixODBC (see the README)"
    return None


def start_sqlserver() -> BaseServer:
    """The env var's server, else a container; skip (even in CI) when there is neither."""
    url = os.environ.get(ENV_VAR, "").strip()
    if url:
        missing = _client_missing()
        if missing is not None:
            pytest.fail(f"{ENV_VAR} is set, but {missing}", pytrace=False)
        return ExternalSqlServer(url).start()
    ok, _ = docker_available()
    if not ok:
        pytest.skip(SKIP_REASON)
    missing = _client_missing()
    if missing is not None:
        pytest.skip(f"a Docker engine answers, but {missing}")
    server = SqlServerContainer()
    try:
        return server.start()
    except BaseException:
        server.close()
        raise


@pytest.fixture(scope="session")
def sqlserver_server() -> Iterator[BaseServer]:
    """A SQL Server (``sa`` login, database ``master``), or a skip saying why not."""
    yield from hold(start_sqlserver())


def _make(request: Any, tmp_path_factory: Any) -> Backend:
    server: BaseServer = request.getfixturevalue("sqlserver_server")
    return Backend("sqlserver", server.url, (server,))


register_backend("sqlserver", "mssql", "multilock-sqlserver", _make)
