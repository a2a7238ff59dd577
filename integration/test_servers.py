"""Tests of the test-server harness itself: it must start, probe, restart and stop for real.

These start their own servers (not the session's) because they stop and restart them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
import redis

import harness.servers
from harness import (
    BaseServer,
    ControlUnavailable,
    ExternalServer,
    NotInstalled,
    PostgresServer,
    Recipe,
    RedisServer,
    ServerError,
    Unavailable,
    in_ci,
    log_sections,
    require_control,
    running_servers,
    skip_or_fail,
    start_servers,
)
from harness.containers import docker_available
from harness.install import postgres_bindir, redis_server_binary


def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _need_redis() -> None:
    if redis_server_binary() is None:
        skip_or_fail("redis-server is not installed (run python integration/harness/install.py)")


@pytest.fixture
def local_redis() -> Iterator[RedisServer]:
    _need_redis()
    with RedisServer() as server:
        yield server


@pytest.fixture
def local_postgres() -> Iterator[PostgresServer]:
    if postgres_bindir() is None:
        skip_or_fail("PostgreSQL is not installed (run python integration/harness/install.py)")
    with PostgresServer() as server:
        yield server


def test_redis_starts_on_loopback_and_answers(local_redis: RedisServer) -> None:
    assert local_redis.url == f"redis://127.0.0.1:{local_redis.port}/0"
    assert local_redis.pid is not None
    assert _alive(local_redis.pid)
    assert local_redis in running_servers()
    client = _redis(local_redis.url)
    try:
        assert client.ping() is True
        assert client.info("server")["process_id"] == local_redis.pid
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert client.config_get("save")["save"] == ""
    finally:
        client.close()
    assert "Ready to accept connections" in local_redis.log_path.read_text()


def test_redis_without_persistence_forgets_on_restart(local_redis: RedisServer) -> None:
    port, pid = local_redis.port, local_redis.pid
    client = _redis(local_redis.url)
    try:
        client.set("k", "v")
        local_redis.restart()
        assert local_redis.port == port
        assert local_redis.pid not in (None, pid)
        assert client.get("k") is None
    finally:
        client.close()


def test_redis_with_aof_keeps_data_on_restart() -> None:
    _need_redis()
    with RedisServer(persistent=True) as server:
        port, pid = server.port, server.pid
        client = _redis(server.url)
        try:
            assert client.config_get("appendfsync")["appendfsync"] == "always"
            client.set("k", "v")
            server.restart()
            assert (server.port, server.url) == (port, f"redis://127.0.0.1:{port}/0")
            assert server.pid not in (None, pid)
            assert client.get("k") == b"v"
        finally:
            client.close()


def test_stop_ends_the_process_and_close_removes_the_dir() -> None:
    _need_redis()
    server = RedisServer().start()
    pid = server.pid
    assert pid is not None
    assert server.stop() == 0  # SIGTERM: a clean exit, not the SIGKILL fallback
    assert not _alive(pid)
    assert server.pid is None
    with pytest.raises(ServerError):
        server.wait_ready(time.monotonic() + 0.5)
    assert server.stop() is None  # stopping twice is harmless
    server.close()
    assert not server.dir.exists()
    assert server not in running_servers()


def test_kill_is_a_crash(local_redis: RedisServer) -> None:
    pid = local_redis.pid
    assert pid is not None
    local_redis.kill()
    assert not _alive(pid)
    local_redis.start()
    assert local_redis.pid not in (None, pid)


def test_a_taken_port_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    _need_redis()
    # Someone else listens on the first port the harness picks: the start must move on.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real = harness.servers.free_port
        monkeypatch.setattr(harness.servers, "free_port", lambda: next(picks, None) or real())
        with RedisServer() as server:
            assert server.port != taken
            client = _redis(server.url)
            try:
                assert client.ping() is True
            finally:
                client.close()
            log = server.log_path.read_text()
            assert "in use" in log
            assert log.count("--- harness: start attempt") == 2


def test_postgres_runs_unprivileged_and_keeps_data_on_restart(
    local_postgres: PostgresServer,
) -> None:
    port = local_postgres.port
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.execute("SELECT current_setting('fsync')").fetchone() == ("off",)
        if os.geteuid() == 0:
            assert os.stat(local_postgres.data_dir).st_uid != 0
        conn.execute("CREATE TABLE kept (v text)")
        conn.execute("INSERT INTO kept VALUES ('v')")
    pid = local_postgres.pid
    local_postgres.restart()
    assert local_postgres.port == port
    assert local_postgres.pid not in (None, pid)
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        assert conn.execute("SELECT v FROM kept").fetchall() == [("v",)]


def test_postgres_started_as_its_user_runs_no_fork_handlers_before_exec() -> None:
    """As root the harness drops to ``postgres`` without ``fork()``'s at-fork handlers.

    A library's ``pthread_atfork`` child handler (gRPC's, with a test's etcd client busy)
    crashed about one started server in ten. Here the child handler is ``abort()``: a
    server started through ``fork()`` dies with SIGABRT before its ``exec``.
    """
    if os.geteuid() != 0:
        pytest.skip("the harness drops to the postgres user only when the tests run as root")
    if postgres_bindir() is None:
        skip_or_fail("PostgreSQL is not installed (run python integration/harness/install.py)")
    script = textwrap.dedent(
        """
        import ctypes
        import psycopg
        from harness import PostgresServer

        # pthread_atfork() itself lives in libc_nonshared.a; this is what it calls.
        libc = ctypes.CDLL("libc.so.6")
        abort = ctypes.cast(libc.abort, ctypes.c_void_p)
        assert libc.__register_atfork(None, None, abort, None) == 0
        with PostgresServer() as server, psycopg.connect(server.url) as conn:
            print(conn.execute("SELECT current_user").fetchone()[0])
        """
    )
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": here},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["postgres"]


def test_postgres_stops_with_sigint_despite_open_clients(
    local_postgres: PostgresServer,
) -> None:
    pid = local_postgres.pid
    assert pid is not None
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        conn.execute("SELECT 1")
        started = time.monotonic()
        # SIGTERM would wait for this client and hit the SIGKILL fallback (status -9).
        assert local_postgres.stop(timeout=10) == 0
        assert time.monotonic() - started < 5
    assert not _alive(pid)


def test_postgres_kill_takes_the_children_down_and_recovers(
    local_postgres: PostgresServer,
) -> None:
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        conn.execute("CREATE TABLE committed (v int)")
        conn.execute("INSERT INTO committed VALUES (1)")
    pid = local_postgres.pid
    assert pid is not None
    local_postgres.kill()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # no backend, checkpointer or writer outlives the postmaster
    local_postgres.start()  # crash recovery; no "shared memory block is still in use"
    with psycopg.connect(local_postgres.url, autocommit=True) as conn:
        assert conn.execute("SELECT v FROM committed").fetchall() == [(1,)]


def test_postgres_servers_do_not_share_data(local_postgres: PostgresServer) -> None:
    with PostgresServer() as other:
        assert other.port != local_postgres.port
        assert other.data_dir != local_postgres.data_dir
        with psycopg.connect(local_postgres.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE only_here (v int)")
        with psycopg.connect(other.url, autocommit=True) as conn:
            found = conn.execute("SELECT to_regclass('only_here')").fetchone()
        assert found == (None,)


def test_external_server_refuses_restart_and_stop(local_redis: RedisServer) -> None:
    external = ExternalServer("redis", local_redis.url, "MULTILOCK_TEST_REDIS_URL").start()
    assert (external.host, external.port, external.pid) == ("127.0.0.1", local_redis.port, None)
    reason = external.control_unavailable
    assert "MULTILOCK_TEST_REDIS_URL" in reason
    with pytest.raises(ControlUnavailable, match="MULTILOCK_TEST_REDIS_URL"):
        external.restart()
    with pytest.raises(ControlUnavailable, match="MULTILOCK_TEST_REDIS_URL"):
        external.stop()
    assert local_redis.pid is not None
    assert _alive(local_redis.pid)
    with pytest.raises(pytest.skip.Exception, match="MULTILOCK_TEST_REDIS_URL"):
        require_control(external)
    assert require_control(local_redis) is local_redis


def test_external_server_that_does_not_answer_is_an_error() -> None:
    port = harness.servers.free_port()
    external = ExternalServer("redis", f"redis://127.0.0.1:{port}/0", "MULTILOCK_TEST_REDIS_URL")
    with pytest.raises(ServerError, match="not ready"):
        external.start(timeout=0.3)


def test_resolution_prefers_the_environment(local_redis: RedisServer) -> None:
    def no_local() -> RedisServer:
        raise AssertionError("a local server was started although the URL was given")

    recipe = Recipe("redis", "MULTILOCK_TEST_REDLOCK_URLS", no_local, "redis", count=3)
    urls = ",".join([local_redis.url] * 3)
    servers = start_servers(recipe, environ={"MULTILOCK_TEST_REDLOCK_URLS": urls})
    assert [s.url for s in servers] == [local_redis.url] * 3
    assert all(isinstance(s, ExternalServer) for s in servers)
    with pytest.raises(Unavailable, match="names 1 server"):
        start_servers(recipe, environ={"MULTILOCK_TEST_REDLOCK_URLS": local_redis.url})


def test_resolution_falls_back_to_local_then_docker_then_explains() -> None:
    def missing() -> RedisServer:
        raise NotInstalled("redis-server is not installed")

    recipe = Recipe("redis", "MULTILOCK_TEST_REDIS_URL", missing, "redis")
    with pytest.raises(Unavailable) as caught:
        start_servers(recipe, environ={}, docker=lambda: (False, "no Docker engine answers"))
    message = str(caught.value)
    for part in ["MULTILOCK_TEST_REDIS_URL", "not installed", "install.py", "no Docker engine"]:
        assert part in message

    if redis_server_binary() is not None:
        local = start_servers(
            Recipe("redis", "MULTILOCK_TEST_REDIS_URL", RedisServer, "redis", count=2),
            environ={},
        )
        try:
            assert len({s.port for s in local}) == 2
            assert all(isinstance(s, RedisServer) and s.running for s in local)
        finally:
            for server in local:
                server.close()


def test_skip_becomes_failure_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    assert in_ci()
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        skip_or_fail("redis: not installed")
    monkeypatch.delenv("CI")
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception, match="redis: not installed"):
        skip_or_fail("redis: not installed")


def test_log_sections_carry_the_server_log(local_redis: RedisServer) -> None:
    external = ExternalServer("redis", local_redis.url, "MULTILOCK_TEST_REDIS_URL")
    sections = log_sections([local_redis, external])
    assert len(sections) == 1
    title, text = sections[0]
    assert str(local_redis.log_path) in title
    assert "Ready to accept connections" in text


def test_docker_check_answers_quickly() -> None:
    started = time.monotonic()
    ok, reason = docker_available(timeout=5)
    assert time.monotonic() - started < 6
    assert reason.startswith("a Docker engine answers" if ok else "no Docker engine")


def test_session_fixtures_give_distinct_servers(
    redis_server: BaseServer, redis_persistent_server: BaseServer, redis_servers: list[BaseServer]
) -> None:
    urls = [s.url for s in [redis_server, redis_persistent_server, *redis_servers]]
    if any(isinstance(s, ExternalServer) for s in [redis_server, *redis_servers]):
        pytest.skip("servers come from the environment; their identity is the user's choice")
    assert len(set(urls)) == 5
    key = f"probe-{uuid.uuid4().hex}"
    clients = [_redis(url) for url in urls]
    try:
        clients[0].set(key, "x")
        assert [c.exists(key) for c in clients] == [1, 0, 0, 0, 0]
    finally:
        for client in clients:
            client.close()
