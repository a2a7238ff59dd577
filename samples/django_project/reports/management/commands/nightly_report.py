"""``manage.py nightly_report``: fake report work meant to run under ``leader_run``.

It prints one line every 0.1 s for ``--seconds`` seconds. A management command cannot be
stopped from outside, so it looks at its term itself: ``check()`` raises
`LeadershipLost` once the term is over (``leader_run`` treats that as "the term ended"),
and it waits on ``lost`` instead of sleeping, so it notices at once.
"""

import os
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from multilock.django import current_leadership


class Command(BaseCommand):
    help = "Print report ticks for a while; run it with leader_run."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--seconds", type=float, default=1.0, help="how long (default 1)")

    def handle(self, *args: Any, **options: Any) -> None:
        leadership = current_leadership()
        if leadership is None:
            raise CommandError("run me with: manage.py leader_run GROUP -- nightly_report")
        end = time.monotonic() + options["seconds"]
        while time.monotonic() < end:
            leadership.check()  # raises LeadershipLost once the term is over
            # A real report would pass leadership.token along with what it writes.
            print(f"report tick {os.getpid()} token={leadership.token}", flush=True)
            leadership.lost.wait(0.1)  # sleeps, but wakes at once if the term ends
