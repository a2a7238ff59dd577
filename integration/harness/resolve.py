"""Find a server for each backend: a URL from the environment, a local one, a container.

Order, per backend: (1) the ``MULTILOCK_TEST_<BACKEND>_URL`` variable (comma-separated
for several servers): used as given, never restarted or stopped; (2) a throwaway server
from locally installed binaries; (3) a container when a Docker engine answers; (4) none:
`Unavailable` says why, and `skip_or_fail` skips, or fails when ``CI`` is set, because in
CI every backend that can run here must run.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import NoReturn

import attrs
import pytest

from .containers import SPECS, ContainerServer, docker_available
from .servers import BaseServer, ExternalServer, NotInstalled, Server

__all__ = [
    "Recipe",
    "Unavailable",
    "hold",
    "in_ci",
    "require_control",
    "serve",
    "session_servers",
    "skip_or_fail",
    "start_servers",
]

INSTALL_HINT = "python integration/harness/install.py"


class Unavailable(Exception):
    """No server can be had for a backend; the message says why."""


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``CI`` is set to something other than empty, 0 or false."""
    return environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test with *reason*, or fail it in CI, where no backend may silently skip."""
    if in_ci():
        pytest.fail(f"{reason} [CI is set: this backend must run here]", pytrace=False)
    pytest.skip(reason)


def require_control(server: BaseServer | None) -> BaseServer:
    """Skip the test unless *server* can be restarted and stopped here.

    Even in CI: a server named by URL is the user's deliberate choice, not a missing backend.
    """
    if server is None:
        pytest.skip("this backend has no server to restart or stop")
    reason = server.control_unavailable
    if reason is not None:
        pytest.skip(reason)
    return server


@functools.cache
def _docker() -> tuple[bool, str]:
    return docker_available()


@attrs.frozen
class Recipe:
    """How to get the servers of one backend."""

    #: The probe kind: "redis" or "postgres".
    kind: str
    #: The variable that names existing servers, e.g. ``MULTILOCK_TEST_REDIS_URL``.
    env_var: str
    #: Makes one local server; raises `NotInstalled` when the binaries are missing.
    make_local: Callable[[], Server]
    #: The key of `containers.SPECS` for the Docker fallback.
    container: str
    #: How many independent servers (3 for Redlock).
    count: int = 1


def start_servers(
    recipe: Recipe,
    environ: Mapping[str, str] = os.environ,
    docker: Callable[[], tuple[bool, str]] = _docker,
) -> list[BaseServer]:
    """Return *recipe.count* ready servers; the caller closes them. Raise `Unavailable`.

    A server named in the environment that does not answer, or a local server that is
    installed but fails to start, is an error (`ServerError`), not a reason to skip.
    """
    value = environ.get(recipe.env_var, "").strip()
    if value:
        urls = [url.strip() for url in value.split(",") if url.strip()]
        if len(urls) < recipe.count:
            raise Unavailable(
                f"{recipe.env_var} names {len(urls)} server(s); this backend needs {recipe.count}"
            )
        return [ExternalServer(recipe.kind, url, recipe.env_var).start() for url in urls]

    started: list[BaseServer] = []
    try:
        try:
            for _ in range(recipe.count):
                local = recipe.make_local()
                started.append(local)
                local.start()
            return started
        except NotInstalled as exc:
            local_reason = f"{exc} (run {INSTALL_HINT})"
        for server in started:
            server.close()
        started.clear()

        ok, docker_reason = docker()
        if ok:
            for _ in range(recipe.count):
                container = ContainerServer(recipe.kind, SPECS[recipe.container])
                started.append(container)
                container.start()
            return started
    except BaseException:
        for server in started:
            server.close()
        raise
    raise Unavailable(
        f"no {recipe.container} server: {recipe.env_var} is not set, {local_reason}, "
        f"and {docker_reason}"
    )


#: Every server started through `serve` in this test session, for failure reports.
session_servers: list[BaseServer] = []


def serve(recipe: Recipe) -> Iterator[list[BaseServer]]:
    """Start *recipe*'s servers for a session fixture (``for servers in serve(r): yield``).

    Skips (fails in CI) when they cannot be had; stops them when the fixture ends.
    """
    try:
        servers = start_servers(recipe)
    except Unavailable as exc:
        skip_or_fail(str(exc))
    session_servers.extend(servers)
    try:
        yield servers
    finally:
        for server in servers:
            server.close()
            session_servers.remove(server)


def hold(server: BaseServer) -> Iterator[BaseServer]:
    """Yield a started *server* for a session fixture; list it for failure reports, then close.

    ``yield from hold(start_my_server())`` is the whole body of a backend's session fixture.
    """
    session_servers.append(server)
    try:
        yield server
    finally:
        server.close()
        session_servers.remove(server)
