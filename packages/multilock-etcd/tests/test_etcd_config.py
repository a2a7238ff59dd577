"""EtcdProvider without a server: URLs, options, validation, redaction, dead endpoints.

The behaviour against a real etcd is tested in the repository's integration suite.
"""

from __future__ import annotations

import socket
import time

import pytest

from multilock.core import ConfigurationError, LeaderElection, ProviderError, from_url
from multilock.etcd import EtcdProvider


def test_from_url_reads_address_prefix_and_options() -> None:
    provider = EtcdProvider.from_url("etcd://db.example:2400/app/locks?timeout=2&min_lease=1")
    assert repr(provider) == "<EtcdProvider db.example:2400 prefix='app/locks'>"
    assert provider._timeout == 2.0
    assert provider._min_lease == 1.0
    assert provider._key("g") == b"app/locks/g"


def test_from_url_defaults() -> None:
    provider = EtcdProvider.from_url("etcd://localhost")
    assert repr(provider) == "<EtcdProvider localhost:2379 prefix='multilock'>"


def test_the_scheme_is_registered() -> None:
    assert isinstance(from_url("etcd://localhost:2379"), EtcdProvider)


def test_keywords_win_over_the_url() -> None:
    provider = EtcdProvider.from_url("etcd://localhost/a?timeout=2", prefix="b", timeout=3)
    assert (provider._prefix, provider._timeout) == ("b", 3.0)


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:2379",
        "etcd://",
        "etcd://localhost:99999",
        "etcd://localhost?colour=blue",
        "etcd://localhost?timeout=soon",
        "etcd://localhost/a//b",
        "etcd://localhost#frag",
    ],
)
def test_bad_urls_are_configuration_errors(url: str) -> None:
    with pytest.raises(ConfigurationError):
        EtcdProvider.from_url(url)


def test_password_never_shows() -> None:
    provider = EtcdProvider.from_url("etcd://app:s3cret@localhost:2379")
    assert "s3cret" not in repr(provider)
    with pytest.raises(ConfigurationError) as caught:
        EtcdProvider.from_url("etcd://app:s3cret@localhost:2379?nope=1")
    assert "s3cret" not in str(caught.value)


async def test_leases_below_the_server_minimum_are_refused() -> None:
    provider = EtcdProvider(min_lease=2)
    assert provider.lease_bounds.minimum == 2.0
    provider.lease_bounds.check(2.0)
    with pytest.raises(ConfigurationError, match="minimum lease TTL"):
        provider.lease_bounds.check(1.5)
    with pytest.raises(ConfigurationError, match="minimum lease TTL is 1 s"):
        LeaderElection(EtcdProvider.from_url("etcd://h?min_lease=1"), group="g", lease_duration=0.5)
    await provider.aclose()


async def test_bad_names_fail_before_any_io() -> None:
    provider = EtcdProvider("127.0.0.1", 1)
    with pytest.raises(ConfigurationError):
        await provider.try_acquire("bad/group", "p1", 5.0, {})
    with pytest.raises(ConfigurationError):
        await provider.renew("g", "bad id", 1, 5.0, {})
    with pytest.raises(ConfigurationError):
        await provider.try_acquire("g", "p1", 5.0, {"": "empty key"})
    with pytest.raises(ConfigurationError):
        provider.watch("bad group")
    await provider.aclose()


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_nothing_listening_is_a_prompt_provider_error() -> None:
    async with EtcdProvider.from_url(
        f"etcd://app:s3cret@127.0.0.1:{_unused_port()}?timeout=1"
    ) as provider:
        start = time.monotonic()
        with pytest.raises(ProviderError) as caught:
            await provider.get_leader("g")
        assert time.monotonic() - start < 2.5
        assert caught.value.__cause__ is not None
        assert "s3cret" not in str(caught.value)


async def test_a_closed_provider_refuses_calls() -> None:
    provider = EtcdProvider()
    await provider.aclose()
    await provider.aclose()  # idempotent
    with pytest.raises(ProviderError, match="closed"):
        await provider.get_leader("g")
