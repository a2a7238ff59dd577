"""`LeaderScheduler` for threaded programs: a ``BackgroundScheduler`` that runs on the leader.

It campaigns through `multilock.core.sync.LeaderElection` and is used in a ``with`` block::

    from apscheduler.schedulers.background import BackgroundScheduler
    from multilock.apscheduler.sync import LeaderScheduler

    scheduler = BackgroundScheduler()
    scheduler.add_job(report, "cron", hour=3)
    with LeaderScheduler(scheduler, "redis://localhost:6379/0", group="reports"):
        stop_event.wait()
"""

from ._sync import LeaderScheduler

__all__ = ["LeaderScheduler"]
