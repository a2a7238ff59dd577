"""The Docker fallback: the same servers as `servers`, run by testcontainers.

Used only when a backend's binaries are missing here and a Docker engine answers. The
host port is picked here and bound explicitly, so ``restart()`` (``docker restart``) keeps
it, like the local servers do.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any, Self

import attrs

from .servers import PROBES, START_TIMEOUT, BaseServer, ServerError, free_port

__all__ = ["SPECS", "ContainerServer", "ContainerSpec", "docker_available"]

_PING = """
from testcontainers.core.docker_client import DockerClient
DockerClient(timeout=3).client.ping()
"""


def docker_available(timeout: float = 5.0) -> tuple[bool, str]:
    """Whether a Docker engine answers, and if not why, checked in a child process.

    A child keeps docker-py's warnings and half-open sockets out of the test process.
    """
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PING],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return False, f"no Docker engine answered within {timeout:.0f} s"
    if done.returncode == 0:
        return True, "a Docker engine answers"
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return False, f"no Docker engine answers ({lines[-1] if lines else 'unknown error'})"


@attrs.frozen
class ContainerSpec:
    """How to run one backend in a container and how to reach it."""

    image: str
    port: int
    url: str  # with {host} and {port}
    command: list[str] | None = None
    env: dict[str, str] = attrs.field(factory=dict)


SPECS: dict[str, ContainerSpec] = {
    "redis": ContainerSpec(
        image="redis:7",
        port=6379,
        url="redis://{host}:{port}/0",
        command=["redis-server", "--save", "", "--appendonly", "no"],
    ),
    "redis-persistent": ContainerSpec(
        image="redis:7",
        port=6379,
        url="redis://{host}:{port}/0",
        command=["redis-server", "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
    ),
    "postgres": ContainerSpec(
        image="postgres:15",
        port=5432,
        url="postgresql://postgres@{host}:{port}/postgres",
        command=[
            "postgres",
            "-c",
            "fsync=off",
            "-c",
            "-c",
            "full_page_writes=off",
            "-c",
            "max_connections=200",
        ],
        env={"POSTGRES_HOST_AUTH_METHOD": "trust"},
    ),
}


class ContainerServer(BaseServer):
    """One container running *spec*; ``kind`` names the probe ("redis", "postgres")."""

    def __init__(self, kind: str, spec: ContainerSpec) -> None:
        self.kind = kind
        self.spec = spec
        self._host_port = free_port()
        self._host = "127.0.0.1"
        self._container: Any = None

    @property
    def url(self) -> str:
        return self.spec.url.format(host=self._host, port=self._host_port)

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._host_port

    def probe(self) -> None:
        PROBES[self.kind](self.url)

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        """Create and start the container (or start it again after ``stop()``)."""
        if self._container is None:
            from testcontainers.core.container import DockerContainer

            container = DockerContainer(self.spec.image).with_bind_ports(
                self.spec.port, self._host_port
            )
            if self.spec.command:
                container = container.with_command(self.spec.command)
            for key, value in self.spec.env.items():
                container = container.with_env(key, value)
            self._container = container.start()
            self._host = self._container.get_container_host_ip()
        else:
            self._container.get_wrapped_container().start()
        self.wait_ready(time.monotonic() + timeout)
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """``docker stop``: the image's stop signal, then SIGKILL after *timeout*."""
        if self._container is None:
            return None
        wrapped = self._container.get_wrapped_container()
        wrapped.stop(timeout=round(timeout))
        wrapped.reload()
        status: int = wrapped.attrs["State"]["ExitCode"]
        return status

    def restart(self, timeout: float = START_TIMEOUT) -> None:
        if self._container is None:
            raise ServerError(f"{self!r} is not started")
        self.stop()
        self.start(timeout)

    def log_tail(self, lines: int = 40) -> str:
        if self._container is None:
            return "(container not started)"
        try:
            out, err = self._container.get_logs()
        except Exception as exc:
            return f"(cannot read the container's logs: {exc})"
        text = (out + err).decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Remove the container."""
        if self._container is not None:
            container, self._container = self._container, None
            container.stop()

    def __repr__(self) -> str:
        return f"<ContainerServer {self.kind} {self.spec.image} {self._host}:{self._host_port}>"
