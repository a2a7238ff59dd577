"""The S3 backend of the integration suite: a moto S3 server in a child process.

Resolution order: ``MULTILOCK_TEST_S3_URL`` (an ``s3://`` or ``s3+http://`` URL naming a
bucket, used as given); else ``python -m moto.server`` from this interpreter when moto
(with flask and flask-cors) is installed; else the ``motoserver/moto`` image when a Docker
engine answers; else skip (fail in CI). moto keeps everything in memory, so a restart
loses every object: no server-restart test runs on it. The URL sets ``poll_interval=0.2``
so that polling followers see a graceful hand-off within the fault suite's bound.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from .backends import Backend, register_backend
from .containers import ContainerServer, ContainerSpec, docker_available
from .resolve import INSTALL_HINT, hold, skip_or_fail
from .servers import HOST, PROBES, BaseServer, ExternalServer, NotInstalled, Server, ServerError

__all__ = ["S3Server", "probe_s3", "s3_server"]

ENV_VAR = "MULTILOCK_TEST_S3_URL"
BUCKET = "multilock-test"
#: Read from the URL by `S3Provider.from_url`: moto accepts any credentials.
QUERY = "create_bucket=true&poll_interval=0.2&timeout=5"
_IMAGE = ContainerSpec(
    image="motoserver/moto:5.0.28",
    port=5000,
    url=f"s3+http://testing:testing@{{host}}:{{port}}/{BUCKET}?{QUERY}",
)


def probe_s3(url: str, timeout: float = 2.0) -> None:
    """One unsigned round trip to the S3 endpoint of *url*: any HTTP answer will do."""
    import urllib3

    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "s3" else "http"
    http = urllib3.PoolManager(timeout=timeout, retries=False)
    try:
        response = http.request("GET", f"{scheme}://{parts.hostname}:{parts.port or 443}/")
    finally:
        http.clear()
    if response.status >= 500:
        raise ServerError(f"the S3 endpoint answered HTTP {response.status}")


PROBES.setdefault("s3", probe_s3)


class S3Server(Server):
    """``python -m moto.server`` on 127.0.0.1: an in-memory S3 with conditional writes."""

    kind = "s3"

    def __init__(self) -> None:
        for module in ("moto", "flask", "flask_cors"):
            if importlib.util.find_spec(module) is None:
                raise NotInstalled(f"{module} is not installed (pip install 'moto[s3]' flask-cors)")
        super().__init__()

    @property
    def url(self) -> str:
        return f"s3+http://testing:testing@{HOST}:{self.port}/{BUCKET}?{QUERY}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]

    def probe(self) -> None:
        probe_s3(self.url, timeout=1.0)


def _start() -> BaseServer:
    value = os.environ.get(ENV_VAR, "").strip()
    if value:
        return ExternalServer("s3", value, ENV_VAR).start()
    try:
        local = S3Server()
    except NotInstalled as exc:
        ok, docker_reason = docker_available()
        if not ok:
            reason = f"no s3 server: {ENV_VAR} is not set, {exc} (run {INSTALL_HINT})"
            skip_or_fail(f"{reason}, and {docker_reason}")
        container = ContainerServer("s3", _IMAGE)
        try:
            return container.start()
        except BaseException:
            container.close()
            raise
    try:
        return local.start()
    except BaseException:
        local.close()
        raise


@pytest.fixture(scope="session")
def s3_server() -> Iterator[BaseServer]:
    """An S3 endpoint with a bucket the providers create on first use."""
    yield from hold(_start())


def _make(request: Any, tmp_path_factory: Any) -> Backend:
    server: BaseServer = request.getfixturevalue("s3_server")
    # A prefix per test keeps objects of different tests apart on a shared bucket.
    url = server.url
    parts = urlsplit(url)
    path = f"{parts.path.rstrip('/')}/t-{uuid.uuid4().hex[:8]}/"
    return Backend("s3", parts._replace(path=path).geturl(), (server,))


register_backend("s3", "s3+http", "multilock-s3", _make)
