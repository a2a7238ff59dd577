"""Celery beat on every replica, exactly one of them sending the schedule.

From the repository root, with Redis running:

    export CELERY_BROKER_URL=redis://localhost:6379/1   # the broker
    export MULTILOCK_URL=redis://localhost:6379/0       # the store that elects beat's leader
    celery -A samples.celery_app worker --pool solo -l info    # logs each tick it runs
    celery -A samples.celery_app beat -S multilock.celery:LeaderScheduler -l info \\
        --schedule beat-1 --pidfile=    # in two or more terminals: beat-1, beat-2, ...

Every beat campaigns for the group ``MULTILOCK_GROUP``; the leader sends ``tick`` every
half second and the others send nothing. Stop the leader (Ctrl-C): it releases its
lease and another beat leads at once. Kill it (``kill -9``): another leads once the lease
(``MULTILOCK_LEASE`` seconds) has expired. Either way the new leader's first tick comes
one interval after it wins, as it restarts its schedule (``multilock_reset_on_acquire``).
The worker logs which beat sent each tick, so the handoff shows.

Give each beat its own ``--schedule`` file (beat's local record of when each entry last
ran; see the multilock-celery README for what that means at a handoff) and an empty
``--pidfile=`` so that replicas sharing a directory do not refuse to start.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from celery import Celery
from celery.beat import BeatLazyFunc

log = logging.getLogger(__name__)

app = Celery("multilock-sample")
app.conf.update(
    broker_url=os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/1"),
    broker_connection_retry_on_startup=True,
    # What LeaderScheduler reads: the store, the group, and election options.
    multilock_url=os.environ.get("MULTILOCK_URL", "redis://localhost:6379/0"),
    multilock_group=os.environ.get("MULTILOCK_GROUP", "celery-beat-sample"),
    multilock_options={"lease_duration": float(os.environ.get("MULTILOCK_LEASE", "10"))},
)


def beat_identity() -> str:
    """Who is sending: called by beat each time it sends the entry (see BeatLazyFunc)."""
    return f"{socket.gethostname()}:{os.getpid()}"


app.conf.beat_schedule = {
    "tick": {
        "task": "sample.tick",
        "schedule": 0.5,
        # BeatLazyFunc values are evaluated in the beat process at send time, so each
        # message carries the sending replica and the moment it was sent.
        "kwargs": {"sender": BeatLazyFunc(beat_identity), "sent_at": BeatLazyFunc(time.time)},
    },
}


@app.task(name="sample.tick")
def tick(sender: str, sent_at: float) -> None:
    """Runs in the worker: say which beat replica sent this tick, and when."""
    log.info("tick sent by beat %s at %.3f", sender, sent_at)
