"""`Session`: the plumbing under `ZooKeeperProvider`.

One kazoo client (started here on first use, or the caller's) and the session it holds.
Calls go through kazoo's asynchronous API straight from the event loop: a request is
queued on kazoo's connection at once (so calls sent back to back are pipelined, and
ZooKeeper answers them in order), and its reply settles an asyncio future through
``loop.call_soon_threadsafe``; every call is bounded by ``operation_timeout``. Only the
first connect, which blocks, runs in a worker thread.

Candidate nodes that their participant stopped refreshing are deleted by one reaper
thread per provider (it does not depend on the event loop running). A node that cannot be
deleted now (connection suspended) is retried every 0.5 s while its session lasts; once
the session is gone, ZooKeeper has deleted the node itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kazoo.client import KazooClient  # type: ignore[import-untyped]
from kazoo.exceptions import KazooException, NoNodeError  # type: ignore[import-untyped]
from kazoo.handlers.threading import KazooTimeoutError  # type: ignore[import-untyped]

from multilock.core import ProviderError

from ._config import Settings, merge
from ._nodes import Node, make_client

__all__ = ["FAILURES", "Session"]

log = logging.getLogger(__name__)
#: What a kazoo call may raise besides a definite answer (NoNodeError & co. are handled).
#: TimeoutError (an OSError) is also what a call that outlives operation_timeout raises.
FAILURES = (KazooException, KazooTimeoutError, OSError, json.JSONDecodeError, KeyError)
_DEFAULT_SESSION = 10.0
_RETRY_DELETE = 0.5


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark an unawaited failure as seen (a pipelined reply nobody needs after an error)."""
    if not future.cancelled():
        future.exception()


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
        self._reaped = threading.Condition(self._lock)
        self._reaper: threading.Thread | None = None
        self._reap_at = float("inf")
        #: The shortest lease armed: the reaper looks at least that often, so that a new
        #: node (due a lease from now) seldom needs to wake it.
        self._shortest = 60.0
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

    @contextlib.contextmanager
    def _failures(self, op: str) -> Iterator[None]:
        """Turn what kazoo raises into `ProviderError` (the driver's error as ``__cause__``)."""
        try:
            yield
        except FAILURES as exc:
            raise self._error(op, exc) from exc

    def _future(self, result: Any) -> asyncio.Future[Any]:
        """An asyncio future for a kazoo ``IAsyncResult``, settled from kazoo's thread.

        Made as soon as the request is sent, so that requests sent back to back each settle
        as their reply arrives; one already answered settles at once, with no thread hop.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        future.add_done_callback(_retrieved)

        def settle(done: Any) -> None:
            if future.done():
                return
            if done.successful():
                future.set_result(done.value)
            else:
                future.set_exception(done.exception)

        def on_done(done: Any) -> None:  # in a kazoo thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, done)

        if result.ready():
            settle(result)
        else:
            result.rawlink(on_done)
        return future

    async def _call(self, result: Any) -> Any:
        """The answer to a kazoo request (a result or its `_future`), within the timeout."""
        future = result if isinstance(result, asyncio.Future) else self._future(result)
        async with asyncio.timeout(self._settings.operation_timeout):
            return await future

    async def _client_for(self, lease: float | None) -> KazooClient:
        """The started client; the first connect blocks, so it runs in a worker thread."""
        if self._client is None:
            return await asyncio.to_thread(self._connect, lease)
        return self._connect(lease)

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
                self._nodes.clear()
                self._session = sid
        return client

    def _path(self, group: str, name: str | None = None) -> str:
        base = f"{self._settings.root}/{group}"
        return base if name is None else f"{base}/{name}"

    async def _children(self, result: Any) -> list[str]:
        """The names a ``get_children_async`` answered; none when the group node is absent."""
        try:
            children: list[str] = await self._call(result)
        except NoNodeError:
            return []
        return children

    # -- refresh deadlines -----------------------------------------------------------------

    def _arm(self, key: tuple[str, str], node: Node, lease: float) -> None:
        """Delete *node* unless it is refreshed again within *lease* (reaper thread)."""
        with self._lock:
            node.deadline = time.monotonic() + lease
            self._shortest = min(self._shortest, lease)
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="multilock-zookeeper-reaper", daemon=True
                )
                self._reaper.start()
            elif node.deadline < self._reap_at:
                self._reaped.notify()

    def _reap(self) -> None:
        """Delete the nodes whose deadline passed; sleep until the next deadline."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for key, node in list(self._nodes.items()):
                    if node.deadline <= now:
                        del self._nodes[key]
                        _later(0, self._delete_quietly, node)
                due = (n.deadline for n in self._nodes.values())
                self._reap_at = min(due, default=now + self._shortest)
                self._reaped.wait(self._reap_at - now)

    # -- deleting nodes ----------------------------------------------------------------------

    async def _remove(self, node: Node) -> None:
        """Delete *node* now, or, when that fails, in the background while the session lasts.

        A node whose create was left in doubt (no name known) is looked up by its prefix.
        """
        client = self._client
        if client is None:
            return
        try:
            names = [node.name] if node.name is not None else []
            if not names:
                listing = await self._children(client.get_children_async(self._path(node.group)))
                names = [c for c in listing if c.startswith(node.prefix)]
            for name in names:
                with contextlib.suppress(NoNodeError):
                    await self._call(client.delete_async(self._path(node.group, name)))
        except FAILURES as exc:
            log.debug("zookeeper delete of %s/%s failed: %r", node.group, node.name, exc)
            with self._lock:
                again = not self._closed and client._session_id == node.session
            if not again:
                raise
            _later(_RETRY_DELETE, self._delete_quietly, node)

    def _delete_quietly(self, node: Node) -> None:
        """`_remove` from a timer or the reaper thread (rare: expiry, failed deletes)."""
        with contextlib.suppress(*FAILURES):
            asyncio.run(self._remove(node))

    async def _forget(self, key: tuple[str, str], node: Node, *, now: bool = True) -> None:
        """Drop *node* from this provider and delete it (now, or in the background)."""
        with self._lock:
            if self._nodes.get(key) is node:
                del self._nodes[key]
        if now:
            await self._remove(node)
        else:
            _later(0, self._delete_quietly, node)
