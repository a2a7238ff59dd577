"""`TcpProxy`: a TCP proxy owned by the test process, to cut or slow one client's network.

Each proxy listens on an ephemeral loopback port and forwards every connection to one
server, from an asyncio loop in a daemon thread of its own. Its controls are thread-safe
and act at once on the connections it carries and on new ones:

- `drop()`: reset every connection (RST) and reset each new one as soon as it is accepted.
- `blackhole(direction)`: keep accepting and reading, forward nothing in that direction:
  the bytes vanish and the peer waits (``"to_server"``, ``"to_client"`` or ``"both"``).
- `delay(seconds, direction)`: forward each chunk *seconds* after it arrived (order kept).
- `heal()`: forward everything again at once, chunks still held by a delay included.

A closed connection is passed on in both directions even through a black hole: the proxy
loses bytes, not the end of a connection. `route_url` rewrites a backend URL so that each
of its servers is reached through a proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Coroutine, Mapping
from typing import Any, Literal, Self, TypeVar
from urllib.parse import urlsplit, urlunsplit

import attrs

__all__ = ["DIRECTIONS", "Direction", "ProxyStats", "TcpProxy", "route_url"]

Direction = Literal["to_server", "to_client", "both"]
DIRECTIONS: tuple[str, str] = ("to_server", "to_client")
T = TypeVar("T")
_CHUNK = 65536
_CONTROL_TIMEOUT = 10.0
#: SO_LINGER on, timeout 0: close() sends RST instead of FIN.
_RST = struct.pack("ii", 1, 0)


def _directions(direction: str) -> tuple[str, ...]:
    if direction == "both":
        return DIRECTIONS
    if direction in DIRECTIONS:
        return (direction,)
    raise ValueError(f"direction must be 'to_server', 'to_client' or 'both', not {direction!r}")


@attrs.frozen
class ProxyStats:
    """What a proxy did so far: connections accepted and bytes per direction."""

    accepted: int
    refused: int
    forwarded: Mapping[str, int]
    discarded: Mapping[str, int]


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close *writer*'s connection with an RST (no FIN, no lingering)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    writer.transport.abort()


class _Pipe:
    """One direction of one connection: read chunks, hold them for the delay, write them."""

    def __init__(
        self, proxy: TcpProxy, direction: str, reader: asyncio.StreamReader, writer: Any
    ) -> None:
        self.proxy, self.direction = proxy, direction
        self.reader, self.writer = reader, writer
        self.queue: deque[tuple[float, bytes]] = deque()
        self.eof = False
        self.wake = asyncio.Event()

    async def read(self) -> None:
        while chunk := await self.reader.read(_CHUNK):
            if self.direction in self.proxy._holes:
                self.proxy._discarded[self.direction] += len(chunk)
                continue
            self.queue.append((time.monotonic(), chunk))
            self.wake.set()
        self.eof = True
        self.wake.set()

    async def write(self) -> None:
        while True:
            self.wake.clear()
            timeout: float | None = None
            if self.queue:
                arrived, chunk = self.queue[0]
                due = arrived + self.proxy._delays[self.direction]
                if due <= time.monotonic():
                    self.queue.popleft()
                    if self.direction in self.proxy._holes:  # blackholed after it arrived
                        self.proxy._discarded[self.direction] += len(chunk)
                        continue
                    self.writer.write(chunk)
                    await self.writer.drain()
                    self.proxy._forwarded[self.direction] += len(chunk)
                    continue
                timeout = due - time.monotonic()
            elif self.eof:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()


class _Link:
    """A client connection and its upstream connection, pumped in both directions."""

    def __init__(self, proxy: TcpProxy, client: tuple[Any, Any], server: tuple[Any, Any]) -> None:
        self.writers = (client[1], server[1])
        self.pipes = (
            _Pipe(proxy, "to_server", client[0], server[1]),
            _Pipe(proxy, "to_client", server[0], client[1]),
        )

    def poke(self) -> None:
        for pipe in self.pipes:
            pipe.wake.set()

    def reset(self) -> None:
        for writer in self.writers:
            _reset(writer)

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(coro) for p in self.pipes for coro in (p.read(), p.write())]
        try:
            # Done when both directions have passed their end on; any error ends both.
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    self.reset()
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in self.writers:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to *upstream*; cut or slow it with the controls.

    Use as a context manager, or call `start()` and `close()`.
    """

    def __init__(self, upstream: tuple[str, int], *, host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self.host = host
        self.port = 0
        self._holes: set[str] = set()
        self._delays: dict[str, float] = dict.fromkeys(DIRECTIONS, 0.0)
        self._dropped = False
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._accepted = self._refused = 0
        self._forwarded: dict[str, int] = dict.fromkeys(DIRECTIONS, 0)
        self._discarded: dict[str, int] = dict.fromkeys(DIRECTIONS, 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError(f"{self!r} was already started")
        self._thread = threading.Thread(target=self._main, name=f"proxy-{self.upstream}")
        self._thread.daemon = True
        self._thread.start()
        self._ready.wait(_CONTROL_TIMEOUT)
        if self._failure is not None:
            raise RuntimeError(f"{self!r} could not start") from self._failure
        if not self._ready.is_set():
            raise RuntimeError(f"{self!r} did not start within {_CONTROL_TIMEOUT} s")
        return self

    def close(self) -> None:
        """Reset every connection, stop listening and end the thread."""
        loop, thread, stop = self._loop, self._thread, self._stop
        if loop is None or thread is None or stop is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):  # the loop may be closing already
            loop.call_soon_threadsafe(stop.set)
        thread.join(_CONTROL_TIMEOUT)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> tuple[str, int]:
        """Where clients connect: ``(host, port)``."""
        return self.host, self.port

    # -- controls (thread-safe, in effect when they return) ----------------------------------

    def drop(self) -> None:
        """Reset every connection; reset new ones as soon as they are accepted."""

        async def apply() -> None:
            self._dropped = True
            for link in list(self._links):
                link.reset()

        self._control(apply())

    def blackhole(self, direction: Direction = "both") -> None:
        """Forward nothing in *direction*: bytes vanish, connections stay open and hang."""
        chosen = _directions(direction)

        async def apply() -> None:
            self._holes.update(chosen)
            self._poke()

        self._control(apply())

    def delay(self, seconds: float, direction: Direction = "both") -> None:
        """Forward each chunk in *direction* *seconds* after it arrived."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0, not {seconds}")
        chosen = _directions(direction)

        async def apply() -> None:
            for name in chosen:
                self._delays[name] = float(seconds)
            self._poke()

        self._control(apply())

    def heal(self) -> None:
        """Undo every control: accept, forward at once, release delayed chunks."""

        async def apply() -> None:
            self._dropped = False
            self._holes.clear()
            self._delays.update(dict.fromkeys(DIRECTIONS, 0.0))
            self._poke()

        self._control(apply())

    def stats(self) -> ProxyStats:
        async def read() -> ProxyStats:
            return ProxyStats(
                self._accepted, self._refused, dict(self._forwarded), dict(self._discarded)
            )

        return self._control(read())

    def __repr__(self) -> str:
        state = "dropped" if self._dropped else ",".join(sorted(self._holes)) or "open"
        up = f"{self.upstream[0]}:{self.upstream[1]}"
        return f"<TcpProxy {self.host}:{self.port or '?'} -> {up} {state}>"

    # -- the loop thread ---------------------------------------------------------------------

    def _control(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"{self!r} is not running")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(_CONTROL_TIMEOUT)

    def _refusing(self) -> bool:
        """Whether new connections are refused now (read afresh after an await)."""
        return self._dropped

    def _poke(self) -> None:
        for link in self._links:
            link.poke()

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start() when it fails early
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._accept, self.host, 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            self._dropped = True  # a connection still being set up is reset too
            for link in list(self._links):
                link.reset()
            # Reset connections end their handlers; cancelling a handler instead would make
            # asyncio's stream callback log the CancelledError (Python 3.11).
            if self._tasks:
                _, stuck = await asyncio.wait(self._tasks, timeout=_CONTROL_TIMEOUT)
                for task in stuck:
                    task.cancel()
            await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._carry(reader, writer)
        finally:
            self._tasks.discard(task)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._dropped:
            self._refused += 1
            _reset(writer)
            return
        try:
            async with asyncio.timeout(_CONTROL_TIMEOUT):
                upstream = await asyncio.open_connection(*self.upstream)
        except (OSError, TimeoutError):
            self._refused += 1  # the server is down: so is the connection through us
            _reset(writer)
            return
        if self._refusing():  # dropped while connecting
            self._refused += 1
            _reset(writer)
            _reset(upstream[1])
            return
        self._accepted += 1
        link = _Link(self, (reader, writer), upstream)
        self._links.add(link)
        try:
            await link.run()
        finally:
            self._links.discard(link)


def route_url(url: str, routes: Mapping[tuple[str, int], tuple[str, int]]) -> str:
    """*url* with each ``host:port`` of its authority replaced as *routes* says.

    Works for one host (``redis://h:p/0``, ``postgresql://u@h:p/db``, ``s3+http://k:s@h:p/b``)
    and for comma-separated lists (``redlock://h1:p1,h2:p2/0``, ``zookeeper://h1:p1,h2:p2``);
    user info, path and query are kept. Raise `ValueError` when a route's server is not
    named in *url* with its port, since the rewritten URL would bypass its proxy.
    """
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    rewritten = []
    used: set[tuple[str, int]] = set()
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        key = (host.strip("[]"), int(port)) if port.isdigit() else None
        if key is not None and key in routes:
            new_host, new_port = routes[key]
            rewritten.append(f"{new_host}:{new_port}")
            used.add(key)
        else:
            rewritten.append(item)
    missing = set(routes) - used
    if missing:
        names = ", ".join(f"{h}:{p}" for h, p in sorted(missing))
        raise ValueError(f"the URL does not name {names} with a port: cannot route it")
    netloc = f"{userinfo}{at}{','.join(rewritten)}"
    return urlunsplit(parts._replace(netloc=netloc))
