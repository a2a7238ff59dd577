"""Clustered stores on loopback, and the campaign that fails the store itself over.

A `StoreCluster` is a store as users deploy it when one machine is not enough (etcd with
three members, a ZooKeeper ensemble, Redis behind Sentinel, Redlock over five nodes,
PostgreSQL with a streaming standby), started without Docker like the single servers of
`servers.py`. Each subclass lives in ``harness/clusters/<name>.py`` and registers itself
in `CLUSTERS`; it says:

- ``url``: the client URL that names every node (``etcd://h1:p1,h2:p2,h3:p3``...), and
  ``servers``: the client-facing node servers, in the URL's order, so that `proxied_urls`
  gives each campaign member a proxy of its own per node (a node can then be cut off from
  one member, or, through every member's proxy of that node, from all clients);
- ``store_faults()``: the store-side faults it can throw, by kind (`STORE_KINDS`), each an
  injector ``(rng, lease) -> StoreFault`` that starts the fault and returns how to end it;
- ``wait_whole(timeout)``: after a heal, every node is back, replicating, and the store
  has a leader or primary again;
- ``promise``: whether the election must stay safe through every store fault as the
  cluster is configured (`SAFE`), or may lose an acknowledged write on failover
  (`MAY_LOSE_WRITES`: asynchronous replication), in which case the campaign counts the
  overlaps and token regressions instead of failing on the first (the measure the issue
  asks for), and a mitigated configuration of the same store must show none.

`ClusterCampaign` is the participant campaign of `campaign.py` with the store faults added
to its kinds; the checker is the same (overlap, token order, work with an old token,
liveness after each fault).
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from multilock.core.testing import Cluster

from .backends import Backend
from .campaign import Campaign
from .faults import RECOVERY_BOUND
from .proxy import TcpProxy
from .servers import BaseServer

__all__ = [
    "CLUSTERS",
    "MAY_LOSE_WRITES",
    "PARTICIPANT_KINDS",
    "SAFE",
    "STORE_KINDS",
    "ClusterCampaign",
    "Fronted",
    "StoreCluster",
    "StoreFault",
    "plan_store",
    "register_cluster",
]

SAFE = "safe"
MAY_LOSE_WRITES = "may-lose-writes"

#: Store-side fault kinds. A cluster offers those that apply to it:
#:
#: - ``store-kill-leader``: SIGKILL of the store's leader node or primary; restarted on heal;
#: - ``store-cut-leader-clients``: every client's proxy of the leader node drops connections;
#: - ``store-cut-leader-peers``: the leader node cut off from the other nodes (peer proxies);
#: - ``store-restart-minority``: a minority of nodes stopped, then started again;
#: - ``store-failover``: the store's own failover: Sentinel promotes a replica, a standby is
#:   promoted with ``pg_ctl promote`` (the old primary is fenced off and rejoins as a standby).
STORE_KINDS = (
    "store-kill-leader",
    "store-cut-leader-clients",
    "store-cut-leader-peers",
    "store-restart-minority",
    "store-failover",
)


class Fronted(BaseServer):
    """A cluster's node as clients reach it: through the client proxy in front of it.

    The URL names the proxy, so cutting the proxy cuts the node off from the clients
    alone. The cluster starts and closes both; a subclass names its ``kind`` and ``url``.
    """

    def __init__(self, node: Any, proxy: TcpProxy) -> None:
        self.node, self.proxy = node, proxy

    @property
    def host(self) -> str:
        return self.proxy.host

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def pid(self) -> int | None:
        pid: int | None = self.node.pid
        return pid

    @property
    def log_path(self) -> Path | None:
        path: Path | None = self.node.log_path
        return path

    def close(self) -> None:
        """Nothing of its own: the cluster closes the node and the proxy."""


@attrs.define
class StoreFault:
    """A store fault in progress: *heal* ends it (restarts, heals proxies, rejoins)."""

    kind: str
    detail: str
    heal: Callable[[], None]


Injector = Callable[[random.Random, float], StoreFault]


class StoreCluster(ABC):
    """A multi-node store on loopback; see the module docstring."""

    #: The backend name in reports and test ids: "etcd-3", "redis-sentinel"...
    name: str = ""
    #: The lease the campaign's members use, in seconds.
    lease: float = 2.0
    promise: str = SAFE

    @property
    @abstractmethod
    def url(self) -> str:
        """The client URL naming every client-facing node, in the order of `servers`."""

    @property
    @abstractmethod
    def servers(self) -> tuple[BaseServer, ...]:
        """The client-facing nodes (what clients connect to), in the URL's order."""

    @abstractmethod
    def start(self) -> None:
        """Start every node and wait until the store answers through them."""

    @abstractmethod
    def close(self) -> None:
        """Stop every node and remove its data."""

    @abstractmethod
    def store_faults(self) -> dict[str, Injector]:
        """The store-side faults this cluster can throw, by kind (a subset of `STORE_KINDS`)."""

    @abstractmethod
    def wait_whole(self, timeout: float) -> None:
        """Return once every node is up, replicating, and the store has a leader/primary."""

    def backend(self) -> Backend:
        return Backend(name=self.name, url=self.url, servers=self.servers, lease=self.lease)

    def __enter__(self) -> StoreCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: name -> factory of each clustered store (a subclass registers itself on import).
CLUSTERS: dict[str, Callable[[], StoreCluster]] = {}


def register_cluster(name: str, factory: Callable[[], StoreCluster]) -> None:
    CLUSTERS[name] = factory


#: The participant faults thrown between store faults (each needs the members' proxies).
PARTICIPANT_KINDS = ("kill", "stop", "cut-drop")


class ClusterCampaign(Campaign):
    """`Campaign` over a `StoreCluster`: the participant faults plus the store's own."""

    def __init__(
        self,
        store: StoreCluster,
        cluster: Cluster,
        proxies: list[list[TcpProxy]],
        rng: random.Random,
    ) -> None:
        super().__init__(store.backend(), cluster, proxies, rng, not_applicable={})
        self.store = store
        self._injectors = store.store_faults()

    @property
    def kinds(self) -> list[str]:
        return [*PARTICIPANT_KINDS, *(k for k in STORE_KINDS if k in self._injectors)]

    @property
    def store_kinds(self) -> list[str]:
        return [k for k in STORE_KINDS if k in self._injectors]

    def _throw(self, kind: str):  # type: ignore[no-untyped-def]  # Campaign's signature
        if kind not in self._injectors:
            return super()._throw(kind)
        found = self.log.wait_for_leader(self.bound + RECOVERY_BOUND)
        assert found is not None
        leader, token, started = found
        self._lag = None
        at = time.monotonic()
        fault = self._injectors[kind](self.rng, self.lease)
        self._detail = fault.detail
        self._sleep_until(at + self._hold(1.1, 1.6))  # past a lease: terms must end or hold
        fault.heal()
        self.store.wait_whole(self.bound + RECOVERY_BOUND)
        self._heal()
        deadline = time.monotonic() + self.bound + RECOVERY_BOUND
        return self._outcome(kind, leader, token, at, deadline, started)


def plan_store(kinds: Sequence[str], store_kinds: Sequence[str], count: int | None,
               rng: random.Random) -> list[str]:  # fmt: skip
    """Each kind once, then up to *count* faults of which two thirds are store faults."""
    order = rng.sample(list(kinds), len(kinds))
    if count is None or count <= len(order):
        return order[:count]
    more = [
        rng.choice(list(store_kinds)) if rng.random() < 2 / 3 else rng.choice(list(kinds))
        for _ in range(count - len(order))
    ]
    return order + more
