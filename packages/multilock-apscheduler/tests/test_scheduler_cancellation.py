"""`multilock.apscheduler.LeaderScheduler` whose exit is cancelled (a shutdown timeout).

Whatever await of the exit the cancel lands on, the scheduler ends shut down, the
election stopped, the lease released (or, when the store does not answer, given up on
within the election's bound), and a provider built from a URL is closed only after the
release. In virtual time (`FakeClock`): nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.schedulers.base import STATE_STOPPED

import multilock.apscheduler._scheduler as private
from multilock.apscheduler import LeaderScheduler
from multilock.core import (
    ElectionState,
    InMemoryProvider,
    LeaderElection,
    Leadership,
    Provider,
    ProviderError,
)
from multilock.core.testing import FakeClock, FaultyProvider

LEASE = 10.0
GROUP = "jobs"


class Store(FaultyProvider):
    """The in-memory store; a call named in ``slow`` takes ``slow[name]`` seconds, or
    hangs (``None``) and then takes *settle* seconds to honour a cancel. It logs each
    release and its close, and once closed it refuses every call, as a real driver does."""

    def __init__(self, inner: Provider, settle: float = 300.0) -> None:
        super().__init__(inner)
        self.settle = settle
        self.slow: dict[str, float | None] = {}
        self.log: list[str] = []
        self.closed = False

    async def _gate(self, method: str) -> Any:
        if self.closed:
            raise ProviderError(f"{method} on a closed provider")
        if method in self.slow:
            seconds = self.slow[method]
            try:
                if seconds is None:
                    await asyncio.Event().wait()
                await asyncio.sleep(seconds or 0)
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


def run(body: Callable[[FakeClock, InMemoryProvider], Any]) -> None:
    clock = FakeClock()

    async def main() -> None:
        await body(clock, InMemoryProvider(clock=clock.monotonic))

    clock.run(main())


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


def ours() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("multilock-")]


def leader_on(store: Store, monkeypatch: pytest.MonkeyPatch, url: bool) -> LeaderScheduler:
    """A LeaderScheduler on *store*: given as is, or built from a URL (and closed by it)."""
    if not url:
        return LeaderScheduler(AsyncIOScheduler(), store, group=GROUP, lease_duration=LEASE)
    monkeypatch.setattr(private, "from_url", lambda url: store)
    return LeaderScheduler(AsyncIOScheduler(), "memory://x", group=GROUP, lease_duration=LEASE)


@pytest.mark.parametrize("url", [False, True], ids=["given provider", "url"])
def test_exit_cancelled_during_a_slow_release_still_releases(
    monkeypatch: pytest.MonkeyPatch, url: bool
) -> None:
    async def body(clock: FakeClock, inner: InMemoryProvider) -> None:
        store = Store(inner)
        leader = leader_on(store, monkeypatch, url)
        await leader.__aenter__()
        await leader.election.wait_until_leader()
        store.slow["release"] = 1.0  # a slow store: the release takes a second

        exiting = asyncio.ensure_future(leader.__aexit__(None, None, None))
        await asyncio.sleep(0.5)  # in the release
        assert not exiting.done()
        assert await cancel(exiting) < 0.01

        assert leader.scheduler.state == STATE_STOPPED  # no job starts from now on
        assert not leader.is_leader
        await until(lambda: leader.election.state is ElectionState.STOPPED)
        await until(lambda: "released" in store.log)
        if url:
            await until(lambda: store.closed)
            assert store.log == ["released", "closed"], "closed under the release"
        else:
            assert store.log == ["released"]  # a given provider is never closed here
        assert ours() == []
        await taken_at_once(inner)

    run(body)


@pytest.mark.parametrize("url", [False, True], ids=["given provider", "url"])
def test_exit_cancelled_while_the_release_hangs_gives_up_within_its_bound(
    monkeypatch: pytest.MonkeyPatch, url: bool
) -> None:
    async def body(clock: FakeClock, inner: InMemoryProvider) -> None:
        store = Store(inner)
        leader = leader_on(store, monkeypatch, url)
        await leader.__aenter__()
        await leader.election.wait_until_leader()
        store.slow["release"] = None

        exiting = asyncio.ensure_future(leader.__aexit__(None, None, None))
        await asyncio.sleep(0.5)
        assert await cancel(exiting) < 0.01
        assert leader.scheduler.state == STATE_STOPPED
        bound = leader.election.options.renew_interval
        await until(lambda: leader.election.state is ElectionState.STOPPED, within=bound)
        if url:
            await until(lambda: store.closed, within=0.1)
        assert ours() == []
        del store.slow["release"]
        clock.advance(LEASE)  # given up on: the lease expires
        assert await inner.get_leader(GROUP) is None

    run(body)


def test_exit_cancelled_at_each_of_its_awaits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancel the exit after 0, 1, 2... turns of the loop: each ends consistent."""

    async def body(clock: FakeClock, inner: InMemoryProvider) -> None:
        for turns in range(1, 12):  # 0: cancelled before the exit begins, it never runs
            store = Store(inner)
            leader = leader_on(store, monkeypatch, url=True)
            await leader.__aenter__()
            await leader.election.wait_until_leader()
            exiting = asyncio.ensure_future(leader.__aexit__(None, None, None))
            for _ in range(turns):
                await asyncio.sleep(0)
            exiting.cancel()
            await asyncio.wait({exiting})
            assert leader.scheduler.state == STATE_STOPPED, turns
            await until(lambda: leader.election.state is ElectionState.STOPPED)  # noqa: B023
            await until(lambda: store.closed)  # noqa: B023
            assert store.log == ["released", "closed"], turns
            assert ours() == []
            await taken_at_once(inner)

    run(body)
