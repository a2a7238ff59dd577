"""Fixtures for the integration suite: real servers, started once per session.

Each server fixture takes, in order: the URL(s) in ``MULTILOCK_TEST_REDIS_URL``,
``MULTILOCK_TEST_REDLOCK_URLS`` (comma-separated) or ``MULTILOCK_TEST_POSTGRES_URL``; a
throwaway local server; a container when Docker answers; else it skips saying why (fails
when ``CI`` is set). Tests share the servers and isolate themselves by unique group
names. A test that restarts or stops a server calls ``harness.require_control(server)``
first: servers named by URL cannot be controlled, and the test skips with that reason.

When a test fails, the tail of each server log it used (or of every server of the
session) is added to its report.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Generator, Iterator

import pytest

from harness import (
    BACKENDS,
    PLUGINS,
    Backend,
    BaseServer,
    PostgresServer,
    Recipe,
    RedisServer,
    load_backend_plugins,
    log_sections,
    missing_provider,
    redlock_url,
    serve,
    session_servers,
    skip_or_fail,
)

# Backends with a module of their own (harness/fixtures_<name>.py): import them so they
# register with the `backend` fixture, and expose the fixtures each lists in __all__.
for _module in load_backend_plugins():
    for _name in getattr(_module, "__all__", ()):
        globals()[_name] = getattr(_module, _name)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[BaseServer]:
    """A Redis server without persistence: a restart forgets everything."""
    recipe = Recipe("redis", "MULTILOCK_TEST_REDIS_URL", RedisServer, "redis")
    for servers in serve(recipe):
        yield servers[0]


@pytest.fixture(scope="session")
def redis_persistent_server() -> Iterator[BaseServer]:
    """A Redis server with the append-only file fsynced on every write: restarts keep data."""
    recipe = Recipe(
        "redis",
        "MULTILOCK_TEST_REDIS_URL",
        lambda: RedisServer(persistent=True),
        "redis-persistent",
    )
    for servers in serve(recipe):
        yield servers[0]


@pytest.fixture(scope="session")
def redis_servers() -> Iterator[list[BaseServer]]:
    """Three independent Redis servers without persistence, for Redlock."""
    recipe = Recipe("redis", "MULTILOCK_TEST_REDLOCK_URLS", RedisServer, "redis", count=3)
    yield from serve(recipe)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[BaseServer]:
    """A PostgreSQL server (trust auth, fsync off) with the database ``postgres``."""
    recipe = Recipe("postgres", "MULTILOCK_TEST_POSTGRES_URL", PostgresServer, "postgres")
    for servers in serve(recipe):
        yield servers[0]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    """Each provider under test in turn, with the servers it needs."""
    name: str = request.param
    reason = missing_provider(name)
    if reason is not None:
        skip_or_fail(reason)
    if name == "memory":
        return Backend(name, f"memory://test-{uuid.uuid4().hex[:12]}", multiprocess=False)
    if name == "filesystem":
        return Backend(name, tmp_path_factory.mktemp("locks").as_uri())
    if name == "redis":
        server: BaseServer = request.getfixturevalue("redis_server")
        return Backend(name, server.url, (server,))
    if name == "redlock":
        servers: list[BaseServer] = request.getfixturevalue("redis_servers")
        return Backend(name, redlock_url(servers), tuple(servers))
    if name == "postgres":
        server = request.getfixturevalue("postgres_server")
        return Backend(name, server.url, (server,))
    if name in PLUGINS:
        return PLUGINS[name].make(request, tmp_path_factory)
    raise AssertionError(f"no recipe for the backend {name!r}")


def _servers_of(item: pytest.Item) -> list[BaseServer]:
    """The servers a test used, or every server of the session if it named none."""
    funcargs = getattr(item, "funcargs", {})
    used: list[BaseServer] = []
    known = False
    for value in funcargs.values():
        if isinstance(value, Backend):
            known = True
            used.extend(value.servers)
        elif isinstance(value, BaseServer):
            known = True
            used.append(value)
        elif isinstance(value, list) and value and all(isinstance(v, BaseServer) for v in value):
            known = True
            used.extend(value)
    return list(dict.fromkeys(used)) if known else list(session_servers)


#: How long a test's end waits for gRPC to finish the calls its providers cancelled.
GRPC_SETTLES = 5.0


@pytest.fixture(autouse=True)
async def _grpc_settled() -> AsyncIterator[None]:
    """Let gRPC finish, on this test's loop, the calls cancelled when its providers closed.

    gRPC (the etcd driver) learns that a cancelled call is over a moment after the
    cancel, through one poller thread for the whole process. If this test's loop closed
    first, the next test's loop would receive that completion, try to hand it to the
    closed loop and log "Event loop is closed" as an asyncio error (see the etcd
    package's README, Limits). gRPC's own tasks on this loop end when their completions
    arrive: wait for them, with a deadline. Runs last: autouse fixtures are set up first.
    """
    yield
    pending = [
        task
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__module__", "").startswith("grpc")
    ]
    if pending:
        await asyncio.wait(pending, timeout=GRPC_SETTLES)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for title, text in log_sections(_servers_of(item)):
            report.sections.append((title, text))
    return report
