"""The Django app of multilock: put ``"multilock.django"`` in INSTALLED_APPS."""

from __future__ import annotations

from django.apps import AppConfig  # type: ignore[import-untyped]
from django.core import checks  # type: ignore[import-untyped]

from ._checks import check_settings

__all__ = ["MultilockConfig"]


class MultilockConfig(AppConfig):  # type: ignore[misc]
    """Adds the ``leader_run`` command and a system check of the ``MULTILOCK`` setting."""

    name = "multilock.django"
    # The default label would be "django": clear about whose app this is, and no clash.
    label = "multilock"
    verbose_name = "multilock"
    default = True

    def ready(self) -> None:
        checks.register(check_settings, "multilock")
