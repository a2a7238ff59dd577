"""Redis behind Sentinel (a primary, 2 replicas, 3 Sentinels) and Redlock over 5 nodes.

**Sentinel** (``redis-sentinel``, and ``redis-sentinel-wait`` with ``wait_replicas=2``).
The clients name the three Sentinels (``redis+sentinel://s1,s2,s3/mymaster/0``: the
campaign's per-member proxies sit in front of them) and reach the data nodes at the
address the Sentinels give them. That address is the node's *front*, a `_SplitProxy` of
its own, which every party uses: the Sentinels monitor the node there, replicas replicate
from it there (``replica-announce-port``), clients connect there. To cut a node from the
clients alone, or from its peers alone, the front tells them apart by their source
address: the data nodes and Sentinels open every connection from `PEER_IP`
(``bind-source-addr``), clients from 127.0.0.1. The harness itself talks to each node on
its private port, never through a front, so a cut never blinds it.

Sentinel timers are shortened (``down-after-milliseconds``, and ``SENTINEL DEBUG`` for the
INFO, publish and TILT periods: Sentinel converts a returning old master into a replica
after four publish periods, 8 s by default) so that a failover and the old primary's return
take a few seconds here; the algorithm is Sentinel's own. A node restarts as a replica of
the master the Sentinels name (what a deployment's start script does); a killed primary
restarts only once the Sentinels have promoted a replica, since without persistence it
would come back empty as the master and take the replicas' data with it.

**Redlock** (``redlock-5``): five independent ``redis-server`` nodes with ``appendonly yes``
and ``appendfsync always`` (the README's advice: a restart or crash then keeps the leases
and counters), each behind a client proxy of the cluster's own, which the URL names.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

from ..proxy import TcpProxy, _reset
from ..servers import HOST, BaseServer, RedisServer, Server, ServerError, argv
from ..store_cluster import (
    MAY_LOSE_WRITES,
    SAFE,
    Fronted,
    Injector,
    StoreCluster,
    StoreFault,
    register_cluster,
)

__all__ = ["PEER_IP", "RedlockCluster", "SentinelCluster"]

log = logging.getLogger(__name__)

#: The source address of every connection a data node or Sentinel opens (to a master, a
#: replica, another Sentinel): the fronts tell peers from clients by it.
PEER_IP = "127.0.0.2"
SERVICE = "mymaster"
#: Sentinel marks a silent master down after this long; a failover follows in 1-3 s.
DOWN_AFTER_MS = 800
FAILOVER_TIMEOUT_MS = 4000
#: ``SENTINEL DEBUG`` timers (Redis 7.0+): INFO every second (10 s by default), publish
#: every 250 ms (an old master is reconverted after 4 of them), TILT only after a 10 s
#: stall of Sentinel's own timer (2 s by default, easily hit on a loaded 2-core machine),
#: and links re-established after 1 s instead of 15.
SENTINEL_DEBUG = {
    "info-period": 1000,
    "publish-period": 250,
    "tilt-trigger": 10000,
    "tilt-period": 5000,
    "min-link-reconnect-period": 1000,
}
#: The longest a Sentinel failover may take here before the harness gives up on it.
FAILOVER_DEADLINE = 30.0
#: The shortest wait for the whole Sentinel cluster after a heal.
WHOLE_TIMEOUT = 30.0
_ADMIN_TIMEOUT = 1.0


@contextlib.contextmanager
def admin(port: int) -> Iterator[Any]:
    """A redis-py client to ``127.0.0.1:port``: short timeouts, no retries, decoded replies."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(
        host=HOST,
        port=port,
        socket_timeout=_ADMIN_TIMEOUT,
        socket_connect_timeout=_ADMIN_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )
    try:
        yield client
    finally:
        client.close()


def _until(what: str, condition: Callable[[], Any], timeout: float, why: Callable[[], str]) -> Any:
    """Poll *condition* until it returns a true value; raise `AssertionError` at the deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    last: Exception | None = None
    while True:
        try:
            found = condition()
        except Exception as exc:  # a node down or refusing for a moment: ask again
            found, last = None, exc
        else:
            last = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.1f} s ({last!r}): {why()}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


# -- the front of a data node: one address, two sides ------------------------------------------

_SIDE: contextvars.ContextVar[str] = contextvars.ContextVar("side", default="clients")


class _SplitProxy(TcpProxy):
    """A node's announced address, carrying clients and peers; `cut` drops one side.

    Peers (Sentinels, replicas) connect from `PEER_IP`, clients from anywhere else. A cut
    side's connections are reset and its new ones refused, like `TcpProxy.drop`.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__(upstream)
        self._cut: set[str] = set()

    @staticmethod
    def _side(writer: Any) -> str:
        peer = writer.get_extra_info("peername")
        return "peers" if peer and peer[0] == PEER_IP else "clients"

    def cut(self, side: str) -> None:
        async def apply() -> None:
            self._cut.add(side)
            for link in list(self._links):
                if self._side(link.writers[0]) == side:
                    link.reset()

        self._control(apply())

    def heal(self) -> None:
        async def apply() -> None:
            self._cut.clear()

        self._control(apply())
        super().heal()

    async def _carry(self, reader: Any, writer: Any) -> None:
        side = self._side(writer)
        if side in self._cut:
            self._refused += 1
            _reset(writer)
            return
        _SIDE.set(side)  # this connection's task only: `_refusing` reads it
        await super()._carry(reader, writer)

    def _refusing(self) -> bool:
        return super()._refusing() or _SIDE.get() in self._cut


# -- Sentinel -------------------------------------------------------------------------------


class _DataNode(RedisServer):
    """A data node of the Sentinel cluster: a private port, announced as its front's."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.front = _SplitProxy((HOST, self.port)).start()
        #: The front port of the master to replicate from at the next start (None: master).
        self.replicaof: int | None = None

    def command(self) -> list[str]:
        options = {
            "--protected-mode": "no",  # peers come from PEER_IP, which it counts as remote
            "--bind-source-addr": PEER_IP,
            "--replica-announce-ip": HOST,
            "--replica-announce-port": self.front.port,
            "--repl-diskless-sync-delay": 0,  # a restarted replica syncs at once, not in 5 s
            "--repl-ping-replica-period": 1,
        }
        extra = argv("", options)[1:]
        if self.replicaof is not None:
            extra += ["--replicaof", HOST, str(self.replicaof)]
        return [*super().command(), *extra]

    def start(self, timeout: float = 30.0) -> Self:
        super().start(timeout)
        self.front.upstream = (HOST, self.port)  # the port is known (or re-picked) by now
        return self

    def close(self) -> None:
        super().close()
        self.front.close()

    def __repr__(self) -> str:
        return f"<redis {self.name} front {self.front.port} -> {self._ports.get('main', '?')}>"


class _Sentinel(Server):
    """``redis-server sentinel.conf --sentinel`` (it rewrites the file with what it learns)."""

    kind = "redis-sentinel"

    def __init__(self, name: str, binary: Path, master_front: int) -> None:
        self.binary = binary
        self.name = name
        self._master_front = master_front
        super().__init__()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def prepare(self) -> None:
        (self.dir / "sentinel.conf").write_text(
            "\n".join(
                [
                    f"bind {HOST}",
                    "protected-mode no",
                    f"bind-source-addr {PEER_IP}",
                    f"sentinel announce-ip {HOST}",  # not PEER_IP, where it does not listen
                    f"sentinel monitor {SERVICE} {HOST} {self._master_front} 2",
                    f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                    f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
                    f"sentinel parallel-syncs {SERVICE} 2",
                    "",
                ]
            )
        )

    def command(self) -> list[str]:
        conf = str(self.dir / "sentinel.conf")
        return [
            str(self.binary),
            conf,
            "--sentinel",
            "--port",
            str(self.port),
            "--dir",
            str(self.dir),
        ]

    def probe(self) -> None:
        with admin(self.port) as client:
            pid = client.info("server")["process_id"]
        if pid != self.pid:
            raise ServerError(f"port {self.port} answers for PID {pid}, not ours")

    def start(self, timeout: float = 30.0) -> Self:
        super().start(timeout)
        with admin(self.port) as client:  # not kept in the config file: again at each start
            args = [str(a) for pair in SENTINEL_DEBUG.items() for a in pair]
            client.execute_command("SENTINEL", "DEBUG", *args)
        return self

    def master_front(self) -> int | None:
        """The front port of the master this Sentinel names, or None if it is not sure."""
        with admin(self.port) as client:
            info = client.sentinel_master(SERVICE)
        return int(info["port"]) if info["flags"] == "master" else None

    def __repr__(self) -> str:
        return f"<sentinel {self.name} {HOST}:{self._ports.get('main', '?')} pid={self.pid}>"


class SentinelCluster(StoreCluster):
    """A primary, two replicas and three Sentinels (quorum 2), on loopback."""

    lease = 1.0

    def __init__(self, name: str, promise: str, query: str = "") -> None:
        self.name, self.promise, self._query = name, promise, query
        self.nodes: list[_DataNode] = []
        self.sentinels: list[_Sentinel] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0{self._query}"

    @property
    def servers(self) -> tuple[BaseServer, ...]:
        return tuple(self.sentinels)

    def start(self) -> None:
        try:
            for i in range(3):
                self.nodes.append(_DataNode(f"r{i}"))
            primary = self.nodes[0].start()
            for node in self.nodes[1:]:
                node.replicaof = primary.front.port
                node.start()
            binary = primary.binary
            for i in range(3):
                self.sentinels.append(_Sentinel(f"s{i}", binary, primary.front.port).start())
            self.wait_whole(60.0)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for server in [*self.sentinels, *self.nodes]:
            with contextlib.suppress(Exception):
                server.close()

    # -- what the Sentinels and the nodes say --------------------------------------------------

    def _by_front(self, port: int) -> _DataNode:
        return next(n for n in self.nodes if n.front.port == port)

    def named_master(self) -> _DataNode | None:
        """The node a majority of the running Sentinels name master (None: no majority)."""
        votes: dict[int, int] = {}
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            with contextlib.suppress(Exception):
                port = sentinel.master_front()
                if port is not None:
                    votes[port] = votes.get(port, 0) + 1
        best = max(votes.items(), key=lambda item: item[1], default=None)
        return self._by_front(best[0]) if best is not None and best[1] >= 2 else None

    def _describe(self) -> str:
        lines = []
        for node in self.nodes:
            role = "down"
            if node.running:
                try:
                    with admin(node.port) as client:
                        info = client.info("replication")
                    role = f"{info['role']}"
                    if info["role"] == "slave":
                        role += f" of {info['master_port']} link {info['master_link_status']}"
                    else:
                        role += f" with {info['connected_slaves']} replicas"
                except Exception as exc:
                    role = f"unreachable ({exc!r})"
            lines.append(f"  {node!r}: {role}")
        for sentinel in self.sentinels:
            state = "down"
            if sentinel.running:
                try:
                    with admin(sentinel.port) as client:
                        info = client.sentinel_master(SERVICE)
                    state = (
                        f"master {info['port']} flags {info['flags']} "
                        f"others {info['num-other-sentinels']} replicas {info['num-slaves']}"
                    )
                except Exception as exc:
                    state = f"unreachable ({exc!r})"
            lines.append(f"  {sentinel!r}: {state}")
        return "\n" + "\n".join(lines)

    def _whole(self) -> bool:
        if not all(s.running for s in [*self.nodes, *self.sentinels]):
            return False
        fronts = set()
        for sentinel in self.sentinels:
            with admin(sentinel.port) as client:
                info = client.sentinel_master(SERVICE)
                if info["flags"] != "master" or int(info["num-other-sentinels"]) != 2:
                    return False
                replicas = client.sentinel_slaves(SERVICE)
            fronts.add(int(info["port"]))
            healthy = set()
            for replica in replicas:
                if replica["flags"] == "slave" and replica["master-link-status"] == "ok":
                    healthy.add(int(replica["port"]))
            if len(healthy - {int(info["port"])}) < 2:
                return False
        if len(fronts) != 1:
            return False
        master = self._by_front(fronts.pop())
        with admin(master.port) as client:
            info = client.info("replication")
        if info["role"] != "master":
            return False
        online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        if sum(1 for v in online if v.get("state") == "online") < 2:
            return False
        for node in self.nodes:
            if node is master:
                continue
            with admin(node.port) as client:
                info = client.info("replication")
            if info["role"] != "slave" or int(info["master_port"]) != master.front.port:
                return False
            if info["master_link_status"] != "up":
                return False
        return True

    def wait_whole(self, timeout: float) -> None:
        """Wait until all agree on one master with two online replicas; Sentinel's own timers
        set the pace (an old master returns as a replica a second or two after its cut
        heals), so this waits at least `WHOLE_TIMEOUT` whatever *timeout* says."""
        timeout = max(timeout, WHOLE_TIMEOUT)
        _until("the Sentinel cluster is not whole", self._whole, timeout, self._describe)

    def _new_master(self, old: _DataNode) -> _DataNode:
        """Wait until a majority of the Sentinels name a master other than *old*."""

        def promoted() -> _DataNode | None:
            found = self.named_master()
            return found if found is not None and found is not old else None

        what = f"the Sentinels did not promote a replica in place of {old.name}"
        found: _DataNode = _until(what, promoted, FAILOVER_DEADLINE, self._describe)
        return found

    def _master(self) -> _DataNode:
        found: _DataNode = _until(
            "the Sentinels name no master", self.named_master, FAILOVER_DEADLINE, self._describe
        )
        return found

    def _restart(self, node: _DataNode) -> None:
        """Start *node* again, as a replica of the master the Sentinels name."""
        master = self._master()
        node.replicaof = None if master is node else master.front.port
        node.start()

    # -- the faults ---------------------------------------------------------------------------

    def store_faults(self) -> dict[str, Injector]:
        return {
            "store-kill-leader": self._kill_leader,
            "store-cut-leader-clients": self._cut_clients,
            "store-cut-leader-peers": self._cut_peers,
            "store-restart-minority": self._restart_minority,
            "store-failover": self._failover,
        }

    def _kill_leader(self, rng: random.Random, lease: float) -> StoreFault:
        primary = self._master()
        primary.kill()

        def heal() -> None:
            # Back only once a replica was promoted: without persistence it would return
            # empty as the master, and its replicas would copy that.
            self._new_master(primary)
            self._restart(primary)

        return StoreFault("store-kill-leader", f"SIGKILL of the primary {primary.name}", heal)

    def _cut_clients(self, rng: random.Random, lease: float) -> StoreFault:
        primary = self._master()
        primary.front.cut("clients")
        return StoreFault(
            "store-cut-leader-clients",
            f"primary {primary.name} cut from the clients",
            primary.front.heal,
        )

    def _cut_peers(self, rng: random.Random, lease: float) -> StoreFault:
        primary = self._master()
        primary.front.cut("peers")

        def heal() -> None:
            # The split brain is the point: keep the old primary cut off (its clients still
            # reach it) until the Sentinels have promoted a replica, then let it back; the
            # Sentinels turn it into a replica of the new master.
            self._new_master(primary)
            primary.front.heal()

        detail = f"primary {primary.name} cut from the replicas and Sentinels"
        return StoreFault("store-cut-leader-peers", detail, heal)

    def _restart_minority(self, rng: random.Random, lease: float) -> StoreFault:
        primary = self._master()
        candidates: list[_DataNode | _Sentinel] = [n for n in self.nodes if n is not primary]
        candidates += self.sentinels
        server = rng.choice(candidates)
        server.stop()

        def heal() -> None:
            if isinstance(server, _DataNode):
                self._restart(server)
            else:
                server.start()

        what = "replica" if isinstance(server, _DataNode) else "Sentinel"
        return StoreFault("store-restart-minority", f"{what} {server.name} restarted", heal)

    def _failover(self, rng: random.Random, lease: float) -> StoreFault:
        primary = self._master()
        sentinel = rng.choice(self.sentinels)

        def ask() -> bool:
            with admin(sentinel.port) as client:
                client.execute_command("SENTINEL", "FAILOVER", SERVICE)
            return True

        # NOGOODSLAVE or INPROG for a moment after an earlier fault: ask again.
        _until(f"SENTINEL FAILOVER refused by {sentinel.name}", ask, 10.0, self._describe)

        def heal() -> None:
            self._new_master(primary)

        detail = f"SENTINEL FAILOVER from {primary.name} (asked {sentinel.name})"
        return StoreFault("store-failover", detail, heal)


# -- Redlock --------------------------------------------------------------------------------


class _Fronted(Fronted):
    """A Redlock node as the clients reach it: through the cluster's own proxy."""

    kind = "redis"
    node: RedisServer

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.proxy.port}/0"

    def probe(self) -> None:
        self.node.probe()

    def start(self, timeout: float = 30.0) -> Self:
        return self

    def __repr__(self) -> str:
        return f"<redlock node {HOST}:{self.proxy.port} -> {self.node!r}>"


class RedlockCluster(StoreCluster):
    """Five independent Redis nodes, persistent (AOF fsynced on every write)."""

    name = "redlock-5"
    promise = SAFE
    #: 1 s (a 200 ms node timeout) is not stable here: with an fsync on every write, 3 of
    #: the 5 nodes sometimes miss a renewal's timeout on a loaded 2-core machine.
    lease = 2.0
    #: Nodes a fault takes out: a minority of 5.
    MINORITY = 2

    def __init__(self) -> None:
        self.nodes: list[RedisServer] = []
        self.fronts: list[_Fronted] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"{f.host}:{f.port}" for f in self.fronts)
        return f"redlock://{hosts}/0"

    @property
    def servers(self) -> tuple[BaseServer, ...]:
        return tuple(self.fronts)

    def start(self) -> None:
        try:
            for _ in range(5):
                node = RedisServer(persistent=True)
                self.nodes.append(node)
                node.start()
                proxy = TcpProxy((node.host, node.port)).start()
                self.fronts.append(_Fronted(node, proxy))
            self.wait_whole(30.0)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for front in self.fronts:
            with contextlib.suppress(Exception):
                front.proxy.close()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()

    def wait_whole(self, timeout: float) -> None:
        def whole() -> bool:
            for front in self.fronts:
                if not front.node.running:
                    return False
                with admin(front.port) as client:  # through the client proxy: healed too
                    client.ping()
            return True

        _until("the Redlock nodes are not all up", whole, timeout, lambda: repr(self.fronts))

    def store_faults(self) -> dict[str, Injector]:
        return {
            "store-kill-leader": self._kill_minority,
            "store-cut-leader-clients": self._cut_minority,
            "store-restart-minority": self._restart_minority,
        }

    def _minority(self, rng: random.Random) -> list[_Fronted]:
        return sorted(rng.sample(self.fronts, self.MINORITY), key=self.fronts.index)

    def _names(self, fronts: list[_Fronted]) -> str:
        return ", ".join(f"node {self.fronts.index(f)} ({f.port})" for f in fronts)

    def _kill_minority(self, rng: random.Random, lease: float) -> StoreFault:
        # Redlock has no leader node: "kill the leader" becomes "kill a minority".
        chosen = self._minority(rng)
        for front in chosen:
            front.node.kill()

        def heal() -> None:
            for front in chosen:
                front.node.start()  # same port, same AOF: its leases and counter are back

        return StoreFault("store-kill-leader", f"SIGKILL of {self._names(chosen)}", heal)

    def _cut_minority(self, rng: random.Random, lease: float) -> StoreFault:
        chosen = self._minority(rng)
        for front in chosen:
            front.proxy.drop()

        def heal() -> None:
            for front in chosen:
                front.proxy.heal()

        detail = f"{self._names(chosen)} cut from the clients"
        return StoreFault("store-cut-leader-clients", detail, heal)

    def _restart_minority(self, rng: random.Random, lease: float) -> StoreFault:
        chosen = self._minority(rng)
        for front in chosen:
            front.node.stop()

        def heal() -> None:
            for front in chosen:
                front.node.start()

        return StoreFault("store-restart-minority", f"restart of {self._names(chosen)}", heal)


register_cluster("redis-sentinel", lambda: SentinelCluster("redis-sentinel", MAY_LOSE_WRITES))
register_cluster(
    "redis-sentinel-wait",
    lambda: SentinelCluster("redis-sentinel-wait", SAFE, "?wait_replicas=2"),
)
register_cluster("redlock-5", RedlockCluster)
