"""Connection strings: parse a URL or an ODBC string, and never show its password.

The URL form is ``mssql://user:pass@host:1433/db?driver=...&Key=value`` (``sqlserver://``
works too). It becomes the ODBC string ``DRIVER={...};SERVER=tcp:host,1433;DATABASE=db;
UID=user;PWD={pass};Key=value``. ``schema``, ``table``, ``login_timeout`` and
``query_timeout`` in the query are the provider's own options; every other query
parameter is an ODBC keyword, passed through as written, unless it looks like a typo of
one of ours (``query_timout``, ``QueryTimeout``): that is refused, naming ours.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import attrs

from multilock.core.provider import ConfigurationError, check_url_options, redact_url, split_url

__all__ = ["SCHEMES", "ConnString", "format_pairs", "parse_odbc", "parse_url"]

SCHEMES = ("mssql", "sqlserver")
#: URL query parameters that are options of the provider, not ODBC keywords.
OPTIONS = ("schema", "table", "login_timeout", "query_timeout")
_REDACTED = "***"
_SECRET_KEYS = frozenset({"pwd", "password", "accesstoken", "clientsecret"})
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9 _-]*")
#: How our own options are written (ODBC keywords are mostly CamelCase).
_OUR_STYLE = re.compile(r"[a-z0-9]+(?:_[a-z0-9]+)+")
#: ODBC keywords of Microsoft's drivers and FreeTDS that are written like our options.
_ODBC_WITH_UNDERSCORE = frozenset(
    {
        "failover_partner",
        "mars_connection",
        "querylog_on",
        "statslog_on",
        "tds_version",
        "trusted_connection",
    }
)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

Pairs = tuple[tuple[str, str], ...]


def _is_secret(key: str) -> bool:
    return key.replace(" ", "").lower() in _SECRET_KEYS


def parse_odbc(text: str) -> Pairs:
    """Split ``Key=value;Key={va;lue}`` into pairs; ``}}`` inside braces is one ``}``.

    Raise ConfigurationError without echoing the text (it may hold a password).
    """
    pairs: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] in "; \t":
            i += 1
            continue
        eq = text.find("=", i)
        if eq < 0:
            raise ConfigurationError(
                f"invalid ODBC connection string: no '=' after key #{len(pairs) + 1}"
            )
        key = text[i:eq].strip()
        if not _KEY.fullmatch(key):
            raise ConfigurationError(f"invalid ODBC connection string: bad key #{len(pairs) + 1}")
        i = eq + 1
        while i < n and text[i] in " \t":
            i += 1
        if i < n and text[i] == "{":
            chars: list[str] = []
            i += 1
            while True:
                if i >= n:
                    raise ConfigurationError(
                        f"invalid ODBC connection string: unclosed '{{' in the value of {key}"
                    )
                if text[i] == "}":
                    if text.startswith("}}", i):
                        chars.append("}")
                        i += 2
                        continue
                    i += 1
                    break
                chars.append(text[i])
                i += 1
            value = "".join(chars)
            while i < n and text[i] in " \t":
                i += 1
            if i < n and text[i] != ";":
                raise ConfigurationError(
                    f"invalid ODBC connection string: text after '}}' in the value of {key}"
                )
        else:
            end = text.find(";", i)
            end = n if end < 0 else end
            value, i = text[i:end].strip(), end
        pairs.append((key, value))
    if not pairs:
        raise ConfigurationError("the ODBC connection string is empty")
    return tuple(pairs)


def _quote(value: str) -> str:
    """Brace-quote a value when it holds a character ODBC would read as syntax."""
    if value == "" or any(c in value for c in ";{}=") or value != value.strip():
        return "{" + value.replace("}", "}}") + "}"
    return value


def format_pairs(pairs: Pairs, *, redact: bool = False) -> str:
    """Join pairs into an ODBC string; *redact* replaces secret values with ``***``."""
    return ";".join(f"{k}={_REDACTED if redact and _is_secret(k) else _quote(v)}" for k, v in pairs)


def _mistyped(key: str) -> bool:
    """Whether a query key is no ODBC keyword but looks like a typo of one of our options.

    Every other key is passed to the driver, which takes keywords no list here can hold
    (DSNs, driver versions): only names written like ours (``query_timout``), close to
    one of ours (``QueryTimeout``) or not keywords at all are refused.
    """
    lowered = key.lower()
    if not _KEY.fullmatch(key):
        return True
    if lowered in _ODBC_WITH_UNDERSCORE or lowered == "driver":
        return False
    close = difflib.get_close_matches(
        lowered.replace("_", ""), [o.replace("_", "") for o in OPTIONS], cutoff=0.8
    )
    return bool(_OUR_STYLE.fullmatch(key) or close)


def parse_url(url: str) -> tuple[Pairs, dict[str, str]]:
    """Turn an ``mssql://`` or ``sqlserver://`` URL into ODBC pairs and the provider's options.

    The server is written the way Microsoft's drivers read it (``tcp:host,port``);
    `ConnString.connect_string` rewrites it for FreeTDS (``Server=host;Port=port``).
    """
    parts = split_url(url, "SQL Server", "a password: '/' as %2F, '?' as %3F, '#' as %23")
    port = parts.port
    if parts.scheme.lower() not in SCHEMES:
        raise ConfigurationError("a SQL Server URL starts with mssql:// or sqlserver://")
    if not parts.hostname:
        raise ConfigurationError(f"the SQL Server URL {redact_url(url)} names no host")
    host = parts.hostname
    if ":" in host:  # IPv6
        host = f"[{host}]"
    # A path of /db/instance is not supported: name an instance with ?server=host\\name.
    server = f"tcp:{host},{port}" if port else f"tcp:{host}"
    pairs: list[tuple[str, str]] = [("DRIVER", ""), ("SERVER", server)]
    database = unquote(parts.path.lstrip("/"))
    if "/" in database:
        raise ConfigurationError(f"the SQL Server URL {redact_url(url)} has more than a database")
    if database:
        pairs.append(("DATABASE", database))
    if parts.username is not None:
        pairs.append(("UID", unquote(parts.username)))
    if parts.password is not None:
        pairs.append(("PWD", unquote(parts.password)))
    options: dict[str, str] = {}
    query = parse_qsl(parts.query, keep_blank_values=True)
    check_url_options(
        (k for k, _ in query if k not in OPTIONS and _mistyped(k)),
        (*OPTIONS, "driver"),
        scheme=parts.scheme.lower(),
        also="any ODBC keyword of the driver (Encrypt, TrustServerCertificate, ...)",
    )
    for key, value in query:
        if key in OPTIONS:
            options[key] = value
        elif key.lower() == "driver":
            pairs[0] = ("DRIVER", value)
        elif key.upper() in ("SERVER", "ADDR", "ADDRESS"):
            pairs[1] = ("SERVER", value)
        else:
            pairs.append((key, value))
    if not pairs[0][1]:
        pairs.pop(0)  # no driver named: one is picked from those installed, at connect time
    return tuple(pairs), options


def _freetds_server(key: str, value: str, host: str, port: Pairs) -> Pairs:
    return (("SERVER", host), *port) if key == "SERVER" else ((key, value),)


@attrs.frozen
class ConnString:
    """A checked connection string: what to connect with, and how to show it."""

    pairs: Pairs = attrs.field(repr=False)
    #: The URL as given, when there was one (to scrub its secrets in any spelling).
    url: str = attrs.field(repr=False, default="")
    #: The URL's host and port, when the URL did not name the server in its query.
    host: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> tuple[ConnString, dict[str, str]]:
        """Parse a URL or an ODBC string; return it and the provider options of a URL."""
        if not isinstance(text, str):
            raise ConfigurationError(
                f"connection must be a str (URL or ODBC string), not {type(text).__name__}"
            )
        scheme = _SCHEME.match(text)
        if scheme is not None:
            if scheme.group(1).lower() not in SCHEMES:
                raise ConfigurationError(
                    f"unsupported URL scheme {scheme.group(1)!r}: use mssql:// or sqlserver://"
                )
            pairs, options = parse_url(text)
            parts = urlsplit(text)
            if dict(pairs)["SERVER"].startswith("tcp:"):
                return cls(pairs, text, parts.hostname, parts.port), options
            return cls(pairs, text), options
        pairs = parse_odbc(text)
        keys = {k.upper() for k, _ in pairs}
        if not keys & {"SERVER", "DSN", "ADDR", "ADDRESS"}:
            raise ConfigurationError("the ODBC connection string names no SERVER (or DSN)")
        return cls(pairs), {}

    def get(self, key: str) -> str | None:
        """The value of *key* (case-insensitive), or None."""
        for k, v in self.pairs:
            if k.upper() == key.upper():
                return v
        return None

    def connect_string(
        self, driver: str | None, defaults: dict[str, str], *, freetds: bool = False
    ) -> str:
        """The string to connect with: *driver* first when none is named, then *defaults*
        for the keys not set; with *freetds*, a URL's server as ``Server=host;Port=port``."""
        head = (("DRIVER", driver),) if driver and self.get("DRIVER") is None else ()
        pairs = self.pairs
        if freetds and self.host is not None:
            host = self.host if ":" not in self.host else f"[{self.host}]"
            port = (("Port", str(self.port)),) if self.port else ()
            pairs = tuple(p for k, v in pairs for p in _freetds_server(k, v, host, port))
        extra = tuple((k, v) for k, v in defaults.items() if self.get(k) is None)
        return format_pairs(head + pairs + extra)

    @property
    def shown(self) -> str:
        """The string with every password replaced by ``***``."""
        return redact_url(self.url) if self.url else format_pairs(self.pairs, redact=True)

    @property
    def where(self) -> str:
        """Just the server (and database), for error messages."""
        server = self.get("SERVER") or self.get("ADDR") or self.get("ADDRESS")
        where = server or f"DSN={self.get('DSN')}"
        database = self.get("DATABASE")
        return f"{where}/{database}" if database else where

    @property
    def secrets(self) -> tuple[str, ...]:
        """Every secret of this string, in every spelling a message may hold."""
        found = {v for k, v in self.pairs if _is_secret(k) and v}
        found |= {_quote(s) for s in found} | {quote(s, safe="") for s in found}
        if self.url:
            with contextlib.suppress(ValueError):
                parts = urlsplit(self.url)
                found.add(parts.password or "")
                found |= {v for k, v in parse_qsl(parts.query) if _is_secret(k)}
        return tuple(s for s in found if s)
