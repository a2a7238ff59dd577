"""`check_url_options`: the kit's one message for unknown URL options, on every backend."""

from __future__ import annotations

import pytest

from multilock.core import ConfigurationError
from multilock.core.provider import check_url_options

PASSWORD = "Corr3ct-h0rse"


def refused(given: list[str], known: list[str], also: str | None = None) -> str:
    with pytest.raises(ConfigurationError) as caught:
        check_url_options(given, known, scheme="toy", also=also)
    assert caught.value.__context__ is None
    assert caught.value.__cause__ is None
    return str(caught.value)


def test_known_options_pass() -> None:
    check_url_options(["b", "a", "a"], ["a", "b", "c"], scheme="toy")
    check_url_options([], [], scheme="toy")


def test_one_unknown_option_with_the_closest_known_one() -> None:
    message = refused(["sockettimeout"], ["socket_timeout", "db", "key_prefix"])
    assert message == (
        "unknown option 'sockettimeout' in the toy URL (did you mean 'socket_timeout'?); "
        "known: db, key_prefix, socket_timeout"
    )
    assert "'socket_timeout'?" in refused(["Socket_Timeout"], ["socket_timeout"])


def test_several_unknown_options_each_once_in_order() -> None:
    message = refused(
        ["zz", "pol_interval", "zz", "lock_timeout"], ["lock_timeout", "poll_interval"]
    )
    assert message == (
        "unknown options 'zz', 'pol_interval' in the toy URL (did you mean 'poll_interval' for "
        "'pol_interval'?); known: lock_timeout, poll_interval"
    )


def test_nothing_known_and_what_else_is_accepted() -> None:
    assert refused(["x"], []) == "unknown option 'x' in the toy URL; known: none"
    assert refused(["x"], [], "any ODBC keyword") == (
        "unknown option 'x' in the toy URL; known: any ODBC keyword"
    )
    assert refused(["x"], ["a"], "any ODBC keyword").endswith("known: a, and any ODBC keyword")


@pytest.mark.parametrize("name", [f"pwd:{PASSWORD}", f"{PASSWORD} ", "", "x" * 65, "é"])
def test_a_name_that_is_no_option_name_is_not_echoed(name: str) -> None:
    message = refused([name], ["password"])
    assert PASSWORD not in message
    assert "xxxxx" not in message
    assert "not shown>" in message or "<an empty name>" in message
    assert "did you mean" not in message
