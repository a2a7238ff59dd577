"""The backend author's kit (`multilock.core.provider`), in virtual time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from multilock.core.provider import (
    EXPIRY_SLACK,
    ConfigurationError,
    DriverCalls,
    LeaseBounds,
    Notifications,
    Observed,
    ProviderError,
    call_until,
    poll_watch,
    validate_identifier,
)
from multilock.core.testing import FakeClock


def run(body):  # type: ignore[no-untyped-def]
    clock = FakeClock()
    return clock.run(body(clock))


class Follow:
    """Consume a watch in a task (as the election does), recording when it yields."""

    def __init__(self, stream: AsyncIterator[None]) -> None:
        self.stream = stream
        self.yields: asyncio.Queue[float] = asyncio.Queue()
        self.task = asyncio.ensure_future(self._consume())

    async def _consume(self) -> None:
        loop = asyncio.get_running_loop()
        async for _ in self.stream:
            self.yields.put_nowait(loop.time())

    async def next(self, within: float) -> float | None:
        """Loop time of the next yield, or None if the watch stays quiet *within* seconds.

        A watch that raised re-raises here.
        """
        getter = asyncio.ensure_future(self.yields.get())
        done, _ = await asyncio.wait(
            {getter, self.task}, timeout=within, return_when="FIRST_COMPLETED"
        )
        if getter in done:
            return getter.result()
        getter.cancel()
        if self.task in done:
            self.task.result()
            raise AssertionError("the watch ended")
        return None

    async def aclose(self) -> None:
        self.task.cancel()
        await asyncio.wait({self.task})
        await self.stream.aclose()  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- poll_watch
def test_poll_watch_yields_on_change_and_at_the_observed_expiry_not_on_renewals():
    async def body(clock: FakeClock) -> None:
        reads: list[float] = []
        state = {"seen": Observed(holder=("a", 1), version=1, expires_in=10.0)}

        async def read() -> Observed:
            reads.append(clock.now)
            return state["seen"]

        start = clock.now
        stream = Follow(poll_watch(read, poll_interval=1.0))
        assert await stream.next(0.5) == pytest.approx(start)  # the first read always yields
        # Renewals: a new version each poll, the same holder: nothing to report.
        for version in range(2, 6):
            state["seen"] = Observed(holder=("a", 1), version=version, expires_in=10.0)
            assert await stream.next(1.0) is None
        # The holder changes: reported at the next poll.
        state["seen"] = Observed(holder=("b", 2), version=9, expires_in=3.0)
        changed_at = await stream.next(1.5)
        assert changed_at is not None
        assert changed_at - start == pytest.approx(5.0)
        # No renewal from b: the watch wakes just after its lease ends, though polls are slow.
        state["seen"] = Observed(holder=("b", 2), version=9, expires_in=3.0)
        await stream.aclose()
        reads.clear()
        stream = Follow(poll_watch(read, poll_interval=60.0))
        first = await stream.next(1.0)
        assert first is not None
        ended = await stream.next(10.0)
        assert ended == pytest.approx(first + 3.0 + EXPIRY_SLACK)
        # Still the same expired version in the store: every poll reports it again.
        again = await stream.next(61.0)
        assert again == pytest.approx(ended + 60.0)
        await stream.aclose()

    run(body)


def test_poll_watch_skips_reads_while_the_cheap_probe_sees_no_change():
    async def body(clock: FakeClock) -> None:
        reads = 0
        probe_says = {"changed": False}

        async def read() -> Observed:
            nonlocal reads
            reads += 1
            return Observed(holder=("a", reads), version=reads)

        async def changed() -> bool:
            return probe_says["changed"]

        stream = Follow(poll_watch(read, poll_interval=1.0, changed=changed))
        assert await stream.next(0.5) is not None
        assert await stream.next(5.5) is None
        assert reads == 1
        probe_says["changed"] = True
        assert await stream.next(1.5) is not None
        await stream.aclose()

    run(body)


# --------------------------------------------------------------------------- Notifications
class FakeStore:
    """A notifying store: its listener counts connections, leases have remaining times."""

    def __init__(self) -> None:
        self.connections = 0
        self.opened = 0
        self.feed: asyncio.Queue[str | BaseException] = asyncio.Queue()
        self.leases: dict[str, float] = {}  # group -> loop time the lease ends
        self.reads = 0

    async def listen(self, notifications: Notifications) -> None:
        self.connections += 1
        self.opened += 1
        try:
            notifications.ready()
            while True:
                item = await self.feed.get()
                if isinstance(item, BaseException):
                    raise item
                notifications.notify(item)
        finally:
            self.connections -= 1

    async def expires_in(self, group: str) -> float | None:
        self.reads += 1
        end = self.leases.get(group)
        left = None if end is None else end - asyncio.get_running_loop().time()
        return None if left is None or left <= 0 else left


def test_one_listener_serves_every_watch_and_stops_with_the_last():
    async def body(clock: FakeClock) -> None:
        store = FakeStore()
        hub = Notifications(store.listen, name="fake", expires_in=store.expires_in)
        streams = {g: [Follow(hub.watch(g)) for _ in range(3)] for g in ("a", "b", "c")}
        for group_streams in streams.values():
            for stream in group_streams:
                assert await stream.next(0.1) is not None  # subscribed: first yield
        assert store.connections == 1
        assert store.opened == 1
        assert hub.groups == {"a", "b", "c"}
        assert hub.listening
        store.feed.put_nowait("b")
        for group, group_streams in streams.items():
            for stream in group_streams:
                woke = await stream.next(0.1)
                assert (woke is not None) == (group == "b"), group
        for group_streams in streams.values():
            for stream in group_streams:
                await stream.aclose()
        await asyncio.sleep(0)
        assert store.connections == 0
        assert not hub.listening
        assert hub.groups == frozenset()
        again = Follow(hub.watch("a"))
        assert await again.next(0.1) is not None
        assert store.opened == 2
        await again.aclose()
        await hub.aclose()

    run(body)


def test_a_watch_wakes_when_the_lease_it_saw_ends_but_not_when_it_was_renewed():
    async def body(clock: FakeClock) -> None:
        store = FakeStore()
        loop = asyncio.get_running_loop()
        store.leases["g"] = loop.time() + 10.0
        hub = Notifications(store.listen, name="fake", expires_in=store.expires_in)
        stream = Follow(hub.watch("g"))
        start = await stream.next(0.1)
        assert start is not None

        async def renew_every(seconds: float, times: int) -> None:
            for _ in range(times):
                await asyncio.sleep(seconds)
                store.leases["g"] = loop.time() + 10.0

        renewer = asyncio.ensure_future(renew_every(3.0, 5))  # renewed until start + 15
        ended = await stream.next(60.0)
        await renewer
        assert ended == pytest.approx(start + 25.0 + EXPIRY_SLACK)
        await stream.aclose()
        await hub.aclose()

    run(body)


def test_a_broken_listener_breaks_every_watch_and_the_next_watch_reconnects():
    async def body(clock: FakeClock) -> None:
        store = FakeStore()
        hub = Notifications(store.listen, name="fake")
        streams = [Follow(hub.watch("a")), Follow(hub.watch("b"))]
        for stream in streams:
            assert await stream.next(0.1) is not None
        store.feed.put_nowait(ConnectionResetError("gone"))
        for stream in streams:
            with pytest.raises(ProviderError, match="the listener broke") as info:
                await stream.next(1.0)
            assert isinstance(info.value.__cause__, ConnectionResetError)
        fresh = Follow(hub.watch("a"))
        assert await fresh.next(0.1) is not None
        assert store.opened == 2
        assert store.connections == 1
        await hub.aclose()
        with pytest.raises(ProviderError, match="closed"):
            await fresh.next(1.0)
        with pytest.raises(ProviderError, match="closed"):
            hub.watch("a")
        assert store.connections == 0

    run(body)


# --------------------------------------------------------------------------- DriverCalls
def test_driver_errors_name_the_store_and_keep_no_secret():
    async def body(clock: FakeClock) -> None:
        calls = DriverCalls(
            "redis", "redis://:***@db:6379", timeout=2.0, failures=(OSError,), secrets=["hunter2"]
        )

        async def leaky() -> None:
            raise OSError("auth failed for password hunter2")

        with pytest.raises(ProviderError) as info:
            await calls.call("renew", leaky())
        text = str(info.value)
        assert text == "redis renew failed on redis://:***@db:6379: auth failed for password ***"
        assert info.value.__cause__ is None  # the driver's error held the secret

        async def plain() -> None:
            raise OSError("connection refused")

        with pytest.raises(ProviderError) as info:
            await calls.call("get_leader", plain())
        assert isinstance(info.value.__cause__, OSError)

        async def hangs() -> None:
            await asyncio.sleep(100)

        with pytest.raises(ProviderError, match=r"redis acquire failed .*no answer within 2 s"):
            await calls.call("acquire", hangs())

        async def bug() -> None:
            raise KeyError("not a driver failure")

        with pytest.raises(KeyError):
            await calls.call("renew", bug())
        calls.closed = True
        with pytest.raises(ProviderError, match="closed"):
            await calls.call("renew", plain())

    run(body)


def test_a_batched_call_has_no_deadline_of_its_own_but_the_same_errors():
    # A call sent through `Batches` is bounded by the batches (the batch on its way, then
    # its own): `batched` adds no deadline, so one that waited longer than the timeout
    # for the batch before its own still gets its answer.
    async def body(clock: FakeClock) -> None:
        calls = DriverCalls("redis", "redis://db", timeout=2.0, failures=(OSError,))
        loop = asyncio.get_running_loop()

        async def queued() -> str:
            await asyncio.sleep(3.5)
            return "granted"

        started = loop.time()
        assert await calls.batched("acquire", queued()) == "granted"
        assert loop.time() - started == pytest.approx(3.5)

        async def refused() -> None:
            raise OSError("connection refused")

        with pytest.raises(ProviderError, match="redis release failed on redis://db") as info:
            await calls.batched("release", refused())
        assert isinstance(info.value.__cause__, OSError)
        calls.closed = True
        with pytest.raises(ProviderError, match="closed"):
            await calls.batched("renew", queued())

    run(body)


async def test_a_cancelled_blocking_call_returns_only_once_the_thread_is_done():
    calls = DriverCalls("s3", "http://s3", timeout=5.0)
    started, release = threading.Event(), threading.Event()
    finished: list[str] = []

    def write() -> str:
        started.set()
        release.wait(5)
        finished.append("written")
        return "ok"

    task = asyncio.ensure_future(calls.blocking("put", write))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # still waiting for the thread, not returning half-way
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == ["written"]
    assert await calls.blocking("get", lambda: 42) == 42


# --------------------------------------------------------------------------- LeaseBounds
def test_lease_bounds_say_what_is_allowed_and_why():
    azure = LeaseBounds(minimum=15, maximum=60, reason="Azure Blob leases last 15 to 60 s")
    azure.check(15)
    azure.check(60)
    with pytest.raises(ConfigurationError) as info:
        azure.check(5, "AzureBlobProvider")
    assert str(info.value) == (
        "lease_duration=5 s is out of range for AzureBlobProvider: use 15 to 60 s "
        "(Azure Blob leases last 15 to 60 s)"
    )
    with pytest.raises(ConfigurationError, match=r"use at least 2 s$"):
        LeaseBounds(minimum=2).check(1)
    with pytest.raises(ConfigurationError, match="use at most 30 s"):
        LeaseBounds(maximum=30).check(31)
    LeaseBounds().check(0.001)


def test_watches_woken_together_share_one_expiry_read_and_yield_before_it():
    async def body(clock: FakeClock) -> None:
        store = FakeStore()
        loop = asyncio.get_running_loop()
        store.leases["g"] = loop.time() + 10.0
        gates = [asyncio.Event(), asyncio.Event()]
        slow_reads = 0

        async def slow_expires_in(group: str) -> float | None:
            nonlocal slow_reads
            slow_reads += 1
            await gates[slow_reads - 1].wait()  # a store that takes its time to answer
            return await store.expires_in(group)

        hub = Notifications(store.listen, name="fake", expires_in=slow_expires_in)
        streams = [Follow(hub.watch("g")) for _ in range(20)]
        for stream in streams:
            assert await stream.next(0.1) is not None
        assert slow_reads == 1  # twenty watches woken together: one read in flight
        gates[0].set()
        await asyncio.sleep(0.01)
        store.feed.put_nowait("g")
        for stream in streams:  # yielded while the read that follows still hangs
            assert await stream.next(0.1) is not None
        assert slow_reads == 2
        gates[1].set()
        for stream in streams:
            await stream.aclose()
        await hub.aclose()

    run(body)


def test_driver_calls_cut_the_url_secrets():
    async def body(clock: FakeClock) -> None:
        url = "redis://user:s3cret@db:6379/0?ssl_password=k3y"
        calls = DriverCalls("redis", "redis://user:***@db:6379/0", timeout=1.0, url=url)

        async def leaky() -> None:
            raise OSError(f"cannot log in to {url}")

        with pytest.raises(ProviderError) as info:
            await calls.call("renew", leaky())
        assert "s3cret" not in str(info.value)
        assert "k3y" not in str(info.value)
        assert info.value.__cause__ is None

    run(body)


@pytest.mark.parametrize("bad", ["", "1table", "a-b", "tåble", "x" * 64, "a b", 'a"b', None])
def test_sql_identifiers_are_checked(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="table"):
        validate_identifier(bad, "table", max_length=63)


def test_sql_identifier_limits_and_reserved_prefixes() -> None:
    assert validate_identifier("_leases_2", "table", max_length=63) == "_leases_2"
    assert validate_identifier("x" * 128, "table", max_length=128) == "x" * 128
    with pytest.raises(ConfigurationError, match="'pg_' names are reserved"):
        validate_identifier("pg_catalog", "schema", max_length=63, reserved_prefixes=("pg_",))


def test_a_watch_cancelled_during_its_expiry_read_leaves_the_hub_consistent():
    async def body(clock: FakeClock) -> None:
        store = FakeStore()
        gate = asyncio.Event()

        async def hanging_expires_in(group: str) -> float | None:
            await gate.wait()
            raise ConnectionResetError("the read failed after everyone left")

        hub = Notifications(store.listen, name="fake", expires_in=hanging_expires_in)
        stays, leaves = Follow(hub.watch("g")), Follow(hub.watch("g"))
        assert await stays.next(0.1) is not None
        assert await leaves.next(0.1) is not None  # both now wait on one shared read
        await leaves.aclose()  # cancelled at that await
        assert hub.groups == {"g"}
        assert store.connections == 1
        await stays.aclose()
        await asyncio.sleep(0)
        assert hub.groups == frozenset()
        assert store.connections == 0
        assert not hub.listening
        gate.set()  # the orphaned read fails: retrieved, nothing left behind
        await asyncio.sleep(0.01)
        again = Follow(hub.watch("g"))
        assert await again.next(0.1) is not None
        await again.aclose()
        await hub.aclose()

    run(body)


def test_notifications_close_is_bounded_when_the_listener_ignores_its_cancellation(caplog):
    """A driver stuck in a read that swallows the cancel cannot hold aclose() for ever."""
    from multilock.core.testing import FakeClock

    clock = FakeClock()
    stuck: list[asyncio.Task[None]] = []
    release = asyncio.Event()

    async def listen(notifications):
        stuck.append(asyncio.current_task())
        notifications.ready()
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # a driver that swallows it, until released

    async def main():
        notifications = Notifications(listen, name="stuck")
        stream = notifications.watch("g")
        await anext(stream)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await notifications.aclose()
        waited = loop.time() - started
        release.set()
        stuck[0].cancel()
        await asyncio.wait(stuck)
        await stream.aclose()
        return waited

    waited = clock.run(main())
    assert 4.9 <= waited <= 5.1, waited
    assert "did not stop within 5 s" in caplog.text


async def test_call_until_resumes_its_caller_one_loop_turn_after_the_call_ends() -> None:
    # Every loop turn between a store's reply and the election's next step waits behind
    # whatever else is ready (a handoff's critical path): asyncio.shield took two.
    loop = asyncio.get_running_loop()
    ticks = 0
    ticker: asyncio.Handle | None = None

    def tick() -> None:
        nonlocal ticks, ticker
        ticks += 1
        ticker = loop.call_soon(tick)

    async def call() -> str:
        await asyncio.sleep(0)
        nonlocal ticker
        ticker = loop.call_soon(tick)  # counts the turns from here on
        return "answer"

    try:
        assert await call_until(call(), loop.time() + 5) == "answer"
        assert ticks == 1
    finally:
        assert ticker is not None
        ticker.cancel()


async def test_a_call_whose_task_is_cancelled_before_it_starts_is_closed_and_fails() -> None:
    # A loop shutting down cancels every task, some before their first step.
    started = False

    async def call() -> None:
        nonlocal started
        started = True

    before = asyncio.all_tasks()
    waiter = asyncio.ensure_future(call_until(call(), asyncio.get_running_loop().time() + 5))
    await asyncio.sleep(0)  # call_until has made the call's task, which has not run yet
    (relay,) = asyncio.all_tasks() - before - {waiter}
    relay.cancel()
    with pytest.raises(ProviderError, match="cancelled before it started"):
        await waiter
    assert not started
    # and no "coroutine ... was never awaited" (pytest turns that warning into an error)


async def test_a_call_the_driver_cancels_is_a_provider_error_and_the_caller_goes_on() -> None:
    async def call() -> None:
        raise asyncio.CancelledError  # gRPC cancels a call on a channel being closed

    with pytest.raises(ProviderError, match="was cancelled by the driver"):
        await call_until(call(), asyncio.get_running_loop().time() + 5)
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
