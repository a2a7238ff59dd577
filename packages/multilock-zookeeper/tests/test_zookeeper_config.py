"""What needs no server: URLs, options, lease bounds, names, ordering, redaction, closed ports."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta

import pytest

from multilock.core import ConfigurationError, LeaderElection, ProviderError, from_url
from multilock.core.provider import LeaseBounds
from multilock.zookeeper import ZooKeeperProvider
from multilock.zookeeper._provider import decode, encode
from multilock.zookeeper._watch import ordered, token_of

SECRET = "s3cr%40t"  # percent-encoded "s3cr@t"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_url_forms() -> None:
    provider = ZooKeeperProvider.from_url(
        "zookeeper://h1:2181,h2:2182/app/chroot?root=/x/y&session_timeout=3"
    )
    assert provider._hosts == "h1:2181,h2:2182/app/chroot"
    assert provider._auth is None
    assert (provider._settings.root, provider._settings.session_timeout) == ("/x/y", 3.0)
    assert provider._settings.connect_timeout == 10.0  # not in the URL: the default
    assert ZooKeeperProvider.from_url("zk://h1")._hosts == "h1"
    provider = ZooKeeperProvider.from_url(f"zookeeper://user:{SECRET}@h1:2181/")
    assert provider._auth == "user:s3cr@t"
    assert "s3cr" not in repr(provider)


@pytest.mark.parametrize(
    "url",
    [
        "zookeeper://",
        "zookeeper://h1,,h2",
        "zookeeper://h1/a//b",
        "zookeeper://h1/zookeeper",
        "zookeeper://h1?nope=1",
        "zookeeper://h1?session_timeout=soon",
        "zookeeper://h1?session_timeout=-1",
        "zookeeper://h1?root=relative",
        "zookeeper://h1?root=/trailing/",
        "zookeeper://user@h1",
        "redis://h1",
    ],
)
def test_bad_urls_are_rejected(url: str) -> None:
    with pytest.raises(ConfigurationError):
        ZooKeeperProvider.from_url(url)


def test_from_url_finds_both_schemes_and_keywords_win() -> None:
    provider = from_url("zookeeper://h1:2181?root=/a", root="/b")
    assert isinstance(provider, ZooKeeperProvider)
    assert provider._settings.root == "/b"
    assert isinstance(from_url("zk://h1"), ZooKeeperProvider)
    provider = ZooKeeperProvider("h1", operation_timeout=timedelta(seconds=2))
    assert provider._settings.operation_timeout == 2.0


def test_credentials_never_shown() -> None:
    provider = from_url(f"zookeeper://user:{SECRET}@h1:2181")
    assert "s3cr" not in repr(provider)


def test_candidates_are_ordered_by_sequence_not_by_name() -> None:
    names = ["zzz-a-0000000001", "aaa-b-0000000007", "mmm-c-0000000003", "not-a-candidate"]
    assert [name for _, name in ordered(names)] == [names[0], names[2], names[1]]
    assert token_of("x-0000000000") == 1  # tokens are sequence numbers plus one
    assert token_of("short") is None


def test_a_record_without_acquired_at_dates_from_the_node_itself() -> None:
    # A node that led from its creation is never written: its mtime (its ctime) is
    # the start of the term; once written, the record says.
    info = decode(7, encode("p1", {"k": "v"}, None), 1_700_000_000_123)
    assert (info.participant_id, info.token, info.metadata) == ("p1", 7, {"k": "v"})
    assert info.acquired_at == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    since = datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    assert decode(7, encode("p1", {}, since), 1).acquired_at == since


async def test_names_are_checked_before_any_io() -> None:
    provider = ZooKeeperProvider(f"127.0.0.1:{closed_port()}", connect_timeout=0.5)
    with pytest.raises(ConfigurationError):
        await provider.try_acquire("bad/group", "p1", 5.0, {})
    with pytest.raises(ConfigurationError):
        await provider.get_leader("")
    with pytest.raises(ConfigurationError):
        provider.watch("a b")
    await provider.aclose()


async def test_unreachable_server_raises_provider_error_in_bounded_time() -> None:
    provider = ZooKeeperProvider(f"127.0.0.1:{closed_port()}", connect_timeout=0.5)
    with pytest.raises(ProviderError) as caught:
        await provider.get_leader("g")
    assert caught.value.__cause__ is not None
    await provider.aclose()
    await provider.aclose()
    with pytest.raises(ProviderError, match="closed"):
        await provider.get_leader("g")


def test_the_lease_is_at_least_the_session_timeout() -> None:
    # A crashed leader's node lives until its session expires: the session timeout (URL
    # option or keyword, 10 s by default, kazoo's own) is the shortest lease.
    assert ZooKeeperProvider("h1").lease_bounds == LeaseBounds(
        minimum=10.0, reason=ZooKeeperProvider("h1").lease_bounds.reason
    )
    provider = from_url("zookeeper://h1?session_timeout=5")
    assert provider.lease_bounds.minimum == 5.0
    with pytest.raises(ConfigurationError, match="session_timeout"):
        LeaderElection(provider, group="g", lease_duration=3.0)
    LeaderElection(provider, group="g", lease_duration=5.0)
    with pytest.raises(ConfigurationError, match="session_timeout"):
        LeaderElection(ZooKeeperProvider("h1"), group="g", lease_duration=9.0)
    short = ZooKeeperProvider("h1", session_timeout=timedelta(seconds=1))
    LeaderElection(short, group="g", lease_duration=1.0)  # the benchmarks' lease


@pytest.mark.parametrize("hosts", ["h1:2181,h2:Xq7f", "app:Xq7f", "h1:99999"])
def test_hosts_whose_port_does_not_parse_are_refused_when_built(hosts: str) -> None:
    # Before: kazoo's ValueError at the first call ("Port could not be cast to integer
    # value as 'Xq7f'"), not a ConfigurationError, quoting what may be half a password.
    with pytest.raises(ConfigurationError, match="host or port does not parse") as caught:
        ZooKeeperProvider(hosts)
    assert "Xq7f" not in str(caught.value)
