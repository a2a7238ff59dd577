"""The servers a benchmark run measures on: started from the integration harness, stopped by PID.

``run.py`` puts ``integration/`` on ``sys.path`` before importing this module.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import TypeVar

from common import ALL_BACKENDS, AZURE_POLL, FILE_POLL

from harness.backends import redlock_url
from harness.fixtures_azure_blob import AzuriteServer
from harness.fixtures_etcd import EtcdServer
from harness.fixtures_s3 import S3Server
from harness.fixtures_zookeeper import ZooKeeperServer
from harness.servers import PostgresServer, RedisServer, Server

S = TypeVar("S", bound=Server)


class ManyConnectionsPostgres(PostgresServer):
    """The harness's PostgreSQL, with a ceiling on connections that a run may raise."""

    def __init__(self, max_connections: int) -> None:
        super().__init__()
        self.max_connections = max_connections

    def command(self) -> list[str]:
        return [*super().command(), "-c", f"max_connections={self.max_connections}"]


class Backends:
    """Starts the servers the chosen backends need; `close()` stops each by its PID."""

    def __init__(self, names: list[str], max_connections: int = 200) -> None:
        self.names, self.max_connections = names, max_connections
        self.servers: list[Server] = []
        self.redis: RedisServer | None = None
        self.postgres: PostgresServer | None = None
        self.urls: dict[str, str] = {}
        self._tmp: str | None = None

    def start(self) -> None:
        for name in self.names:
            if name == "memory":
                self.urls[name] = "memory://bench"
            elif name == "filesystem":
                self._tmp = tempfile.mkdtemp(prefix="multilock-bench-fs-")
                self.urls[name] = f"file://{self._tmp}?poll_interval={FILE_POLL}"
            elif name == "redis":
                self.redis = self._add(RedisServer())
                self.urls[name] = self.redis.url
            elif name == "redlock":
                nodes = [self._add(RedisServer()) for _ in range(3)]
                self.urls[name] = redlock_url(nodes)
            elif name == "postgres":
                self.postgres = self._add(ManyConnectionsPostgres(self.max_connections))
                self.urls[name] = self.postgres.url
            elif name == "etcd":
                self.urls[name] = self._add(EtcdServer()).url  # ?min_lease=1
            elif name == "s3":
                self.urls[name] = self._add(S3Server()).url  # poll_interval=0.2
            elif name == "azure_blob":
                url = self._add(AzuriteServer()).url
                self.urls[name] = f"{url}&poll_interval={AZURE_POLL:g}"
            elif name == "zookeeper":
                self.urls[name] = self._add(ZooKeeperServer()).url
            else:
                raise SystemExit(f"unknown backend {name!r}; known: {', '.join(ALL_BACKENDS)}")

    def ensure_postgres_ceiling(self, max_connections: int) -> None:
        """Restart PostgreSQL (same port, same data) to admit *max_connections* if it does not.

        Only a provider with a connection per watch needs this (see `scale.LEGACY`).
        """
        server = self.postgres
        if not isinstance(server, ManyConnectionsPostgres):
            return
        if server.max_connections >= max_connections:
            return
        server.max_connections = max_connections
        server.restart()

    def _add(self, server: S) -> S:
        self.servers.append(server)
        server.start()
        return server

    def close(self) -> None:
        for server in reversed(self.servers):
            with contextlib.suppress(Exception):
                server.close()  # signals only the PID it started
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
