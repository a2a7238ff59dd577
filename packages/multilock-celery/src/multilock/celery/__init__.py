"""multilock.celery: run ``celery beat`` on every replica; exactly one sends the schedule.

    app.conf.multilock_url = "redis://localhost:6379/0"
    app.conf.multilock_options = {"lease_duration": 10}

    celery -A proj beat -S multilock.celery:LeaderScheduler

`LeaderScheduler` is celery's `PersistentScheduler` gated by a
`multilock.core.sync.LeaderElection`: followers send nothing, and when the leader stops
(lease released) or dies (lease expires) another replica takes over.
"""

from ._scheduler import DEFAULT_GROUP, LeaderScheduler

__all__ = ["DEFAULT_GROUP", "LeaderScheduler"]
