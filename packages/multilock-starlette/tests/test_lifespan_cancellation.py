"""`leader_lifespan` whose startup or shutdown is cancelled (a server's timeout, a test's
cancel scope): the election ends stopped, its tasks gone, the lease released, and the
provider closed only after the release. In virtual time, nothing sleeps."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette

import multilock.starlette._lifespan as lifespan_module
from multilock.core import (
    ElectionState,
    InMemoryProvider,
    LeaderElection,
    Leadership,
    Provider,
    ProviderError,
)
from multilock.core.testing import FakeClock, FaultyProvider
from multilock.starlette import leader_lifespan

LEASE = 10.0
GROUP = "jobs"


class Store(FaultyProvider):
    """The in-memory store, whose calls named in ``slow`` hang and then take *settle*
    seconds to honour a cancel (as psycopg or a worker thread do). It logs each release
    and its close, and once closed it refuses every call, as a real driver does."""

    def __init__(self, inner: Provider, settle: float = 300.0) -> None:
        super().__init__(inner)
        self.settle = settle
        self.slow: set[str] = set()
        self.log: list[str] = []
        self.closed = False

    async def _gate(self, method: str) -> Any:
        if self.closed:
            raise ProviderError(f"{method} on a closed provider")
        if method in self.slow:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                await asyncio.shield(asyncio.sleep(self.settle))
                raise
        return await super()._gate(method)

    async def release(self, group: str, participant_id: str, token: int) -> None:
        await super().release(group, participant_id, token)
        self.log.append("released")

    async def aclose(self) -> None:
        self.closed = True
        self.log.append("closed")


def in_virtual_time(body: Callable[[FakeClock, InMemoryProvider], Any]) -> None:
    clock = FakeClock()

    async def main() -> None:
        await body(clock, InMemoryProvider(clock=clock.monotonic))

    clock.run(main())


@pytest.fixture
def elections(monkeypatch: pytest.MonkeyPatch) -> list[LeaderElection]:
    """The elections the lifespan builds."""
    built: list[LeaderElection] = []

    class Recorded(LeaderElection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(lifespan_module, "LeaderElection", Recorded)
    return built


def ours() -> list[asyncio.Task[Any]]:
    """The loop's tasks that the lifespan or its election started."""
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("multilock-")]


async def until(condition: Callable[[], bool], within: float = LEASE) -> None:
    """Wait for *condition*, at most *within* virtual seconds."""
    async with asyncio.timeout(within):
        while not condition():
            await asyncio.sleep(0.01)


async def cancel(task: asyncio.Future[Any]) -> float:
    """Cancel *task*, check it ends cancelled; return the virtual seconds that took."""
    loop = asyncio.get_running_loop()
    asked = loop.time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return loop.time() - asked


async def taken_at_once(inner: InMemoryProvider) -> Leadership:
    """Another replica takes the group at once: the lease was released, not left to expire."""
    async with LeaderElection(inner, group=GROUP, participant_id="next") as other:
        return await other.wait_until_leader(timeout=0.5)


async def work(leadership: Leadership) -> None:
    await asyncio.Event().wait()


def test_startup_cancelled_in_the_probe(elections: list[LeaderElection]) -> None:
    async def body(clock: FakeClock, inner: InMemoryProvider) -> None:
        store = Store(inner)
        store.slow.add("get_leader")
        lost: list[Any] = []
        lifespan: Callable[[Starlette], Any] = leader_lifespan(
            store,
            group=GROUP,
            run=work,
            on_lost=lost.append,
            close_provider=True,
            probe_timeout=LEASE,
        )
        app = Starlette(lifespan=lifespan)
        starting = asyncio.ensure_future(app.router.lifespan_context(app).__aenter__())
        await asyncio.sleep(1)  # in the probe of the store
        assert not starting.done()
        assert await cancel(starting) < 0.01, "startup waited for the driver's slow cancel"

        (election,) = elections
        assert election.state in (ElectionState.IDLE, ElectionState.STOPPED)
        assert not election.is_leader
        assert ours() == [], "a task of the lifespan was left running"
        assert store.log == ["closed"]
        assert not hasattr(app.state, "multilock_election")
        assert lost == []
        assert await inner.get_leader(GROUP) is None
        await taken_at_once(inner)

    in_virtual_time(body)


def test_startup_cancelled_in_the_apps_own_lifespan(elections: list[LeaderElection]) -> None:
    async def body(clock: FakeClock, inner: InMemoryProvider) -> None:
        class Own:
            async def __aenter__(self) -> None:
                await asyncio.Event().wait()  # a database that does not answer

            async def __aexit__(self, *exc: object) -> None:
                pass

        store = Store(inner)
        lifespan: Callable[[Starlette], Any] = leader_lifespan(
            store, group=GROUP, run=work, lifespan=lambda app: Own()
        )
        app = Starlette(lifespan=lifespan)
        starting = asyncio.ensure_future(app.router.lifespan_context(app).__aenter__())
        await asyncio.sleep(1)
        await cancel(starting)
        assert elections == []  # never built
        assert ours() == []
        assert await inner.get_leader(GROUP) is None

    in_virtual_time(body)


def test_shutdown_cancelled_still_stops_releases_then_closes(
    elections: list[LeaderElection],
) -> None:
    async def body(clock: FakeClock, inner: InMemoryProvider) -> None:
        store = Store(inner)
        stopping: list[str] = []

        async def slow_to_stop(leadership: Leadership) -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                stopping.append("work cancelled")
                finished = asyncio.ensure_future(asyncio.sleep(2))  # flushes its last batch
                while not finished.done():  # however often it is cancelled meanwhile
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(finished)
                stopping.append("work done")
                raise

        lifespan: Callable[[Starlette], Any] = leader_lifespan(
            store,
            group=GROUP,
            run=slow_to_stop,
            close_provider=True,
            participant_id="a",
            lease_duration=LEASE,
        )
        app = Starlette(lifespan=lifespan)
        context = app.router.lifespan_context(app)
        state = await context.__aenter__()
        assert state is not None
        election = state["election"]
        await election.wait_until_leader()
        await asyncio.sleep(0.1)  # the work is running

        stopping_at = clock.now
        exiting = asyncio.ensure_future(context.__aexit__(None, None, None))
        await asyncio.sleep(0.5)
        assert stopping == ["work cancelled"]
        assert not exiting.done()
        assert await cancel(exiting) < 0.01

        await until(lambda: election.state is ElectionState.STOPPED)
        await until(lambda: store.closed)
        assert stopping == ["work cancelled", "work done"]
        assert store.log == ["released", "closed"], "the provider was closed before the release"
        assert ours() == []
        assert clock.now - stopping_at < LEASE / 2
        await taken_at_once(inner)

    in_virtual_time(body)


def test_shutdown_cancelled_while_the_release_hangs(elections: list[LeaderElection]) -> None:
    async def body(clock: FakeClock, inner: InMemoryProvider) -> None:
        store = Store(inner)
        lifespan: Callable[[Starlette], Any] = leader_lifespan(
            store, group=GROUP, run=work, close_provider=True, lease_duration=LEASE
        )
        app = Starlette(lifespan=lifespan)
        context = app.router.lifespan_context(app)
        state = await context.__aenter__()
        assert state is not None
        election = state["election"]
        await election.wait_until_leader()
        store.slow.add("release")

        exiting = asyncio.ensure_future(context.__aexit__(None, None, None))
        await asyncio.sleep(0.5)  # in the release
        assert not exiting.done()
        assert await cancel(exiting) < 0.01

        # The release is bounded by the election (a renew interval), and the provider is
        # closed once it is given up on, never under it.
        await until(lambda: store.closed, within=election.options.renew_interval + 0.1)
        assert election.state is ElectionState.STOPPED
        assert ours() == []
        store.slow.clear()
        clock.advance(LEASE)  # given up on: the lease expires
        assert await inner.get_leader(GROUP) is None

    in_virtual_time(body)
