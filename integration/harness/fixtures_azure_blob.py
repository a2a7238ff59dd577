"""The Azure Blob backend of the integration suite: Azurite, started from npm's install.

Order: ``MULTILOCK_TEST_AZURE_BLOB_URL`` (an ``azureblob://`` URL, used as given); else a
local Azurite (``azurite-blob`` from ``MULTILOCK_AZURITE_DIR``, default
``~/.cache/multilock/azurite``, where ``install.install_azurite`` puts it, or from PATH);
else the Azurite image when a Docker engine answers; else skip (fail in CI).

Azurite runs in memory (``--inMemoryPersistence``): a restart forgets every blob, and so
every token. It listens on a port it picks (``--blobPort 0``), read from its log; a
restart asks for the same port again.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from .backends import Backend, register_backend
from .containers import ContainerServer, ContainerSpec, docker_available
from .install import azurite_binary, azurite_dir
from .resolve import hold, skip_or_fail
from .servers import HOST, PROBES, ExternalServer, NotInstalled, Server, ServerError

__all__ = ["azure_blob_server"]

ENV_URL = "MULTILOCK_TEST_AZURE_BLOB_URL"
ACCOUNT = "devstoreaccount1"
#: Azurite's well-known development key (public, in Azure's documentation).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "multilock-test"
IMAGE = "mcr.microsoft.com/azure-storage/azurite:3.35.0"
_LISTENS = re.compile(r"successfully listens on https?://[^:\s]+:(\d+)")
_FLAGS = ["--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry", "--loose"]


def find_azurite() -> Path | None:
    binary = azurite_binary(azurite_dir())
    if binary.exists():
        return binary
    found = shutil.which("azurite-blob")
    return Path(found) if found else None


def azurite_url(host: str, port: int, container: str = CONTAINER) -> str:
    """The ``azureblob://`` URL of Azurite's development account, key included (public)."""
    return (
        f"azureblob://{ACCOUNT}:{quote(KEY, safe='')}@{host}:{port}/{ACCOUNT}/{container}"
        "?secure=false"
    )


def probe_azure_blob(url: str, timeout: float = 3.0) -> None:
    """One real round trip through the provider: read a blob's lease status."""
    from multilock.core import from_url

    async def probe() -> None:
        provider = from_url(url, timeout=timeout)
        try:
            await provider.get_leader("harness-probe")
        finally:
            await provider.aclose()

    failure: list[BaseException] = []

    def run() -> None:  # in a thread: the caller may be inside a running event loop
        try:
            asyncio.run(probe())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout + 2)
    if thread.is_alive():
        raise ServerError(f"no answer within {timeout + 2:g} s")
    if failure:
        raise failure[0]


PROBES.setdefault("azure_blob", probe_azure_blob)


class AzuriteServer(Server):
    """``azurite-blob`` in memory on 127.0.0.1, on the port it picks at the first start."""

    kind = "azure_blob"

    def __init__(self, binary: Path | None = None) -> None:
        found = binary or find_azurite()
        if found is None:
            raise NotInstalled(f"Azurite is not installed (looked in {azurite_dir()} and PATH)")
        self.binary = found
        self._port: int | None = None  # kept across restarts once known
        super().__init__()

    @property
    def port(self) -> int:
        if self._port is None:
            raise ServerError(f"{self.kind} has not reported its port yet")
        return self._port

    @property
    def url(self) -> str:
        return azurite_url(HOST, self.port)

    def command(self) -> list[str]:
        port = str(self._port or 0)
        return [str(self.binary), "--blobHost", HOST, "--blobPort", port, *_FLAGS]

    def probe(self) -> None:
        if self._port is None:
            text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            found = _LISTENS.findall(text)
            if not found:
                raise ServerError("Azurite has not reported its port yet")
            self._port = int(found[-1])
        probe_azure_blob(self.url)

    def __repr__(self) -> str:
        return f"<AzuriteServer {HOST}:{self._port or '?'} pid={self.pid} dir={self.dir}>"


def _container() -> ContainerServer:
    spec = ContainerSpec(
        image=IMAGE,
        port=10000,
        url=azurite_url("{host}", 0).replace(":0/", ":{port}/"),
        command=["azurite-blob", "--blobHost", "0.0.0.0", "--blobPort", "10000", *_FLAGS],
    )
    return ContainerServer("azure_blob", spec)


@pytest.fixture(scope="session")
def azure_blob_server() -> Iterator[Any]:
    """An Azure Blob endpoint (Azurite, in memory), by the order in the module docstring."""
    from multilock.core import available_schemes

    if "azureblob" not in available_schemes():
        skip_or_fail("no provider for azureblob:// (pip install -e packages/multilock-azure-blob)")
    server: Any
    value = os.environ.get(ENV_URL, "").strip()
    if value:
        server = ExternalServer("azure_blob", value, ENV_URL).start()
    else:
        try:
            server = AzuriteServer().start()
        except NotInstalled as exc:
            ok, why = docker_available()
            if not ok:
                hint = "npm install azurite@3.35.0 (see integration/harness/install.py)"
                skip_or_fail(f"no Azure Blob server: {ENV_URL} is not set, {exc} ({hint}), {why}")
            server = _container().start()
    yield from hold(server)


def _make(request: Any, tmp_path_factory: Any) -> Backend:
    server = request.getfixturevalue("azure_blob_server")
    # Azure leases last 15..60 s: the contract's expiry checks wait 15 s each.
    return Backend("azure_blob", server.url, (server,), lease=15.0)


register_backend("azure_blob", "azureblob", "multilock-azure-blob", _make)
