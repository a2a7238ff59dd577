"""`Batches`, the kit's sender of the calls asked for in one loop turn, in virtual time."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence

import pytest

from multilock.core.provider import Batches
from multilock.core.testing import FakeClock


def run(body):  # type: ignore[no-untyped-def]
    return FakeClock().run(body())


class Store:
    """Records each batch it is sent; answers an item "bad" with an error of its own."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.failure: Exception | None = None

    async def send(self, items: list[str]) -> Sequence[str | Exception]:
        self.batches.append(items)
        await asyncio.sleep(0.01)
        if self.failure is not None:
            raise self.failure
        return [ValueError(i) if i == "bad" else i.upper() for i in items]


@contextlib.asynccontextmanager
async def held(lock: asyncio.Lock) -> AsyncIterator[None]:
    """A slot that is *lock*: busy while the test holds it."""
    async with lock:
        yield


def test_one_turn_is_one_batch_and_each_caller_gets_its_own_reply() -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1)
        calls = [batches(item) for item in ("a", "bad", "c")]
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert results[0] == "A"
        assert isinstance(results[1], ValueError)
        assert results[2] == "C"
        assert store.batches == [["a", "bad", "c"]]
        assert await batches("d") == "D"  # a later turn: a batch of its own
        assert store.batches[1:] == [["d"]]

    run(body)


def test_a_failed_send_fails_every_caller_with_its_own_error() -> None:
    async def body() -> None:
        store = Store()
        store.failure = ConnectionError("down")
        batches: Batches[str, str] = Batches(store.send, timeout=1)
        results = await asyncio.gather(batches("a"), batches("b"), return_exceptions=True)
        assert [type(r) for r in results] == [ConnectionError, ConnectionError]
        assert results[0] is not results[1], "one error object shared by two callers"

    run(body)


def test_a_caller_that_left_before_the_turn_ended_is_not_sent() -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1)
        left = asyncio.ensure_future(batches("a"))
        stays = asyncio.ensure_future(batches("b"))
        await asyncio.sleep(0)  # both queued for this turn's batch
        left.cancel()
        assert await stays == "B"
        assert left.cancelled()
        assert store.batches == [["b"]]

    run(body)


def test_callers_that_left_while_the_slot_was_taken_are_not_sent() -> None:
    async def body() -> None:
        store = Store()
        lock = asyncio.Lock()
        slot = functools.partial(held, lock)
        batches: Batches[str, str] = Batches(store.send, timeout=5, slot=slot)
        await lock.acquire()  # the slot is busy
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(batches("a"), 0.5)
        late = asyncio.ensure_future(batches("b"))
        await asyncio.sleep(0.1)  # its batch waits for the slot too
        lock.release()
        assert await late == "B"
        assert store.batches == [["b"]], "a batch whose callers all left was sent"

    run(body)


def test_the_timeout_bounds_the_slot_and_the_send() -> None:
    async def body() -> None:
        store = Store()
        lock = asyncio.Lock()
        slot = functools.partial(held, lock)
        batches: Batches[str, str] = Batches(store.send, timeout=0.2, slot=slot)
        await lock.acquire()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await batches("a")
        assert loop.time() - started == pytest.approx(0.2)
        assert store.batches == []

    run(body)


def test_aclose_fails_the_batch_being_sent() -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1)
        call = asyncio.ensure_future(batches("a"))
        await asyncio.sleep(0.001)  # sent, its reply not yet in
        assert store.batches == [["a"]]
        await batches.aclose()
        with pytest.raises(ConnectionError):
            await call

    run(body)


def test_aclose_fails_a_batch_cancelled_before_it_began() -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1)
        first = asyncio.ensure_future(batches("a"))
        await asyncio.sleep(0)  # "a" is queued, the turn's end is next
        await asyncio.sleep(0)  # its batch is a task now, not yet started
        assert store.batches == []
        await batches.aclose()
        with pytest.raises(ConnectionError):
            async with asyncio.timeout(1):  # not left waiting forever
                await first
        assert store.batches == []

    run(body)


def test_eager_sends_an_item_at_once_when_nothing_is_on_its_way() -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1, eager=True)
        task = asyncio.ensure_future(batches("a"))
        await asyncio.sleep(0)  # the caller's first step: sent from there, no turn waited
        assert store.batches == [["a"]]
        assert await task == "A"
        assert await batches("b") == "B"
        assert store.batches == [["a"], ["b"]]

    run(body)


def test_eager_items_asked_for_meanwhile_go_together_after_it() -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1, eager=True)
        first = asyncio.ensure_future(batches("a"))
        await asyncio.sleep(0)
        later = [asyncio.ensure_future(batches(i)) for i in ("b", "bad", "d")]
        await asyncio.sleep(0.001)  # "a" is still on its way: they wait for it
        assert store.batches == [["a"]]
        assert await first == "A"
        results = await asyncio.gather(*later, return_exceptions=True)
        assert results[0] == "B"
        assert results[2] == "D"
        assert isinstance(results[1], ValueError)
        assert store.batches == [["a"], ["b", "bad", "d"]]

    run(body)


def test_eager_a_caller_that_leaves_lets_the_waiting_items_go() -> None:
    async def body() -> None:
        store = Store()
        lock = asyncio.Lock()
        batches: Batches[str, str] = Batches(
            store.send, timeout=1, slot=functools.partial(held, lock), eager=True
        )
        await lock.acquire()  # the slot is busy: "a" waits for it in its caller's task
        first = asyncio.ensure_future(batches("a"))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(batches("b"))
        await asyncio.sleep(0)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        lock.release()
        assert await waiting == "B"
        assert store.batches == [["b"]], "the item of a caller that left was sent"

    run(body)


def test_eager_a_queued_caller_that_leaves_is_not_sent() -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1, eager=True)
        first = asyncio.ensure_future(batches("a"))
        await asyncio.sleep(0)
        leaving, staying = (asyncio.ensure_future(batches(i)) for i in ("b", "c"))
        await asyncio.sleep(0.001)  # both wait for "a"
        leaving.cancel()
        assert await first == "A"
        assert await staying == "C"
        assert store.batches == [["a"], ["c"]], "the item of a caller that left was sent"

    run(body)


@pytest.mark.parametrize("eager", [False, True])
def test_aclose_fails_the_waiting_items_and_nothing_is_sent_after(eager: bool) -> None:
    async def body() -> None:
        store = Store()
        batches: Batches[str, str] = Batches(store.send, timeout=1, eager=eager)
        first = asyncio.ensure_future(batches("a"))
        if eager:
            await asyncio.sleep(0)  # "a" is on its way, in its caller's task
        waiting = asyncio.ensure_future(batches("b"))
        await asyncio.sleep(0)  # "b" waits: for "a", or (not eager) for the turn's end
        await batches.aclose()
        with pytest.raises(ConnectionError):
            await waiting
        if eager:  # on its way in its caller's task: it ends as it would have
            assert await first == "A"
        else:
            with pytest.raises(ConnectionError):
                await first
        with pytest.raises(ConnectionError, match="closed"):
            await batches("c")
        await asyncio.sleep(1)
        assert store.batches == ([["a"]] if eager else []), "a batch was sent after aclose"

    run(body)
