import pytest

from multilock.core import (
    ConfigurationError,
    InMemoryProvider,
    available_schemes,
    from_url,
    redact_url,
)
from multilock.core import _url as url_module
from multilock.core.provider import scrub


def test_memory_is_built_in():
    assert "memory" in available_schemes()
    assert isinstance(from_url("memory://"), InMemoryProvider)


async def test_named_memory_stores_are_shared_and_private_ones_are_not():
    a, b = from_url("memory://shared-1"), from_url("memory://shared-1")
    info = await a.try_acquire("g", "p1", 5, {})
    assert info is not None
    assert await b.get_leader("g") == info
    assert await from_url("memory://").get_leader("g") is None
    assert await from_url("memory://shared-2").get_leader("g") is None


@pytest.mark.parametrize("url", ["memory://a/b", "memory://x?y=1", "memory://bad name"])
def test_bad_memory_urls(url):
    with pytest.raises(ConfigurationError):
        from_url(url)


def test_unknown_scheme_lists_installed_schemes_and_hints_the_package(monkeypatch):
    monkeypatch.setattr(url_module, "_entry_points", lambda: dict(url_module._BUILTIN))
    with pytest.raises(ConfigurationError) as info:
        from_url("consul://user:hunter2@host:8500")
    text = str(info.value)
    assert "'consul'" in text
    assert "pip install multilock-consul" in text
    assert "memory" in text
    assert "hunter2" not in text


def test_no_scheme_is_an_error_without_the_password():
    with pytest.raises(ConfigurationError, match="has no scheme") as info:
        from_url("127.0.0.1:6379")
    assert "installed schemes" in str(info.value)


def test_non_string_url():
    with pytest.raises(ConfigurationError, match="url must be a str"):
        from_url(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("postgresql://u:p%40ss@h/db", "postgresql://u:***@h/db"),
        ("redis://u@h", "redis://u@h"),
        ("s3://h/b?secret_key=abc&region=x", "s3://h/b?secret_key=***&region=x"),
        ("x://h?AccountKey=abc&sig=zz", "x://h?AccountKey=***&sig=***"),
        ("memory://", "memory://"),
        (
            "redis+sentinel://h?sentinel_password=p&db=1",
            "redis+sentinel://h?sentinel_password=***&db=1",
        ),
        (
            "x://h?client_secret=c&monkey=m&api-key=k",
            "x://h?client_secret=***&monkey=m&api-key=***",
        ),
    ],
)
def test_redact_url(url, expected):
    assert redact_url(url) == expected


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        # urllib ends the host part inside these passwords: they must still be cut.
        ("redis://:se/cr/et@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://u:se?cret@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://u:se#cret@h/0", "redis://u:***@h/0"),
        ("postgresql://u:1234/5678@h/db", "postgresql://u:***@h/db"),
        # An '@' past a host:port is over-redacted rather than risk a password.
        ("redis://h:6379/0?client_name=a@b", "redis://h:***@b"),
        ("redis://h/0?client_name=a@b", "redis://h/0?client_name=a%40b"),
    ],
)
def test_redact_url_with_unencoded_delimiters_in_the_password(url, expected):
    assert redact_url(url) == expected
    secret = url.partition(":")[2][2:].partition("@")[0].partition(":")[2]
    if secret and expected != url:
        assert secret not in redact_url(url)
        assert scrub(f"driver said {url} and {secret}", url).count(secret) == 0


def test_driver_errors_are_scrubbed(monkeypatch):
    class Leaky(InMemoryProvider):
        @classmethod
        def from_url(cls, url, **kwargs):
            raise ValueError(f"cannot parse {url}")

    monkeypatch.setattr(url_module, "_entry_points", lambda: {"leaky": "leaky"})
    monkeypatch.setattr(url_module, "_load", lambda target: Leaky)
    with pytest.raises(ConfigurationError) as info:
        from_url("leaky://admin:topsecret@host?token=tok123")
    assert "topsecret" not in str(info.value)
    assert "tok123" not in str(info.value)
    assert "***" in str(info.value)


# --------------------------------------------------------------------------- split_url
@pytest.mark.parametrize(
    "url",
    [
        "redis://:Xq7f/Zr9k@host:6379/0",  # a password cut by '/': the port reads "Xq7f"
        "redis://user:Xq7f?Zr9k@host",  # ... by '?'
        "redis://:Xq7f#Zr9k@host",  # ... by '#'
        "redis://:12/Zr9k@host",  # a numeric port, but no host before it
        "zk://u:Xq7f/Zr9k@h1:2181,h2:2181",  # one of a host list
        "redis://host:99999",  # a port out of range
        "redis://[::1",  # urllib's own ValueError
    ],
)
def test_split_url_refuses_a_url_whose_host_or_port_does_not_parse(url):
    from multilock.core.provider import split_url
    from multilock.core.testing import error_texts

    with pytest.raises(ConfigurationError) as caught:
        split_url(url, "Redis", "a password")
    assert str(caught.value) == (
        "invalid Redis URL: its host or port does not parse (percent-encode a password: "
        "'/' as %2F, '?' as %3F, '#' as %23)"
    )
    assert caught.value.__context__ is None
    assert caught.value.__cause__ is None
    assert all(s not in t for t in error_texts(caught.value) for s in ("Xq7f", "Zr9k", url))


@pytest.mark.parametrize(
    ("url", "netloc"),
    [
        ("redis://u:p%2Fw@host:6379/0", "u:p%2Fw@host:6379"),  # encoded: fine
        ("redis://host:6379/0?client_name=me@there", "host:6379"),  # '@' in the query
        ("zk://h1:2181,h2:2181/app@prod", "h1:2181,h2:2181"),  # '@' in a chroot
        ("postgresql://u:p@h1:5432,[::1]:5433/db", "u:p@h1:5432,[::1]:5433"),
        ("postgresql:///db?host=/run/postgresql", ""),
        ("file:///var/lib/leases", ""),
    ],
)
def test_split_url_returns_what_urlsplit_does_for_a_url_that_parses(url, netloc):
    from urllib.parse import urlsplit

    from multilock.core.provider import split_url

    assert split_url(url, "X") == urlsplit(url)
    assert split_url(url, "X").netloc == netloc


def test_split_url_takes_the_secret_s_own_characters():
    from multilock.core.provider import split_url

    with pytest.raises(ConfigurationError, match=r"\(percent-encode a key: '\+' as %2B\)$"):
        split_url("s3://a:b/c@h", "S3", "a key: '+' as %2B")


@pytest.mark.parametrize("url", ["zk://h:0", "s3://h:0/b", "zk://h1:2181,h2:0"])
def test_split_url_refuses_port_0(url):
    from multilock.core.provider import split_url

    # Before (ZooKeeper, S3): built, then "no answer within 5 s" at the first call.
    with pytest.raises(ConfigurationError, match=r"^invalid X URL: port 0 is no server's port"):
        split_url(url, "X")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h/0?password=Xq7f&Zr9k&db=1", "redis://h/0?password=***&***=&db=1"),
        ("redis://h/0?token=Xq7f#Zr9k", "redis://h/0?token=***#***"),
        ("redis://h/0?db=1#Zr9k", "redis://h/0?db=1#***"),
    ],
)
def test_a_query_secret_cut_short_is_redacted_and_scrubbed_whole(url, shown):
    assert redact_url(url) == shown
    for text in ("unknown option 'Zr9k'", "bad query field: 'Zr9k'", "auth Xq7f&Zr9k"):
        assert "Zr9k" not in scrub(text, url)
