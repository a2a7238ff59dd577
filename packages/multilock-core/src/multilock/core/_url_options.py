"""A URL's query options, read alike by every backend: `check_url_options` refuses unknown
names; `url_seconds` and `url_flag` read the two kinds of value a URL carries as text.

A typo in a URL option (``?sockettimeout=1``) must not surface as a driver's internal
error, nor be ignored: each provider lists the options its URL takes (its own and those
it passes to the driver) and calls this, so every backend says the same thing: which
options are unknown, which are known, and the closest known name.

Its message names options, never their values and never the URL, so it holds no secret;
a name that does not look like an option name (it may be a mistyped secret) is described,
not shown. `url_seconds` and `url_flag` run on options it has let through, so the value
they quote belongs to a known option that is a number or a flag, never a secret.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

from ._errors import ConfigurationError

__all__ = ["check_url_options", "url_flag", "url_seconds"]

#: The words a flag option takes (any case, blanks around ignored).
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

#: What an option name looks like; anything else is not echoed (it may be a secret).
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")


def _shown(name: str) -> str:
    if _NAME.fullmatch(name):
        return repr(name)
    if not name:
        return "<an empty name>"
    return f"<a name of {len(name)} characters, not shown>"


def _closest(name: str, known: list[str]) -> str | None:
    """The known name closest to *name*, ignoring case, or None if none is close."""
    if not _NAME.fullmatch(name):
        return None
    by_lower = {k.lower(): k for k in known}
    match = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.75)
    return by_lower[match[0]] if match else None


def check_url_options(
    given: Iterable[str],
    known: Iterable[str],
    *,
    scheme: str,
    also: str | None = None,
) -> None:
    """Raise `ConfigurationError` if a name in *given* is not in *known* (case-sensitive).

    *given* are the query option names of a URL (values are never looked at), *known*
    every name the provider accepts there: its own options and those it passes on to
    its driver. *scheme* names the URL in the message (``the redis URL``); *also*, if
    given, says in words what else the URL may carry, when the driver accepts names
    that cannot all be listed (``"any ODBC keyword"``). The message::

        unknown option 'sockettimeout' in the redis URL (did you mean 'socket_timeout'?);
        known: db, key_prefix, ..., socket_timeout

    Call it outside any ``except`` block, so that no exception holding the URL is
    attached to the error as its context.
    """
    names = sorted(set(known))
    unknown = list(dict.fromkeys(name for name in given if name not in names))
    if not unknown:
        return
    shown = ", ".join(_shown(name) for name in unknown)
    message = f"unknown option{'s' if len(unknown) > 1 else ''} {shown} in the {scheme} URL"
    hints = [(name, _closest(name, names)) for name in unknown]
    found = [(name, match) for name, match in hints if match is not None]
    if len(unknown) == 1 and found:
        message += f" (did you mean {found[0][1]!r}?)"
    elif found:
        message += " (did you mean " + ", ".join(f"{m!r} for {n!r}" for n, m in found) + "?)"
    listed = ", ".join(names)
    if also:
        listed = f"{listed}, and {also}" if listed else also
    raise ConfigurationError(f"{message}; known: {listed or 'none'}")


def url_seconds(name: str, value: str) -> float:
    """The value of URL option *name*, a number of seconds (``"0.5"``, ``"10"``), as a float.

    Raises `ConfigurationError` (``timeout must be a number of seconds, got 'soon'``) for
    anything ``float`` does not read. Its range is the constructor's to check (with
    `to_seconds`), as for the same option given as a keyword: one check, one message.
    """
    try:
        return float(value)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}") from None


def url_flag(name: str, value: str) -> bool:
    """The value of URL flag option *name*: ``1``, ``true``, ``yes``, ``on`` or ``0``,
    ``false``, ``no``, ``off``, in any case; else `ConfigurationError`
    (``notify must be true or false, got 'maybe'``)."""
    word = value.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ConfigurationError(f"{name} must be true or false, got {value!r}")
