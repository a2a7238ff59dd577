"""URL mistakes: unknown options listed against the known ones, and no token in any
error, nor in any exception chained to it."""

from __future__ import annotations

import pytest

from multilock.consul import ConsulProvider
from multilock.core import ConfigurationError, from_url
from multilock.core.testing import error_texts as texts

TOKEN = "b1gs3cr3t-acl-t0ken"


def test_an_unknown_option_lists_the_known_ones() -> None:
    # Before: "unknown query parameter 'wach_wait' in <url>; known: ...", no suggestion.
    with pytest.raises(ConfigurationError) as caught:
        ConsulProvider.from_url(f"consul://:{TOKEN}@h?wach_wait=5")
    assert str(caught.value) == (
        "unknown option 'wach_wait' in the consul URL (did you mean 'watch_wait'?); "
        "known: dc, prefix, timeout, tls, token, verify, watch_wait"
    )
    assert all(TOKEN not in text for text in texts(caught.value))


@pytest.mark.parametrize("build", [from_url, ConsulProvider.from_url])
def test_a_token_cut_by_an_unencoded_slash_is_in_no_error(build: object) -> None:
    # Before: "invalid Consul address ...: Port could not be cast to integer value as
    # '<the token's first half>'".
    with pytest.raises(ConfigurationError) as caught:
        build(f"consul://:{TOKEN}/more@h")  # type: ignore[operator]
    assert "does not parse" in str(caught.value)
    assert all(TOKEN not in text for text in texts(caught.value))
