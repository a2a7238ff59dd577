"""Calls across nodes, and the watch: pub/sub on every node plus a wake-up at lease expiry."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.asyncio.client import PubSub

from multilock.core import ProviderError

from ._node import Node, close_pubsub

__all__ = ["fanout", "watch_nodes"]

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _listen(pubsub: PubSub, wake: asyncio.Event) -> None:
    """Set *wake* on every message (a re-subscription after a reconnect counts too)."""
    try:
        while True:
            await pubsub.get_message(timeout=None)
            wake.set()
    finally:
        wake.set()


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


async def _expires_in(
    nodes: Sequence[Node], group: str, need: int, stragglers: set[asyncio.Future[Any]]
) -> tuple[float | None, bool]:
    """Seconds until the lease seen on *need* nodes ends, and whether any lease was seen.

    Only the first *need* answers count (a hung node must not delay the watch), so the
    wake may come early; the caller reads again after each wake.
    """
    replies = await fanout(
        range(len(nodes)),
        lambda i: nodes[i].pttl(group),
        stragglers,
        lambda r: sum(1 for v in r.values() if isinstance(v, int)) >= need,
    )
    answers = [r for r in replies.values() if isinstance(r, int)]
    if len(answers) < need:
        errors = [r for r in replies.values() if isinstance(r, ProviderError)]
        raise ProviderError(f"watch of {group!r}: only {len(answers)} servers answered") from (
            errors[0] if errors else None
        )
    left = sorted((ms for ms in answers if ms >= 0), reverse=True)  # -1: no expiry, -2: none
    if not left:
        return None, any(ms == -1 for ms in answers)
    # Wake a millisecond after the key is gone, so the follower sees it gone.
    return (left[need - 1] if len(left) >= need else left[-1]) / 1000 + 0.001, True


async def watch_nodes(
    nodes: Sequence[Node], group: str, need: int, stragglers: set[asyncio.Future[Any]]
) -> AsyncIterator[None]:
    """Yield on every message on the group's channel of any node, and at lease expiry.

    Raise `ProviderError` once fewer than *need* subscriptions are alive. Closing the
    iterator unsubscribes and closes the subscription connections.
    """
    # Tasks, not a gather: if the caller is cancelled just as the subscriptions complete,
    # gather's results are lost, and with them the connections to close.
    subscribing = [asyncio.ensure_future(n.subscribe(group)) for n in nodes]
    listeners: list[asyncio.Task[None]] = []
    wake = asyncio.Event()
    try:
        await asyncio.wait(subscribing)
        errors = [e for t in subscribing if (e := t.exception()) is not None]
        for error in errors:
            if not isinstance(error, ProviderError):
                raise error
        pubsubs = _subscribed(subscribing)
        if len(pubsubs) < need:
            raise ProviderError(f"watch of {group!r}: could not subscribe") from errors[0]
        listeners = [asyncio.ensure_future(_listen(p, wake)) for p in pubsubs]
        seen = False
        while True:
            broken = [t for t in listeners if t.done()]
            if len(listeners) - len(broken) < need:
                cause = next((t.exception() for t in broken if not t.cancelled()), None)
                raise ProviderError(f"watch of {group!r}: the subscription broke") from cause
            expires_in, live = await _expires_in(nodes, group, need, stragglers)
            # A lease seen at the last read and gone now ended since: report it at once,
            # because the follower may have looked just before it ended.
            if live or not seen:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(expires_in):
                        await wake.wait()
            seen = live
            wake.clear()
            yield None
    finally:
        for task in [*subscribing, *listeners]:
            task.cancel()  # a subscription cancelled half-way closes its own connection
        await asyncio.wait([*subscribing, *listeners])
        for task in [*subscribing, *listeners]:
            if not task.cancelled():
                task.exception()  # retrieved: asyncio logs exceptions nobody looked at
        await asyncio.gather(*(close_pubsub(p) for p in _subscribed(subscribing)))


def _subscribed(tasks: Sequence[asyncio.Future[PubSub]]) -> list[PubSub]:
    """The subscriptions the tasks made."""
    return [t.result() for t in tasks if t.done() and not t.cancelled() and t.exception() is None]
