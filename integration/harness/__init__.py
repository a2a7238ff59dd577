"""The integration suite's test servers: start, probe, restart and stop real backends.

`servers` runs them from local binaries, `containers` through testcontainers, `resolve`
picks one of those or a URL from the environment, `backends` names the providers under
test, and ``install.py`` installs the binaries (run it as a script).
"""

from .backends import (
    BACKENDS,
    PLUGINS,
    Backend,
    load_backend_plugins,
    missing_provider,
    redlock_url,
    register_backend,
)
from .resolve import (
    Recipe,
    Unavailable,
    hold,
    in_ci,
    require_control,
    serve,
    session_servers,
    skip_or_fail,
    start_servers,
)
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
    "PLUGINS",
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
    "hold",
    "in_ci",
    "load_backend_plugins",
    "log_sections",
    "missing_provider",
    "redlock_url",
    "register_backend",
    "require_control",
    "running_servers",
    "serve",
    "session_servers",
    "skip_or_fail",
    "start_servers",
]
