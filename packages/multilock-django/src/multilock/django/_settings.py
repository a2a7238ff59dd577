"""The ``MULTILOCK`` setting: read, validated, and turned into election options.

Every replica of a Django project shares one settings module, so the setting holds only
what every replica shares: the store URL, a prefix for group names and the timing
options. Each process still gets its own participant id (the default,
``hostname-pid-random``); a participant id in the settings would make every replica
believe it holds the others' lease, so it is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    available_schemes,
    redact_url,
    validate_name,
)

__all__ = ["MultilockSettings", "multilock_settings"]

#: The keys of ``MULTILOCK``.
_KEYS = ("URL", "GROUP_PREFIX", "OPTIONS")
#: The `ElectionOptions` fields ``MULTILOCK["OPTIONS"]`` may set.
_OPTION_NAMES = (
    "lease_duration",
    "renew_interval",
    "retry_interval",
    "release_on_stop",
    "metadata",
    "max_clock_drift",
)
_EXAMPLE = 'MULTILOCK = {"URL": "redis://localhost:6379/0"}'


@dataclasses.dataclass(frozen=True)
class MultilockSettings:
    """The validated ``MULTILOCK`` setting (see `multilock_settings`)."""

    #: The store URL for `multilock.core.from_url` (not shown in the repr: it may hold a password).
    url: str = dataclasses.field(repr=False)
    #: Prepended to every group name, so that projects sharing one store keep apart.
    group_prefix: str = ""
    #: `ElectionOptions` fields, checked (group and participant_id excluded).
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def redacted_url(self) -> str:
        """The URL with its password and secret query values hidden."""
        return redact_url(self.url)

    def group(self, name: str) -> str:
        """Return the store's group name for *name*: the prefix, then *name*, validated.

        Raise `ConfigurationError` (a `ValueError`) when the result is not a valid group
        name.
        """
        if not isinstance(name, str):
            raise ConfigurationError(f"group must be a str, not {type(name).__name__}")
        return validate_name(self.group_prefix + name, "group")

    def election_options(self, name: str, **overrides: Any) -> ElectionOptions:
        """Build the `ElectionOptions` of group *name*: ``OPTIONS``, then *overrides*.

        Raise `ConfigurationError` when the result breaks a rule (the override may clash
        with ``OPTIONS``, e.g. a short lease against a long renew interval).
        """
        return ElectionOptions(group=self.group(name), **{**self.options, **overrides})

    def __repr__(self) -> str:
        return (
            f"MultilockSettings(url={self.redacted_url!r}, group_prefix={self.group_prefix!r}, "
            f"options={dict(self.options)!r})"
        )


def _fail(problem: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{problem} (for example {_EXAMPLE})")


def multilock_settings() -> MultilockSettings:
    """Read and check ``settings.MULTILOCK``; raise `ImproperlyConfigured` saying what is wrong.

    The setting is a dict: ``URL`` (required; any URL `multilock.core.from_url` takes, such
    as ``redis://host:6379/0``), ``GROUP_PREFIX`` (default ``""``) and ``OPTIONS`` (default
    ``{}``; `ElectionOptions` fields except ``group`` and ``participant_id``). Read on
    every call, so that ``override_settings`` works; nothing connects to the store.
    """
    config = getattr(settings, "MULTILOCK", None)
    if config is None:
        raise _fail("the MULTILOCK setting is missing")
    if not isinstance(config, Mapping):
        raise _fail(f"MULTILOCK must be a dict, not {type(config).__name__}")
    unknown = sorted(str(key) for key in config if key not in _KEYS)
    if unknown:
        raise _fail(f"MULTILOCK has unknown keys {unknown}; the keys are {list(_KEYS)}")

    url = config.get("URL")
    if not isinstance(url, str) or not url:
        what = "missing" if url is None else "empty" if url == "" else type(url).__name__
        raise _fail(f'MULTILOCK["URL"] must be a store URL, not {what}')
    _check_scheme(url)

    prefix = config.get("GROUP_PREFIX", "")
    if not isinstance(prefix, str):
        raise _fail(f'MULTILOCK["GROUP_PREFIX"] must be a str, not {type(prefix).__name__}')
    if prefix:
        try:
            validate_name(prefix, 'MULTILOCK["GROUP_PREFIX"]')
        except ConfigurationError as exc:
            raise _fail(str(exc)) from None

    options = config.get("OPTIONS", {})
    if not isinstance(options, Mapping):
        raise _fail(f'MULTILOCK["OPTIONS"] must be a dict, not {type(options).__name__}')
    for name in options:
        if name in ("group", "participant_id"):
            why = (
                "the group is named where the election runs (leader_run GROUP, leader_only)"
                if name == "group"
                else "every replica reads the same settings, and each needs an id of its own "
                "(the default, hostname-pid-random)"
            )
            raise _fail(f'MULTILOCK["OPTIONS"] must not set {name!r}: {why}')
        if name not in _OPTION_NAMES:
            raise _fail(
                f'MULTILOCK["OPTIONS"] has the unknown option {name!r}; '
                f"the options are {list(_OPTION_NAMES)}"
            )
    try:
        ElectionOptions(**options)
    except ConfigurationError as exc:
        raise _fail(f'MULTILOCK["OPTIONS"] is invalid: {exc}') from None
    return MultilockSettings(url=url, group_prefix=prefix, options=dict(options))


def _check_scheme(url: str) -> None:
    """Refuse a URL whose scheme no installed package serves, before anything runs."""
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError:
        scheme = ""
    if not scheme:
        raise _fail(f'MULTILOCK["URL"] {redact_url(url)!r} has no scheme such as redis://')
    schemes = available_schemes()
    if scheme not in schemes:
        raise _fail(
            f'MULTILOCK["URL"] uses the scheme {scheme!r}, which no installed multilock '
            f"package provides (installed: {', '.join(schemes)})"
        )
