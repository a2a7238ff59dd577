"""multilock.apscheduler: run APScheduler 3.x jobs on one replica only, the elected leader.

Every replica runs the same scheduler with the same jobs; `LeaderScheduler` starts it
paused and resumes it while a `multilock.core.LeaderElection` says this replica leads::

    async with LeaderScheduler(AsyncIOScheduler(...), "redis://...", group="jobs") as leader:
        ...

Threaded programs (``BackgroundScheduler``) use `multilock.apscheduler.sync.LeaderScheduler`
in a ``with`` block. Jobs already running when leadership is lost are not stopped: they
fence their writes with ``leader.leadership.token``.
"""

from ._scheduler import LeaderScheduler

__all__ = ["LeaderScheduler"]

__version__ = "0.1.0"
