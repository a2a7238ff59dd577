"""`health_endpoint` and `get_election`, served through ASGI in virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from multilock.core import (
    ConfigurationError,
    InMemoryProvider,
    LeaderElection,
    MultilockError,
)
from multilock.core.testing import FakeClock, Fault, FaultyProvider
from multilock.starlette import get_election, health_endpoint, leader_lifespan

LEASE = 9.0


def in_virtual_time(body: Callable[[FakeClock], Coroutine[Any, Any, None]]) -> None:
    clock = FakeClock()
    clock.run(body(clock))


async def get(app: Starlette, path: str = "/health") -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path)


def test_no_election_is_unhealthy() -> None:
    async def body(clock: FakeClock) -> None:
        app = Starlette(routes=[Route("/health", health_endpoint())])  # no leader_lifespan
        response = await get(app)
        assert response.status_code == 503
        assert response.json() == {
            "healthy": False,
            "state": None,
            "is_leader": False,
            "detail": "no leader election is running for this app",
        }

    in_virtual_time(body)


def test_unhealthy_before_start_and_after_stop_healthy_while_running() -> None:
    async def body(clock: FakeClock) -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        election = LeaderElection(store, group="jobs", lease_duration=LEASE)
        app = Starlette(routes=[Route("/health", health_endpoint(lambda request: election))])

        response = await get(app)
        assert response.status_code == 503
        assert response.json()["state"] == "idle"
        assert response.json()["healthy"] is False

        async with election:
            await election.wait_until_leader()
            response = await get(app)
            assert response.status_code == 200
            body = response.json()
            assert (body["healthy"], body["state"], body["is_leader"]) == (True, "leading", True)
            assert "leading with token" in body["detail"]

        response = await get(app)
        assert response.status_code == 503
        assert response.json() == {
            "healthy": False,
            "state": "stopped",
            "is_leader": False,
            "detail": "the election is stopped",
        }

    in_virtual_time(body)


def test_follower_is_healthy_and_a_leader_that_cannot_renew_is_not() -> None:
    async def body(clock: FakeClock) -> None:
        store = FaultyProvider(InMemoryProvider(clock=clock.monotonic))
        apps = {
            name: Starlette(
                routes=[Route("/health", health_endpoint())],
                lifespan=leader_lifespan(
                    store, group="jobs", participant_id=name, lease_duration=LEASE
                ),
            )
            for name in ("a", "b")
        }
        contexts = {name: app.router.lifespan_context(app) for name, app in apps.items()}
        states = {name: await cm.__aenter__() for name, cm in contexts.items()}
        leadership = await states["a"]["election"].wait_until_leader()  # a started first
        await asyncio.sleep(1)  # b's first campaign round sees a
        answers = {name: (await get(app)).json() for name, app in apps.items()}
        assert answers["a"]["is_leader"] is True
        assert answers["b"] == {
            "healthy": True,
            "state": "campaigning",
            "is_leader": False,
            "detail": "following; the leader is a",
        }

        store.inject(Fault.HANG, "renew")
        election = states["a"]["election"]
        # Unhealthy once no renew has succeeded for two renew intervals, which comes
        # before the term's deadline: a probe sees the trouble while it still leads.
        while election.is_leader:
            response = await get(apps["a"])
            if response.status_code == 503:
                break
            await asyncio.sleep(election.options.renew_interval / 4)
        assert response.status_code == 503, "a leader that cannot renew must say so"
        assert response.json()["is_leader"] is True
        assert leadership.is_valid
        store.heal()
        for cm in contexts.values():
            await cm.__aexit__(None, None, None)

    in_virtual_time(body)


def test_getter_must_be_callable() -> None:
    with pytest.raises(ConfigurationError, match="election_getter must be a function"):
        health_endpoint("election")  # type: ignore[arg-type]


def test_get_election_without_a_lifespan_names_the_fix() -> None:
    async def endpoint(request: Request) -> None:
        get_election(request)

    async def body(clock: FakeClock) -> None:
        app = Starlette(routes=[Route("/", endpoint)])
        with pytest.raises(MultilockError, match=r"lifespan=leader_lifespan\(\.\.\.\)"):
            await get(app, "/")

    in_virtual_time(body)
