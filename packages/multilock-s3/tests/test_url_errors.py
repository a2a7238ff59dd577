"""URL mistakes: unknown options listed against the known ones, and no secret key in any
error, nor in any exception chained to it."""

from __future__ import annotations

import pytest

from multilock.core import ConfigurationError, from_url
from multilock.core.testing import error_texts as texts
from multilock.s3 import S3Provider

SECRET = "wJalrXUtnFEMI-K7MDENG"


def test_an_unknown_option_lists_the_known_ones() -> None:
    # Before: "unknown option 'regoin' in <url>; known: ...", no suggestion.
    with pytest.raises(ConfigurationError) as caught:
        S3Provider.from_url(f"s3://AKIA:{SECRET}@h/bucket?regoin=eu-west-1")
    assert str(caught.value) == (
        "unknown option 'regoin' in the s3 URL (did you mean 'region'?); known: ca_certs, "
        "cert_check, create_bucket, poll_interval, prefix, region, session_token, timeout"
    )
    assert all(SECRET not in text for text in texts(caught.value))


@pytest.mark.parametrize("build", [from_url, S3Provider.from_url])
def test_a_key_cut_by_an_unencoded_slash_is_in_no_chained_error(build: object) -> None:
    # Before: the message was clean, but urllib's ValueError, quoting the key's first half
    # as the port, stayed on as the error's (suppressed) __context__.
    with pytest.raises(ConfigurationError) as caught:
        build(f"s3://AKIA:{SECRET}/more@h/bucket")  # type: ignore[operator]
    assert "percent-encode" in str(caught.value)
    assert all(SECRET not in text for text in texts(caught.value))
