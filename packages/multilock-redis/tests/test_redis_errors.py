"""What a user reads when something is wrong: unknown URL options, a refused password, a
subscription that broke. Each message is specific, names the server once, and holds no
secret. The password tests run against a throwaway ``redis-server --requirepass``."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.core.testing import error_texts as texts
from multilock.redis import RedisProvider, RedlockProvider
from multilock.redis._config import OWN_QUERY_KEYS, driver_url_options

PASSWORD = "Corr3ct-h0rse"
WRONG = "wr0ng-Batt3ry"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# -- unknown URL options -------------------------------------------------------------------


def test_a_mistyped_option_is_named_with_the_known_ones_and_the_closest() -> None:
    # Before: redis-py's "AbstractConnection.__init__() got an unexpected keyword argument".
    with pytest.raises(ConfigurationError) as caught:
        from_url(f"redis://:{PASSWORD}@localhost:6379/0?sockettimeout=1")
    message = str(caught.value)
    known = ", ".join(sorted({*OWN_QUERY_KEYS, *driver_url_options("redis")}))
    assert message == (
        "unknown option 'sockettimeout' in the redis URL (did you mean 'socket_timeout'?); "
        f"known: {known}"
    )
    assert "unexpected keyword" not in message
    assert PASSWORD not in "".join(texts(caught.value))


def test_the_known_options_are_ours_and_those_redis_py_takes() -> None:
    known = driver_url_options("redis")
    assert {"db", "client_name", "health_check_interval", "max_connections", "timeout"} <= set(
        known
    )
    assert not any(name.startswith("ssl_") for name in known)  # TLS options: rediss:// only
    assert "ssl_cert_reqs" in driver_url_options("rediss")
    assert driver_url_options("redis+sentinel") == ()
    # Every option offered is one the client really takes.
    for name, value in [("client_name", "x"), ("socket_keepalive", "true"), ("timeout", "2")]:
        RedisProvider(f"redis://localhost/0?{name}={value}")
    RedisProvider("rediss://localhost/0?ssl_cert_reqs=none&ssl_check_hostname=false")


@pytest.mark.parametrize(
    ("url", "start"),
    [
        ("rediss://h/0?keyprefix=x", "unknown option 'keyprefix' in the rediss URL"),
        ("redis://h/0?ssl_cert_reqs=none", "unknown option 'ssl_cert_reqs' in the redis URL"),
        ("redis+sentinel://s1/m/0?ssl=true", "unknown option 'ssl' in the redis+sentinel URL"),
        ("redlock://a,b,c/0?node_timout=1", "unknown option 'node_timout' in the redlock URL"),
        ("redis://h/0?bogus=1&colour=2", "unknown options 'bogus', 'colour' in the redis URL"),
    ],
)
def test_every_scheme_lists_its_known_options(url: str, start: str) -> None:
    build = RedlockProvider if url.startswith("redlock") else RedisProvider
    with pytest.raises(ConfigurationError) as caught:
        build(url)
    assert str(caught.value).startswith(start)
    assert "; known: " in str(caught.value)


def test_a_node_url_of_a_redlock_list_is_checked_too() -> None:
    with pytest.raises(ConfigurationError, match="unknown option 'sockettimeout' in the redis"):
        RedlockProvider(["redis://a/0", "redis://b/0?sockettimeout=1", "redis://c/0"])


# -- a broken subscription says why --------------------------------------------------------


async def test_a_redlock_subscription_failure_says_why_each_server_failed() -> None:
    # Before: "redlock pub/sub: 2 of 3 subscriptions broke, 2 needed", the reasons only
    # in __cause__ (one of them), which a log line of str(error) drops.
    ports = [closed_port() for _ in range(3)]
    hosts = ",".join(f"127.0.0.1:{p}" for p in ports)
    async with RedlockProvider(f"redlock://:{PASSWORD}@{hosts}/0", socket_timeout=1) as provider:
        with pytest.raises(ProviderError) as caught:
            async for _ in provider.watch("g"):
                pass
    message = str(caught.value)
    assert message.startswith("redlock pub/sub: 2 of 3 subscriptions broke, 2 needed: ")
    assert message.count("redis subscribe failed on redis://:***@127.0.0.1:") == 2
    assert "111" in message or "refused" in message.lower()  # the OS's reason, kept
    assert all(PASSWORD not in text for text in texts(caught.value))


# -- a refused password against a real server ------------------------------------------------


@pytest.fixture(scope="module")
def protected_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A ``redis-server`` that requires PASSWORD, on a free port; yields the port."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    workdir: Path = tmp_path_factory.mktemp("redis-auth")
    for _ in range(3):
        port = closed_port()
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD]
        args += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
        with open(workdir / "redis.log", "ab") as log:
            process = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.02)
        if process.poll() is None:
            break
        process.wait()  # the port was taken between the pick and the bind: another one
    else:
        pytest.fail(f"redis-server did not start: {(workdir / 'redis.log').read_text()}")
    try:
        yield port
    finally:
        process.terminate()  # this pid only: the server this fixture started
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def refusal(url: str) -> ProviderError:
    async with from_url(url) as provider:
        with pytest.raises(ProviderError) as caught:
            await provider.get_leader("g")
    return caught.value


async def test_a_wrong_password_is_an_authentication_failure_naming_the_server_once(
    protected_redis: int,
) -> None:
    where = f"redis://:***@127.0.0.1:{protected_redis}/0"
    error = await refusal(f"redis://:{WRONG}@127.0.0.1:{protected_redis}/0")
    message = str(error)
    # Before: "redis get_leader failed on <url>: invalid username-password pair ...",
    # which the CLI printed as "cannot reach the store".
    assert message.startswith(
        f"redis get_leader failed: the Redis server at {where} refused the credentials: "
    )
    assert "invalid username-password pair" in message  # the server's own words, kept
    assert message.count(f"127.0.0.1:{protected_redis}") == 1
    assert all(WRONG not in text for text in texts(error))
    assert type(error.__cause__).__name__ == "AuthenticationError"


async def test_a_missing_password_says_none_was_given(protected_redis: int) -> None:
    error = await refusal(f"redis://127.0.0.1:{protected_redis}/0")
    assert str(error).startswith(
        f"redis get_leader failed: the Redis server at redis://127.0.0.1:{protected_redis}/0 "
        "requires a password, and none was given"
    )


async def test_a_wrong_user_is_refused_credentials_too(protected_redis: int) -> None:
    error = await refusal(f"redis://nobody:{PASSWORD}@127.0.0.1:{protected_redis}/0")
    assert "refused the credentials" in str(error)
    assert all(PASSWORD not in text for text in texts(error))


async def test_a_refused_subscription_keeps_its_cause(protected_redis: int) -> None:
    url = f"redis://:{WRONG}@127.0.0.1:{protected_redis}/0"
    async with RedisProvider(url) as provider:
        with pytest.raises(ProviderError) as caught:
            async for _ in provider.watch("g"):
                pass
    message = str(caught.value)
    assert message.startswith("redis subscribe failed: the Redis server at redis://:***@")
    assert "refused the credentials: invalid username-password pair" in message
    assert all(WRONG not in text for text in texts(caught.value))


async def test_the_right_password_works(protected_redis: int) -> None:
    async with from_url(f"redis://:{PASSWORD}@127.0.0.1:{protected_redis}/0") as provider:
        assert await provider.get_leader("g") is None
