"""What needs no server: URLs, options, redaction, validation before any I/O."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
from redis.asyncio import BlockingConnectionPool, Redis

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.redis import RedisProvider, RedlockProvider
from multilock.redis._config import DEFAULT_MAX_CONNECTIONS, DEFAULT_SOCKET_TIMEOUT
from multilock.redis._provider import lease_ms
from multilock.redis._scripts import channel_name, channel_pattern

SECRET = "s3cr%40t!pw"  # percent-encoded "s3cr@t!pw"
RAW_SECRET = "s3cr@t!pw"


def kwargs_of(provider: RedisProvider | RedlockProvider, node: int = 0) -> dict[str, object]:
    nodes = provider._nodes if isinstance(provider, RedlockProvider) else [provider._node]
    kwargs: dict[str, object] = nodes[node].client.connection_pool.connection_kwargs
    return kwargs


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def assert_hidden(text: str) -> None:
    assert SECRET not in text
    assert RAW_SECRET not in text
    assert "s3cr" not in text


# -- URLs and schemes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "cls"),
    [
        ("redis://localhost:6379/0", RedisProvider),
        ("rediss://localhost:6380/1", RedisProvider),
        ("redis+sentinel://localhost:26379/mymaster/0", RedisProvider),
        ("redlock://h1:6379,h2:6380,h3:6381/0", RedlockProvider),
    ],
)
def test_core_from_url_finds_the_provider(url: str, cls: type) -> None:
    assert type(from_url(url)) is cls


def test_redis_url_gives_host_port_db_password_and_timeouts() -> None:
    p = RedisProvider(f"redis://user:{SECRET}@example.org:6390/3?socket_timeout=0.5")
    kwargs = kwargs_of(p)
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("example.org", 6390, 3)
    assert (kwargs["username"], kwargs["password"]) == ("user", RAW_SECRET)
    # Calls are bounded by the provider (connect + socket timeouts), not by redis-py's
    # socket timeout, which would send every command through asyncio.wait_for.
    assert kwargs["socket_timeout"] is None
    assert p._node.calls.timeout == 1.0
    assert kwargs["socket_connect_timeout"] == 0.5  # defaults to socket_timeout
    retry = kwargs["retry"]
    assert retry.get_retries() == 1  # type: ignore[attr-defined]
    assert p.key_prefix == "multilock:"


def test_built_clients_retry_only_broken_connections_once() -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    retry = kwargs_of(RedisProvider("redis://localhost"))["retry"]
    supported = retry._supported_errors  # type: ignore[attr-defined]
    assert RedisConnectionError in supported
    assert RedisTimeoutError not in supported


def test_keywords_win_over_the_query_string() -> None:
    url = "redis://localhost/0?key_prefix=fromurl:&socket_timeout=3&socket_connect_timeout=4"
    p = RedisProvider(url)
    assert p.key_prefix == "fromurl:"
    assert (p._node.calls.timeout, kwargs_of(p)["socket_connect_timeout"]) == (7.0, 4.0)
    p = RedisProvider(url, key_prefix="kw:", socket_timeout=timedelta(milliseconds=250))
    assert p.key_prefix == "kw:"
    assert p._node.calls.timeout == 4.25
    assert "key_prefix" not in repr(kwargs_of(p))  # our options never reach redis-py


def test_redis_py_query_options_pass_through() -> None:
    p = RedisProvider("redis://localhost/0?client_name=elector&health_check_interval=5")
    assert kwargs_of(p)["client_name"] == "elector"
    assert kwargs_of(p)["health_check_interval"] == 5


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:6379/0",
        "redis://:6379/0",
        "redis://localhost:notaport/0",
        "redis://localhost:0/0",
        "redis://localhost:6379/zero",
        "redis://localhost:6379/0?no_such_option=1",
        "redis://localhost:6379/0?socket_timeout=-1",
        "redis://localhost:6379/0?socket_timeout=soon",
        "redis://localhost:6379/0?socket_timeout=inf",
        "redis://localhost:6379/0?key_prefix=has space",
        "redis://localhost:6379/0?node_timeout=1",
        "redis://localhost:6379/0?protocol=5",  # before: redis-py's own ConnectionError
    ],
)
def test_invalid_redis_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        RedisProvider(url)


@pytest.mark.parametrize("prefix", ["has space", "{tag}", "x" * 201, "tab\t", 42])
def test_invalid_key_prefixes_are_refused(prefix: object) -> None:
    with pytest.raises(ConfigurationError, match="key_prefix"):
        RedisProvider("redis://localhost", key_prefix=prefix)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "1", True, timedelta(0)])
def test_invalid_timeouts_are_refused(value: object) -> None:
    for option in ["socket_timeout", "socket_connect_timeout"]:
        with pytest.raises(ConfigurationError, match=option):
            RedisProvider("redis://localhost", **{option: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="node_timeout"):
        RedlockProvider("redlock://a,b,c", node_timeout=value)  # type: ignore[arg-type]


def test_unknown_keyword_through_core_from_url_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        from_url("redis://localhost", no_such_option=1)


def test_client_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis"):
        RedisProvider(42)  # type: ignore[arg-type]


async def test_a_callers_client_is_used_not_owned() -> None:
    client = Redis(host="example.org", port=6391, db=2, password=RAW_SECRET)
    p = RedisProvider(client, key_prefix="app:")
    assert p._node.client is client
    assert p._node._closers == []
    assert repr(p) == "<RedisProvider example.org:6391/2 key_prefix='app:'>"
    await p.aclose()
    await client.aclose()


def test_lease_is_rounded_up_to_whole_milliseconds() -> None:
    assert lease_ms(1.0) == 1000
    assert lease_ms(0.0011) == 2
    assert lease_ms(0.0001) == 1
    assert lease_ms(15.0) == 15000


def test_a_built_client_has_a_bounded_blocking_pool() -> None:
    pool = RedisProvider("redis://localhost:6379/0")._node.client.connection_pool
    assert isinstance(pool, BlockingConnectionPool)
    assert pool.max_connections == DEFAULT_MAX_CONNECTIONS
    assert pool.timeout == 2 * DEFAULT_SOCKET_TIMEOUT  # connect + command
    wider = RedisProvider("redis://localhost:6379/0?max_connections=50&socket_timeout=0.5")
    pool = wider._node.client.connection_pool
    assert (pool.max_connections, pool.timeout) == (50, 1.0)  # type: ignore[attr-defined]
    for node in RedlockProvider("redlock://h1,h2,h3/0")._nodes:
        assert isinstance(node.client.connection_pool, BlockingConnectionPool)


@pytest.mark.parametrize(
    ("query", "match"),
    [
        # Before: built, then every campaign round and renew timed out (the listener's
        # subscription held the one connection), or renews hung on a nan wait.
        ("max_connections=1", "at least 2, got 1: the watch's pub/sub subscription"),
        ("max_connections=0", "at least 2, got 0"),
        ("max_connections=many", "a whole number, got 'many'"),
        ("timeout=nan", "positive number of seconds, got 'nan'"),
        ("timeout=-1", "positive number of seconds, got '-1'"),
        ("timeout=0", "positive number of seconds, got '0'"),
        ("timeout=inf", "positive number of seconds, got 'inf'"),
    ],
)
@pytest.mark.parametrize("scheme", ["redis", "redlock"])
def test_pool_options_no_election_can_work_with_are_refused(
    scheme: str, query: str, match: str
) -> None:
    hosts = "h1,h2,h3" if scheme == "redlock" else "localhost"
    with pytest.raises(ConfigurationError, match=match):
        from_url(f"{scheme}://{hosts}/0?{query}")


def test_a_callers_client_with_a_one_connection_pool_is_refused() -> None:
    client = Redis(connection_pool=BlockingConnectionPool(max_connections=1))
    with pytest.raises(ConfigurationError, match="at least 2, got 1"):
        RedisProvider(client)


async def test_the_pattern_escapes_the_prefix_and_messages_name_their_group() -> None:
    assert channel_name("multilock:", "g") == "multilock:{g}:changed"
    assert channel_pattern("multilock:") == "multilock:{*}:changed"
    assert channel_pattern("a*b?[c]") == r"a\*b\?\[c\]{*}:changed"
    node = RedisProvider("redis://localhost:6379/0", key_prefix="p*:")._node
    assert node._remember(b"p*:{g-1}:changed", b"released") == ("g-1", "released", "")
    assert node._hints == {"g-1": None}
    assert node._remember("p*:{}:changed", "released") is None
    # A Redlock lease's messages name the attempt that made it.
    assert node._remember("p*:{g}:changed", "acquired 500 f00d") == ("g", "acquired", "f00d")
    assert node._remember("p*:{g}:changed", "released f00d") == ("g", "released", "f00d")
    assert node._remember("p*:{g}:changed", "acquired 500") == ("g", "acquired", "")


async def test_a_message_answers_the_watch_without_a_round_trip() -> None:
    node = RedisProvider(f"redis://127.0.0.1:{closed_port()}/0")._node
    node._remember("multilock:{g}:changed", "acquired 60000")
    left = await node.expires_in("g")
    assert left is not None
    assert 59 < left <= 60
    node._remember("multilock:{g}:changed", "released")
    assert await node.expires_in("g") is None
    node._remember("multilock:{g}:changed", "acquired 30000 f00d")  # a Redlock lease
    left = await node.expires_in("g")
    assert left is not None
    assert 29 < left <= 30
    node._remember("multilock:{g}:changed", "acquired")  # an older writer: ask the server
    with pytest.raises(ProviderError, match="pttl"):
        await node.expires_in("g")
    await node.aclose()


# -- Redlock and Sentinel URLs ------------------------------------------------------------


def test_redlock_url_names_every_node_with_the_shared_parts() -> None:
    p = RedlockProvider(
        f"redlock://:{SECRET}@h1,h2:6380,[::1]:6381/4?key_prefix=rl:&node_timeout=0.3"
        "&client_name=elector"
    )
    addresses = [(kwargs_of(p, i)["host"], kwargs_of(p, i)["port"]) for i in range(3)]
    assert addresses == [("h1", 6379), ("h2", 6380), ("::1", 6381)]
    for i in range(3):
        assert kwargs_of(p, i)["db"] == 4
        assert kwargs_of(p, i)["password"] == RAW_SECRET
        assert kwargs_of(p, i)["client_name"] == "elector"
    assert p.key_prefix == "rl:"
    assert p.quorum == 2
    assert p._round_timeout(10.0) == 0.3


def test_redlock_round_timeout_defaults_to_a_fifth_of_the_lease() -> None:
    p = RedlockProvider("redlock://h1,h2,h3/0", socket_timeout=2.0)
    assert p._round_timeout(1.0) == pytest.approx(0.2)
    assert p._round_timeout(60.0) == 2.0


@pytest.mark.parametrize(("count", "quorum"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_redlock_quorum_is_a_majority(count: int, quorum: int) -> None:
    urls = [f"redis://h{i}:6379/0" for i in range(count)]
    assert RedlockProvider(urls).quorum == quorum


@pytest.mark.parametrize(
    "nodes",
    [
        "redlock://h1,h1:6379,h2/0",
        "redlock:///0",
        "redlock://h1,,h2/0",
        "redlock://h1:99999,h2/0",
        "redlock://h1 ,h2/0",
        "redlock://h1,h2/x",
        "redis://h1,h2/0",
        [],
        ["redis://h1/0", "redis://h1:6379/0"],
        ["redis://h1/0", "redlock://h2,h3/0"],
        ["redis://h1/0?key_prefix=x:", "redis://h2/0"],
        ["redis://h1/0", 42],
        42,
    ],
)
def test_invalid_redlock_nodes_are_refused(nodes: object) -> None:
    with pytest.raises(ConfigurationError):
        RedlockProvider(nodes)  # type: ignore[arg-type]


async def test_redlock_takes_urls_and_callers_clients_together() -> None:
    client = Redis(host="h2", port=6379)
    p = RedlockProvider(["redis://h1/0", client, "rediss://h3:6390/0"])
    assert p._nodes[1].client is client
    assert [n._owned for n in p._nodes] == [True, False, True]
    await p.aclose()
    await client.aclose()
    with pytest.raises(ConfigurationError, match="twice"):
        RedlockProvider(["redis://h2:6379/0", Redis(host="h2", port=6379)])


def test_sentinel_url_names_sentinels_service_and_db() -> None:
    p = RedisProvider(f"redis+sentinel://:{SECRET}@s1,s2:26380/primary/5?socket_timeout=0.7")
    pool = p._node.client.connection_pool
    assert pool.service_name == "primary"  # type: ignore[attr-defined]
    assert pool.connection_kwargs["db"] == 5
    assert pool.connection_kwargs["password"] == RAW_SECRET
    sentinels = pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
    found = [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in sentinels
    ]
    assert found == [("s1", 26379), ("s2", 26380)]
    assert sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 0.7
    assert (
        RedisProvider("redis+sentinel://s1")._node.client.connection_pool.service_name == "mymaster"
    )  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "url", ["redis+sentinel://s1/bad service/0", "redis+sentinel://s1/m/0?ssl=true"]
)
def test_invalid_sentinel_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        RedisProvider(url)


# -- credentials never show ---------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@localhost:6379/0",
        f"redis://user:{SECRET}@localhost:6379/0",
        f"rediss://:{SECRET}@localhost:6379/0",
        f"redis://localhost:6379/0?password={SECRET}",
        f"redlock://:{SECRET}@h1,h2,h3/0",
        f"redis+sentinel://:{SECRET}@s1,s2/mymaster/0",
    ],
)
def test_repr_hides_the_password(url: str) -> None:
    text = repr(from_url(url))
    assert_hidden(text)
    assert "***" in text


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@localhost:6379/zero",
        f"redis://:{SECRET}@localhost:6379/0?no_such_option=1",
        f"redis://:{SECRET}@localhost:6379/0?socket_timeout=x",
        f"redlock://:{SECRET}@h1,h1/0",
        f"redlock://:{SECRET}@h1,h2/x",
        f"redis+sentinel://:{SECRET}@s1/bad service",
        f"http://:{SECRET}@localhost/0",
    ],
)
def test_configuration_errors_hide_the_password(url: str) -> None:
    for build in [from_url, RedisProvider, RedlockProvider]:
        with pytest.raises(ConfigurationError) as caught:
            build(url)  # type: ignore[operator]
        assert_hidden(str(caught.value))


@pytest.mark.parametrize("scheme", ["redis", "redlock"])
async def test_a_refused_connection_is_a_quick_provider_error_without_the_password(
    scheme: str,
) -> None:
    port = closed_port()
    url = f"{scheme}://:{SECRET}@127.0.0.1:{port}/0"
    async with from_url(url) as provider:
        started = time.monotonic()
        with pytest.raises(ProviderError) as caught:
            await provider.try_acquire("g", "p1", 1.0, {})
        assert time.monotonic() - started < 2.0
        assert_hidden(str(caught.value))
        assert caught.value.__cause__ is not None
        with pytest.raises(ProviderError):
            await provider.get_leader("g")


# -- validation comes before any I/O ---------------------------------------------------------


@pytest.mark.parametrize("scheme", ["redis", "redlock"])
async def test_bad_names_and_metadata_fail_before_any_io(scheme: str) -> None:
    async with from_url(f"{scheme}://127.0.0.1:{closed_port()}/0") as p:
        with pytest.raises(ConfigurationError):
            await p.try_acquire("bad group", "p1", 1.0, {})
        with pytest.raises(ConfigurationError):
            await p.try_acquire("g", "p1", 1.0, {"k": "x" * 4001})
        with pytest.raises(ConfigurationError):
            await p.try_acquire("g", "p1", -1.0, {})
        with pytest.raises(ConfigurationError):
            await p.renew("g", "bad/id", 1, 1.0, {})
        with pytest.raises(ConfigurationError):
            await p.release("g", "", 1)
        with pytest.raises(ConfigurationError):
            await p.get_leader("{x}")
        with pytest.raises(ConfigurationError):
            p.watch("bad group")


async def test_calls_after_aclose_fail_cleanly() -> None:
    p = RedisProvider("redis://localhost:6379/0")
    await p.aclose()
    await p.aclose()
    with pytest.raises(ProviderError, match="closed"):
        await p.get_leader("g")
