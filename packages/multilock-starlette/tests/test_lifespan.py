"""`leader_lifespan` on the in-memory provider, in virtual time: nothing sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import multilock.starlette._lifespan as lifespan_module
from multilock.core import (
    ConfigurationError,
    ElectionState,
    InMemoryProvider,
    LeaderElection,
    Leadership,
    LeadershipEvent,
)
from multilock.core.testing import FakeClock
from multilock.starlette import leader_lifespan

LEASE = 10.0


def in_virtual_time(body: Callable[[FakeClock], Coroutine[Any, Any, None]]) -> None:
    clock = FakeClock()
    clock.run(body(clock))


class Work:
    """A leader-only coroutine that records when it starts and when it is cancelled."""

    def __init__(self) -> None:
        self.started: list[tuple[str, int]] = []
        self.cancelled: list[tuple[str, int]] = []
        self.changed = asyncio.Event()

    async def __call__(self, leadership: Leadership) -> None:
        term = (leadership.participant_id, leadership.token)
        self.started.append(term)
        self.changed.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(term)
            self.changed.set()
            raise

    async def wait_started(self, count: int) -> None:
        while len(self.started) < count:
            self.changed.clear()
            await self.changed.wait()


class SpyProvider(InMemoryProvider):
    """An in-memory provider that counts its closes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1
        await super().aclose()


def app_with(lifespan: Any) -> Starlette:
    return Starlette(lifespan=lifespan)


# --------------------------------------------------------------------------- election
def test_work_runs_only_on_the_leader_and_shutdown_hands_over_at_once() -> None:
    async def body(clock: FakeClock) -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        work = Work()
        apps = {
            name: app_with(
                leader_lifespan(
                    store, group="jobs", run=work, participant_id=name, lease_duration=LEASE
                )
            )
            for name in ("a", "b")
        }
        contexts = {name: app.router.lifespan_context(app) for name, app in apps.items()}
        states = {name: await cm.__aenter__() for name, cm in contexts.items()}
        await work.wait_started(1)
        ((leader, token),) = work.started
        follower = "b" if leader == "a" else "a"
        assert states[leader]["election"].is_leader
        assert not states[follower]["election"].is_leader
        for _ in range(3):  # terms are renewed; the follower never runs the work
            await asyncio.sleep(LEASE)
        assert work.started == [(leader, token)]

        stopped_at = clock.now
        await contexts[leader].__aexit__(None, None, None)  # lifespan shutdown (SIGTERM)
        assert work.cancelled == [(leader, token)]
        assert states[leader]["election"].state is ElectionState.STOPPED
        await work.wait_started(2)
        assert work.started[1][0] == follower
        assert work.started[1][1] > token
        assert clock.now - stopped_at < 1.0, "the lease was released, not left to expire"
        await contexts[follower].__aexit__(None, None, None)
        assert work.cancelled[-1] == work.started[1]

    in_virtual_time(body)


def test_the_election_is_in_the_lifespan_state_and_on_app_state(serve: Any) -> None:
    async def endpoint(request: Request) -> JSONResponse:
        election = request.state.election
        assert election is request.app.state.multilock_election
        return JSONResponse({"participant": election.participant_id, "db": request.state.db})

    @contextlib.asynccontextmanager
    async def own(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        yield {"db": "pool"}

    async def body(clock: FakeClock) -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        lifespan = leader_lifespan(store, group="jobs", participant_id="me", lifespan=own)
        app = Starlette(routes=[Route("/", endpoint)], lifespan=lifespan)
        async with serve(app) as client:  # the ASGI lifespan protocol, as uvicorn runs it
            election = app.state.multilock_election
            assert isinstance(election, LeaderElection)
            assert (await client.get("/")).json() == {"participant": "me", "db": "pool"}
            assert (await election.wait_until_leader()).participant_id == "me"
        assert election.state is ElectionState.STOPPED

    in_virtual_time(body)


def test_own_lifespan_wraps_the_election() -> None:
    """The app's own resources are ready before leader work starts and outlive it."""

    async def body(clock: FakeClock) -> None:
        order: list[str] = []

        @contextlib.asynccontextmanager
        async def own(app: Starlette) -> AsyncIterator[None]:  # stateless
            order.append("own startup")
            yield
            order.append("own shutdown")

        working = asyncio.Event()

        async def run(leadership: Leadership) -> None:
            order.append("work")
            working.set()
            try:
                await asyncio.Event().wait()
            finally:
                order.append("work cancelled")

        store = InMemoryProvider(clock=clock.monotonic)
        app = app_with(leader_lifespan(store, group="jobs", run=run, lifespan=own))
        async with app.router.lifespan_context(app) as state:
            assert set(state) == {"election"}
            await working.wait()
        assert order == ["own startup", "work", "work cancelled", "own shutdown"]

    in_virtual_time(body)


@pytest.mark.parametrize(
    ("from_url", "close_provider", "closed"),
    [
        (True, None, 1),  # built here from a URL: closed here
        (True, False, 0),
        (False, None, 0),  # the caller's provider: the caller closes it
        (False, True, 1),
    ],
)
def test_provider_is_closed_only_when_built_here_or_asked(
    monkeypatch: pytest.MonkeyPatch, from_url: bool, close_provider: bool | None, closed: int
) -> None:
    async def body(clock: FakeClock) -> None:
        spy = SpyProvider(clock=clock.monotonic)
        urls: list[str] = []

        def fake_from_url(url: str) -> SpyProvider:
            urls.append(url)
            return spy

        monkeypatch.setattr(lifespan_module, "from_url", fake_from_url)
        target = "memory://spy" if from_url else spy
        app = app_with(leader_lifespan(target, group="jobs", close_provider=close_provider))
        async with app.router.lifespan_context(app) as state:
            assert state["election"].provider is spy
            assert spy.closed == 0
        assert urls == (["memory://spy"] if from_url else [])
        assert spy.closed == closed

    in_virtual_time(body)


def test_a_url_builds_a_provider_per_startup() -> None:
    async def body(clock: FakeClock) -> None:
        app = app_with(leader_lifespan("memory://lifespan-url", group="jobs"))
        elections = []
        for _ in range(2):  # an app can be started again (tests do this)
            async with app.router.lifespan_context(app) as state:
                elections.append(state["election"])
                await state["election"].wait_until_leader()
        first, second = elections
        assert first is not second
        assert first.participant_id != second.participant_id
        assert isinstance(first.provider, InMemoryProvider)

    in_virtual_time(body)


def test_work_that_raises_is_resigned_and_restarted_in_a_later_term(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(clock: FakeClock) -> None:
        tokens: list[int] = []
        again = asyncio.Event()

        async def run(leadership: Leadership) -> None:
            tokens.append(leadership.token)
            if len(tokens) == 1:
                raise RuntimeError("boom")
            again.set()
            await asyncio.Event().wait()

        store = InMemoryProvider(clock=clock.monotonic)
        app = app_with(leader_lifespan(store, group="jobs", run=run, lease_duration=LEASE))
        async with app.router.lifespan_context(app) as state:
            await again.wait()
            assert state["election"].is_leader
        assert len(tokens) == 2
        assert tokens[1] > tokens[0]

    with caplog.at_level(logging.INFO, logger="multilock"):
        in_virtual_time(body)
    assert "boom" in caplog.text
    assert "will start again in the next term" in caplog.text


def test_transition_callbacks_sync_and_async_and_their_errors_are_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(clock: FakeClock) -> None:
        seen: list[tuple[str, int | None]] = []

        def on_acquired(event: LeadershipEvent) -> None:
            seen.append(("acquired", event.token))
            raise ValueError("callback bug")

        async def on_lost(event: LeadershipEvent) -> None:
            seen.append(("lost", event.token))

        store = InMemoryProvider(clock=clock.monotonic)
        app = app_with(
            leader_lifespan(store, group="jobs", on_acquired=on_acquired, on_lost=on_lost)
        )
        async with app.router.lifespan_context(app) as state:
            election = state["election"]
            first = await election.wait_until_leader()
            await election.resign()  # LOST, then (after the hold-off) ACQUIRED again
            second = await election.wait_until_leader()
        assert seen == [
            ("acquired", first.token),
            ("lost", first.token),
            ("acquired", second.token),
            ("lost", second.token),
        ]

    in_virtual_time(body)
    messages = [record.getMessage() for record in caplog.records]
    assert messages.count("on_acquired raised on ACQUIRED of jobs") == 2


# --------------------------------------------------------------------------- checks
async def _async_run(leadership: Leadership) -> None:
    pass


def _sync_run(leadership: Leadership) -> None:
    pass


async def _async_gen(leadership: Leadership) -> AsyncIterator[None]:
    yield


class _AsyncCallable:
    async def __call__(self, leadership: Leadership) -> None:
        pass


class _SyncCallable:
    def __call__(self, leadership: Leadership) -> None:
        pass


@pytest.mark.parametrize(
    "run",
    [_async_run, functools.partial(_async_run), _AsyncCallable()],
    ids=["async def", "partial", "async __call__"],
)
def test_async_work_is_accepted(run: Any) -> None:
    assert callable(leader_lifespan(InMemoryProvider(), group="jobs", run=run))


@pytest.mark.parametrize(
    ("run", "named"),
    [
        (_sync_run, "the plain function '_sync_run'"),
        (lambda leadership: _async_run(leadership), "'<lambda>'"),
        (_async_gen, "'_async_gen'"),
        (_SyncCallable(), "a _SyncCallable object"),
        (_AsyncCallable, "'_AsyncCallable'"),  # the class, not an instance
    ],
    ids=["plain function", "lambda", "async generator", "sync callable", "class"],
)
def test_work_that_is_not_async_def_is_rejected_by_name(run: Any, named: str) -> None:
    with pytest.raises(ConfigurationError, match="run must be an async def function") as info:
        leader_lifespan(InMemoryProvider(), group="jobs", run=run)
    assert named in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"group": "no spaces"}, "group"),
        ({"group": "g", "lease_duration": 1, "renew_interval": 1}, "renew_interval"),
        ({"group": "g", "lease": 10}, "unknown election option"),
        ({"group": "g", "on_lost": "log"}, "on_lost must be callable"),
        ({"group": "g", "close_provider": "yes"}, "close_provider"),
        ({"group": "g", "lifespan": object()}, "lifespan must be"),
    ],
)
def test_bad_arguments_fail_when_the_app_is_built(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        leader_lifespan(InMemoryProvider(), **kwargs)


def test_a_provider_that_is_neither_is_rejected() -> None:
    with pytest.raises(ConfigurationError, match="Provider or a URL string, not dict"):
        leader_lifespan({"url": "redis://"}, group="jobs")  # type: ignore[arg-type]


def test_a_bad_url_fails_startup(serve: Any) -> None:
    async def body(clock: FakeClock) -> None:
        app = app_with(leader_lifespan("nosuch://host", group="jobs"))
        with pytest.raises(ConfigurationError, match="no multilock provider"):
            async with serve(app):
                pass
        assert not hasattr(app.state, "multilock_election")

    in_virtual_time(body)


def test_served_through_asgi_without_lifespan_state() -> None:
    """Servers and clients that do not pass lifespan state still reach the election."""

    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse({"is_leader": request.app.state.multilock_election.is_leader})

    async def body(clock: FakeClock) -> None:
        lifespan = leader_lifespan(InMemoryProvider(clock=clock.monotonic), group="jobs")
        app = Starlette(routes=[Route("/", endpoint)], lifespan=lifespan)
        async with app.router.lifespan_context(app) as state:
            await state["election"].wait_until_leader()
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                assert (await client.get("/")).json() == {"is_leader": True}

    in_virtual_time(body)
