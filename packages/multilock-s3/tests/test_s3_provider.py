"""What `S3Provider` decides without a server: URLs, names, options, errors, redaction,
and its decisions over an in-memory object store that keeps S3's conditional writes.

The tests against a real S3 server (moto) live in ``integration/test_s3.py``.
"""

from __future__ import annotations

import copy
import socket
import threading
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest

from multilock.core import ConfigurationError, ProviderError, from_url
from multilock.s3 import S3Provider
from multilock.s3._config import parse_url
from multilock.s3._store import strip_query

SECRET = "s3cr3t/Key+x"
ENCODED = quote(SECRET, safe="")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_url_forms() -> None:
    endpoint, bucket, options = parse_url(
        "s3://AKIA:s3cr3t%2FKey%2Bx@s3.example.com/leases/app/prod/?region=eu-west-1"
        "&poll_interval=0.5&timeout=2&cert_check=false&create_bucket=yes"
    )
    assert endpoint == "s3.example.com"
    assert bucket == "leases"
    assert options == {
        "secure": True,
        "prefix": "app/prod/",
        "access_key": "AKIA",
        "secret_key": SECRET,
        "region": "eu-west-1",
        "poll_interval": 0.5,
        "timeout": 2.0,
        "cert_check": False,
        "create_bucket": True,
    }
    endpoint, bucket, options = parse_url("s3+http://127.0.0.1:9000/b-1")
    assert (endpoint, bucket, options) == ("127.0.0.1:9000", "b-1", {"secure": False})
    assert parse_url("s3+http://[::1]:9000/bkt")[0] == "[::1]:9000"


@pytest.mark.parametrize(
    "url",
    [
        "http://host/bucket",
        "s3://host",
        "s3://host/",
        "s3:///bucket",
        "s3://host/bucket?nope=1",
        "s3://host/bucket?timeout=soon",
        "s3://host/bucket?cert_check=maybe",
        "s3://host:99999/bucket",
    ],
)
def test_bad_urls_are_rejected(url: str) -> None:
    with pytest.raises(ConfigurationError):
        parse_url(url)


@pytest.mark.parametrize(
    "url", [f"s3://key:{ENCODED}@host/bucket?nope=1", f"s3://key:{SECRET}@host/bucket"]
)
def test_url_errors_do_not_show_the_secret(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        from_url(url)
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize("bucket", ["", "ab", "Upper", "has_underscore", "a" * 64, "-a-", "a..b"])
def test_bad_buckets_are_rejected(bucket: str) -> None:
    with pytest.raises(ConfigurationError, match="bucket"):
        S3Provider("host", bucket)


@pytest.mark.parametrize("prefix", ["/abs", "a//b", "a/../b", "sp ace/", "ü/"])
def test_bad_prefixes_are_rejected(prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="prefix"):
        S3Provider("host", "bucket", prefix=prefix)


def test_durations_are_checked() -> None:
    with pytest.raises(ConfigurationError, match="poll_interval"):
        S3Provider("host", "bucket", poll_interval=0)
    with pytest.raises(ConfigurationError, match="timeout"):
        S3Provider("host", "bucket", timeout=-1)
    S3Provider("host", "bucket", timeout=timedelta(seconds=1), poll_interval=timedelta(0, 2))


def test_from_url_finds_the_provider_by_scheme() -> None:
    for scheme in ("s3", "s3+http"):
        provider = from_url(f"{scheme}://key:{ENCODED}@host:9000/bucket/pre/")
        assert isinstance(provider, S3Provider)
        shown = repr(provider)
        assert "s3cr3t" not in shown
        assert "bucket" in shown
        assert "pre/" in shown


def test_strip_query_hides_signatures() -> None:
    text = "Max retries exceeded with url: /b/k.json?X-Amz-Signature=abc&X-Amz-Credential=K (x)"
    assert "abc" not in strip_query(text)
    assert "/b/k.json?..." in strip_query(text)


async def test_unreachable_server_raises_provider_error_without_secrets() -> None:
    url = f"s3+http://key:{ENCODED}@127.0.0.1:{closed_port()}/bucket?timeout=1"
    provider = from_url(url)
    try:
        with pytest.raises(ProviderError) as info:
            await provider.get_leader("g1")
        message = str(info.value)
        assert "s3cr3t" not in message
        assert "X-Amz-Signature" not in message
        assert info.value.__cause__ is not None
    finally:
        await provider.aclose()
    with pytest.raises(ProviderError, match="closed"):
        await provider.get_leader("g1")


async def test_invalid_names_and_tokens_fail_before_any_request() -> None:
    provider = S3Provider("127.0.0.1:1", "bucket", secure=False)
    with pytest.raises(ConfigurationError):
        await provider.try_acquire("bad name", "p1", 1.0, {})
    with pytest.raises(ConfigurationError):
        await provider.renew("g", "p1", True, 1.0, {})
    with pytest.raises(ConfigurationError):
        await provider.release("g", "p1", "1")  # type: ignore[arg-type]
    assert provider.requests_sent == 0
    await provider.aclose()


class FakeStore:
    """The provider's `Store` in memory: ETags, ``If-Match`` and ``If-None-Match: *``."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[str, dict[str, Any]]] = {}
        self.puts = 0
        self.requests = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[str, dict[str, Any]] | None:
        with self._lock:
            self.requests += 1
            found = self.objects.get(key)
            return None if found is None else (found[0], copy.deepcopy(found[1]))

    def put(self, key: str, record: dict[str, Any], *, if_match: str | None = None) -> str | None:
        with self._lock:
            self.requests += 1
            self.puts += 1
            current = self.objects.get(key)
            if (current is None) != (if_match is None):
                return None  # 412: exists (If-None-Match: *) or missing (If-Match)
            if current is not None and current[0] != if_match:
                return None  # 412: someone else wrote first
            etag = f'"{uuid.uuid4().hex}"'
            self.objects[key] = (etag, copy.deepcopy(record))
            return etag

    def close(self) -> None:
        pass


def on_store(store: FakeStore) -> S3Provider:
    provider = S3Provider("127.0.0.1:1", "bucket", secure=False)
    provider._store = store  # type: ignore[assignment]
    return provider


async def test_a_live_term_is_never_shared_and_a_refusal_writes_nothing() -> None:
    store = FakeStore()
    p, q = on_store(store), on_store(store)  # two processes configured with one id
    first = await p.try_acquire("g", "p1", 30.0, {"instance": "a"})
    assert first is not None
    assert first.token == 1
    written, puts = store.objects["multilock/g.json"], store.puts
    assert await q.try_acquire("g", "p1", 30.0, {"instance": "b"}) is None
    assert await p.try_acquire("g", "p1", 30.0, {"instance": "c"}) is None
    assert await p.try_acquire("g", "p2", 30.0, {}) is None
    assert store.puts == puts, "a refused acquire sent a write"
    assert store.objects["multilock/g.json"] == written
    assert await q.get_leader("g") == first
    assert await p.renew("g", "p1", first.token, 30.0, {"instance": "a"})
    await p.release("g", "p1", first.token)
    taken = await q.try_acquire("g", "p1", 30.0, {"instance": "b"})
    assert taken is not None
    assert taken.token == first.token + 1


async def test_a_term_whose_reply_was_lost_is_renewed_after_a_read() -> None:
    store = FakeStore()
    p = on_store(store)
    first = await p.try_acquire("g", "p1", 30.0, {"instance": "a"})
    assert first is not None
    p._mine.clear()  # as if the acquire's reply had been lost after the write
    leader = await p.get_leader("g")
    assert leader == first
    assert await p.try_acquire("g", "p1", 30.0, {"instance": "a"}) is None
    assert await p.renew("g", "p1", leader.token, 30.0, {"instance": "a"})
    assert not await p.renew("g", "p1", leader.token + 1, 30.0, {"instance": "a"})


async def test_a_release_raced_by_its_own_terms_renew_still_frees_the_group() -> None:
    store = FakeStore()
    p = on_store(store)
    first = await p.try_acquire("g", "p1", 30.0, {})
    assert first is not None
    original = store.get
    raced = []

    def get_then_renew(key: str) -> tuple[str, dict[str, Any]] | None:
        seen = original(key)
        if not raced:  # the release has read; the term's renew lands before its write
            raced.append(key)
            assert p._renew("g", "p1", first.token, 30.0, {})
        return seen

    store.get = get_then_renew  # type: ignore[method-assign]
    await p.release("g", "p1", first.token)
    assert raced
    assert await p.get_leader("g") is None
    taken = await p.try_acquire("g", "p2", 30.0, {})
    assert taken is not None
    assert taken.token == first.token + 1
    # A takeover in between is not ours to undo: the release leaves it alone.
    store.get = original  # type: ignore[method-assign]
    await p.release("g", "p1", first.token)
    assert await p.get_leader("g") == taken
