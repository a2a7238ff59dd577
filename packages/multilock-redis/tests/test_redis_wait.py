"""Replica acknowledgement (``wait_replicas``) and Sentinel's master, followed at each write.

The option tests need no server. The WAIT tests run against a throwaway master with one
replica, the Sentinel test against a master, a replica and one Sentinel (``redis-server``
processes this module starts and stops).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.sentinel import SentinelManagedConnection

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.redis import RedisProvider, RedlockProvider
from multilock.redis._config import Settings
from multilock.redis._sentinel import FollowMasterPool, MasterCheck

# -- the options ---------------------------------------------------------------------------


def test_wait_options_come_from_the_url_or_keywords() -> None:
    p = RedisProvider("redis://h/0?wait_replicas=2&wait_timeout=0.05")
    assert (p._settings.wait_replicas, p._settings.wait_timeout) == (2, 0.05)
    assert "wait_replicas=2" in repr(p)
    p = RedisProvider("redis+sentinel://s1,s2/mymaster/0?wait_replicas=1", wait_replicas=3)
    assert p._settings.wait_replicas == 3  # the keyword wins
    assert "wait_replicas" not in repr(RedisProvider("redis://h/0"))
    assert type(from_url("redis://h/0?wait_replicas=1")) is RedisProvider


def test_the_wait_timeout_defaults_to_a_fifth_of_the_lease_within_the_socket_timeout() -> None:
    settings = Settings(wait_replicas=1, socket_timeout=2.0)
    assert settings.wait_ms(1000) == 200
    assert settings.wait_ms(60_000) == 1000  # half the socket timeout, which bounds the reply
    assert settings.wait_ms(1) == 1  # never 0: WAIT 0 blocks for ever
    assert Settings(wait_replicas=1, wait_timeout=0.05).wait_ms(60_000) == 50


@pytest.mark.parametrize(
    ("url", "kwargs", "message"),
    [
        ("redis://h/0?wait_replicas=x", {}, "wait_replicas must be a whole number"),
        ("redis://h/0?wait_replicas=-1", {}, "wait_replicas must be a whole number"),
        ("redis://h/0", {"wait_replicas": True}, "wait_replicas must be a whole number"),
        ("redis://h/0", {"wait_replicas": 1.5}, "wait_replicas must be a whole number"),
        ("redis://h/0?wait_timeout=0.1", {}, "wait_timeout needs wait_replicas"),
        ("redis://h/0?wait_replicas=1&wait_timeout=-1", {}, "wait_timeout must be a positive"),
        (
            "redis://h/0?wait_replicas=1&wait_timeout=2&socket_timeout=2",
            {},
            "wait_timeout (2 s) must be shorter than socket_timeout (2 s)",
        ),
        ("redis://h/0?wait_replica=1", {}, "did you mean 'wait_replicas'?"),
    ],
)
def test_invalid_wait_options_are_refused(url: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        RedisProvider(url, **kwargs)
    assert message in str(caught.value)


def test_redlock_refuses_the_wait_options() -> None:
    with pytest.raises(ConfigurationError, match="Redlock's servers are independent"):
        RedlockProvider("redlock://a,b,c/0?wait_replicas=1")


# -- Sentinel: every write goes to the master the sentinels name ---------------------------------


class _Sentinels:
    """Stands for redis-py's `Sentinel`: names *address* and counts the questions."""

    def __init__(self) -> None:
        self.address = ("10.0.0.1", 6379)
        self.asked = 0

    async def discover_master(self, service: str) -> tuple[str, int]:
        self.asked += 1
        return self.address


async def test_a_new_master_closes_the_connections_in_use_too() -> None:
    sentinels = _Sentinels()
    pool = FollowMasterPool("mymaster", sentinels)
    idle, busy = pool.make_connection(), pool.make_connection()
    assert isinstance(idle, SentinelManagedConnection)
    pool._available_connections.append(idle)
    pool._in_use_connections.add(busy)
    closed: list[object] = []

    async def disconnect(conn: object, **_: object) -> None:
        closed.append(conn)

    for conn in (idle, busy):
        conn.disconnect = lambda conn=conn, **kw: disconnect(conn, **kw)  # type: ignore[method-assign]
    assert await pool.get_master_address() == ("10.0.0.1", 6379)  # the first answer
    closed.clear()
    assert await pool.get_master_address() == ("10.0.0.1", 6379)
    assert closed == []  # the same master: nothing to close
    sentinels.address = ("10.0.0.2", 6379)
    assert await pool.get_master_address() == ("10.0.0.2", 6379)
    # redis-py alone closes only `idle`: `busy` would go back to the pool, on the old master.
    assert {id(c) for c in closed} == {id(idle), id(busy)}
    assert sentinels.asked == 3


async def test_concurrent_master_checks_share_one_question() -> None:
    release = asyncio.Event()

    class Pool:
        asked = 0

        async def get_master_address(self) -> tuple[str, int]:
            Pool.asked += 1
            await release.wait()
            if Pool.asked == 2:
                raise redis.exceptions.ConnectionError("no sentinel answered")
            return ("h", 1)

    check = MasterCheck(Pool())  # type: ignore[arg-type]
    waiters = [asyncio.ensure_future(check()) for _ in range(5)]
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(*waiters)
    assert Pool.asked == 1
    with pytest.raises(redis.exceptions.ConnectionError):  # a new question once it is answered
        await check()
    assert Pool.asked == 2


# -- real servers ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class _Processes:
    """``redis-server`` processes of this module: started on free ports, stopped at the end."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.binary, self.workdir = binary, workdir
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str, sentinel_conf: str | None = None) -> int:
        for _ in range(3):
            port = _free_port()
            folder = self.workdir / f"{name}-{port}"
            folder.mkdir()
            argv = [self.binary]
            if sentinel_conf is not None:
                (folder / "sentinel.conf").write_text(sentinel_conf)
                argv += [str(folder / "sentinel.conf"), "--sentinel"]
            argv += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
            if sentinel_conf is None:
                argv += ["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"]
            with open(folder / "log", "ab") as log:
                process = subprocess.Popen([*argv, *args], stdout=log, stderr=log)
            if self._answers(process, port):
                self.processes.append(process)
                return port
        pytest.fail(f"redis-server {name} did not start")

    @staticmethod
    def _answers(process: subprocess.Popen[bytes], port: int) -> bool:
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            try:
                redis.Redis(port=port, socket_timeout=0.5).ping()
                return True
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        process.kill()
        process.wait()
        return False

    def stop(self) -> None:
        for process in self.processes:  # only the processes this module started
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _until(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def _replicating(master: int, replicas: int) -> bool:
    info = redis.Redis(port=master, decode_responses=True).info("replication")
    states = [v.get("state") for k, v in info.items() if k.startswith("slave")]
    return states.count("online") == replicas


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Processes]:
    processes = _Processes(tmp_path_factory.mktemp("redis-wait"))
    try:
        yield processes
    finally:
        processes.stop()


@pytest.fixture(scope="module")
def replicated(servers: _Processes) -> tuple[int, int]:
    """A master and its one replica: (master port, replica port)."""
    master = servers.start("master")
    replica = servers.start("replica", "--replicaof", "127.0.0.1", str(master))
    _until(lambda: _replicating(master, 1))
    return master, replica


async def test_an_acknowledged_acquire_is_on_the_replica(replicated: tuple[int, int]) -> None:
    master, replica = replicated
    async with RedisProvider(f"redis://127.0.0.1:{master}/0?wait_replicas=1") as provider:
        won = await provider.try_acquire("acked", "a", 5.0, {})
        assert won is not None
        # Acknowledged means there already, without waiting for replication.
        held = redis.Redis(port=replica).hget("multilock:{acked}:lease", "token")
        assert held is not None
        assert int(held) == won.token
        assert await provider.renew("acked", "a", won.token, 5.0, {}) is True
        await provider.release("acked", "a", won.token)


async def test_an_unacknowledged_acquire_is_not_won_and_is_released(
    replicated: tuple[int, int],
) -> None:
    master, _ = replicated
    plain_url = f"redis://127.0.0.1:{master}/0"
    url = f"{plain_url}?wait_replicas=2&wait_timeout=0.05"
    async with RedisProvider(url) as provider, RedisProvider(plain_url) as plain:
        with pytest.raises(ProviderError) as caught:
            await provider.try_acquire("lone", "a", 5.0, {})
        assert str(caught.value) == (
            f"redis acquire of 'lone' on redis://127.0.0.1:{master}/0: only 1 of the 2 "
            "replicas asked for acknowledged it within 50 ms (wait_replicas): not won, released"
        )
        assert await plain.get_leader("lone") is None  # released: nobody waits for it
        taken = await plain.try_acquire("lone", "b", 5.0, {})
        assert taken is not None
        # A renewal the replicas did not all take is not counted: the term keeps its
        # deadline and ends there unless a later one is acknowledged.
        with pytest.raises(ProviderError, match="only 1 of the 2 replicas"):
            await provider.renew("lone", "b", taken.token, 5.0, {})
        # A lease that is not the caller's is no lease at all, acknowledged or not.
        assert await provider.renew("lone", "c", taken.token, 5.0, {}) is False


async def test_a_flushed_script_cache_is_loaded_again(replicated: tuple[int, int]) -> None:
    master, _ = replicated
    async with RedisProvider(f"redis://127.0.0.1:{master}/0?wait_replicas=1") as provider:
        first = await provider.try_acquire("flushed", "a", 5.0, {})
        assert first is not None
        redis.Redis(port=master).script_flush()  # what a failover to a new master looks like
        assert await provider.renew("flushed", "a", first.token, 5.0, {}) is True


async def test_behind_sentinel_writes_follow_the_new_master_at_once(servers: _Processes) -> None:
    # After a failover the old master takes writes until the Sentinels turn it into a
    # replica (8 s by default): a client still connected to it would renew a lease there
    # that the new master does not have.
    old = servers.start("sentinel-master")
    new = servers.start("sentinel-replica", "--replicaof", "127.0.0.1", str(old))
    _until(lambda: _replicating(old, 1))
    conf = (
        f"sentinel monitor svc 127.0.0.1 {old} 1\n"
        "sentinel down-after-milliseconds svc 1000\nsentinel failover-timeout svc 5000\n"
    )
    sentinel = servers.start("sentinel", sentinel_conf=conf)
    admin = redis.Redis(port=sentinel, decode_responses=True)
    _until(lambda: admin.sentinel_master("svc")["num-slaves"] == 1)
    async with RedisProvider(f"redis+sentinel://127.0.0.1:{sentinel}/svc/0") as provider:
        won = await provider.try_acquire("follow", "a", 30.0, {})
        assert won is not None
        _until(lambda: redis.Redis(port=new).exists("multilock:{follow}:lease"))
        _until(lambda: _failover(admin))
        _until(lambda: admin.sentinel_master("svc")["port"] == new)
        assert redis.Redis(port=old, decode_responses=True).info("replication")["role"] == "master"
        redis.Redis(port=new).delete("multilock:{follow}:lease")  # gone on the new master only
        assert await provider.renew("follow", "a", won.token, 30.0, {}) is False


def _failover(admin: redis.Redis) -> bool:
    try:
        admin.execute_command("SENTINEL", "FAILOVER", "svc")
    except redis.exceptions.ResponseError:  # NOGOODSLAVE until the Sentinel knows the replica
        return False
    return True
