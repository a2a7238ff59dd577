"""`from_url`: build a provider from a URL, finding backends through entry points.

Each backend distribution registers its provider class under the entry-point group
``multilock.providers``, one entry per URL scheme. The class must offer
``from_url(url: str, **kwargs) -> Provider``. ``memory://`` is built in.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import EntryPoint, entry_points
from typing import Any
from urllib.parse import (
    SplitResult,
    quote,
    unquote,
    unquote_plus,
    urlencode,
    urlsplit,
    urlunsplit,
)

from ._errors import ConfigurationError
from ._provider import Provider

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_schemes",
    "from_url",
    "redact_text",
    "redact_url",
    "split_url",
]

ENTRY_POINT_GROUP = "multilock.providers"
_BUILTIN = {"memory": "multilock.core._memory:InMemoryProvider"}
#: Where to find the provider for a scheme that is not installed, for the error message.
_DISTRIBUTIONS = {
    "file": "multilock-filesystem",
    "redis": "multilock-redis",
    "rediss": "multilock-redis",
    "redis+sentinel": "multilock-redis",
    "redlock": "multilock-redis",
    "postgresql": "multilock-postgres",
    "postgres": "multilock-postgres",
    "mssql": "multilock-sqlserver",
    "sqlserver": "multilock-sqlserver",
    "azureblob": "multilock-azure-blob",
    "s3": "multilock-s3",
    "consul": "multilock-consul",
    "zookeeper": "multilock-zookeeper",
    "zk": "multilock-zookeeper",
    "etcd": "multilock-etcd",
}
_SECRET_QUERY_KEYS = frozenset(
    {
        "password",
        "passwd",
        "pwd",
        "secret",
        "secret_key",
        "accountkey",
        "account_key",
        "sig",
        "token",
        "access_token",
        "sas",
        "credential",
        "key",
    }
)
#: A key whose last ``_``/``-``/``.`` part is one of these is secret too (sentinel_password).
_SECRET_WORDS = frozenset(
    {"password", "passwd", "pwd", "secret", "token", "key", "sig", "credential", "credentials"}
)
_REDACTED = "***"


def _is_secret(key: str) -> bool:
    lowered = key.lower()
    return lowered in _SECRET_QUERY_KEYS or re.split(r"[_.\-]", lowered)[-1] in _SECRET_WORDS


def _query_items(query: str) -> list[tuple[str, str, bool, bool]]:
    """``(name, value, secret, has '=')`` of each item of *query*, decoded.

    An item without ``=`` that follows a secret one is taken for the rest of that secret
    (``?password=ab&cd`` is the password ``ab&cd`` with its ``&`` not encoded): it is
    secret too, and its name is what would otherwise be shown.
    """
    items: list[tuple[str, str, bool, bool]] = []
    for item in query.split("&"):
        if not item:
            continue
        name, equals, value = item.partition("=")
        after_secret = bool(items) and items[-1][2]
        secret = _is_secret(unquote_plus(name)) if equals else after_secret
        items.append((unquote_plus(name), unquote_plus(value), secret, bool(equals)))
    return items


def _unparsed_password(url: str) -> tuple[str, str, str] | None:
    """``(before, password, after)`` when a password holds an unencoded ``/``, ``?`` or ``#``.

    urllib then ends the host part inside the password (``redis://:se/cret@host`` has the
    netloc ``:se``), so the password would pass unredacted. Whenever the netloc has a
    ``:`` but no ``@`` while an ``@`` follows later, everything up to the last ``@`` is
    taken for the user information: a host:port URL with an ``@`` in its path or query is
    then over-redacted, never a password shown.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None
    netloc = urlsplit(url).netloc
    at = rest.rfind("@")
    if "@" in netloc or ":" not in netloc or at < 0:
        return None
    userinfo = rest[:at]
    user, colon, password = userinfo.partition(":")
    if not colon:
        return None
    return f"{scheme}://{user}:", password, rest[at:]


#: One host of a URL's host list: a name or an [IPv6 address], and an optional port.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^\s\[\]:/?#@,]+)(?::(\d{1,5}))?")


def split_url(url: str, name: str, encode: str = "a password") -> SplitResult:
    """``urllib.parse.urlsplit(url)``, refused unless its hosts and ports parse.

    A password (a token, a key) with an unencoded ``/``, ``?`` or ``#`` ends urllib's
    host part inside the secret: ``redis://:se/cret@host`` reads as the host ``""`` and
    the port ``se``, which urllib's error, a driver's "cannot resolve" or a host list
    parser would go on to quote. Such a URL, or one whose port is not a number, raises
    `ConfigurationError` with neither the URL nor urllib's error in it (nor as its
    context): "invalid *name* URL: its host or port does not parse (percent-encode
    *encode*...)". *encode* names the secret, and may add the characters it often holds
    (``"a secret key: '/' as %2F, '+' as %2B"``). A port 0 is refused too, and so is a
    URL with a ``#`` part (nothing reads one) or a query item without ``=`` right after a
    secret one (``?password=ab&cd``): both are most likely a secret cut short. A host list
    (``h1:1,h2:2``) is checked host by host; what each host may be is left to the provider.
    """
    hint = encode if ":" in encode else f"{encode}: '/' as %2F, '?' as %3F, '#' as %23"
    try:
        parts = urlsplit(url)
        hosts = parts.netloc.rpartition("@")[2]
        if "," in hosts or _unparsed_password(url) is not None:
            ports = [_port(host) for host in hosts.split(",")]
        else:
            ports = [parts.port]  # raises ValueError if it is not a number up to 65535
    except ValueError:
        ports = [-1]
    if -1 in ports:
        raise ConfigurationError(
            f"invalid {name} URL: its host or port does not parse (percent-encode {hint})"
        )
    if 0 in ports:
        raise ConfigurationError(f"invalid {name} URL: port 0 is no server's port (1 to 65535)")
    if parts.fragment or any(s and not e for _, _, s, e in _query_items(parts.query)):
        # What follows the '#', or a query item with no '=' right after a password, token
        # or key, is most likely the rest of that secret: say so without quoting it.
        raise ConfigurationError(
            f"invalid {name} URL: a '#' or '&' cuts a password, token or key short "
            "(percent-encode them: '#' as %23, '&' as %26)"
        )
    return parts


def _port(host: str) -> int | None:
    """The port of one ``host[:port]`` of a host list (None: none given; -1: no parse)."""
    match = _HOST_PORT.fullmatch(host)
    if match is None or int(match.group(2) or 0) > 65535:
        return -1
    return None if match.group(2) is None else int(match.group(2))


def _redacted(name: str, value: str, secret: bool, equals: bool) -> tuple[str, str]:
    """One query item as `redact_url` shows it: a secret's value, or a cut secret's rest."""
    if not secret:
        return name, value
    return (name, _REDACTED) if equals else (_REDACTED, "")


def redact_url(url: str) -> str:
    """Return *url* with its password and secret query values replaced by ``***``."""
    try:
        unparsed = _unparsed_password(url)
        if unparsed is not None:
            before, _, after = unparsed
            return redact_url(f"{before}{_REDACTED}{after}")
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, sep, _password = userinfo.partition(":")
            netloc = f"{user}{sep}{_REDACTED if sep else ''}@{hostport}"
        query = parts.query
        if query:
            items = _query_items(query)
            query = urlencode([_redacted(*item) for item in items], safe="*")
        # Nothing reads a fragment; it may be the rest of a secret with a '#' not encoded.
        fragment = _REDACTED if parts.fragment else ""
        if netloc == parts.netloc and query == parts.query and fragment == parts.fragment:
            return url
        return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))
    except ValueError:
        return "<unparseable URL>"


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")
_PAIR_IN_TEXT = re.compile(r"\b([A-Za-z_][\w.\-]*)=('[^']*'|\"[^\"]*\"|[^\s&;,'\")]+)")


def redact_text(text: str) -> str:
    """*text* with every URL in it redacted, and every ``secret=value`` pair too.

    For messages of unknown origin (a third-party driver's error), where the URL whose
    secrets `scrub` would cut is not known: a libpq-style ``password=...`` or a URL with
    credentials is still caught.
    """
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)
    return _PAIR_IN_TEXT.sub(
        lambda m: f"{m.group(1)}={_REDACTED}" if _is_secret(m.group(1)) else m.group(0), text
    )


def secrets_of(url: str) -> list[str]:
    """The raw secret substrings of *url*, to scrub from driver error messages."""
    found: list[str] = []
    try:
        unparsed = _unparsed_password(url)
        if unparsed is not None:
            password = unparsed[1]
            found += [password, unquote(password), quote(password)]
            url = f"{unparsed[0]}{_REDACTED}{unparsed[2]}"
        parts = urlsplit(url)
        if parts.password:
            found += [parts.password, unquote(parts.password), quote(parts.password)]
        wholes: list[str] = []  # each secret of the query, rejoined where '&'s cut it
        for name, value, secret, equals in _query_items(parts.query):
            if not secret:
                continue
            found.append(value if equals else name)  # a message may quote one piece
            if equals:
                wholes.append(value)
            else:
                wholes[-1] += f"&{name}"
        for whole in wholes:
            found += [whole, quote(whole, safe="")]
        if parts.fragment:  # the rest of a secret with its '#' not encoded, maybe
            found += [parts.fragment, unquote(parts.fragment)]
    except ValueError:
        pass
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """Remove every secret of *url* from *text*."""
    for secret in secrets_of(url):
        text = text.replace(secret, _REDACTED)
    return text


def _entry_points() -> dict[str, EntryPoint | str]:
    found: dict[str, EntryPoint | str] = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name] = ep
    return found


def available_schemes() -> list[str]:
    """The URL schemes of every installed provider, sorted."""
    return sorted(_entry_points())


def _load(target: EntryPoint | str) -> Any:
    if isinstance(target, EntryPoint):
        return target.load()
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _no_scheme(url: str, schemes: list[str]) -> ConfigurationError:
    """The error for a URL written without its ``scheme://``, with a corrected example."""
    shown = redact_url(url) if "://" in url else redact_url(f"//{url}")[2:]
    rest = shown.partition("://")[2] if "://" in shown else shown
    stores = [s for s in schemes if s != "memory"]
    if rest.startswith(("/", ".", "~")):
        example = f"file://{rest}" if rest.startswith("/") else "file:///path/to/dir"
    else:
        example = f"{'redis' if 'redis' in stores or not stores else stores[0]}://{rest}"
    return ConfigurationError(
        f"URL {shown!r} has no scheme: write it as scheme://host:port/..., for example "
        f"{example}; installed schemes: {', '.join(schemes)}"
    )


def from_url(url: str, **kwargs: Any) -> Provider:
    """Build the provider that *url*'s scheme names, e.g. ``redis://localhost:6379/0``.

    Keyword arguments go to the provider's ``from_url``. Unknown schemes raise
    `ConfigurationError` listing the installed ones; credentials never appear in errors.
    """
    if not isinstance(url, str):
        raise ConfigurationError(f"url must be a str, not {type(url).__name__}")
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as exc:
        raise ConfigurationError(f"invalid URL {redact_url(url)}: {exc}") from None
    providers = _entry_points()
    target = providers.get(scheme)
    # "localhost:6379" parses as the scheme "localhost": without "://" and an installed
    # scheme, the user meant a host, not a scheme.
    if not scheme or (target is None and "://" not in url):
        raise _no_scheme(url, sorted(providers))
    if target is None:
        hint = _DISTRIBUTIONS.get(scheme)
        install = f" (pip install {hint})" if hint else ""
        raise ConfigurationError(
            f"no multilock provider is installed for the scheme {scheme!r}{install}; "
            f"installed schemes: {', '.join(sorted(providers))}"
        )
    cls = _load(target)
    error: ConfigurationError | None
    try:
        provider = cls.from_url(url, **kwargs)
    except ConfigurationError as exc:
        error = ConfigurationError(scrub(str(exc), url))
    except (ValueError, TypeError) as exc:
        error = ConfigurationError(
            f"invalid {scheme} URL {redact_url(url)}: {scrub(str(exc), url)}"
        )
    else:
        error = None
    if error is not None:
        # Raised outside the handler: the provider's error, which may hold the password,
        # must not travel on as this one's (suppressed) __context__.
        raise error
    if not isinstance(provider, Provider):
        raise ConfigurationError(f"the {scheme!r} entry point did not build a Provider")
    return provider
