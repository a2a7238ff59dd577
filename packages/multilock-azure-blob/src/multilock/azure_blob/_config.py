"""Where the blobs live: connection strings and ``azureblob://`` URLs, checked, never shown.

URL form (``from_url``)::

    azureblob://<account>.blob.core.windows.net/<container>[?options]
    azureblob://<account>:<key>@<account>.blob.core.windows.net/<container>
    azureblob://<account>:<key>@127.0.0.1:10000/<account>/<container>?secure=false

The host (and, for path-style endpoints such as Azurite, every path segment but the last)
is the account URL, ``https://`` unless ``secure=false``; the last path segment is the
container. Credentials: ``<account>:<key>@`` (a shared key, percent-encoded), ``?sas=``
(a SAS token), the ``credential=`` keyword (any azure-identity credential), or none.
``?connection_string_env=NAME`` (or the ``connection_string=`` keyword) takes everything
from a connection string instead, and the URL's host is ignored: ``azureblob:///<container>
?connection_string_env=AZURE_STORAGE_CONNECTION_STRING``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl, unquote

from multilock.core.provider import (
    ConfigurationError,
    check_url_options,
    redact_url,
    split_url,
    to_seconds,
    url_flag,
    url_seconds,
)

__all__ = [
    "SCHEME",
    "parse_url",
    "seconds",
    "secrets_of_connection_string",
    "secrets_of_credential",
    "validate_container",
    "validate_prefix",
]

SCHEME = "azureblob"
_CONTAINER = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}")
_PREFIX = re.compile(r"[A-Za-z0-9_.\-/]{0,512}")
#: Query parameters read by `parse_url`; everything else is an error.
_OPTIONS = ("prefix", "poll_interval", "timeout", "api_version")


def validate_container(name: object) -> str:
    """Return *name* if it is a valid container name (3..63 of ``[a-z0-9-]``), else raise."""
    if not isinstance(name, str) or not _CONTAINER.fullmatch(name):
        raise ConfigurationError(
            f"container {name!r} is invalid: use 3 to 63 lowercase letters, digits and "
            "single hyphens, starting and ending with a letter or digit"
        )
    return name


def validate_prefix(prefix: object) -> str:
    """Return *prefix* if it fits in a blob name before any group name, else raise."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ConfigurationError(
            f"prefix {prefix!r} is invalid: use at most 512 characters of letters, "
            "digits, '_', '.', '-' and '/'"
        )
    return prefix


def secrets_of_connection_string(text: str) -> list[str]:
    """The secret values of a connection string (account key, SAS), longest first."""
    found = []
    for part in text.split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip().lower() in ("accountkey", "sharedaccesssignature") and value:
            found.append(value.strip())
    return sorted(found, key=len, reverse=True)


def parse_url(url: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Turn an ``azureblob://`` URL plus keywords into `AzureBlobProvider` keywords."""
    parts = split_url(url, "Azure Blob", "an account key: '/' as %2F, '+' as %2B, '=' as %3D")
    port = parts.port
    shown = redact_url(url)
    if parts.scheme.lower() != SCHEME:
        raise ConfigurationError(f"an Azure Blob URL starts with {SCHEME}://, not {shown!r}")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    known = (*_OPTIONS, "secure", "sas", "connection_string_env")
    check_url_options((k for k, _ in pairs), known, scheme=SCHEME)
    query = dict(pairs)
    result: dict[str, Any] = {k: query.pop(k) for k in _OPTIONS if k in query}
    secure = url_flag("secure", query.pop("secure", "true"))
    env = query.pop("connection_string_env", None)
    sas = query.pop("sas", None)
    segments = [unquote(s) for s in parts.path.split("/") if s]
    if not segments:
        raise ConfigurationError(f"no container in {shown}: azureblob://<host>/<container>")
    result["container"] = segments[-1]
    if env is not None or "connection_string" in kwargs:
        if env is not None:
            value = os.environ.get(env, "")
            if not value:
                raise ConfigurationError(f"the environment variable {env} is not set or empty")
            result["connection_string"] = value
        return {**result, **kwargs}
    if not parts.hostname:
        raise ConfigurationError(
            f"no account host in {shown}: azureblob://<account>.blob.core.windows.net/"
            "<container>, or pass connection_string_env= or connection_string="
        )
    host = parts.hostname if port is None else f"{parts.hostname}:{port}"
    path = "".join(f"/{s}" for s in parts.path.split("/")[:-1] if s)
    result["account_url"] = f"{'https' if secure else 'http'}://{host}{path}"
    if parts.password is not None:
        from azure.core.credentials import AzureNamedKeyCredential

        account = unquote(parts.username or "")
        result["credential"] = AzureNamedKeyCredential(account, unquote(parts.password))
    elif sas is not None:
        result["credential"] = sas
    return {**result, **kwargs}


def seconds(value: float | timedelta | str, field: str) -> float:
    """*value* in seconds; a string (a URL's) is read as a number of seconds first."""
    return to_seconds(url_seconds(field, value) if isinstance(value, str) else value, field)


def secrets_of_credential(credential: Any) -> list[str]:
    """Secret strings inside *credential*, to scrub from error messages."""
    if isinstance(credential, str):
        return [credential, credential.lstrip("?")]
    named = getattr(credential, "named_key", None)
    if named is not None:
        return [named.key]
    sas = getattr(credential, "signature", None)
    if isinstance(sas, str):
        return [sas]
    if isinstance(credential, Mapping):
        return [str(v) for k, v in credential.items() if k != "account_name"]
    return []
