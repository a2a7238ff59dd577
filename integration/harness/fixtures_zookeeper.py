"""The ZooKeeper backend of the integration suite: server, probe, container and fixture.

Resolution, as for every backend: ``MULTILOCK_TEST_ZOOKEEPER_URL`` (``zookeeper://h:p``),
else a throwaway local server (apt ``zookeeper``: the jar in ``/usr/share/java`` and
``java`` on PATH), else the ``zookeeper:3.8`` image when Docker answers, else skip (fail
in CI). The server runs with ``tickTime=500`` and session timeouts of 1..60 s, so the
contract runs with a 2 s lease, and with ``forceSync=no`` (no fsync per write, as the
PostgreSQL and etcd servers of the harness).
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from .backends import Backend, register_backend
from .containers import SPECS, ContainerSpec
from .install import zookeeper_classpath
from .resolve import Recipe, serve
from .servers import HOST, PROBES, BaseServer, NotInstalled, Server, ServerError

__all__ = ["zookeeper_server"]

LEASE = 2.0


def probe_zookeeper(url: str, timeout: float = 2.0) -> None:
    """Send ``srvr`` to the first host of *url*; the server is ready once it answers ``Mode:``."""
    parts = urlsplit(url)
    first = parts.netloc.rpartition("@")[2].split(",")[0]
    host, _, port = first.rpartition(":") if ":" in first else (first, "", "2181")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(b"srvr")
        chunks = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    reply = b"".join(chunks).decode(errors="replace")
    if "Mode:" not in reply:
        raise ServerError(f"srvr did not answer Mode: ({reply.strip()[:200]!r})")


class ZooKeeperServer(Server):
    """A standalone ZooKeeper 3.8 (``ZooKeeperServerMain``); its data dir survives restarts."""

    kind = "zookeeper"

    def __init__(self) -> None:
        java = shutil.which("java")
        classpath = zookeeper_classpath()
        if java is None or classpath is None:
            raise NotInstalled("zookeeper is not installed (apt zookeeper: java and the jars)")
        self.java, self.classpath = java, classpath
        super().__init__()

    @property
    def url(self) -> str:
        return f"zookeeper://{HOST}:{self.port}"

    def prepare(self) -> None:
        (self.dir / "data").mkdir()

    def command(self) -> list[str]:
        config = self.dir / "zoo.cfg"
        config.write_text(
            "\n".join(
                [
                    "tickTime=500",
                    f"dataDir={self.dir / 'data'}",
                    f"clientPort={self.port}",
                    f"clientPortAddress={HOST}",
                    "admin.enableServer=false",
                    "4lw.commands.whitelist=ruok,srvr,stat,mntr",
                    "minSessionTimeout=1000",
                    "maxSessionTimeout=60000",
                    # Like PostgreSQL's fsync=off and etcd's --unsafe-no-fsync here: a
                    # write survives kill() (it is in the OS cache), only an OS crash
                    # could lose it, and a throwaway server need not survive that.
                    "forceSync=no",
                    "",
                ]
            )
        )
        return [
            self.java,
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-cp",
            self.classpath,
            "org.apache.zookeeper.server.ZooKeeperServerMain",
            str(config),
        ]

    def probe(self) -> None:
        probe_zookeeper(self.url)


# Register the URL probe and the Docker fallback with the shared harness (no file edits).
PROBES.setdefault("zookeeper", probe_zookeeper)
SPECS.setdefault(
    "zookeeper",
    ContainerSpec(
        image="zookeeper:3.8",
        port=2181,
        url="zookeeper://{host}:{port}",
        env={
            "ZOO_TICK_TIME": "500",
            "ZOO_4LW_COMMANDS_WHITELIST": "ruok,srvr,stat,mntr",
            "ZOO_CFG_EXTRA": "minSessionTimeout=1000 maxSessionTimeout=60000 forceSync=no",
        },
    ),
)


@pytest.fixture(scope="session")
def zookeeper_server() -> Iterator[BaseServer]:
    """A standalone ZooKeeper server (tickTime 500 ms, session timeouts 1..60 s)."""
    recipe = Recipe("zookeeper", "MULTILOCK_TEST_ZOOKEEPER_URL", ZooKeeperServer, "zookeeper")
    for servers in serve(recipe):
        yield servers[0]


def _make(request: Any, tmp_path_factory: Any) -> Backend:
    server: BaseServer = request.getfixturevalue("zookeeper_server")
    return Backend("zookeeper", server.url, (server,), lease=LEASE)


register_backend("zookeeper", "zookeeper", "multilock-zookeeper", _make)
