"""The ZooKeeper backend of the integration suite: server, probe, container and fixture.

Resolution, as for every backend: ``MULTILOCK_TEST_ZOOKEEPER_URL`` (``zookeeper://h:p``),
else a throwaway local server (apt ``zookeeper``: the jar in ``/usr/share/java`` and
``java`` on PATH), else the ``zookeeper:3.8`` image when Docker answers, else skip (fail
in CI). The server runs with ``tickTime=500`` and session timeouts of 1..60 s, and with
``forceSync=no`` (no fsync per write, as the PostgreSQL and etcd servers of the harness).

A provider's lease must be at least its session timeout (``session_timeout``, 10 s unless
the URL says): the server's URL asks for 1 s (the benchmarks' lease), the contract's
backend for `LEASE` (2 s).
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import pytest

from .backends import Backend, register_backend
from .containers import SPECS, ContainerSpec
from .install import zookeeper_classpath
from .resolve import Recipe, serve
from .servers import HOST, PROBES, BaseServer, NotInstalled, Server, ServerError

__all__ = ["four_letter_word", "with_session_timeout", "zookeeper_server"]

LEASE = 2.0


def four_letter_word(url: str, word: str, timeout: float = 2.0) -> str:
    """The first host of *url*'s answer to four-letter word *word* (``srvr``, ``cons``...)."""
    parts = urlsplit(url)
    first = parts.netloc.rpartition("@")[2].split(",")[0]
    host, _, port = first.rpartition(":") if ":" in first else (first, "", "2181")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(word.encode())
        chunks = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def probe_zookeeper(url: str, timeout: float = 2.0) -> None:
    """Send ``srvr`` to the first host of *url*; the server is ready once it answers ``Mode:``."""
    reply = four_letter_word(url, "srvr", timeout)
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
        return f"zookeeper://{HOST}:{self.port}?session_timeout=1"

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
                    "4lw.commands.whitelist=ruok,srvr,stat,mntr,cons",
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
        url="zookeeper://{host}:{port}?session_timeout=1",
        env={
            "ZOO_TICK_TIME": "500",
            "ZOO_4LW_COMMANDS_WHITELIST": "ruok,srvr,stat,mntr,cons",
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


def with_session_timeout(url: str, seconds: float) -> str:
    """*url* asking for a ZooKeeper session timeout of *seconds* (the provider's shortest lease)."""
    parts = urlsplit(url)
    query = {**dict(parse_qsl(parts.query)), "session_timeout": f"{seconds:g}"}
    return parts._replace(query=urlencode(query)).geturl()


def _make(request: Any, tmp_path_factory: Any) -> Backend:
    server: BaseServer = request.getfixturevalue("zookeeper_server")
    return Backend("zookeeper", with_session_timeout(server.url, LEASE), (server,), lease=LEASE)


register_backend("zookeeper", "zookeeper", "multilock-zookeeper", _make)
