"""The integration suite's test servers: start, probe, restart and stop real backends.

`servers` runs them from local binaries, `containers` through testcontainers, `resolve`
picks one of those or a URL from the environment, `backends` names the providers under
test, and ``install.py`` installs the binaries (run it as a script).
"""

from .backends import BACKENDS, Backend, missing_provider, redlock_url
from .resolve import Recipe, Unavailable, in_ci, require_control, skip_or_fail, start_servers
from .servers import (
    BaseServer,
    ControlUnavailable,
    ExternalServer,
    NotInstalled,
    PostgresServer,
    RedisServer,
    Server,
    ServerError,
    free_port,
    log_sections,
    running_servers,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "BaseServer",
    "ControlUnavailable",
    "ExternalServer",
    "NotInstalled",
    "PostgresServer",
    "Recipe",
    "RedisServer",
    "Server",
    "ServerError",
    "Unavailable",
    "free_port",
    "in_ci",
    "log_sections",
    "missing_provider",
    "redlock_url",
    "require_control",
    "running_servers",
    "skip_or_fail",
    "start_servers",
]
