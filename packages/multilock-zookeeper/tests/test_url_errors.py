"""URL mistakes: unknown options listed against the known ones, without the password."""

from __future__ import annotations

import pytest

from multilock.core import ConfigurationError
from multilock.zookeeper import ZooKeeperProvider

PASSWORD = "Corr3ct-h0rse"


@pytest.mark.parametrize("scheme", ["zk", "zookeeper"])
def test_an_unknown_option_lists_the_known_ones(scheme: str) -> None:
    # Before: "unknown option 'sesion_timeout' in <url>; known: ('root', ...)", a tuple.
    with pytest.raises(ConfigurationError) as caught:
        ZooKeeperProvider.from_url(f"{scheme}://u:{PASSWORD}@h:2181?sesion_timeout=5")
    assert str(caught.value) == (
        f"unknown option 'sesion_timeout' in the {scheme} URL (did you mean "
        "'session_timeout'?); known: connect_timeout, operation_timeout, root, session_timeout"
    )
    assert caught.value.__context__ is None
