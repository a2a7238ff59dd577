"""`Slots`, the queue in front of a node's connection pool: renewals and releases first,
and no slot lost to a waiter that leaves."""

from __future__ import annotations

import asyncio

from multilock.redis._node import Slots


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_a_waiter_that_goes_first_is_served_before_earlier_ones() -> None:
    slots, order = Slots(1), []
    await slots.acquire()

    async def take(name: str, first: bool) -> None:
        await slots.acquire(first=first)
        order.append(name)
        slots.release()

    campaigns = [asyncio.ensure_future(take(f"acquire {i}", False)) for i in range(3)]
    await turns()
    renewal = asyncio.ensure_future(take("renew", True))
    await turns()
    assert slots.waiting == 4
    slots.release()
    await asyncio.gather(renewal, *campaigns)
    assert order == ["renew", "acquire 0", "acquire 1", "acquire 2"]
    assert (slots.free, slots.waiting) == (1, 0)


async def test_a_slot_handed_to_a_waiter_cancelled_before_it_resumes_goes_on() -> None:
    slots = Slots(1)
    await slots.acquire()
    left = asyncio.ensure_future(slots.acquire())
    next_one = asyncio.ensure_future(slots.acquire())
    await turns()
    slots.release()  # handed to `left`...
    left.cancel()  # ...which leaves before it resumes
    await asyncio.wait_for(next_one, 1)  # the slot went on, not lost
    assert left.cancelled()
    assert (slots.free, slots.waiting) == (0, 0)
    slots.release()
    assert slots.free == 1


async def test_a_waiter_cancelled_while_waiting_takes_nothing() -> None:
    slots = Slots(1)
    await slots.acquire()
    gone = asyncio.ensure_future(slots.acquire(first=True))
    await turns()
    gone.cancel()
    await turns()
    assert gone.cancelled()
    assert slots.waiting == 0
    slots.release()
    assert slots.free == 1
    await asyncio.wait_for(slots.acquire(), 1)  # free again, at once
    assert slots.free == 0
