"""`Backend`: one provider under test, as a URL any process can pass to `from_url`."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import attrs

from multilock.core import Provider, available_schemes, from_url, redact_url

from .servers import BaseServer

__all__ = [
    "BACKENDS",
    "PLUGINS",
    "SCHEMES",
    "Backend",
    "BackendPlugin",
    "load_backend_plugins",
    "missing_provider",
    "redlock_url",
    "register_backend",
]

#: The backends every provider-level integration test runs against.
BACKENDS = ["memory", "filesystem", "redis", "redlock", "postgres"]

#: The URL scheme of each backend, and the distribution that provides it.
SCHEMES: dict[str, tuple[str, str]] = {
    "memory": ("memory", "multilock-core"),
    "filesystem": ("file", "multilock-filesystem"),
    "redis": ("redis", "multilock-redis"),
    "redlock": ("redlock", "multilock-redis"),
    "postgres": ("postgresql", "multilock-postgres"),
}


def missing_provider(name: str) -> str | None:
    """Why backend *name*'s provider cannot be built here, or None when it can."""
    scheme, distribution = SCHEMES[name]
    if scheme in available_schemes():
        return None
    return (
        f"{name}: no provider for {scheme}:// is installed (pip install -e packages/{distribution})"
    )


def redlock_url(servers: Sequence[BaseServer]) -> str:
    """``redlock://[user:pass@]h1:p1,h2:p2,h3:p3/DB`` from the first server's URL and the rest."""
    first = urlsplit(servers[0].url)
    userinfo = first.netloc.rpartition("@")[0]
    hosts = ",".join(f"{server.host}:{server.port}" for server in servers)
    netloc = f"{userinfo}@{hosts}" if userinfo else hosts
    return f"redlock://{netloc}{first.path or '/0'}"


@attrs.frozen
class Backend:
    """A provider under test: *url* builds it, *servers* hold its data (none in-process)."""

    name: str
    url: str
    servers: tuple[BaseServer, ...] = ()
    #: The short lease the expiry checks use, in seconds.
    lease: float = 1.0
    #: False when the URL only works inside this process (``memory://``).
    multiprocess: bool = True

    @property
    def server(self) -> BaseServer | None:
        """The server to restart or stop (for Redlock: one of its nodes), or None."""
        return self.servers[0] if self.servers else None

    def make_provider(self, **kwargs: Any) -> Provider:
        """A new provider for this backend: ``from_url(self.url, **kwargs)``."""
        return from_url(self.url, **kwargs)

    def __repr__(self) -> str:
        return f"<Backend {self.name} {redact_url(self.url)}>"


#: make(request, tmp_path_factory) -> Backend, called by the ``backend`` fixture.
BackendFactory = Callable[[Any, Any], Backend]


@attrs.frozen
class BackendPlugin:
    """A backend added by a ``harness/fixtures_<name>.py`` module."""

    name: str
    scheme: str
    distribution: str
    make: BackendFactory


PLUGINS: dict[str, BackendPlugin] = {}


def register_backend(name: str, scheme: str, distribution: str, make: BackendFactory) -> None:
    """Add a backend to the ``backend`` fixture (call it from a ``fixtures_*`` module)."""
    PLUGINS[name] = BackendPlugin(name, scheme, distribution, make)
    SCHEMES[name] = (scheme, distribution)
    if name not in BACKENDS:
        BACKENDS.append(name)


def load_backend_plugins() -> list[ModuleType]:
    """Import every ``harness.fixtures_*`` module; each registers its backend and fixtures.

    A module lists its pytest fixtures in ``__all__``; conftest.py re-exports them, so
    adding a backend to the suite touches no shared file.
    """
    package = importlib.import_module("harness")
    return [
        importlib.import_module(f"harness.{info.name}")
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name)
        if info.name.startswith("fixtures_")
    ]
