"""Consul for the integration suite: a server named by URL, or a container, or a skip.

No Consul server can run on the project's machines (none in Debian, PyPI or npm), so,
unlike the other backends, there is no local-binary step and a missing server skips even
in CI: ``MULTILOCK_TEST_CONSUL_URL`` (e.g. ``consul://127.0.0.1:18500`` with the
docker-compose service), else a ``hashicorp/consul`` container when Docker answers, else
``pytest.skip``. The container runs a single *server* agent with its data dir inside the
container (not ``-dev``, which keeps nothing): ``restart()`` keeps the Raft log, so tokens
(ModifyIndex values) keep rising across a server restart, as they do in production.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import Any

import pytest

from .backends import Backend, register_backend
from .containers import ContainerServer, ContainerSpec, docker_available
from .resolve import hold
from .servers import START_TIMEOUT, BaseServer, ExternalServer

__all__ = ["consul_server"]

ENV_VAR = "MULTILOCK_TEST_CONSUL_URL"
SKIP_REASON = (
    "no Consul server can run on this machine: set MULTILOCK_TEST_CONSUL_URL or start Docker"
)
#: Consul's shortest session TTL, so the shortest lease the Consul provider accepts.
LEASE = 10.0

SPEC = ContainerSpec(
    image="hashicorp/consul:1.20",
    port=8500,
    url="consul://{host}:{port}",
    # The image's entrypoint adds -data-dir=/consul/data and -config-dir to "agent".
    command=[
        "agent",
        "-server",
        "-bootstrap-expect=1",
        "-bind=127.0.0.1",
        "-client=0.0.0.0",
        "-log-level=warn",
        "-hcl=performance { raft_multiplier = 1 }",
    ],
)


def probe_consul(url: str, timeout: float = 2.0) -> None:
    """Ready means a leader is elected and a session can be made: create and destroy one."""
    import consul  # type: ignore[import-untyped]

    from multilock.consul._config import Settings, parse_address

    settings = Settings(**{**parse_address(url), "timeout": timeout})
    client: Any = settings.client()
    try:
        if not client.status.leader():
            raise RuntimeError("no Consul leader elected yet")
        session = client.session.create(ttl=10, lock_delay=0, behavior="delete")
        client.session.destroy(session)
    except consul.ConsulException as exc:
        raise RuntimeError(f"Consul is not ready: {exc}") from exc
    finally:
        client.http.session.close()


class ConsulExternalServer(ExternalServer):
    """The server named by ``MULTILOCK_TEST_CONSUL_URL``: never restarted or stopped."""

    def probe(self) -> None:
        probe_consul(self.url)


class ConsulContainerServer(ContainerServer):
    """A ``hashicorp/consul`` container, probed with a real session round trip."""

    def __init__(self) -> None:
        super().__init__("consul", SPEC)

    def probe(self) -> None:
        probe_consul(self.url)


@functools.cache
def _docker() -> tuple[bool, str]:
    return docker_available()


def _start() -> BaseServer:
    url = os.environ.get(ENV_VAR, "").strip()
    if url:
        return ConsulExternalServer("consul", url, ENV_VAR).start(timeout=30.0)
    ok, _ = _docker()
    if not ok:
        pytest.skip(SKIP_REASON)
    server = ConsulContainerServer()
    try:
        # A fresh server elects itself and registers its node before sessions work.
        server.start(timeout=START_TIMEOUT + 30.0)
    except BaseException:
        server.close()
        raise
    return server


@pytest.fixture(scope="session")
def consul_server() -> Iterator[BaseServer]:
    """A Consul server agent; skips (also in CI) when none can be had here."""
    yield from hold(_start())


def _make(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    server: BaseServer = request.getfixturevalue("consul_server")
    return Backend("consul", server.url, (server,), lease=LEASE)


register_backend("consul", "consul", "multilock-consul", _make)
