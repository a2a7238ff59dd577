"""The etcd backend: a throwaway single-member etcd with fast raft timings.

Order: ``MULTILOCK_TEST_ETCD_URL`` (``etcd://host:port[?min_lease=N]``), else a local
``etcd`` binary (Debian: ``etcd-server``), else a container when Docker answers, else skip
(fail in CI). The local server keeps its data dir across restarts, as a real one does.
With ``--election-timeout 100`` etcd's minimum lease TTL is 1 s, hence ``min_lease=1``.
"""

from __future__ import annotations

import functools
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from .backends import Backend, register_backend
from .containers import ContainerServer, ContainerSpec, docker_available
from .install import etcd_binary
from .resolve import hold, skip_or_fail
from .servers import HOST, BaseServer, ExternalServer, NotInstalled, Server, ServerError

__all__ = ["etcd_server"]

ENV_VAR = "MULTILOCK_TEST_ETCD_URL"
FAST_RAFT = ["--heartbeat-interval", "10", "--election-timeout", "100"]


def probe_etcd(url: str, timeout: float = 2.0) -> None:
    """``GET /health`` on the client port must answer ``{"health": "true"}``."""
    parts = urlsplit(url)
    with urllib.request.urlopen(
        f"http://{parts.hostname}:{parts.port or 2379}/health", timeout=timeout
    ) as reply:
        body = json.loads(reply.read())
    if body.get("health") != "true":
        raise ServerError(f"etcd is not healthy: {body}")


class EtcdServer(Server):
    """``etcd`` from the local binary, one member, data in ``self.dir/data``."""

    kind = "etcd"

    def __init__(self, binary: Path | str | None = None) -> None:
        found = binary or etcd_binary()
        if found is None:
            raise NotInstalled("etcd is not installed (Debian: etcd-server)")
        self.binary = Path(found)
        super().__init__()

    @property
    def url(self) -> str:
        return f"etcd://{HOST}:{self.port}?min_lease=1"

    def command(self) -> list[str]:
        client = f"http://{HOST}:{self.port}"
        peer = f"http://{HOST}:{self.port_for('peer')}"
        return [
            str(self.binary),
            *("--name", "t", "--data-dir", str(self.dir / "data")),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"t={peer}", "--initial-cluster-state", "new"),
            "--unsafe-no-fsync",
            *FAST_RAFT,
        ]

    def probe(self) -> None:
        probe_etcd(self.url, timeout=1.0)


class ExternalEtcd(ExternalServer):
    def probe(self) -> None:
        probe_etcd(self._url)


class EtcdContainer(ContainerServer):
    def probe(self) -> None:
        probe_etcd(self.url)


CONTAINER = ContainerSpec(
    image="gcr.io/etcd-development/etcd:v3.5.17",
    port=2379,
    url="etcd://{host}:{port}?min_lease=1",
    command=[
        "etcd",
        *("--listen-client-urls", "http://0.0.0.0:2379"),
        *("--advertise-client-urls", "http://127.0.0.1:2379"),
        "--unsafe-no-fsync",
        *FAST_RAFT,
    ],
)


@functools.cache
def _docker() -> tuple[bool, str]:
    return docker_available()


def _start() -> BaseServer:
    url = os.environ.get(ENV_VAR, "").strip()
    if url:
        return ExternalEtcd("etcd", url, ENV_VAR).start()
    try:
        local = EtcdServer()
    except NotInstalled as exc:
        reason = str(exc)
    else:
        try:
            return local.start()
        except BaseException:
            local.close()
            raise
    ok, docker_reason = _docker()
    if not ok:
        skip_or_fail(f"no etcd server: {ENV_VAR} is not set, {reason}, and {docker_reason}")
    container = EtcdContainer("etcd", CONTAINER)
    try:
        return container.start()
    except BaseException:
        container.close()
        raise


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[BaseServer]:
    """A single-member etcd (fast raft flags, min lease 1 s) that keeps data on restart."""
    yield from hold(_start())


def _make(request: Any, tmp_path_factory: Any) -> Backend:
    server: BaseServer = request.getfixturevalue("etcd_server")
    return Backend("etcd", server.url, (server,), lease=1.0)


register_backend("etcd", "etcd", "multilock-etcd", _make)
