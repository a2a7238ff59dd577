"""What needs no server: URLs, options, lease limits, redaction, validation before any I/O."""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import quote

import pytest

from multilock.azure_blob import AzureBlobProvider
from multilock.azure_blob._record import lease_seconds
from multilock.core import ConfigurationError, LeaderElection, ProviderError, from_url

KEY = "c2VjcmV0LWtleS1mb3ItdGVzdHMvd2l0aCtzeW1ib2xzPQ=="
ENC_KEY = quote(KEY, safe="")
CONN = (
    "DefaultEndpointsProtocol=http;AccountName=acct;"
    f"AccountKey={KEY};BlobEndpoint=http://127.0.0.1:1/acct;"
)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def assert_hidden(text: str) -> None:
    assert KEY not in text
    assert ENC_KEY not in text
    assert "c2VjcmV0" not in text


def test_core_from_url_finds_the_provider() -> None:
    p = from_url("azureblob://acct.blob.core.windows.net/leases")
    assert type(p) is AzureBlobProvider
    assert "https://acct.blob.core.windows.net/leases" in repr(p)


def test_path_style_url_with_a_shared_key() -> None:
    url = f"azureblob://acct:{ENC_KEY}@127.0.0.1:10000/acct/leases?secure=false&prefix=x/"
    p = AzureBlobProvider.from_url(url, poll_interval=1)
    assert p._store.client.primary_endpoint.startswith("http://127.0.0.1:10000/acct/leases")
    assert p._store.client.credential.account_name == "acct"
    assert p._store.client.credential.account_key == KEY
    assert p._prefix == "x/"
    assert p._poll == 1.0
    assert_hidden(repr(p))


def test_connection_string_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_AZ_CONN", CONN)
    p = from_url("azureblob:///leases?connection_string_env=TEST_AZ_CONN")
    assert isinstance(p, AzureBlobProvider)
    assert p._store.client.primary_endpoint.startswith("http://127.0.0.1:1/acct/leases")
    assert_hidden(repr(p))
    monkeypatch.delenv("TEST_AZ_CONN")
    with pytest.raises(ConfigurationError, match="TEST_AZ_CONN"):
        from_url("azureblob:///leases?connection_string_env=TEST_AZ_CONN")


def test_connection_string_keyword() -> None:
    p = from_url("azureblob:///leases", connection_string=CONN)
    assert_hidden(repr(p))
    p2 = AzureBlobProvider("leases", connection_string=CONN)
    assert_hidden(repr(p2))


@pytest.mark.parametrize(
    "url",
    [
        "azureblob://acct.blob.core.windows.net/",
        "azureblob://acct.blob.core.windows.net/Upper",
        "azureblob://acct.blob.core.windows.net/ab",
        "azureblob://acct.blob.core.windows.net/a--b",
        "azureblob://acct.blob.core.windows.net/leases?bogus=1",
        "azureblob://acct.blob.core.windows.net/leases?secure=maybe",
        "azureblob://acct.blob.core.windows.net/leases?prefix=bad%20prefix",
        "azureblob://acct.blob.core.windows.net/leases?poll_interval=-1",
        "azureblob:///leases",
    ],
)
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        from_url(url)


def test_bad_urls_never_show_the_key() -> None:
    with pytest.raises(ConfigurationError) as caught:
        from_url(f"azureblob://acct:{ENC_KEY}@h/Bad_Container")
    assert_hidden(str(caught.value))
    with pytest.raises(ConfigurationError) as caught:
        from_url(f"azureblob://h/leases?sas={ENC_KEY}&bogus=1")
    assert_hidden(str(caught.value))


def test_exactly_one_source() -> None:
    with pytest.raises(ConfigurationError, match="exactly one"):
        AzureBlobProvider("leases")
    with pytest.raises(ConfigurationError, match="exactly one"):
        AzureBlobProvider("leases", connection_string=CONN, account_url="https://h")


@pytest.mark.parametrize(
    ("lease", "expected"),
    [(15, 15), (15.0, 15), (15.2, 16), (59.5, 60), (60, 60), (60.5, -1), (300, -1)],
)
def test_lease_seconds_round_up(lease: float, expected: int) -> None:
    assert lease_seconds(lease) == expected
    assert lease_seconds(timedelta(seconds=lease)) == expected


@pytest.mark.parametrize("lease", [0.5, 1, 14.999])
def test_short_leases_are_refused(lease: float) -> None:
    with pytest.raises(ConfigurationError, match="15 to 60"):
        lease_seconds(lease)


@pytest.mark.parametrize("lease", [1.0, 14.5, 60.01, 61, 3600])
def test_lease_bounds_refuse_leases_azure_cannot_hold(lease: float) -> None:
    p = AzureBlobProvider("leases", account_url="https://acct.blob.core.windows.net")
    assert (p.lease_bounds.minimum, p.lease_bounds.maximum) == (15, 60)
    with pytest.raises(ConfigurationError, match="15 to 60"):
        p.lease_bounds.check(lease)
    with pytest.raises(ConfigurationError, match="15 to 60"):
        LeaderElection(p, group="g", lease_duration=lease, renew_interval=lease / 4)


@pytest.mark.parametrize("lease", [15, 22.5, 60])
def test_lease_bounds_accept_15_to_60(lease: float) -> None:
    p = AzureBlobProvider("leases", account_url="https://acct.blob.core.windows.net")
    p.lease_bounds.check(lease)
    LeaderElection(p, group="g", lease_duration=lease)


async def test_invalid_input_raises_before_any_request() -> None:
    # The account does not exist: any request would fail with ProviderError instead.
    p = AzureBlobProvider("leases", account_url=f"http://127.0.0.1:{closed_port()}/acct")
    try:
        with pytest.raises(ConfigurationError):
            await p.try_acquire("bad name", "p1", 15, {})
        with pytest.raises(ConfigurationError):
            await p.try_acquire("g", "p1", 5, {})
        with pytest.raises(ConfigurationError):
            await p.renew("g", "p1", "1", 15, {})  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            await p.try_acquire("g", "p1", 15, {"k": "x" * 4001})
    finally:
        await p.aclose()


async def test_network_errors_are_provider_errors_without_the_key() -> None:
    url = f"azureblob://acct:{ENC_KEY}@127.0.0.1:{closed_port()}/acct/leases?secure=false"
    p = from_url(url, timeout=2)
    try:
        with pytest.raises(ProviderError) as caught:
            await p.get_leader("g")
        assert_hidden(str(caught.value))
        assert isinstance(caught.value.__cause__, Exception)
    finally:
        await p.aclose()
    with pytest.raises(ProviderError, match="closed"):
        await p.get_leader("g")
    await p.aclose()  # idempotent
