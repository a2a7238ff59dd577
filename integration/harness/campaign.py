"""The fault campaign: a seeded random sequence of faults thrown at a 3-member `Cluster`.

Each member reaches every server through a `TcpProxy` of its own, so a network fault can
cut off or slow down the leader alone. The faults (`KINDS`):

- ``kill``: SIGKILL of the leader (relaunched once a successor leads);
- ``stop``: SIGSTOP of the leader for 1.1..1.6 leases, then SIGCONT;
- ``term``: SIGTERM of the leader (it releases and exits; relaunched);
- ``resign``: the leader resigns (SIGUSR1);
- ``restart``: one server stopped and started again on its port, only where this process
  controls it and the store keeps its data or at least its tokens (not moto, not Azurite);
  a store that forgets its leases (Redis without persistence) stays down past a lease;
- ``cut-drop``, ``cut-blackhole``, ``cut-oneway``: the leader's proxies reset every
  connection, or black-hole both directions, or one (drawn from the seed);
- ``slow-leader``: the leader's proxies hold each chunk 1.2..2 leases;
- ``slow-all``: every proxy holds each chunk an eighth of the renew interval, for 1..1.5
  leases: the leader must keep its term or hand over safely.

A cut or slowed leader must log the end of its term with a deadline no later than the
fault's start plus one lease. After each fault the campaign waits (each wait with a
deadline derived from the lease, `failover_bound` and the fault's own duration) until one
member leads and the cluster is whole again: killed members relaunched, frozen ones
thawed, proxies healed. `Cluster.check()` judges the whole run at the end.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import time
from collections.abc import Callable, Sequence

import attrs

from multilock.core.testing import Cluster, Member

from .backends import Backend
from .faults import RECOVERY_BOUND, STARTUP_TIMEOUT, ClusterLog, failover_bound
from .proxy import Direction, TcpProxy, route_url

__all__ = [
    "FAILOVER_KINDS",
    "HANDOFF_KINDS",
    "KINDS",
    "Campaign",
    "Outcome",
    "plan",
    "proxied_urls",
]

#: The ``lost`` line follows the local deadline within this long (the election ends the
#: term on time even while a store call is still settling; generous for a loaded machine).
STEP_DOWN_LAG = 1.0
KINDS = (
    "kill", "stop", "term", "resign", "restart",
    "cut-drop", "cut-blackhole", "cut-oneway", "slow-leader", "slow-all",
)  # fmt: skip
NETWORK_KINDS = frozenset({"cut-drop", "cut-blackhole", "cut-oneway", "slow-leader", "slow-all"})
FAILOVER_KINDS = frozenset(
    {"kill", "stop", "cut-drop", "cut-blackhole", "cut-oneway", "slow-leader"}
)
HANDOFF_KINDS = frozenset({"term", "resign"})
#: Stores whose restart wipes everything, tokens included: no restart fault on them.
WIPED_BY_RESTART = {
    "s3": "moto keeps its objects in memory: a restart wipes the store, tokens included",
    "azure_blob": "Azurite runs in memory: a restart wipes the store, tokens included",
}
#: Stores whose restart forgets the leases but keeps tokens rising (seeded from the clock):
#: the server stays down past a lease, so that the leader has stepped down before it returns.
FORGETS_LEASES = frozenset({"redis"})
NO_NETWORK = "no network: the store is a local file system"
#: How long past a fault's bound older terms may take to log their end (a store call that
#: hangs until its own timeout, e.g. psycopg cancelling a query, holds up the ``lost`` line).
SETTLE = 30.0
#: A participant stops within this long of SIGTERM (it releases within a renew interval).
STOP_TIMEOUT = 10.0


def plan(kinds: Sequence[str], count: int | None, rng: random.Random) -> list[str]:
    """Each kind once in a random order, then random kinds up to *count* (None: one round)."""
    order = rng.sample(list(kinds), len(kinds))
    if count is None or count <= len(order):
        return order[:count]
    return order + [rng.choice(order) for _ in range(count - len(order))]


def proxied_urls(
    backend: Backend, members: int, stack: contextlib.ExitStack
) -> tuple[list[list[TcpProxy]], list[str]]:
    """A proxy per member and server (closed by *stack*), and each member's URL through them.

    Raise `ValueError` when the backend has no server or its URL cannot be routed.
    """
    if not backend.servers:
        raise ValueError(NO_NETWORK)
    proxies, urls = [], []
    for _ in range(members):
        mine = [stack.enter_context(TcpProxy((s.host, s.port))) for s in backend.servers]
        routes = {(s.host, s.port): p.address for s, p in zip(backend.servers, mine, strict=True)}
        urls.append(route_url(backend.url, routes))
        proxies.append(mine)
    return proxies, urls


@attrs.frozen
class Outcome:
    """One fault and what followed it."""

    kind: str
    detail: str
    old: str
    old_token: int
    new: str
    new_token: int
    #: Seconds from the fault's start to the next term's acquisition (0 when kept).
    to_leader: float
    #: The leader's term went on through the fault (same token).
    kept: bool
    #: For a cut or slowed leader: seconds from its term's deadline to its ``lost`` line
    #: (how long a hung store call held up the step-down; the term ended on time).
    step_down_lag: float | None = None


class Campaign:
    """Throw faults at *cluster* (members' proxies in *proxies*, by member index)."""

    def __init__(
        self,
        backend: Backend,
        cluster: Cluster,
        proxies: list[list[TcpProxy]] | None,
        rng: random.Random,
        not_applicable: dict[str, str],
    ) -> None:
        self.backend, self.cluster, self.proxies, self.rng = backend, cluster, proxies, rng
        self.log = ClusterLog(cluster)
        self.lease = backend.lease
        self.bound = failover_bound(backend)
        self.not_applicable = dict(not_applicable)
        self.outcomes: list[Outcome] = []
        self.started = self.finished = 0.0
        self._detail = ""
        self._lag: float | None = None

    @staticmethod
    def applicable(backend: Backend, network: str | None) -> dict[str, str]:
        """Why each kind that cannot run on *backend* is n/a (*network*: why no proxies)."""
        reasons = dict.fromkeys(NETWORK_KINDS, network) if network else {}
        uncontrolled = [s.control_unavailable for s in backend.servers if s.control_unavailable]
        if not backend.servers:
            reasons["restart"] = "no server to restart (the store is local files)"
        elif backend.name in WIPED_BY_RESTART:
            reasons["restart"] = WIPED_BY_RESTART[backend.name]
        elif uncontrolled:
            reasons["restart"] = uncontrolled[0]
        return {kind: reasons[kind] for kind in KINDS if kind in reasons}

    @property
    def kinds(self) -> list[str]:
        return [kind for kind in KINDS if kind not in self.not_applicable]

    def run(self, kinds: Sequence[str]) -> None:
        """Throw *kinds* one after the other; on a failure, name an overlap first if any."""
        self.log.first_leader()
        self.started = time.monotonic()
        for number, kind in enumerate(kinds, 1):
            try:
                self.outcomes.append(self._throw(kind))
            except AssertionError as exc:
                report = self.cluster.check()
                unsafe = (
                    "timeline problems in the logs so far (a live member's term shows as open "
                    f"until it logs its end): {report.problems}\n{report.describe()}\n"
                    if report.problems
                    else ""
                )
                raise AssertionError(
                    f"{unsafe}{self.backend.name}: fault {number} ({kind} {self._detail}): {exc}"
                ) from None
        self.finished = time.monotonic()

    # -- the faults ----------------------------------------------------------------------------

    def _throw(self, kind: str) -> Outcome:
        found = self.log.wait_for_leader(self.bound + STARTUP_TIMEOUT)
        assert found is not None
        leader, token, _ = found
        self._detail, self._lag = "", None
        fault: Callable[[Member, int], tuple[float, float]] = getattr(
            self, "_" + kind.replace("-", "_")
        )
        since, deadline = fault(leader, token)
        self._heal()
        return self._outcome(kind, leader, token, since, deadline)

    def _kill(self, leader: Member, token: int) -> tuple[float, float]:
        at = self.cluster.kill(leader)
        # Relaunch (in _heal) only once a successor leads: a process started again under
        # the same participant id within the lease would take its predecessor's live term
        # back (a holder's acquire returns its own term), and with it the same token.
        self.log.wait_for_leader(self.bound, newer_than=token, sole=False)
        return at, at + self.bound

    def _stop(self, leader: Member, token: int) -> tuple[float, float]:
        held = self._hold(1.1, 1.6)
        at = self.cluster.freeze(leader)
        self._sleep_until(at + held)
        self.cluster.thaw(leader)
        # Frozen past its deadline, it can only say LOST once thawed: no bound on the lag.
        self._wait_stepped_down(leader, token, at, frozen=True)
        return at, at + held + self.bound

    def _term(self, leader: Member, token: int) -> tuple[float, float]:
        at = time.monotonic()
        try:
            self.cluster.terminate(leader, timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{leader.name} still runs {STOP_TIMEOUT} s after SIGTERM: its election's "
                f"stop() did not return; logs:\n{self.log.tail()}"
            ) from None
        self.log.wait_for_leader(self.bound, newer_than=token, sole=False)  # then relaunch
        return at, at + self.bound

    def _resign(self, leader: Member, token: int) -> tuple[float, float]:
        at = self.cluster.resign(leader)
        return at, at + self.bound

    def _restart(self, leader: Member, token: int) -> tuple[float, float]:
        server = self.rng.choice(self.backend.servers)
        forgets = self.backend.name in FORGETS_LEASES
        down = self._hold(1.2, 2.0) if forgets else self._hold(0.3, 2.0)
        self._detail = f"{server.kind}:{server.port} down {down:.2f} s"
        at = time.monotonic()
        server.stop()
        self._sleep_until(at + down)
        if forgets:  # it comes back empty: the old term must be over by then
            self._wait_stepped_down(leader, token, at)
        server.start()
        return at, time.monotonic() + self.bound + RECOVERY_BOUND

    def _cut_drop(self, leader: Member, token: int) -> tuple[float, float]:
        return self._isolate(leader, token, TcpProxy.drop, required=True)

    def _cut_blackhole(self, leader: Member, token: int) -> tuple[float, float]:
        return self._isolate(leader, token, lambda p: p.blackhole("both"), required=True)

    def _cut_oneway(self, leader: Member, token: int) -> tuple[float, float]:
        direction: Direction = "to_server" if self.rng.random() < 0.5 else "to_client"
        self._detail = direction
        # Requests that still reach the store may keep the lease (or a ZooKeeper session)
        # alive while the leader hears nothing: a successor is only required after healing.
        return self._isolate(
            leader, token, lambda p: p.blackhole(direction), required=direction == "to_server"
        )

    def _slow_leader(self, leader: Member, token: int) -> tuple[float, float]:
        delay = self._hold(1.2, 2.0)
        self._detail = f"{delay:.2f} s per chunk"
        return self._isolate(leader, token, lambda p: p.delay(delay), required=False)

    def _slow_all(self, leader: Member, token: int) -> tuple[float, float]:
        delay = self.lease / 3 / 8  # an eighth of the default renew interval, each way
        held = self._hold(1.0, 1.5)
        self._detail = f"{delay * 1000:.0f} ms per chunk for {held:.2f} s"
        at = time.monotonic()
        for proxy in self._all_proxies():
            proxy.delay(delay)
        self._sleep_until(at + held)
        return at, at + held + self.bound

    # -- steps ---------------------------------------------------------------------------------

    def _isolate(
        self, leader: Member, token: int, cut: Callable[[TcpProxy], None], *, required: bool
    ) -> tuple[float, float]:
        """Apply *cut* to *leader*'s proxies until a successor leads (or a lease past the bound).

        With *required*, the successor must come while the cut lasts; the cut leader must
        step down by its deadline either way.
        """
        at = time.monotonic()
        for proxy in self._member_proxies(leader):
            cut(proxy)
        cap = self.bound + self.lease
        successor = self.log.wait_for_leader(cap, newer_than=token, sole=False, required=required)
        self._lag = self._wait_stepped_down(leader, token, at)
        if successor is not None:  # keep the cut a little longer: the old leader stays out
            self._sleep_until(time.monotonic() + self._hold(0.0, 0.5))
        return at, at + cap + self.bound

    def _wait_stepped_down(
        self, leader: Member, token: int, since: float, *, frozen: bool = False
    ) -> float:
        """Wait for *leader* to log the end of term *token*, which must end a lease past
        *since* at the latest; return how long after that end the ``lost`` line came.
        """
        lost = self.log.wait_for(
            f"'lost' of token {token} from {leader.name}",
            lambda r: (
                r["participant"] == leader.name and r["event"] == "lost" and r["token"] == token
            ),
            self.bound + STARTUP_TIMEOUT,
        )
        valid_until = lost.get("valid_until")
        assert valid_until is not None, f"{leader.name} logged no deadline for term {token}"
        assert valid_until <= since + self.lease, (
            f"{leader.name}'s term {token} ran until {valid_until}, more than a lease "
            f"({self.lease} s) after the fault at {since:.3f}; logs:\n{self.log.tail()}"
        )
        lag = float(lost["t"]) - float(valid_until)
        assert frozen or lag <= STEP_DOWN_LAG, (
            f"{leader.name} ended term {token} {lag:.3f} s after its deadline: leader tasks "
            f"must be cancelled at the deadline whatever the store does; logs:\n"
            f"{self.log.tail()}"
        )
        return lag

    def _still_valid(self, member: Member, token: int) -> bool:
        """Whether *member* still does leader work with *token* (it checks ``is_valid``).

        A term past its deadline shows as open until its ``lost`` line, which a hung store
        call can hold up: only fresh work proves the term goes on.
        """
        now = time.monotonic()
        try:
            self.log.wait_for(
                f"work of {member.name} with token {token}",
                lambda r: (
                    r["participant"] == member.name
                    and r["event"] == "work"
                    and r["token"] == token
                    and r["t"] >= now
                ),
                self.lease,
            )
        except AssertionError:
            return False
        return True

    def _heal(self) -> None:
        """Make the cluster whole: proxies healed, members thawed and running."""
        for proxy in self._all_proxies():
            proxy.heal()
        for member in self.cluster.members:
            if member.frozen:
                self.cluster.thaw(member)
            if not member.alive:
                at = time.monotonic()
                self.cluster.launch(member)
                self.log.wait_started([member], since=at)

    def _outcome(
        self,
        kind: str,
        old: Member,
        token: int,
        since: float,
        deadline: float,
        started: float | None = None,
    ) -> Outcome:
        """Wait for a sole leader, whose term began by *deadline* unless it is the old one.

        *started*, when known, is when the old term began: a later term with the same
        token (a store that lost the old term's acquire) is then a new term.
        """
        # After a failover or handoff kind the old term must be over; otherwise it may go on.
        ends = kind in FAILOVER_KINDS | HANDOFF_KINDS
        # The wait goes on past *deadline* (SETTLE) for older terms to log their end.
        wait = max(deadline - time.monotonic(), 0.0) + SETTLE
        after = started if ends else None
        found = self.log.wait_for_leader(wait, newer_than=token if ends else token - 1, after=after)
        assert found is not None
        same = found[1] == token and (started is None or found[2] == started)
        if same and not self._still_valid(old, token):
            found = self.log.wait_for_leader(wait, newer_than=token, after=started)  # ending
            assert found is not None
            same = False
        new, new_token, acquired = found
        kept = same
        assert kept or acquired <= deadline, (
            f"the next term began {acquired - since:.3f} s after the fault, "
            f"{acquired - deadline:.3f} s past the bound; logs:\n{self.log.tail()}"
        )
        return Outcome(
            kind=kind,
            detail=self._detail,
            old=old.name,
            old_token=token,
            new=new.name,
            new_token=new_token,
            to_leader=0.0 if kept else acquired - since,
            kept=kept,
            step_down_lag=self._lag,
        )

    def _hold(self, low: float, high: float) -> float:
        """A fault duration between *low* and *high* leases."""
        return self.lease * self.rng.uniform(low, high)

    def _sleep_until(self, when: float) -> None:
        time.sleep(max(0.0, when - time.monotonic()))  # a fault's own duration, not a wait

    def _member_proxies(self, member: Member) -> list[TcpProxy]:
        assert self.proxies is not None
        return self.proxies[self.cluster.members.index(member)]

    def _all_proxies(self) -> list[TcpProxy]:
        return [p for mine in self.proxies or [] for p in mine]
