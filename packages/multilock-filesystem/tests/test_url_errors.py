"""URL mistakes: unknown options listed against the known ones (the kit's one message for
every backend, `multilock.core.provider.check_url_options`), and no password in any
error, nor in any exception chained to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from multilock.core import ConfigurationError, from_url
from multilock.core.provider import check_url_options
from multilock.filesystem import FileSystemProvider

PASSWORD = "Corr3ct-h0rse"


def texts(exc: BaseException) -> list[str]:
    """str, repr and args of *exc* and of every exception chained to it, either way."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        todo += [current.__cause__, current.__context__]
    return [t for e in found for t in (str(e), repr(e), *(repr(a) for a in e.args))]


# -- the kit's function ----------------------------------------------------------------------


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
