"""File URL mistakes: unknown options listed against the known ones, and no password in
any error, nor in any exception chained to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from multilock.core import ConfigurationError, from_url
from multilock.core.testing import error_texts as texts
from multilock.filesystem import FileSystemProvider

PASSWORD = "Corr3ct-h0rse"


# -- the file:// URL -------------------------------------------------------------------------


def test_an_unknown_file_url_option_lists_the_known_ones(tmp_path: Path) -> None:
    # Before: "unknown option 'pol_interval' in file URL; known: lock_timeout, ..."
    with pytest.raises(ConfigurationError) as caught:
        from_url(f"file://{tmp_path}?pol_interval=1&notify=false")
    assert str(caught.value) == (
        "unknown option 'pol_interval' in the file URL (did you mean 'poll_interval'?); "
        "known: lock_timeout, notify, poll_interval"
    )


@pytest.mark.parametrize(
    "url",
    [
        f"file://u:{PASSWORD}@host/tmp/leases",
        f"file://u:{PASSWORD}@localhost/tmp/leases",
        f"file://:{PASSWORD}@/tmp/leases",
        f"file://u:{PASSWORD}@host/tmp/leases?lock_timeout=x",
    ],
)
@pytest.mark.parametrize("build", [from_url, FileSystemProvider.from_url])
def test_no_password_in_the_error_nor_in_its_chain(url: str, build: object) -> None:
    # Before: the provider's own error said "names the host 'u:<password>@host'", and core
    # kept that error, unscrubbed, as the (suppressed) context of the one it raised.
    with pytest.raises(ConfigurationError) as caught:
        build(url)  # type: ignore[operator]
    assert "three slashes" in str(caught.value)
    for text in texts(caught.value):
        assert PASSWORD not in text
    assert (
        "'host'" in str(caught.value)
        or "'localhost'" in str(caught.value)
        or "''" in str(caught.value)
    )
