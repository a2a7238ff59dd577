"""A system check (``manage.py check``, and before most commands) of the MULTILOCK setting."""

from __future__ import annotations

from typing import Any

from django.core import checks  # type: ignore[import-untyped]
from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]

from ._settings import multilock_settings

__all__ = ["check_settings"]


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Report a missing or invalid ``MULTILOCK`` setting as the error ``multilock.E001``."""
    try:
        multilock_settings()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="multilock.E001")]
    return []
