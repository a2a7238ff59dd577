"""``etcd-3``: etcd with three members on loopback, each reachable and cuttable on its own.

Clients reach member i through a `TcpProxy` of this cluster's own (the URL names those
proxies), so that dropping it cuts the member off from every client at once. Members
reach each other's peer port through a `PeerGates` gate, which can cut one member off from
the other two, both ways, while those two still talk to each other. A proxy per peer link
would not do: every member must be given the same peer URL for each member (etcd derives
the member ids, and from them the cluster id, from those URLs), so member i cannot be
told to reach member j at an address of its own; the gate tells the senders apart by
the ``X-Server-From`` header of etcd's peer requests instead.

Raft runs with a 50 ms heartbeat and a 500 ms election timeout (steady on a loaded
2-core machine; etcd's minimum lease TTL is then 1 s, hence ``min_lease=1`` and the 1 s
lease), and with pre-vote (etcd 3.5's default: a member back from a cut does not depose
the leader). The leader is found with each member's maintenance status call (JSON
gateway on its client port). Faults: ``store-kill-leader`` (SIGKILL, restarted on heal
with its data dir), ``store-cut-leader-clients``, ``store-cut-leader-peers``,
``store-restart-minority`` (one member, SIGTERM then started again); etcd's own leader
election is its failover, so there is no ``store-failover``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import struct
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self, TypeVar

from ..fixtures_etcd import EtcdServer, probe_etcd
from ..install import etcd_binary
from ..proxy import TcpProxy
from ..servers import HOST, START_TIMEOUT, BaseServer, NotInstalled
from ..store_cluster import SAFE, Fronted, Injector, StoreCluster, StoreFault, register_cluster

__all__ = ["EtcdCluster", "EtcdMember", "PeerGates"]

T = TypeVar("T")
SIZE = 3
RAFT = ["--heartbeat-interval", "50", "--election-timeout", "500", "--pre-vote"]
#: How long a fault waits for the store to name its leader (an election may be under way).
LEADER_TIMEOUT = 15.0
_CONTROL_TIMEOUT = 10.0
#: A peer connection must send its first request head within this long.
_HEAD_TIMEOUT = 10.0
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, timeout 0: close() sends RST


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    writer.transport.abort()


def _sender(head: bytes) -> str | None:
    """The member id (hex) an etcd peer request head names in ``X-Server-From``."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-server-from":
            return value.strip().decode("ascii", "replace").lower()
    return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()


class _Link:
    """One peer connection through a gate: which gate, who sends, both ends."""

    def __init__(self, gate: int, writer: asyncio.StreamWriter) -> None:
        self.gate = gate
        self.sender: str | None = None
        self.writers = [writer]

    def reset(self) -> None:
        for writer in self.writers:
            _reset(writer)


class PeerGates:
    """Each member's peer port behind a gate; `cut` cuts one member off from the others.

    Gate i listens on ``ports[i]`` (the peer URL every member is given for member i) and
    forwards to member i's peer port, read from *upstreams* at each connection (it is
    picked again if taken when the member starts). etcd names the sender of each raft
    request (streams, pipeline, snapshots) in ``X-Server-From``: the gate reads each
    connection's first request head, then forwards bytes both ways. While member c is cut,
    gate c resets every connection and the other gates reset those whose sender is c:
    c hears nobody and nobody hears c. A connection without the header (a version probe)
    passes except into c. One asyncio loop in a daemon thread runs every gate.
    """

    def __init__(self, upstreams: Sequence[Callable[[], int]]) -> None:
        self._upstreams = list(upstreams)
        self.ports: list[int] = []
        #: Each member's id in hex (as etcd writes it in the header), once known.
        self.ids: list[str] = []
        self._cut: int | None = None
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="etcd-peer-gates", daemon=True)
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    def start(self) -> Self:
        self._thread.start()
        if not self._ready.wait(_CONTROL_TIMEOUT) or self._failure is not None:
            raise RuntimeError("the etcd peer gates did not start") from self._failure
        return self

    def close(self) -> None:
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or not self._thread.is_alive():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(_CONTROL_TIMEOUT)

    def cut(self, member: int) -> None:
        """Cut *member* off from the others, both ways: connections reset, new ones refused."""

        async def apply() -> None:
            self._cut = member
            for link in list(self._links):
                if self._blocked(link):
                    link.reset()

        self._control(apply())

    def heal(self) -> None:
        async def apply() -> None:
            self._cut = None

        self._control(apply())

    def _blocked(self, link: _Link) -> bool:
        cut = self._cut
        if cut is None:
            return False
        return link.gate == cut or (cut < len(self.ids) and link.sender == self.ids[cut])

    def _control(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the etcd peer gates are not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CONTROL_TIMEOUT)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start() when it fails early
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        servers = []
        handlers: set[asyncio.Task[Any]] = set()
        for gate in range(len(self._upstreams)):

            async def accept(r: Any, w: Any, gate: int = gate) -> None:
                task = asyncio.current_task()
                assert task is not None
                handlers.add(task)
                try:
                    await self._carry(gate, r, w)
                finally:
                    handlers.discard(task)

            servers.append(await asyncio.start_server(accept, HOST, 0))
        self.ports = [server.sockets[0].getsockname()[1] for server in servers]
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            for server in servers:
                server.close()
            for link in list(self._links):
                link.reset()
            # Reset connections end their handlers; cancelling one instead would make
            # asyncio's stream callback log the CancelledError (Python 3.11).
            if handlers:
                await asyncio.wait(handlers, timeout=_CONTROL_TIMEOUT)

    async def _carry(
        self, gate: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        link = _Link(gate, writer)
        self._links.add(link)
        failed = True
        try:
            async with asyncio.timeout(_HEAD_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            link.sender = _sender(head)
            if self._blocked(link):
                return
            up_reader, up_writer = await asyncio.open_connection(HOST, self._upstreams[gate]())
            link.writers.append(up_writer)
            if self._blocked(link):  # cut while connecting
                return
            up_writer.write(head)
            pumps = [
                asyncio.ensure_future(_pump(reader, up_writer)),
                asyncio.ensure_future(_pump(up_reader, writer)),
            ]
            try:
                await asyncio.gather(*pumps)
                failed = False
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the member is down, or the connection was reset: so is this one
        finally:
            self._links.discard(link)
            for each in link.writers:
                if failed:
                    _reset(each)
                else:
                    each.close()


class EtcdMember(EtcdServer):
    """One member: it listens on its own ports; peers reach it at ``peer_url`` (its gate)."""

    def __init__(self, name: str, binary: Path) -> None:
        super().__init__(binary)
        self.member_name = name
        self.peer_url = ""
        self.initial_cluster = ""
        self.token = ""

    def command(self) -> list[str]:
        client = f"http://{HOST}:{self.port}"
        return [
            str(self.binary),
            *("--name", self.member_name, "--data-dir", str(self.dir / "data")),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", f"http://{HOST}:{self.port_for('peer')}"),
            *("--initial-advertise-peer-urls", self.peer_url),
            *("--initial-cluster", self.initial_cluster, "--initial-cluster-state", "new"),
            *("--initial-cluster-token", self.token, "--logger", "zap"),
            "--unsafe-no-fsync",
            *RAFT,
        ]

    def rejoin(self) -> None:
        """Start again with the same ports and data: it rejoins as a follower."""
        self.start()

    def status(self, timeout: float = 1.0) -> dict[str, Any]:
        """The maintenance status call: member id, leader id (hex), raft term."""
        request = urllib.request.Request(
            f"http://{HOST}:{self.port}/v3/maintenance/status", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = json.loads(reply.read())
        return {
            "member_id": f"{int(body['header']['member_id']):x}",
            "leader": f"{int(body.get('leader', 0)):x}",
            "term": int(body.get("raftTerm", 0)),
        }

    def __repr__(self) -> str:
        port = self._ports.get("main", "?")
        return f"<EtcdMember {self.member_name} {HOST}:{port} pid={self.pid} dir={self.dir}>"


class _ClientEnd(Fronted):
    """A member as clients reach it: through the cluster's client proxy."""

    kind = "etcd"
    node: EtcdMember

    @property
    def url(self) -> str:
        return f"etcd://{HOST}:{self.proxy.port}?min_lease=1"

    def probe(self) -> None:
        probe_etcd(self.url, timeout=1.0)

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        self.node.start(timeout)
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        return self.node.stop(timeout)

    def __repr__(self) -> str:
        return f"<etcd {self.node.member_name} via {HOST}:{self.proxy.port}>"


class EtcdCluster(StoreCluster):
    """Three etcd members, each behind a client proxy and a peer gate."""

    name = "etcd-3"
    lease = 1.0
    promise = SAFE

    def __init__(self) -> None:
        binary = etcd_binary()
        if binary is None:
            raise NotInstalled("etcd is not installed (Debian: etcd-server)")
        self._binary = binary
        self.members: list[EtcdMember] = []
        self.proxies: list[TcpProxy] = []
        self.gates: PeerGates | None = None

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{HOST}:{p.port}" for p in self.proxies) + "?min_lease=1"

    @property
    def servers(self) -> tuple[BaseServer, ...]:
        return tuple(_ClientEnd(m, p) for m, p in zip(self.members, self.proxies, strict=True))

    def start(self) -> None:
        try:
            self.members = [EtcdMember(f"m{i}", self._binary) for i in range(SIZE)]
            gates = self.gates = PeerGates(
                [functools.partial(m.port_for, "peer") for m in self.members]
            ).start()
            peers = [f"http://{HOST}:{port}" for port in gates.ports]
            names = [m.member_name for m in self.members]
            initial = ",".join(f"{n}={url}" for n, url in zip(names, peers, strict=True))
            token = f"etcd-3-{uuid.uuid4().hex[:8]}"
            for member, url in zip(self.members, peers, strict=True):
                member.peer_url, member.initial_cluster, member.token = url, initial, token
            # All at once: a member answers /health only once a quorum has formed.
            with ThreadPoolExecutor(SIZE) as pool:
                list(pool.map(lambda m: m.start(), self.members))
            gates.ids = [m.status()["member_id"] for m in self.members]
            self.proxies = [TcpProxy((HOST, m.port)).start() for m in self.members]
            self.wait_whole(START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        if self.gates is not None:
            self.gates.close()
        for member in self.members:
            member.close()

    def wait_whole(self, timeout: float) -> None:
        """Every member up, healthy (a quorum read) and agreeing on one leader and term."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                views = [m.status() for m in self.members]
                for member in self.members:
                    probe_etcd(member.url, timeout=1.0)
                agreed = {(v["leader"], v["term"]) for v in views}
                if len(agreed) == 1 and views[0]["leader"] in {v["member_id"] for v in views}:
                    return
                problem = f"the members disagree on the leader: {views}"
            except Exception as exc:
                problem = repr(exc)
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"etcd-3 not whole within {timeout:.1f} s: {problem}\n{self._tails()}"
                )
            time.sleep(0.05)

    def store_faults(self) -> dict[str, Injector]:
        return {
            "store-kill-leader": self._kill_leader,
            "store-cut-leader-clients": self._cut_leader_clients,
            "store-cut-leader-peers": self._cut_leader_peers,
            "store-restart-minority": self._restart_minority,
        }

    # -- the faults ------------------------------------------------------------------------

    def _kill_leader(self, rng: Any, lease: float) -> StoreFault:
        index = self._leader()
        member = self.members[index]
        member.kill()
        return StoreFault("store-kill-leader", f"m{index} (the leader) SIGKILLed", member.rejoin)

    def _cut_leader_clients(self, rng: Any, lease: float) -> StoreFault:
        index = self._leader()
        proxy = self.proxies[index]
        proxy.drop()
        return StoreFault("store-cut-leader-clients", f"m{index} (the leader)", proxy.heal)

    def _cut_leader_peers(self, rng: Any, lease: float) -> StoreFault:
        index = self._leader()
        gates = self.gates
        assert gates is not None
        gates.cut(index)
        return StoreFault("store-cut-leader-peers", f"m{index} (the leader)", gates.heal)

    def _restart_minority(self, rng: Any, lease: float) -> StoreFault:
        leader = self._leader()
        index = rng.randrange(SIZE)
        member = self.members[index]
        member.stop()
        role = "the leader" if index == leader else "a follower"
        return StoreFault("store-restart-minority", f"m{index} ({role}) stopped", member.rejoin)

    def _leader(self) -> int:
        """The index of the member that says it leads, waiting for an election to end."""
        deadline = time.monotonic() + LEADER_TIMEOUT
        while True:
            for index, member in enumerate(self.members):
                with contextlib.suppress(Exception):
                    view = member.status()
                    if view["member_id"] == view["leader"]:
                        return index
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"etcd-3 named no leader within {LEADER_TIMEOUT} s\n{self._tails()}"
                )
            time.sleep(0.02)

    def _tails(self) -> str:
        return "\n".join(f"--- {m!r}:\n{m.log_tail(15)}" for m in self.members)


register_cluster(EtcdCluster.name, EtcdCluster)
