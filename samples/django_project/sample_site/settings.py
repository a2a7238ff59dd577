"""Settings of the sample project: only what multilock needs, nothing else."""

import os

SECRET_KEY = "sample-only-not-a-secret"  # a sample: never use a fixed key for real
DEBUG = False
USE_TZ = True
INSTALLED_APPS = [
    "multilock.django",  # adds the leader_run command and a check of MULTILOCK
    "reports",  # the app with the nightly_report command
]
DATABASES: dict[str, dict[str, str]] = {}  # the sample writes nowhere

MULTILOCK = {
    # Every replica must use the same store. memory:// lives in one process only, so it
    # is good for trying the commands, not for electing between processes.
    "URL": os.environ.get("MULTILOCK_URL", "memory://"),
    # Keeps this project's groups apart from other projects using the same store.
    "GROUP_PREFIX": "sample-site.",
    # ElectionOptions fields; `leader_run --lease-duration` overrides the lease.
    "OPTIONS": {"lease_duration": 15},
}
