"""What `ConsulProvider` decides without a server: addresses, options, keys, redaction.

The tests against a real Consul live in ``integration/test_consul.py``.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import requests

from multilock.consul import ConsulProvider
from multilock.consul._config import Settings, key_for, parse_address, session_ttl
from multilock.core import ConfigurationError, LeaderElection, ProviderError, from_url

SECRET = "9f1c-acl-s3cr3t"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def settings_of(provider: ConsulProvider) -> Settings:
    settings: Settings = provider._settings
    return settings


def test_core_from_url_finds_the_provider() -> None:
    provider = from_url("consul://127.0.0.1:8500")
    assert isinstance(provider, ConsulProvider)


@pytest.mark.parametrize(
    ("url", "where"),
    [
        ("consul://example.org", "http://example.org:8500"),
        ("consul://example.org:18500/", "http://example.org:18500"),
        ("consul://example.org?tls=true", "https://example.org:8501"),
        ("http://10.0.0.1:8500", "http://10.0.0.1:8500"),
        ("https://consul.internal", "https://consul.internal:8501"),
    ],
)
def test_addresses(url: str, where: str) -> None:
    assert settings_of(ConsulProvider(url)).where == where


def test_query_options_are_read_and_keywords_win() -> None:
    url = "consul://h?dc=dc2&prefix=apps/election&timeout=2.5&watch_wait=30&verify=false"
    settings = settings_of(ConsulProvider(url))
    assert (settings.dc, settings.prefix, settings.timeout) == ("dc2", "apps/election", 2.5)
    assert (settings.watch_wait, settings.verify) == (30.0, False)
    settings = settings_of(ConsulProvider(url, prefix="other", timeout=timedelta(seconds=1)))
    assert (settings.prefix, settings.timeout) == ("other", 1.0)
    assert parse_address("consul://h?verify=/etc/ca.pem")["verify"] == "/etc/ca.pem"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://h", "consul://"),
        ("consul://", "no host"),
        ("consul://h/some/path", "no path"),
        ("consul://h?colour=blue", "unknown option 'colour' in the consul URL"),
        ("consul://h?tls=maybe", "tls must be true or false"),
        ("https://h?tls=true", "tls= only goes with consul://"),
        ("consul://h?timeout=soon", "timeout must be a number of seconds"),
        ("consul://h?timeout=0", "timeout must be a positive"),
        ("consul://h:99999", "invalid Consul URL: its host or port does not parse"),
        ("consul://h?prefix=/leading", "prefix"),
        ("consul://h?prefix=a/../b", "prefix"),
        ("consul://h?dc=bad%20dc", "dc"),
    ],
)
def test_bad_addresses_are_rejected(url: str, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        ConsulProvider(url)


def test_token_in_the_password_or_query_is_never_shown() -> None:
    for url in [f"consul://:{SECRET}@h:8500", f"consul://h:8500?token={SECRET}"]:
        provider = ConsulProvider(url)
        assert settings_of(provider).token == SECRET
        assert provider._client.token == SECRET
        assert SECRET not in repr(provider)
        assert SECRET not in repr(settings_of(provider))
    with pytest.raises(ConfigurationError) as info:
        ConsulProvider(f"consul://{SECRET}@h:8500")
    assert SECRET not in str(info.value)
    assert "password part" in str(info.value)
    with pytest.raises(ConfigurationError) as info:
        from_url(f"consul://:{SECRET}@h:8500/path")
    assert SECRET not in str(info.value)


def test_an_explicit_token_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "from-env")
    assert ConsulProvider(f"consul://:{SECRET}@h")._client.token == SECRET
    assert ConsulProvider("consul://h")._client.token == "from-env"


def test_keys_and_prefixes() -> None:
    assert key_for("multilock", "nightly") == "multilock/nightly"
    assert key_for("a/b", "x.y-z_1") == "a/b/x.y-z_1"
    # Dot-only groups are valid names but would be collapsed as path segments.
    assert key_for("multilock", ".") == "multilock/~."
    assert key_for("multilock", "..") == "multilock/~.."
    assert key_for("multilock", "...") == "multilock/~..."
    assert len({key_for("p", g) for g in [".", "..", "...", "a", "a."]}) == 5
    for bad in ["", "/x", "x/", "a//b", "a/./b", "sp ace", "é", "x" * 201]:
        with pytest.raises(ConfigurationError, match="prefix"):
            ConsulProvider("consul://h", prefix=bad)


@pytest.mark.parametrize(("lease", "ttl"), [(10, 10), (10.2, 11), (15.0, 15), (86400, 86400)])
def test_session_ttl_is_never_shorter_than_the_lease(lease: float, ttl: int) -> None:
    assert session_ttl(lease) == ttl
    assert session_ttl(lease) >= lease


@pytest.mark.parametrize("lease", [1.0, 9.99, 86400.5])
def test_leases_outside_consul_limits_are_rejected(lease: float) -> None:
    provider = ConsulProvider("consul://127.0.0.1:8500")
    with pytest.raises(ConfigurationError, match=r"10 to 86400 s \(a Consul session TTL"):
        provider.lease_bounds.check(lease)


@pytest.mark.parametrize("lease", [10.0, 86400, timedelta(minutes=1)])
def test_leases_within_consul_limits_are_accepted(lease: float | timedelta) -> None:
    provider = ConsulProvider("consul://127.0.0.1:8500")
    LeaderElection(provider, group="g", lease_duration=lease)


def test_an_election_with_a_short_lease_is_refused_before_it_runs() -> None:
    provider = ConsulProvider("consul://127.0.0.1:8500")
    with pytest.raises(ConfigurationError, match="out of range"):
        LeaderElection(provider, group="g", lease_duration=5.0)


async def test_unreachable_agent_raises_provider_error_quickly_without_the_token() -> None:
    url = f"consul://:{SECRET}@127.0.0.1:{closed_port()}?timeout=1"
    provider = ConsulProvider(url)
    started = time.monotonic()
    for call in [lambda: provider.try_acquire("g", "p1", 10, {}), lambda: provider.get_leader("g")]:
        with pytest.raises(ProviderError) as info:
            await call()
        assert isinstance(info.value.__cause__, requests.RequestException)
        assert SECRET not in str(info.value)
        assert "127.0.0.1" in str(info.value)
    # renew and release know no term here, so they need no I/O: False and a no-op.
    assert not await provider.renew("g", "p1", 1, 10, {})
    await provider.release("g", "p1", 1)
    watch = provider.watch("g")
    with pytest.raises(ProviderError):
        await anext(watch)
    assert time.monotonic() - started < 10
    await provider.aclose()
    await provider.aclose()
    with pytest.raises(ProviderError, match="closed"):
        await provider.get_leader("g")


async def test_bad_names_and_tokens_are_rejected_before_any_io() -> None:
    provider = ConsulProvider(f"consul://127.0.0.1:{closed_port()}")
    with pytest.raises(ConfigurationError):
        await provider.try_acquire("bad/group", "p1", 10, {})
    with pytest.raises(ConfigurationError):
        await provider.renew("g", "p 1", 1, 10, {})
    with pytest.raises(ConfigurationError, match="token"):
        await provider.release("g", "p1", True)
    with pytest.raises(ConfigurationError):
        provider.watch("..a/b")
    await provider.aclose()
