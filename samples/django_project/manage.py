#!/usr/bin/env python
"""A minimal Django project whose nightly report runs on one replica at a time.

Run it on every replica (here: two terminals, one Redis)::

    export MULTILOCK_URL=redis://localhost:6379/0
    python samples/django_project/manage.py leader_run nightly --every 5 -- nightly_report

The replica that leads the group ``nightly`` runs ``nightly_report`` every 5 s; the
other waits. Stop the leader with Ctrl-C (or SIGTERM): it releases the group and the
other takes over at once. Kill it with SIGKILL: the other takes over when the lease
(15 s by default) expires.
"""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sample_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
