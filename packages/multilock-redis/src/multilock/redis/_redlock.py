"""`RedlockProvider`: leases on a majority of N independent Redis servers (Redlock).

Guarantees. Each server runs the same atomic scripts as `RedisProvider`, so a server
grants a lease only when it holds none: it refuses while any lease is live there, even
one of the caller's participant id, and a refusal writes nothing. A term holds when a
majority of servers granted it, within its validity (lease - elapsed - drift, drift =
1% of the lease + 2 ms); otherwise the attempt is undone and ``try_acquire`` returns
None. A live term is thus never joined, nor extended by anyone's ``try_acquire``: a term
whose reply was lost is found with ``get_leader`` and taken up with ``renew``. To avoid
split votes among concurrent candidates, the servers are asked alone, one after another,
until one grants (a candidate stops once a majority is out of reach: with three
servers, at its second refusal); the servers after it are then asked concurrently. A
server that has yet to run the last holder's release (or that kept a lease a release
did not reach) thus costs a candidate one round trip, not the term.
``renew`` needs a majority too, ``release`` goes to all, ``get_leader`` reports the holder
a majority reports, with the metadata as written. One dead or hung server does not stall
a round: every call has a short per-node timeout, and reads end as soon as their outcome
is decided. The watches share one pattern subscription per server and break when fewer
than a majority of them are alive; each event wakes them once, when a majority of the
servers has published it.

Undo. Every lease an attempt creates carries the attempt's random nonce, and the undo
deletes exactly those leases, whatever token a lost reply or a lost commit left there,
and never another lease, not even one of the same participant id. It goes to every
server that did not refuse: all of them when the attempt fails, and in the background to
those outside the term when it succeeds. A lease the undo misses (a server unreachable,
a request overtaken by its undo) expires within one lease; until then a minority of them
is no term, and a majority with one token is a term like any other, which ``get_leader``
reports and the election that made it takes up.

Tokens. Every server keeps a counter; a server's token for an attempt is
max(counter + 1, candidate), where the candidate is the token of the first server, and
the term's token is the largest any server gave. When they differ, a commit step raises
the lease and counter of each granting server to that token, and a majority must hold it.
So a majority of counters is at least the token of every term, and any later term's
majority shares a server with it: tokens strictly increase as long as a majority of
servers keeps its counters (persistence, or at most a minority restarted since). A
server that lost its counter seeds it from its clock in microseconds, so tokens still
rise after a majority restarts if the servers' clocks are roughly in step with each
other and do not go back.

Failure modes (Kleppmann's critique holds): safety rests on timing. A server that
restarts without data, or whose clock jumps forward, can expire a lease early and let a
second leader in, and a leader paused (GC, SIGSTOP) past its deadline acts on a lease
that is gone. The election's deadline bounds the first holder's belief; only the fencing
token, checked by the protected resource, makes stale writes harmless. A stray lease on
a minority of servers is skipped; on a majority it delays the next term until it is
undone or expires, and never splits one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence, Set
from typing import Any, TypeVar

import attrs
from redis.asyncio import Redis

from multilock.core.provider import ConfigurationError, LeaderInfo, Notifications, ProviderError

from ._base import RedisBase
from ._config import Settings, redlock_targets
from ._node import Granted, Node, encode_metadata, lease_ms
from ._quorum import fanout, listen_quorum, quorum_expiry

__all__ = ["RedlockProvider"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_DRIFT_FACTOR = 0.01
_DRIFT_MIN = 0.002


def _first_error(results: Mapping[int, object]) -> ProviderError | None:
    return next((v for v in results.values() if isinstance(v, ProviderError)), None)


def _vote(
    results: Mapping[int, LeaderInfo | ProviderError | None],
) -> tuple[LeaderInfo | None, int]:
    """The holder most nodes report (as the lowest such node reports it), and its votes."""
    holders = [v for _, v in sorted(results.items()) if isinstance(v, LeaderInfo)]
    votes = Counter((v.participant_id, v.token) for v in holders)
    if not votes:
        return None, 0
    best, count = votes.most_common(1)[0]
    return next(v for v in holders if (v.participant_id, v.token) == best), count


@attrs.define
class _Attempt:
    """One try_acquire: which nodes were asked and what they gave, so it can be undone."""

    group: str
    participant_id: str
    ms: int
    metadata: str
    #: Stored with every lease this attempt creates, so that its undo deletes those and no
    #: other lease: not even one of the same participant id (another process, or an earlier
    #: attempt whose reply was lost and which the election may take up).
    nonce: str = attrs.field(factory=lambda: secrets.token_hex(8))
    sent: set[int] = attrs.field(factory=set)
    granted: dict[int, Granted] = attrs.field(factory=dict)
    refused: set[int] = attrs.field(factory=set)
    errors: list[ProviderError] = attrs.field(factory=list)


class RedlockProvider(RedisBase):
    """Leader election on a majority of independent Redis servers.

    *nodes* is a ``redlock://`` URL naming all servers, or a sequence of ``redis://`` /
    ``rediss://`` URLs and ``redis.asyncio.Redis`` clients (a caller's clients are never
    closed). ``node_timeout`` bounds one server's call (default: the smaller of
    ``socket_timeout`` and a fifth of the lease for acquire and renew, ``socket_timeout``
    otherwise). Use an odd number of servers, at least 3.
    """

    def __init__(
        self,
        nodes: str | Sequence[str | Redis],
        *,
        key_prefix: str | None = None,
        socket_timeout: float | None = None,
        socket_connect_timeout: float | None = None,
        node_timeout: float | None = None,
    ) -> None:
        targets, query = redlock_targets(nodes)
        self._settings = Settings.merge(
            query,
            key_prefix=key_prefix,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            node_timeout=node_timeout,
        )
        if self._settings.wait_replicas or self._settings.wait_timeout is not None:
            raise ConfigurationError(
                "wait_replicas and wait_timeout are options of RedisProvider: Redlock's "
                "servers are independent, with no replicas to wait for"
            )
        timeout = self._settings.node_timeout or self._settings.socket_timeout
        self._nodes = [Node.build(t, self._settings, timeout=timeout) for t in targets]
        self.quorum = len(self._nodes) // 2 + 1
        self._stragglers: set[asyncio.Future[Any]] = set()
        self._notifications = Notifications(
            lambda n: listen_quorum(self._nodes, self.quorum, n),
            name="redlock pub/sub on " + ", ".join(n.label for n in self._nodes),
            expires_in=lambda g: quorum_expiry(self._nodes, g, self.quorum, self._stragglers),
        )

    def __repr__(self) -> str:
        nodes = ", ".join(n.label for n in self._nodes)
        return f"<RedlockProvider [{nodes}] quorum={self.quorum} key_prefix={self.key_prefix!r}>"

    def _round_timeout(self, lease: float) -> float:
        return self._settings.node_timeout or min(self._settings.socket_timeout, lease / 5)

    def _fanout(
        self,
        indexes: Sequence[int],
        call: Callable[[int], Awaitable[T]],
        decided: Callable[[dict[int, T | ProviderError]], bool] | None = None,
    ) -> Awaitable[dict[int, T | ProviderError]]:
        return fanout(indexes, call, self._stragglers, decided)

    def _unknown(self, results: Mapping[int, object]) -> int:
        """How many nodes have not answered (failed, or still running)."""
        failed = sum(1 for v in results.values() if isinstance(v, ProviderError))
        return len(self._nodes) - len(results) + failed

    async def try_acquire(
        self,
        group: str,
        participant_id: str,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> LeaderInfo | None:
        ms = lease_ms(lease_duration)
        attempt = _Attempt(group, participant_id, ms, encode_metadata(metadata))
        started = time.monotonic()
        try:
            token = await self._campaign(attempt, self._round_timeout(ms / 1000))
            validity = ms / 1000 * (1 - _DRIFT_FACTOR) - _DRIFT_MIN - (time.monotonic() - started)
            if token is not None and validity > 0:
                first = attempt.granted[min(attempt.granted)]
                # A node whose reply or commit was lost may hold a lease of this attempt
                # outside the term: undo those in the background (a hung node must not
                # delay the term); a lease the undo misses expires on its own.
                holding = {i for i, g in attempt.granted.items() if g.token == token}
                await self._undo(attempt, keep=holding, wait=False)
                return LeaderInfo(
                    participant_id=participant_id,
                    token=token,
                    metadata=metadata,
                    acquired_at=first.acquired_at,
                )
        except BaseException:  # cancelled, or failed: leave nothing behind
            await asyncio.shield(self._undo(attempt))
            raise
        await self._undo(attempt)
        if len(attempt.errors) > len(self._nodes) - self.quorum:
            raise ProviderError(
                f"redlock acquire of {group!r}: {len(attempt.errors)} of {len(self._nodes)} "
                f"servers failed, a majority of {self.quorum} is out of reach"
            ) from attempt.errors[0]
        return None

    async def _ask(self, attempt: _Attempt, i: int, candidate: int, limit: float) -> bool:
        """Ask node *i* for the lease; return whether it answered (a refusal wrote nothing)."""
        attempt.sent.add(i)
        try:
            granted = await self._nodes[i].acquire(
                attempt.group, attempt.participant_id, attempt.ms, attempt.metadata,
                candidate=candidate, clock_floor=False, attempt=attempt.nonce, within=limit,
            )  # fmt: skip
        except ProviderError as exc:
            attempt.errors.append(exc)
            return False
        if granted is None:
            attempt.refused.add(i)
        else:
            attempt.granted[i] = granted
        return True

    async def _campaign(self, attempt: _Attempt, limit: float) -> int | None:
        """Take a majority and agree on one token; return it, or None."""
        order = range(len(self._nodes))
        spare = len(self._nodes) - self.quorum  # how many may refuse or fail: a majority left
        for first in order:
            if await self._ask(attempt, first, 0, limit) and first not in attempt.refused:
                break
            if len(attempt.refused) + len(attempt.errors) > spare:
                return None
        else:
            return None
        candidate = attempt.granted[first].token
        await asyncio.gather(*(self._ask(attempt, i, candidate, limit) for i in order[first + 1 :]))
        if len(attempt.granted) < self.quorum:
            return None
        token = max(g.token for g in attempt.granted.values())
        behind = [i for i, g in attempt.granted.items() if g.token != token]
        if behind:
            g, pid = attempt.group, attempt.participant_id
            given = {i: attempt.granted[i].token for i in behind}
            results = await self._fanout(
                behind, lambda i: self._nodes[i].commit(g, pid, given[i], token, limit)
            )
            for i, ok in results.items():
                if ok is True:
                    attempt.granted[i] = attrs.evolve(attempt.granted[i], token=token)
        holding = sum(1 for g in attempt.granted.values() if g.token == token)
        return token if holding >= self.quorum else None

    async def _undo(
        self, attempt: _Attempt, keep: Set[int] = frozenset(), *, wait: bool = True
    ) -> None:
        """Delete the leases this attempt may have created outside *keep*, best effort.

        Refused nodes wrote nothing; on the others the lease must carry the attempt's nonce,
        whatever its token (a lost reply, a lost commit). With *wait* False the calls run in
        the background, and `aclose` waits for them.
        """
        undo = sorted(attempt.sent - attempt.refused - keep)
        if not undo:
            return
        g, pid, nonce = attempt.group, attempt.participant_id, attempt.nonce
        results = await self._fanout(
            undo,
            lambda i: self._nodes[i].release(g, pid, 0, attempt=nonce),
            None if wait else lambda _: True,
        )
        for i, result in results.items():
            if isinstance(result, ProviderError):
                log.debug("undo of %s on node %d failed: %r", g, i, result)

    async def renew(
        self,
        group: str,
        participant_id: str,
        token: int,
        lease_duration: float,
        metadata: Mapping[str, str],
    ) -> bool:
        ms = lease_ms(lease_duration)
        meta = encode_metadata(metadata)
        limit = self._round_timeout(ms / 1000)

        # Every server, not just a majority: a straggler would serve old metadata.
        results = await self._fanout(
            range(len(self._nodes)),
            lambda i: self._nodes[i].renew(group, participant_id, token, ms, meta, limit),
        )
        yes, unknown = sum(1 for v in results.values() if v is True), self._unknown(results)
        if yes >= self.quorum:
            return True
        if yes + unknown < self.quorum:
            return False
        raise ProviderError(
            f"redlock renew of {group!r}: {yes} of {len(self._nodes)} servers renewed, "
            f"{self.quorum} needed"
        ) from _first_error(results)

    async def release(self, group: str, participant_id: str, token: int) -> None:
        results = await self._fanout(
            range(len(self._nodes)),
            lambda i: self._nodes[i].release(group, participant_id, token),
        )
        answered = len(self._nodes) - self._unknown(results)
        if answered < self.quorum:
            raise ProviderError(
                f"redlock release of {group!r}: only {answered} servers answered, "
                f"{self.quorum} needed"
            ) from _first_error(results)

    async def get_leader(self, group: str) -> LeaderInfo | None:
        n = len(self._nodes)

        def decided(r: dict[int, LeaderInfo | ProviderError | None]) -> bool:
            votes, running = _vote(r)[1], n - len(r)
            return votes >= self.quorum or (
                votes + running < self.quorum and n - self._unknown(r) >= self.quorum
            )

        results = await self._fanout(range(n), lambda i: self._nodes[i].leader(group), decided)
        leader, votes = _vote(results)
        if votes >= self.quorum:
            return leader
        answered = n - self._unknown(results)
        if answered < self.quorum:
            raise ProviderError(
                f"redlock get_leader of {group!r}: only {answered} of {n} servers answered, "
                f"{self.quorum} needed"
            ) from _first_error(results)
        # No holder has a majority among the answers. One whose majority includes silent
        # servers cannot be confirmed live, so it is not reported.
        return None

    async def aclose(self) -> None:
        """Stop watching and close the clients this provider built (a caller's stay open)."""
        await self._close_watches()
        if self._stragglers:
            await asyncio.wait(set(self._stragglers))
        await asyncio.gather(*(n.aclose() for n in self._nodes))
