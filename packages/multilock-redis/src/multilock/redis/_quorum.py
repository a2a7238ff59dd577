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


class OncePerEvent:
    """Every node publishes each event of a group (its acquire, its release): pass the
    first copy on, to ``notify(group)``, and drop the others.

    Each node's messages come in the order its server ran the scripts, so the k-th
    ``released`` of a group from one node is the k-th from another: a message is a new
    event when its node has now sent more of that kind for that group than any other
    node. A watch thus wakes once per event, not once per node (a resigner would take
    the copies of its own release for another participant's acts). Counts are kept
    relative to the node that sent fewest, and dropped once every node has sent the
    same, so only events some node has yet to report take memory.
    """

    def __init__(self, nodes: int, notify: Callable[[str], None]) -> None:
        self._nodes, self._notify = nodes, notify
        #: (group, kind) -> each node's messages of that kind beyond the fewest any sent.
        self._ahead: dict[tuple[str, str], list[int]] = {}

    def message(self, node: int, group: str, kind: str) -> None:
        counts = self._ahead.pop((group, kind), None) or [0] * self._nodes
        counts[node] += 1
        if counts[node] > max((c for i, c in enumerate(counts) if i != node), default=0):
            self._notify(group)  # the first copy of a new event
        self._keep((group, kind), counts)

    def resubscribed(self, node: int) -> None:
        """*node* (again) subscribed, and missed what came before: level it with the node
        that sent most (a copy it did not miss then wakes the watches once more)."""
        for key, counts in list(self._ahead.items()):
            counts[node] = max(counts)
            self._keep(key, counts)

    def _keep(self, key: tuple[str, str], counts: list[int]) -> None:
        least = min(counts)
        counts = [c - least for c in counts] if least else counts
        if any(counts):
            self._ahead[key] = counts
        else:
            self._ahead.pop(key, None)


async def listen_quorum(nodes: Sequence[Node], quorum: int, notifications: Notifications) -> None:
    """Listen on every node; ready once *quorum* are subscribed; raise when too few are left.

    The first copy of each event, whichever node sends it, wakes the group's watches
    (`OncePerEvent`). A node whose subscription breaks is not retried while a quorum
    remains: the next listener (after every watch closed, or after this one raised)
    subscribes on every node again.
    """
    subscribed: set[int] = set()
    events = OncePerEvent(len(nodes), notifications.notify)

    def on_ready(i: int) -> Callable[[], None]:
        def ready() -> None:
            # Ready once a quorum is subscribed, and again when one of them subscribes anew
            # after a reconnect (it may have missed messages); a late node joining is quiet.
            again = i in subscribed
            subscribed.add(i)
            events.resubscribed(i)  # what it did not hear is older than its subscription
            if len(subscribed) == quorum or (again and len(subscribed) >= quorum):
                notifications.ready()

        return ready

    def on_message(i: int) -> Callable[[str, str], None]:
        return lambda group, kind: events.message(i, group, kind)

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
