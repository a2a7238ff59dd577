"""The fault suites' TCP proxy against a recording echo server: forward, drop, black-hole, delay.

The echo server records every byte it receives, so each test can tell which direction
lost what: bytes sent through a black hole never show up, even after `heal()`, while
bytes sent after it do (order is kept, so "not forwarded" is proven by what arrives next).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from harness.proxy import TcpProxy, route_url

WAIT = 10.0  # generous: these waits end as soon as their condition holds


def wait_until(what: str, condition: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.005)


class EchoServer:
    """Echo every byte back and record it, with the time it arrived."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.received = bytearray()
        self.arrivals: list[float] = []
        self.eofs = 0
        self.conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self.conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                with self._lock:
                    self.received += data
                    self.arrivals.append(time.monotonic())
                conn.sendall(data)
            with self._lock:
                self.eofs += 1
            conn.close()

    def got(self) -> bytes:
        with self._lock:
            return bytes(self.received)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self.listener.close()
        with self._lock:
            conns = list(self.conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        for thread in self._threads:
            thread.join(WAIT)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[TcpProxy]:
    with TcpProxy(echo.address) as running:
        yield running


@contextlib.contextmanager
def client(proxy: TcpProxy) -> Iterator[socket.socket]:
    with socket.create_connection(proxy.address, timeout=WAIT) as sock:
        yield sock


def receive(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer reset or closed the connection (recv gives an error or EOF)."""
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def refused(proxy: TcpProxy) -> bool:
    """True when a new connection through *proxy* is reset (during or after the connect)."""
    try:
        sock = socket.create_connection(proxy.address, timeout=WAIT)
    except ConnectionResetError:
        return True
    with sock:
        return closed_by_peer(sock)


def test_forwards_both_ways(proxy: TcpProxy, echo: EchoServer) -> None:
    with client(proxy) as sock:
        sock.sendall(b"ping")
        assert receive(sock, 4) == b"ping"
    assert echo.got() == b"ping"
    stats = proxy.stats()
    assert stats.accepted == 1
    assert stats.forwarded == {"to_server": 4, "to_client": 4}


def test_drop_resets_connections_and_refuses_new_ones_until_healed(
    proxy: TcpProxy, echo: EchoServer
) -> None:
    with client(proxy) as sock:
        sock.sendall(b"a")
        assert receive(sock, 1) == b"a"
        proxy.drop()
        assert closed_by_peer(sock)
    assert refused(proxy)
    wait_until("the proxy counted the refusal", lambda: proxy.stats().refused == 1)
    proxy.heal()
    with client(proxy) as sock:
        sock.sendall(b"b")
        assert receive(sock, 1) == b"b"
    assert echo.got() == b"ab"


def test_blackhole_to_server_loses_requests(proxy: TcpProxy, echo: EchoServer) -> None:
    with client(proxy) as sock:
        proxy.blackhole("to_server")
        sock.sendall(b"lost")
        wait_until("the proxy read the request", lambda: proxy.stats().discarded["to_server"] == 4)
        proxy.heal()
        sock.sendall(b"kept")
        assert receive(sock, 4) == b"kept"
    assert echo.got() == b"kept"


def test_blackhole_to_client_loses_replies(proxy: TcpProxy, echo: EchoServer) -> None:
    with client(proxy) as sock:
        proxy.blackhole("to_client")
        sock.sendall(b"one")
        wait_until("the server got the request", lambda: echo.got() == b"one")
        wait_until("the reply vanished", lambda: proxy.stats().discarded["to_client"] == 3)
        proxy.heal()
        sock.sendall(b"two")
        assert receive(sock, 3) == b"two"  # not "one": its echo is gone for good
    assert echo.got() == b"onetwo"


def test_blackhole_both_hangs_an_existing_and_a_new_connection(
    proxy: TcpProxy, echo: EchoServer
) -> None:
    with client(proxy) as old:
        old.sendall(b"x")
        assert receive(old, 1) == b"x"
        proxy.blackhole()
        with client(proxy) as new:
            old.sendall(b"y")
            new.sendall(b"z")
            wait_until("both requests vanished", lambda: proxy.stats().discarded["to_server"] == 2)
            new.settimeout(0.2)
            with pytest.raises(TimeoutError):
                new.recv(1)  # hangs: no reply, no reset
            proxy.heal()
            new.settimeout(WAIT)
            new.sendall(b"w")
            assert receive(new, 1) == b"w"
    assert echo.got() == b"xw"


def test_delay_holds_each_chunk_and_keeps_order(proxy: TcpProxy, echo: EchoServer) -> None:
    delay = 0.3
    with client(proxy) as sock:
        proxy.delay(delay, "to_server")
        sent = time.monotonic()
        for i in range(5):
            sock.sendall(b"%d" % i)
        assert receive(sock, 5) == b"01234"
    assert echo.got() == b"01234"
    assert echo.arrivals[0] - sent >= delay  # never early (a lower bound, not a race)


def test_heal_releases_delayed_chunks_at_once(proxy: TcpProxy, echo: EchoServer) -> None:
    with client(proxy) as sock:
        proxy.delay(600, "to_client")
        sock.sendall(b"held")
        wait_until("the server got the request", lambda: echo.got() == b"held")
        proxy.heal()
        sock.settimeout(WAIT)  # far below the 600 s delay
        assert receive(sock, 4) == b"held"


def test_closing_is_passed_on_through_a_black_hole(proxy: TcpProxy, echo: EchoServer) -> None:
    with client(proxy) as sock:
        sock.sendall(b"q")
        assert receive(sock, 1) == b"q"
        proxy.blackhole()
    wait_until("the server saw the client leave", lambda: echo.eofs == 1)


def test_a_server_that_is_down_resets_the_client() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        address = placeholder.getsockname()[:2]
    with TcpProxy(address) as proxy:
        assert refused(proxy)
        wait_until("the proxy counted the refusal", lambda: proxy.stats().refused == 1)


def test_direction_must_be_known(proxy: TcpProxy) -> None:
    with pytest.raises(ValueError, match="direction"):
        proxy.blackhole("upstream")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        proxy.delay(-1)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:1001/0"),
        (
            "redlock://127.0.0.1:6379,127.0.0.1:6380,127.0.0.1:6381/0",
            "redlock://127.0.0.1:1001,127.0.0.1:1002,127.0.0.1:1003/0",
        ),
        (
            "postgresql://postgres:pw@127.0.0.1:5432/postgres",
            "postgresql://postgres:pw@127.0.0.1:1001/postgres",
        ),
        ("etcd://127.0.0.1:2379?min_lease=1", "etcd://127.0.0.1:1001?min_lease=1"),
        ("zookeeper://127.0.0.1:2181/chroot", "zookeeper://127.0.0.1:1001/chroot"),
        (
            "s3+http://k:s@127.0.0.1:9000/bucket/t-1/?poll_interval=0.2",
            "s3+http://k:s@127.0.0.1:1001/bucket/t-1/?poll_interval=0.2",
        ),
        (
            "azureblob://acct:a%2Bb%3D@127.0.0.1:10000/acct/c?secure=false",
            "azureblob://acct:a%2Bb%3D@127.0.0.1:1001/acct/c?secure=false",
        ),
    ],
)
def test_route_url_sends_every_server_through_its_proxy(url: str, expected: str) -> None:
    ports = [6379, 6380, 6381, 5432, 2379, 2181, 9000, 10000]
    named = sorted((p for p in ports if f":{p}" in url), key=lambda p: url.index(f":{p}"))
    # The proxies are numbered 1001, 1002... in the order the URL names its servers.
    routes = {("127.0.0.1", port): ("127.0.0.1", 1001 + i) for i, port in enumerate(named)}
    assert route_url(url, routes) == expected


def test_route_url_refuses_a_server_it_cannot_find() -> None:
    with pytest.raises(ValueError, match=r"127\.0\.0\.1:6380"):
        route_url("redis://127.0.0.1:6379/0", {("127.0.0.1", 6380): ("127.0.0.1", 1)})
