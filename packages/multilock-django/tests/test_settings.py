"""The MULTILOCK setting: every mistake is an ImproperlyConfigured saying what to fix."""

from __future__ import annotations

from typing import Any

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test.utils import override_settings

from multilock.core import ConfigurationError
from multilock.django import MultilockSettings, multilock_settings

SECRET = "pa55w0rd-hidden"
URL = f"redis://user:{SECRET}@localhost:6379/0"


def settings_error(value: Any) -> str:
    with override_settings(MULTILOCK=value), pytest.raises(ImproperlyConfigured) as caught:
        multilock_settings()
    return str(caught.value)


def test_missing_setting() -> None:
    with override_settings():
        from django.conf import settings

        del settings.MULTILOCK
        with pytest.raises(ImproperlyConfigured, match="the MULTILOCK setting is missing"):
            multilock_settings()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("redis://localhost", "MULTILOCK must be a dict, not str"),
        ({"URL": "memory://", "URLS": []}, "unknown keys ['URLS']"),
        ({}, 'MULTILOCK["URL"] must be a store URL, not missing'),
        ({"URL": ""}, 'MULTILOCK["URL"] must be a store URL, not empty'),
        ({"URL": 6379}, 'MULTILOCK["URL"] must be a store URL, not int'),
        ({"URL": "localhost:6379"}, "uses the scheme 'localhost', which no installed"),
        ({"URL": "nosuch://host"}, "uses the scheme 'nosuch', which no installed"),
        ({"URL": "/var/locks"}, "has no scheme"),
        ({"URL": "memory://", "GROUP_PREFIX": 1}, 'GROUP_PREFIX"] must be a str, not int'),
        ({"URL": "memory://", "GROUP_PREFIX": "my app:"}, "is invalid"),
        ({"URL": "memory://", "OPTIONS": [1]}, 'OPTIONS"] must be a dict, not list'),
        ({"URL": "memory://", "OPTIONS": {"group": "g"}}, "must not set 'group'"),
        (
            {"URL": "memory://", "OPTIONS": {"participant_id": "me"}},
            "must not set 'participant_id': every replica reads the same settings",
        ),
        ({"URL": "memory://", "OPTIONS": {"lease": 3}}, "unknown option 'lease'"),
        (
            {"URL": "memory://", "OPTIONS": {"lease_duration": 3, "renew_interval": 2}},
            'OPTIONS"] is invalid: renew_interval is too long',
        ),
        ({"URL": "memory://", "OPTIONS": {"lease_duration": "10"}}, "lease_duration must be"),
    ],
)
def test_invalid_settings(value: Any, message: str) -> None:
    text = settings_error(value)
    assert message in text
    assert "for example MULTILOCK = {" in text


def test_errors_hide_the_password() -> None:
    text = settings_error({"URL": f"nosuch://user:{SECRET}@host/", "OPTIONS": {}})
    assert SECRET not in text
    text = settings_error({"URL": URL, "OPTIONS": {"lease_duration": -1}})
    assert SECRET not in text


def test_valid_settings() -> None:
    options = {"lease_duration": 6, "metadata": {"app": "billing"}}
    value = {"URL": URL, "GROUP_PREFIX": "billing.", "OPTIONS": options}
    with override_settings(MULTILOCK=value):
        config = multilock_settings()
    assert config == MultilockSettings(url=URL, group_prefix="billing.", options=options)
    assert SECRET not in repr(config)
    assert "***" in config.redacted_url
    assert config.group("nightly") == "billing.nightly"
    built = config.election_options("nightly")
    assert (built.group, built.lease_duration, built.metadata) == (
        "billing.nightly",
        6.0,
        {"app": "billing"},
    )
    assert config.election_options("nightly", lease_duration=3).lease_duration == 3.0


def test_group_names_are_checked() -> None:
    config = MultilockSettings(url="memory://", group_prefix="p.")
    with pytest.raises(ConfigurationError, match=r"'p\.no spaces' is invalid"):
        config.group("no spaces")
    with pytest.raises(ConfigurationError, match="is invalid"):
        config.group("x" * 254)  # 256 characters with the prefix
    with pytest.raises(ConfigurationError, match="renew_interval is too long"):
        MultilockSettings(url="memory://", options={"renew_interval": 5}).election_options(
            "g", lease_duration=2
        )


def test_system_check_reports_the_setting() -> None:
    with override_settings(MULTILOCK={"URL": "nosuch://x"}):
        errors = checks.run_checks(tags=["multilock"])
        assert [e.id for e in errors] == ["multilock.E001"]
        assert "nosuch" in errors[0].msg
        with pytest.raises(SystemCheckError, match=r"multilock\.E001"):
            call_command("check")
    with override_settings(MULTILOCK={"URL": "memory://"}):
        assert checks.run_checks(tags=["multilock"]) == []
