"""Redlock's calls across nodes, and its listener: one subscription per node, a quorum alive."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from multilock.core.provider import Notifications, ProviderError

from ._node import Node

__all__ = ["OncePerEvent", "fanout", "listen_quorum", "quorum_expiry"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def _forget(stragglers: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    def forget(task: asyncio.Future[Any]) -> None:
        stragglers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a late redis call failed: %r", task.exception())

    return forget


async def fanout(
    indexes: Sequence[int],
    call: Callable[[int], Awaitable[T]],
    stragglers: set[asyncio.Future[Any]],
    decided: Callable[[dict[int, T | ProviderError]], bool] | None = None,
) -> dict[int, T | ProviderError]:
    """Run ``call(i)`` for every index concurrently until all answered or *decided*.

    Calls still running then go on in the background (into *stragglers*, which the owner
    awaits before it closes), each within its own timeout: cancelling a call stuck on a
    hung server can take as long as letting it finish.
    """
    tasks = {asyncio.ensure_future(call(i)): i for i in indexes}
    results: dict[int, T | ProviderError] = {}
    pending = set(tasks)
    try:
        while pending and not (decided is not None and decided(results)):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None and not isinstance(exc, ProviderError):
                    raise exc
                results[tasks[task]] = exc if exc is not None else task.result()
    finally:
        for task in pending:
            stragglers.add(task)
            task.add_done_callback(_forget(stragglers))
    return results


#: Events of one group that some node has yet to report, kept at most (the oldest goes).
PENDING = 8


class OncePerEvent:
    """Every node publishes each event of a Redlock lease (its acquire, its release),
    tagged with the attempt that made the lease: pass the event on, to
    ``notify(group)``, at the copy that shows it on *quorum* nodes, and drop the others.

    A follower woken then finds the lease gone from a majority, so its try can win, even
    while the other nodes have yet to run the release (Redis orders commands per
    connection, not across clients). A resigner sees its own release once, not once per
    node (it would take the copies for other participants' acts), and a successor's
    acquire once the successor holds a majority. An attempt that fell short of one, and
    its undo, wake nobody. A message with no attempt id (a writer of an older version)
    passes on at once. An event is dropped once every node reported it; each group keeps
    at most `PENDING` others (a node is down, an attempt fell short), the oldest that
    notified going first, then the oldest.
    """

    def __init__(self, nodes: int, quorum: int, notify: Callable[[str], None]) -> None:
        self._nodes, self._quorum, self._notify = nodes, quorum, notify
        #: group -> (kind, attempt) -> the nodes that reported it, oldest event first.
        self._pending: dict[str, dict[tuple[str, str], set[int]]] = {}

    def message(self, node: int, group: str, kind: str, attempt: str) -> None:
        if not attempt:
            self._notify(group)
            return
        events = self._pending.setdefault(group, {})
        reported = events.get((kind, attempt))
        if reported is None:
            if len(events) >= PENDING:
                # Rather one that notified: its last copies are fewer than a majority, so
                # one of them never notifies again, and cannot be mistaken for a new event.
                full = [key for key, nodes in events.items() if len(nodes) >= self._quorum]
                del events[full[0] if full else next(iter(events))]
            reported = events[kind, attempt] = set()
        elif node in reported:
            return
        reported.add(node)
        if len(reported) == self._quorum:
            self._notify(group)  # the event now holds on a majority of the nodes
        if len(reported) == self._nodes:
            del events[kind, attempt]
            if not events:
                del self._pending[group]


async def listen_quorum(nodes: Sequence[Node], quorum: int, notifications: Notifications) -> None:
    """Listen on every node; ready once *quorum* are subscribed; raise when too few are left.

    Each event wakes the group's watches once, when *quorum* nodes have reported it
    (`OncePerEvent`). A node whose subscription breaks is not retried while a quorum
    remains: the next listener (after every watch closed, or after this one raised)
    subscribes on every node again.
    """
    subscribed: set[int] = set()
    events = OncePerEvent(len(nodes), quorum, notifications.notify)

    def on_ready(i: int) -> Callable[[], None]:
        def ready() -> None:
            # Ready once a quorum is subscribed, and again when one of them subscribes anew
            # after a reconnect (it may have missed messages, so an event may never show
            # on a majority here: every watch wakes instead); a late node joining is quiet.
            again = i in subscribed
            subscribed.add(i)
            if len(subscribed) == quorum or (again and len(subscribed) >= quorum):
                notifications.ready()

        return ready

    def on_message(i: int) -> Callable[[str, str, str], None]:
        return lambda group, kind, attempt: events.message(i, group, kind, attempt)

    tasks = [
        asyncio.ensure_future(node.listen(on_ready(i), on_message(i)))
        for i, node in enumerate(nodes)
    ]
    errors: list[BaseException] = []
    try:
        for done in asyncio.as_completed(tasks):
            try:
                await done
                errors.append(ProviderError("a subscription ended"))
            except ProviderError as exc:
                errors.append(exc)
            if len(errors) > len(nodes) - quorum:
                # Each node's reason, already free of secrets (its DriverCalls scrubbed it).
                reasons = "; ".join(str(e) or type(e).__name__ for e in errors)
                raise ProviderError(
                    f"redlock pub/sub: {len(errors)} of {len(nodes)} subscriptions broke, "
                    f"{quorum} needed: {reasons}"
                ) from errors[0]
    finally:
        for task in tasks:
            task.cancel()  # each closes its own connection as it ends
        await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: asyncio logs exceptions nobody looked at


async def quorum_expiry(
    nodes: Sequence[Node], group: str, quorum: int, stragglers: set[asyncio.Future[Any]]
) -> float | None:
    """Seconds until the lease seen on *quorum* nodes ends (None: no lease anywhere).

    Only the first *quorum* answers count (a hung node must not delay the watch), so the
    wake may come early; the watch reads again then. Nodes answer from their last message
    when it still holds, without a round trip.
    """
    replies = await fanout(
        range(len(nodes)),
        lambda i: nodes[i].expires_in(group),
        stragglers,
        lambda r: sum(1 for v in r.values() if not isinstance(v, ProviderError)) >= quorum,
    )
    answers = [r for r in replies.values() if not isinstance(r, ProviderError)]
    if len(answers) < quorum:
        errors = [r for r in replies.values() if isinstance(r, ProviderError)]
        raise ProviderError(
            f"redlock watch of {group!r}: only {len(answers)} servers answered"
        ) from (errors[0] if errors else None)
    left = sorted((s for s in answers if s is not None), reverse=True)
    return left[min(quorum, len(left)) - 1] if left else None
