"""URL mistakes: unknown options listed against the known ones, and no account key in any
error, nor in any exception chained to it."""

from __future__ import annotations

import pytest

from multilock.azure_blob import AzureBlobProvider
from multilock.core import ConfigurationError, from_url
from multilock.core.testing import error_texts as texts

KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsu"


def test_an_unknown_option_lists_the_known_ones() -> None:
    # Before: "unknown query parameter(s) poll_intervall in <url>; known: ...".
    with pytest.raises(ConfigurationError) as caught:
        AzureBlobProvider.from_url(
            f"azureblob://acct:{KEY}@acct.blob.core.windows.net/c1?poll_intervall=1"
        )
    assert str(caught.value) == (
        "unknown option 'poll_intervall' in the azureblob URL (did you mean 'poll_interval'?); "
        "known: api_version, connection_string_env, poll_interval, prefix, sas, secure, timeout"
    )
    assert all(KEY not in text for text in texts(caught.value))


@pytest.mark.parametrize("build", [from_url, AzureBlobProvider.from_url])
def test_a_key_cut_by_an_unencoded_slash_is_in_no_error(build: object) -> None:
    # Account keys are base64: a '/' left unencoded makes the key's first half the "port".
    # Before: urllib's ValueError quoting it escaped from_url as it was.
    with pytest.raises(ConfigurationError) as caught:
        build(f"azureblob://acct:{KEY}/more@127.0.0.1:10000/acct/c1")  # type: ignore[operator]
    assert "percent-encode" in str(caught.value)
    assert all(KEY not in text for text in texts(caught.value))
