"""A ZooKeeper ensemble of three nodes on loopback: ``zookeeper-3``, promise `SAFE`.

Each node is a ``QuorumPeerMain`` with its own data dir (``myid``) and ``zoo.cfg``, a
short ``tickTime`` (so that a lost leader is noticed within about a second) and
``forceSync=no`` like the single server of ``fixtures_zookeeper``. Every link between
two nodes goes through the `PeerNetwork`, a listener per direction and per port (node
*i*'s ``zoo.cfg`` names node *j* at the listeners of ``i -> j``), so that a node can be
cut off from its peers while clients still reach it. `PeerNetwork` says why a plain
`TcpProxy` per link does not do for ZooKeeper's election and quorum ports.

Clients reach node *k* through a proxy of the cluster's own (the URL names those), so
``store-cut-leader-clients`` is a drop on one proxy; the campaign puts each member's
proxies in front of them. The leader is the node whose ``srvr`` four-letter word says
``Mode: leader``, asked on its real client port (never through a proxy).

The faults: ``store-kill-leader`` (SIGKILL, restarted on heal), ``store-cut-leader-clients``
(its client proxy drops every connection), ``store-cut-leader-peers`` (every peer proxy to
and from it drops: it loses its quorum, the other two elect a leader among themselves),
``store-restart-minority`` (one node, drawn from the seed, stopped with SIGTERM and
started again). ZooKeeper has no failover command of its own: ``store-failover`` is what
the first and third kinds do.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import shutil
import socket
import struct
import threading
import time
from typing import Any, Self

import attrs

from ..fixtures_zookeeper import four_letter_word
from ..install import zookeeper_classpath
from ..proxy import TcpProxy
from ..servers import HOST, START_TIMEOUT, BaseServer, NotInstalled, Server, ServerError
from ..store_cluster import SAFE, Fronted, Injector, StoreCluster, StoreFault, register_cluster

__all__ = ["ZooKeeperEnsemble"]

SIZE = 3
#: The lease of the campaign's members, and so the session timeout their URL asks for.
LEASE = 2.0
#: 250 ms ticks: a leader that hears no follower for ``syncLimit`` ticks (1.5 s) steps
#: down, and a follower that hears no leader for as long stops serving, both before a
#: session (2 s) can expire: a server cut off from the ensemble never answers a client
#: whose session the others may expire. Sessions of 1 s or more (``minSessionTimeout``).
SETTINGS = {
    "tickTime": 250,
    "initLimit": 20,
    "syncLimit": 6,
    "minSessionTimeout": 1000,
    "maxSessionTimeout": 60000,
    "admin.enableServer": "false",
    "4lw.commands.whitelist": "ruok,srvr,stat,mntr,cons",
    "forceSync": "no",
    "reconfigEnabled": "false",
}
#: The election's first message: protocol version (V1 -65536 or V2 -65535), the sender's
#: id, then the length and text of its election address(es), ``host:port[|host:port]``.
_ELECTION_VERSIONS = (-65536, -65535)
_HEADER = struct.Struct(">qqi")
_HANDSHAKE_TIMEOUT = 5.0
#: A quorum link waits this long for its node to listen (a follower that connects to a
#: new leader before it listens is refused and retries; through a proxy it would be
#: accepted, then reset, and would give up the round).
_PATIENCE = 3.0
_CHUNK = 65536
_CONTROL_TIMEOUT = 10.0


@attrs.define(eq=False)
class _Link:
    """One listener of the peer network: node *src* reaching node *dst*'s *kind* port."""

    src: int
    dst: int
    kind: str  # "quorum" or "election"
    upstream: int
    port: int = 0


class PeerNetwork:
    """Every link between two nodes of the ensemble, one listener per (from, to, port).

    Node *i*'s ``zoo.cfg`` names node *j* at the listeners ``(i, j, quorum)`` and
    ``(i, j, election)``; `isolate` resets every connection to and from a node and
    refuses new ones until `rejoin`. It runs on one asyncio loop in a daemon thread.

    Two things differ from a plain `TcpProxy`:

    - an election connection starts with the caller's id and its own election address,
      which a node with a higher id closes and calls back, bypassing the proxies: the
      address is rewritten to the listener of the way back, ``(j, i, election)``;
    - a quorum connection is accepted before its node listens; it waits up to
      `_PATIENCE` for it, as a refused follower would retry, instead of resetting.
    """

    def __init__(self) -> None:
        self._links: dict[tuple[int, int, str], _Link] = {}
        self._isolated: set[int] = set()
        self._writers: dict[asyncio.StreamWriter, _Link] = {}
        self._servers: list[asyncio.Server] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="zk-peers")
        self._thread.daemon = True
        self._thread.start()

    def add(self, src: int, dst: int, kind: str, upstream: int) -> int:
        """Listen for node *src*'s connections to node *dst*'s *kind* port; return the port."""
        link = self._links[src, dst, kind] = _Link(src, dst, kind, upstream)
        self._run(self._listen(link))
        return link.port

    def port(self, src: int, dst: int, kind: str) -> int:
        return self._links[src, dst, kind].port

    def isolate(self, sid: int) -> None:
        """Cut node *sid* off from every other node (both ways, both ports) until `rejoin`."""

        async def apply() -> None:
            self._isolated.add(sid)
            for writer, link in list(self._writers.items()):
                if sid in (link.src, link.dst):
                    _abort(writer)

        self._run(apply())

    def rejoin(self, sid: int) -> None:
        async def apply() -> None:
            self._isolated.discard(sid)

        self._run(apply())

    def close(self) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()
            for writer in list(self._writers):
                _abort(writer)
            for server in self._servers:
                await server.wait_closed()

        if self._thread.is_alive():
            self._run(stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_CONTROL_TIMEOUT)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    # -- the loop --------------------------------------------------------------------------

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(_CONTROL_TIMEOUT)

    def _cut(self, link: _Link) -> bool:
        return link.src in self._isolated or link.dst in self._isolated

    async def _listen(self, link: _Link) -> None:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self._carry(link, reader, writer)
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                _abort(writer)

        server = await asyncio.start_server(accept, HOST, 0)
        link.port = server.sockets[0].getsockname()[1]
        self._servers.append(server)

    async def _carry(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        first = b""
        if link.kind == "election":
            async with asyncio.timeout(_HANDSHAKE_TIMEOUT):
                first = await self._rewrite(link, reader)
        upstream = await self._connect(link)
        if upstream is None or self._cut(link):
            _abort(writer)
            if upstream is not None:
                _abort(upstream[1])
            return
        up_reader, up_writer = upstream
        self._writers[writer] = self._writers[up_writer] = link
        try:
            if first:
                up_writer.write(first)
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for end in (writer, up_writer):
                self._writers.pop(end, None)
                end.close()

    async def _rewrite(self, link: _Link, reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(_HEADER.size)
        version, sid, length = _HEADER.unpack(header)
        if version not in _ELECTION_VERSIONS or not 0 < length <= 2048:
            return header  # an older protocol: no address follows
        await reader.readexactly(length)  # the caller's own election address: replaced
        back = self._links[link.dst, link.src, "election"]
        address = f"{HOST}:{back.port}".encode()
        return _HEADER.pack(version, sid, len(address)) + address

    async def _connect(self, link: _Link) -> tuple[Any, Any] | None:
        patience = _PATIENCE if link.kind == "quorum" else 0.0
        deadline = self._loop.time() + patience
        while not self._cut(link):
            try:
                return await asyncio.open_connection(HOST, link.upstream)
            except OSError:
                if self._loop.time() >= deadline:
                    return None
                await asyncio.sleep(0.05)
        return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST, as a network cut shows to both ends."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _srvr(port: int, timeout: float = 1.0) -> str:
    return four_letter_word(f"zookeeper://{HOST}:{port}", "srvr", timeout)


def _mode(port: int) -> str | None:
    """``leader``, ``follower``... as ``srvr`` says on *port*, or None (down, not serving)."""
    try:
        reply = _srvr(port)
    except OSError:
        return None
    for line in reply.splitlines():
        if line.startswith("Mode:"):
            return line.partition(":")[2].strip()
    return None


class ZooKeeperNode(Server):
    """One ``QuorumPeerMain`` of the ensemble; its ports and data survive restarts."""

    kind = "zookeeper"

    def __init__(self, ensemble: ZooKeeperEnsemble, sid: int) -> None:
        java = shutil.which("java")
        classpath = zookeeper_classpath()
        if java is None or classpath is None:
            raise NotInstalled("zookeeper is not installed (apt zookeeper: java and the jars)")
        self.java, self.classpath = java, classpath
        self.ensemble, self.sid = ensemble, sid
        super().__init__()
        for name in ("main", "quorum", "election"):  # fixed now: other nodes' configs name them
            self.port_for(name)

    @property
    def url(self) -> str:
        return f"zookeeper://{HOST}:{self.port}"

    @property
    def mode(self) -> str | None:
        return _mode(self.port) if self.running else None

    def prepare(self) -> None:
        (self.dir / "data").mkdir()
        (self.dir / "data" / "myid").write_text(f"{self.sid}\n")

    def command(self) -> list[str]:
        lines = [f"{key}={value}" for key, value in SETTINGS.items()]
        lines += [f"dataDir={self.dir / 'data'}", f"clientPort={self.port}"]
        lines += [f"clientPortAddress={HOST}"]
        lines += [self.ensemble.server_line(self.sid, other) for other in self.ensemble.nodes]
        config = self.dir / "zoo.cfg"
        config.write_text("\n".join([*lines, ""]))
        return [
            self.java,
            "-Xmx128m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-cp",
            self.classpath,
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(config),
        ]

    def restore(self) -> None:
        """Start the node again (same ports, same data): it rejoins as a follower."""
        self.start()

    def probe(self) -> None:
        """The node answers ``srvr`` (serving or not: a lone node waits for its quorum)."""
        reply = _srvr(self.port)
        if "Mode:" not in reply and "not currently serving" not in reply:
            raise ServerError(f"srvr answered {reply.strip()[:200]!r}")

    def __repr__(self) -> str:
        return f"<ZooKeeperNode {self.sid} {HOST}:{self.port} pid={self.pid}>"


class _Front(Fronted):
    """What clients see of one node: the cluster's client proxy in front of it."""

    kind = "zookeeper"
    node: ZooKeeperNode

    @property
    def url(self) -> str:
        return f"zookeeper://{self.host}:{self.port}?session_timeout={LEASE:g}"

    def probe(self) -> None:
        reply = four_letter_word(self.url, "srvr", 1.0)
        if "Mode:" not in reply:
            raise ServerError(f"srvr answered {reply.strip()[:200]!r}")

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        if not self.node.running:
            self.node.start(timeout)
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        return self.node.stop(timeout)

    def __repr__(self) -> str:
        return f"<zookeeper node {self.node.sid} via {self.host}:{self.port}>"


class ZooKeeperEnsemble(StoreCluster):
    """Three ZooKeeper nodes; every peer link and every node's clients behind proxies."""

    name = "zookeeper-3"
    lease = LEASE
    promise = SAFE

    def __init__(self, size: int = SIZE) -> None:
        self.nodes: list[ZooKeeperNode] = []
        self._client: list[TcpProxy] = []
        self._peers: PeerNetwork | None = None
        self._size = size

    # -- the surface ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        hosts = ",".join(f"{p.host}:{p.port}" for p in self._client)
        return f"zookeeper://{hosts}?session_timeout={LEASE:g}"

    @property
    def servers(self) -> tuple[BaseServer, ...]:
        return tuple(_Front(n, p) for n, p in zip(self.nodes, self._client, strict=True))

    def start(self) -> None:
        try:
            self.nodes = [ZooKeeperNode(self, sid) for sid in range(1, self._size + 1)]
            self._peers = peers = PeerNetwork()
            for node in self.nodes:
                self._client.append(TcpProxy((HOST, node.port)).start())
                for other in self.nodes:
                    if other is not node:
                        for kind in ("quorum", "election"):
                            peers.add(node.sid, other.sid, kind, other.port_for(kind))
            self._parallel([node.start for node in self.nodes])
            self.wait_whole(START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        for proxy in self._client:
            proxy.close()
        if self._peers is not None:
            self._peers.close()

    def server_line(self, sid: int, other: ZooKeeperNode) -> str:
        """``server.N=...`` as node *sid* sees node *other*: itself directly, others by proxy."""
        if other.sid == sid:
            quorum, election = other.port_for("quorum"), other.port_for("election")
        else:
            assert self._peers is not None
            quorum = self._peers.port(sid, other.sid, "quorum")
            election = self._peers.port(sid, other.sid, "election")
        return f"server.{other.sid}={HOST}:{quorum}:{election}"

    def leader(self, timeout: float = 10.0) -> ZooKeeperNode:
        """The node that says it leads (waiting up to *timeout* for one)."""
        deadline = time.monotonic() + timeout
        while True:
            for node in self.nodes:
                if node.mode == "leader":
                    return node
            if time.monotonic() >= deadline:
                raise AssertionError(f"no ZooKeeper leader within {timeout:.1f} s: {self.modes()}")
            time.sleep(0.05)

    def modes(self) -> dict[int, str | None]:
        return {node.sid: node.mode for node in self.nodes}

    def wait_whole(self, timeout: float) -> None:
        """Every node up and serving, one leader, and both followers synced with it."""
        deadline = time.monotonic() + timeout
        while True:
            modes = self.modes()
            leaders = [n for n in self.nodes if modes[n.sid] == "leader"]
            if len(leaders) == 1 and sorted(modes.values(), key=str).count("follower") == 2:
                synced = _synced_followers(leaders[0].port)
                if synced == self._size - 1:
                    return
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"the ZooKeeper ensemble is not whole within {timeout:.1f} s: "
                    f"modes {modes}\n" + "\n".join(n.log_tail(15) for n in self.nodes)
                )
            time.sleep(0.05)

    # -- faults --------------------------------------------------------------------------

    def store_faults(self) -> dict[str, Injector]:
        return {
            "store-kill-leader": self._kill_leader,
            "store-cut-leader-clients": self._cut_leader_clients,
            "store-cut-leader-peers": self._cut_leader_peers,
            "store-restart-minority": self._restart_minority,
        }

    def _kill_leader(self, rng: random.Random, lease: float) -> StoreFault:
        node = self.leader()
        node.kill()
        return StoreFault("store-kill-leader", f"zk{node.sid} (leader) SIGKILL", node.restore)

    def _cut_leader_clients(self, rng: random.Random, lease: float) -> StoreFault:
        node = self.leader()
        proxy = self._client[self.nodes.index(node)]
        proxy.drop()
        return StoreFault("store-cut-leader-clients", f"zk{node.sid} (leader)", proxy.heal)

    def _cut_leader_peers(self, rng: random.Random, lease: float) -> StoreFault:
        node, peers = self.leader(), self._peers
        assert peers is not None
        peers.isolate(node.sid)
        heal = functools.partial(peers.rejoin, node.sid)
        return StoreFault("store-cut-leader-peers", f"zk{node.sid} (leader)", heal)

    def _restart_minority(self, rng: random.Random, lease: float) -> StoreFault:
        node = rng.choice(self.nodes)
        mode = node.mode
        node.stop()
        detail = f"zk{node.sid} ({mode}) SIGTERM"
        return StoreFault("store-restart-minority", detail, node.restore)

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def _parallel(calls: list[Any]) -> None:
        """Run *calls* in threads (each node's JVM starts on its own); re-raise the first error."""
        errors: list[BaseException] = []

        def run(call: Any) -> None:
            try:
                call()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(call,)) for call in calls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]


def _synced_followers(port: int) -> int | None:
    """``zk_synced_followers`` of the leader on *port*, or None when it does not answer."""
    try:
        reply = four_letter_word(f"zookeeper://{HOST}:{port}", "mntr", 1.0)
    except OSError:
        return None
    for line in reply.splitlines():
        key, _, value = line.partition("\t")
        if key == "zk_synced_followers":
            return int(float(value))
    return None


def _make() -> StoreCluster:
    if zookeeper_classpath() is None or shutil.which("java") is None:
        raise NotInstalled("zookeeper is not installed (apt zookeeper: java and the jars)")
    return ZooKeeperEnsemble()


register_cluster(ZooKeeperEnsemble.name, _make)
