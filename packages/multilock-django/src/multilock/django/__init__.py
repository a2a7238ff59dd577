"""multilock.django: run management commands and jobs only on the replica that leads.

Add ``"multilock.django"`` to INSTALLED_APPS and configure the store::

    MULTILOCK = {"URL": "redis://localhost:6379/0"}

then, on every replica::

    python manage.py leader_run nightly-report --every 3600 -- nightly_report

Inside the command, `current_leadership()` returns the term: call ``.check()`` between
steps and pass ``.token`` to what you write to. `leader_only` guards a plain function
the same way; `multilock_settings` reads the setting.
"""

from ._current import current_leadership
from ._leader_only import LeaderOnly, close_elections, leader_only
from ._settings import MultilockSettings, multilock_settings

__all__ = [
    "LeaderOnly",
    "MultilockSettings",
    "close_elections",
    "current_leadership",
    "leader_only",
    "multilock_settings",
]
