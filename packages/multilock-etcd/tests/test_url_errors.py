"""URL mistakes: unknown options listed against the known ones, and no password in any
error, nor in any exception chained to it."""

from __future__ import annotations

import pytest

from multilock.core import ConfigurationError, from_url
from multilock.core.testing import error_texts as texts
from multilock.etcd import EtcdProvider

PASSWORD = "Corr3ct-h0rse"


def test_an_unknown_option_lists_the_known_ones() -> None:
    # Before: "unknown etcd URL parameter 'timout'", without the known ones.
    with pytest.raises(ConfigurationError) as caught:
        EtcdProvider.from_url(f"etcd://u:{PASSWORD}@h:2379/app?timout=1")
    assert str(caught.value) == (
        "unknown option 'timout' in the etcd URL (did you mean 'timeout'?); "
        "known: min_lease, timeout"
    )
    assert all(PASSWORD not in text for text in texts(caught.value))


@pytest.mark.parametrize("build", [from_url, EtcdProvider.from_url])
def test_a_password_cut_by_an_unencoded_slash_is_in_no_chained_error(build: object) -> None:
    # The '/' ends the host part: urllib reads the password's first half as the port, and
    # its error quoted it; that error was this one's __cause__.
    with pytest.raises(ConfigurationError) as caught:
        build(f"etcd://u:{PASSWORD}/more@h:2379")  # type: ignore[operator]
    assert "bad port" in str(caught.value)
    assert all(PASSWORD not in text for text in texts(caught.value))
