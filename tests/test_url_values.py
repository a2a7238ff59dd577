"""Every provider reads the seconds and the flags in its URL alike (the kit's `url_seconds`
and `url_flag`): one message each, naming the option and the value, nothing chained."""

from __future__ import annotations

import pytest

from multilock.core import ConfigurationError, from_url
from multilock.core.provider import url_flag, url_seconds

#: A URL a scheme, and in its query an option that takes seconds.
SECONDS = [
    "redis://localhost:6379/0?socket_timeout={v}",
    "redlock://h1:6379,h2:6379,h3:6379/0?node_timeout={v}",
    "zookeeper://localhost:2181?session_timeout={v}",
    "etcd://localhost:2379?timeout={v}",
    "s3://key:secret@localhost:9000/bucket?poll_interval={v}",
    "azureblob://account:key@localhost:10000/account/leases?timeout={v}",
    "consul://localhost:8500?watch_wait={v}",
    "file:///tmp/multilock-url-values?lock_timeout={v}",
]

#: A URL a scheme, and in its query an option that is a flag.
FLAGS = [
    "s3://key:secret@localhost:9000/bucket?cert_check={v}",
    "azureblob://account:key@localhost:10000/account/leases?secure={v}",
    "consul://localhost:8500?tls={v}",
    "file:///tmp/multilock-url-values?notify={v}",
]


def option(template: str) -> str:
    return template.rpartition("?")[2].partition("=")[0]


def refused(url: str) -> ConfigurationError:
    with pytest.raises(ConfigurationError) as caught:
        from_url(url)
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__ or caught.value.__context__ is None
    return caught.value


@pytest.mark.parametrize("template", SECONDS)
def test_a_url_number_of_seconds_that_is_not_one_is_refused_alike(template: str) -> None:
    error = refused(template.format(v="soon"))
    assert f"{option(template)} must be a number of seconds, got 'soon'" in str(error)


@pytest.mark.parametrize("template", SECONDS)
def test_a_url_number_of_seconds_out_of_range_is_refused_as_the_keyword_is(
    template: str,
) -> None:
    error = refused(template.format(v="-1"))
    assert f"{option(template)} must be a positive, finite duration" in str(error)


@pytest.mark.parametrize("template", FLAGS)
def test_a_url_flag_that_is_not_one_is_refused_alike(template: str) -> None:
    error = refused(template.format(v="maybe"))
    assert f"{option(template)} must be true or false, got 'maybe'" in str(error)


@pytest.mark.parametrize("template", FLAGS)
@pytest.mark.parametrize("word", ["1", "TRUE", "yes", " on ", "0", "False", "NO", "off"])
def test_every_url_flag_takes_the_same_words(template: str, word: str) -> None:
    provider = from_url(template.format(v=word.strip()))
    assert provider is not None


def test_the_kit_reads_seconds_and_flags() -> None:
    assert url_seconds("timeout", "2.5") == 2.5
    assert url_seconds("timeout", "10") == 10.0
    assert [url_flag("f", w) for w in ("1", " Yes ", "ON", "true")] == [True] * 4
    assert [url_flag("f", w) for w in ("0", "no", "Off", "FALSE")] == [False] * 4
    with pytest.raises(ConfigurationError, match=r"^timeout must be a number of seconds, got ''$"):
        url_seconds("timeout", "")
    with pytest.raises(ConfigurationError, match=r"^f must be true or false, got 'y'$"):
        url_flag("f", "y")
