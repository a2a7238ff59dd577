"""PostgreSQL with streaming standbys on loopback, failed over by promoting a standby.

Two clusters register here:

- ``postgres-standby``: a primary and one standby, asynchronous replication (PostgreSQL's
  default). A commit is acknowledged once it is on the primary alone, so a promotion after
  the primary crashed may lose the last acquires and renewals: `MAY_LOSE_WRITES`, and the
  campaign counts the overlaps and token regressions that follow.
- ``postgres-sync``: a primary and two standbys, ``synchronous_standby_names = 'ANY 1 (*)'``
  with ``synchronous_commit = on``: a commit is acknowledged only once one standby has
  flushed it, and the failover promotes the standby that received the most WAL, which
  therefore holds every acknowledged commit: `SAFE`. Two standbys, not one, so that a
  standby restart does not stall every commit (with one synchronous standby the primary
  waits for it while it is down).

Each node runs as the ``postgres`` user (``PostgresServer``: a copy of the session's
``initdb`` template, or a ``pg_basebackup -R`` of the current primary for a standby) and
sits behind two proxies of the cluster's own: a client proxy, which the URL names
(``postgresql://postgres@c1,c2/postgres?target_session_attrs=read-write``, so libpq finds
the primary among them), and a peer proxy, which standbys replicate through. The peer
proxies delay every chunk by `REPLICATION_DELAY` (a standby in another region: the lag an
asynchronous failover loses), in both clusters, so that only the replication mode differs.
`wait_whole` waits for a writable primary and every standby streaming its timeline (and,
synchronous, counted for the quorum); a standby may still be catching up.

Faults (`STORE_KINDS`), each naming its node in the detail:

- ``store-failover``: a planned switchover: the primary is shut down cleanly (``SIGINT``,
  which first sends every WAL record to the connected standbys), the most advanced
  standby is promoted (``pg_promote()``, what ``pg_ctl promote`` does), the others follow
  it; on heal the old primary is rebuilt as a standby of the new one (a fresh
  ``pg_basebackup``: its data may hold commits the new timeline does not);
- ``store-kill-leader``: a crash: the primary's replication link is cut (what was still on
  its way to the standbys is lost with the machine) and the primary SIGKILLed; a random
  0 to `DETECTION` leases later (the failure detector) the most advanced standby is
  promoted, the others follow, and the heal rebuilds the old primary as above. The
  failover asynchronous replication may lose acknowledged writes to;
- ``store-cut-leader-clients``: the primary's client proxy drops every connection; no
  promotion, the outage lasts until heal;
- ``store-cut-leader-peers``: the primary's peer proxy drops replication; with
  synchronous replication the primary then waits for a standby and every commit stalls
  until heal (documented, and the liveness check after heal still applies);
- ``store-restart-minority``: one standby stopped, started again on heal.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import subprocess
import time
from typing import Any, Self

from ..proxy import TcpProxy
from ..servers import START_TIMEOUT, BaseServer, PostgresServer, ServerError, argv
from ..store_cluster import (
    MAY_LOSE_WRITES,
    SAFE,
    Fronted,
    Injector,
    StoreCluster,
    StoreFault,
    register_cluster,
)

__all__ = ["DETECTION", "REPLICATION_DELAY", "PostgresCluster"]

#: The settings every node runs with (a standby uses them once promoted).
_SETTINGS = (
    "wal_log_hints=on",  # so that pg_rewind works on these data dirs, if wanted
    "wal_keep_size=256MB",
    # A standby cut off from its primary retries its connection this often, not every 5 s.
    "wal_retrieve_retry_interval=100ms",
    "wal_receiver_status_interval=1s",
    "wal_sender_timeout=5s",
    "wal_receiver_timeout=5s",
    "hot_standby=on",
)
#: The one-way delay of every replication link: a standby in another region (a round
#: trip of 100 ms), whose lag is what an asynchronous failover loses. The same for both
#: clusters, so that only the replication mode differs.
REPLICATION_DELAY = 0.05
#: After a crash of the primary, the standby is promoted after a random delay of up to
#: this many leases (the failure detector's timeout: Patroni, repmgr, a human).
DETECTION = 1.0
#: A standby ``pg_basebackup`` copies from the primary (through its peer proxy).
_BASEBACKUP_TIMEOUT = 60.0
#: How long a promoted standby may take to accept writes.
_PROMOTE_TIMEOUT = 30
#: How long a standby told to follow a new primary may take to stream from it before it
#: is rebuilt instead.
_FOLLOW_TIMEOUT = 5.0


class _Node(PostgresServer):
    """One PostgreSQL node: a copy of the template (the first primary) or a base backup of
    the primary at *upstream* (a standby), run with the cluster's settings."""

    def __init__(self, name: str, settings: tuple[str, ...]) -> None:
        super().__init__()
        self.name = name
        self.settings = settings
        #: Where to take the base backup from when (re)built as a standby, else None.
        self.upstream: tuple[str, int] | None = None

    def prepare(self) -> None:
        if self.upstream is None:
            super().prepare()
        else:
            self._basebackup(self.upstream)

    def command(self) -> list[str]:
        return [*super().command(), *(arg for opt in self.settings for arg in ("-c", opt))]

    def rebuild(self, upstream: tuple[str, int], timeout: float = START_TIMEOUT) -> None:
        """Throw the data away and start again as a standby of *upstream*."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.upstream = upstream
        self._basebackup(upstream)
        self.start(timeout)

    def _basebackup(self, upstream: tuple[str, int]) -> None:
        self.chown_dir()
        host, port = upstream
        conninfo = f"host={host} port={port} user=postgres application_name={self.name}"
        options = {"-D": self.data_dir, "-d": conninfo, "-X": "stream", "-c": "fast"}
        command = [*argv(self.bindir / "pg_basebackup", options), "-R", "--no-sync"]
        with open(self.log_path, "ab") as log:
            log.write(f"--- harness: {' '.join(command)}\n".encode())
            log.flush()
            done = subprocess.run(
                self.as_run_as(command),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                timeout=_BASEBACKUP_TIMEOUT,
                check=False,
            )
        if done.returncode != 0:
            raise ServerError(f"pg_basebackup of {self.name} failed:\n{self.log_tail()}")

    def sql(self, query: str, timeout: float = 2.0) -> list[tuple[Any, ...]]:
        """Run *query* on this node directly (not through a proxy), autocommit."""
        import psycopg

        with psycopg.connect(
            self.url, connect_timeout=max(1, round(timeout)), autocommit=True
        ) as conn:
            cur = conn.execute(query.encode())
            return cur.fetchall() if cur.description is not None else []

    def __repr__(self) -> str:
        return f"<{self.name} {super().__repr__()[1:]}"


class _Endpoint(Fronted):
    """What clients see of a node: its client proxy (the URL names it)."""

    kind = "postgres"
    node: _Node

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/postgres"

    @property
    def control_unavailable(self) -> str:
        return "a node of a PostgreSQL cluster: the cluster's own faults stop and rebuild it"

    def probe(self) -> None:
        self.node.probe()

    def start(self, timeout: float = START_TIMEOUT) -> Self:
        self.wait_ready(time.monotonic() + timeout)
        return self

    def __repr__(self) -> str:
        return f"<postgres endpoint {self.host}:{self.port} -> {self.node!r}>"


class PostgresCluster(StoreCluster):
    """A primary and *standbys* streaming standbys; see the module docstring."""

    lease = 1.0

    def __init__(
        self,
        name: str,
        *,
        standbys: int,
        synchronous: bool,
        replication_delay: float = 0.0,
        detection: float = 0.0,
    ) -> None:
        self.name = name
        self.promise = SAFE if synchronous else MAY_LOSE_WRITES
        self.synchronous = synchronous
        self.replication_delay = replication_delay
        self.detection = detection
        settings: tuple[str, ...] = _SETTINGS
        if synchronous:
            settings += ("synchronous_standby_names=ANY 1 (*)", "synchronous_commit=on")
        self.nodes = [_Node(f"node{i}", settings) for i in range(standbys + 1)]
        self.primary = 0
        self.client_proxies: list[TcpProxy] = []
        self.peer_proxies: list[TcpProxy] = []
        self._endpoints: tuple[_Endpoint, ...] = ()

    # -- the surface -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        hosts = ",".join(f"{e.host}:{e.port}" for e in self._endpoints)
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    @property
    def servers(self) -> tuple[BaseServer, ...]:
        return self._endpoints

    @property
    def standbys(self) -> list[_Node]:
        return [n for i, n in enumerate(self.nodes) if i != self.primary]

    def start(self) -> None:
        deadline = time.monotonic() + 120.0
        try:
            for i, node in enumerate(self.nodes):
                if i != self.primary:
                    node.upstream = self.peer_proxies[self.primary].address
                node.start()
                # After the start: a port re-picked because it was taken is known by now.
                self.peer_proxies.append(TcpProxy((node.host, node.port)).start())
                self.client_proxies.append(TcpProxy((node.host, node.port)).start())
            self._delay_peers()
            self._endpoints = tuple(
                _Endpoint(n, p) for n, p in zip(self.nodes, self.client_proxies, strict=True)
            )
            self.wait_whole(max(deadline - time.monotonic(), 10.0))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for proxy in [*self.client_proxies, *self.peer_proxies]:
            proxy.close()
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()

    def store_faults(self) -> dict[str, Injector]:
        return {
            "store-kill-leader": self._kill_leader,
            "store-cut-leader-clients": self._cut_leader_clients,
            "store-cut-leader-peers": self._cut_leader_peers,
            "store-restart-minority": self._restart_minority,
            "store-failover": self._failover,
        }

    def wait_whole(self, timeout: float) -> None:
        """Wait for a writable primary with every standby streaming from it (and, with
        synchronous replication, one of them acknowledging commits)."""
        deadline = time.monotonic() + timeout
        state: object = None
        while True:
            try:
                state = self._replication()
                if state == "whole":
                    return
            except Exception as exc:
                state = exc
            if time.monotonic() > deadline:
                logs = "\n".join(f"{n.name}:\n{n.log_tail(15)}" for n in self.nodes)
                raise AssertionError(
                    f"{self.name} not whole within {timeout:.1f} s: {state}\n{logs}"
                )
            time.sleep(0.05)

    # -- faults ------------------------------------------------------------------------------

    def _failover(self, rng: random.Random, lease: float) -> StoreFault:
        old = self.nodes[self.primary]
        old.stop()
        return self._promote(rng, "store-failover", f"{old.name} shut down")

    def _kill_leader(self, rng: random.Random, lease: float) -> StoreFault:
        # A machine that dies: what its standbys had not received yet (still in its
        # buffers or on the wire) is gone with it, so its replication link is cut first.
        old = self.nodes[self.primary]
        link = self.peer_proxies[self.primary]
        detect = rng.uniform(0.0, self.detection * lease)
        at = time.monotonic()
        link.drop()
        old.kill()
        time.sleep(max(0.0, at + detect - time.monotonic()))  # the failure detector's delay
        fault = self._promote(
            rng, "store-kill-leader", f"{old.name} SIGKILLed, promotion after {detect:.2f} s"
        )

        def heal() -> None:
            link.heal()
            self._delay_peers()
            fault.heal()

        return StoreFault(fault.kind, fault.detail, heal)

    def _cut_leader_clients(self, rng: random.Random, lease: float) -> StoreFault:
        proxy = self.client_proxies[self.primary]
        proxy.drop()
        return StoreFault(
            "store-cut-leader-clients",
            f"{self.nodes[self.primary].name} (primary) cut from clients",
            proxy.heal,
        )

    def _cut_leader_peers(self, rng: random.Random, lease: float) -> StoreFault:
        proxy = self.peer_proxies[self.primary]
        proxy.drop()

        def heal() -> None:
            proxy.heal()
            self._delay_peers()

        return StoreFault(
            "store-cut-leader-peers",
            f"{self.nodes[self.primary].name} (primary) cut from its standbys",
            heal,
        )

    def _restart_minority(self, rng: random.Random, lease: float) -> StoreFault:
        node = rng.choice(self.standbys)
        node.stop()

        def heal() -> None:
            node.start()

        return StoreFault("store-restart-minority", f"{node.name} (standby) stopped", heal)

    # -- steps -------------------------------------------------------------------------------

    def _promote(self, rng: random.Random, kind: str, what: str) -> StoreFault:
        """Promote the standby that received the most WAL from the old primary, once none
        receives any more; the others follow it. The heal rebuilds the old primary as a
        standby of the new one, and any other standby that could not follow."""
        old = self.nodes[self.primary]
        self._wait_quiet(self.standbys, _FOLLOW_TIMEOUT)
        received = {}
        for node in self.standbys:
            [(lsn,)] = node.sql("SELECT pg_wal_lsn_diff(pg_last_wal_receive_lsn(), '0/0')")
            received[node.name] = float(lsn or 0)
        best = max(received.values())
        chosen = rng.choice([n for n in self.standbys if received[n.name] == best])
        chosen.sql(f"SELECT pg_promote(true, {_PROMOTE_TIMEOUT})", timeout=_PROMOTE_TIMEOUT + 5)
        self.primary = self.nodes.index(chosen)
        upstream = self.peer_proxies[self.primary].address
        for node in self.standbys:
            if node is not old:
                self._follow(node, upstream)

        def heal() -> None:
            old.rebuild(upstream)
            for node in self.standbys:
                if node is not old and not self._follows(node, _FOLLOW_TIMEOUT):
                    node.rebuild(upstream)  # it could not switch to the new timeline

        return StoreFault(kind, f"{what}, {chosen.name} promoted", heal)

    def _wait_quiet(self, standbys: list[_Node], timeout: float) -> None:
        """Wait until no standby streams from the dead primary: whatever was on its way
        to them has arrived (or was lost), so their received positions are final."""
        deadline = time.monotonic() + timeout
        query = "SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'"
        while any(node.sql(query) != [(0,)] for node in standbys):
            if time.monotonic() > deadline:
                return  # promote anyway: the follow check at heal repairs a wrong choice
            time.sleep(0.02)

    def _follow(self, node: _Node, upstream: tuple[str, int]) -> None:
        """Point a standby at a new primary (primary_conninfo reloads without a restart)."""
        host, port = upstream
        conninfo = f"host={host} port={port} user=postgres application_name={node.name}"
        node.sql(f"ALTER SYSTEM SET primary_conninfo = '{conninfo}'")
        node.sql("SELECT pg_reload_conf()")
        node.upstream = upstream

    def _follows(self, node: _Node, timeout: float) -> bool:
        """Whether *node* streams the primary's timeline within *timeout* seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self._lag(node, self._timeline()) is None:
                    return True
            time.sleep(0.05)
        return False

    def _timeline(self) -> int:
        """The primary's current timeline (from its WAL file's name)."""
        [(name,)] = self.nodes[self.primary].sql("SELECT pg_walfile_name(pg_current_wal_lsn())")
        return int(name[:8], 16)

    def _lag(self, node: _Node, timeline: int) -> str | None:
        """What keeps standby *node* from following the primary on *timeline*, or None."""
        rows = node.sql("SELECT status, received_tli FROM pg_stat_wal_receiver")
        if rows != [("streaming", timeline)]:
            return f"{node.name} receives {rows or 'nothing'}, not timeline {timeline}"
        return None

    def _replication(self) -> str:
        """``"whole"``, or what is missing."""
        primary = self.nodes[self.primary]
        [(recovering,)] = primary.sql("SELECT pg_is_in_recovery()")
        if recovering:
            return f"{primary.name} is not writable yet"
        timeline = self._timeline()
        for node in self.standbys:
            lag = self._lag(node, timeline)
            if lag is not None:
                return lag
        rows = primary.sql("SELECT application_name, state, sync_state FROM pg_stat_replication")
        streaming = {name for name, state, _ in rows if state == "streaming"}
        missing = [n.name for n in self.standbys if n.name not in streaming]
        if missing:
            return f"not streaming from {primary.name}: {', '.join(missing)} (seen: {rows})"
        if self.synchronous and any(s not in ("sync", "quorum") for *_, s in rows):
            return f"not every standby acknowledges commits yet: {rows}"
        return "whole"

    def _delay_peers(self) -> None:
        if self.replication_delay:
            for proxy in self.peer_proxies:
                proxy.delay(self.replication_delay)


register_cluster(
    "postgres-standby",
    lambda: PostgresCluster(
        "postgres-standby",
        standbys=1,
        synchronous=False,
        replication_delay=REPLICATION_DELAY,
        detection=DETECTION,
    ),
)
register_cluster(
    "postgres-sync",
    lambda: PostgresCluster(
        "postgres-sync",
        standbys=2,
        synchronous=True,
        replication_delay=REPLICATION_DELAY,
        detection=DETECTION,
    ),
)
