"""`Session`: the plumbing under `ZooKeeperProvider`.

One kazoo client (started here on first use, or the caller's), the session it holds, calls
run in worker threads and bounded by ``operation_timeout``, the children watch, and the
timers that delete a candidate node its participant stopped refreshing. A node that
cannot be deleted now (connection suspended) is retried every 0.5 s while its session
lasts; once the session is gone, ZooKeeper has deleted the node itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import KazooException, NoNodeError  # type: ignore[import-untyped]
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]

from multilock.core import ProviderError

from ._config import Settings, merge
from ._nodes import Node, make_client

__all__ = ["FAILURES", "Session"]

log = logging.getLogger(__name__)
T = TypeVar("T")
#: What a kazoo call may raise besides a definite answer (NoNodeError & co. are handled).
FAILURES = (KazooException, KazooTimeoutError, OSError, json.JSONDecodeError, KeyError)
_DEFAULT_SESSION = 10.0
_RETRY_DELETE = 0.5


def _later(delay: float, fn: Callable[..., None], *args: Any) -> threading.Timer:
    timer = threading.Timer(delay, fn, args)
    timer.daemon = True
    timer.start()
    return timer


class Session:
    """The client, session and node bookkeeping of one provider."""

    def __init__(
        self, hosts: str | KazooClient, /, *, auth: str | None = None, **options: Any
    ) -> None:
        self._settings: Settings = merge({}, options)
        self._auth = auth
        self._own = isinstance(hosts, str)
        self._hosts = hosts if isinstance(hosts, str) else None
        self._client: KazooClient | None = None if isinstance(hosts, str) else hosts
        self._shown = "zookeeper://" + (hosts.split("@")[-1] if isinstance(hosts, str) else "")
        self._lock = threading.RLock()
        self._nodes: dict[tuple[str, str], Node] = {}
        self._session: int | None = None
        self._lease_hint: float | None = None
        self._closed = False

    @property
    def client(self) -> KazooClient | None:
        """The kazoo client in use (None until the first call connects)."""
        return self._client

    def _error(self, op: str, exc: BaseException) -> ProviderError:
        detail = str(exc).strip() or type(exc).__name__
        if self._auth:
            detail = detail.replace(self._auth, "***")
        return ProviderError(f"zookeeper {op} failed on {self._shown}: {detail}")

    async def _run(self, op: str, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(fn)
        except FAILURES as exc:
            raise self._error(op, exc) from exc

    def _wait(self, result: Any) -> Any:
        return result.get(timeout=self._settings.operation_timeout)

    def _connect(self, lease: float | None) -> KazooClient:
        """The started client; start ours on first use with the session timeout chosen."""
        with self._lock:
            if self._closed:
                raise ProviderError(f"{self!r} is closed")
            if self._client is None:
                assert self._hosts is not None
                timeout = self._settings.session_timeout or self._lease_hint or lease
                timeout = timeout or _DEFAULT_SESSION
                client = make_client(self._hosts, timeout, self._auth)
                client.start(timeout=self._settings.connect_timeout)
                self._client = client
            client = self._client
        sid = client._session_id  # kept while reconnecting (client_id is None then)
        with self._lock:
            if sid is not None and sid != self._session:  # a new session: old nodes are gone
                for node in self._nodes.values():
                    if node.timer is not None:
                        node.timer.cancel()
                self._nodes.clear()
                self._session = sid
        return client

    def _path(self, group: str, name: str | None = None) -> str:
        base = f"{self._settings.root}/{group}"
        return base if name is None else f"{base}/{name}"

    def _children(self, client: KazooClient, group: str) -> list[str]:
        try:
            children: list[str] = self._wait(client.get_children_async(self._path(group)))
        except NoNodeError:
            return []
        return children

    def _arm(self, key: tuple[str, str], node: Node, lease: float) -> None:
        """(Re)start the timer that deletes *node* unless refreshed within *lease*."""
        with self._lock:
            node.deadline = time.monotonic() + lease
            if node.timer is not None:
                node.timer.cancel()
            node.timer = _later(lease, self._expire, key, node)

    def _expire(self, key: tuple[str, str], node: Node) -> None:
        with self._lock:
            if self._nodes.get(key) is not node or time.monotonic() < node.deadline:
                return  # refreshed or released meanwhile
            del self._nodes[key]
        self._delete(node, retry=True)

    def _delete(self, node: Node, *, retry: bool) -> None:
        """Delete *node*; on failure (retry=True) try again shortly while the session lasts.

        A node whose create was left in doubt (no name known) is looked up by its prefix.
        """
        client = self._client
        if client is None:
            return
        try:
            names = [node.name] if node.name is not None else []
            if not names:
                names = [c for c in self._children(client, node.group) if c.startswith(node.prefix)]
            for name in names:
                with contextlib.suppress(NoNodeError):
                    self._wait(client.delete_async(self._path(node.group, name)))
        except FAILURES as exc:
            log.debug("zookeeper delete of %s/%s failed: %r", node.group, node.name, exc)
            with self._lock:
                again = retry and not self._closed and client._session_id == node.session
            if not again:
                raise
            _later(_RETRY_DELETE, self._delete_quietly, node)

    def _delete_quietly(self, node: Node) -> None:
        with contextlib.suppress(*FAILURES):
            self._delete(node, retry=True)

    def _forget(self, key: tuple[str, str], node: Node, *, now: bool = True) -> None:
        """Drop *node* from this provider and delete it (now, or in the background)."""
        with self._lock:
            if self._nodes.get(key) is node:
                del self._nodes[key]
            if node.timer is not None:
                node.timer.cancel()
        if now:
            self._delete(node, retry=True)
        else:
            _later(0, self._delete_quietly, node)

    async def _watch(self, group: str) -> AsyncIterator[None]:
        """Yield on every change of the group's children and every connection state change."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake(*_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: being torn down
                loop.call_soon_threadsafe(event.set)

        client = await self._run("watch", lambda: self._connect(None))
        client.add_listener(wake)
        path = self._path(group)

        def arm() -> None:
            self._wait(client.ensure_path_async(path))
            self._wait(client.get_children_async(path, watch=wake))

        try:
            while True:
                await self._run("watch", arm)
                await event.wait()
                event.clear()
                yield None
        finally:
            client.remove_listener(wake)
