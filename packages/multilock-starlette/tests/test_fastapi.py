"""The FastAPI side: ``FastAPI(lifespan=...)``, `get_election` as a dependency, the health route."""

from __future__ import annotations

from typing import Annotated, Any

import pytest

fastapi = pytest.importorskip("fastapi")

from fastapi import Depends, FastAPI  # noqa: E402

from multilock.core import InMemoryProvider, LeaderElection  # noqa: E402
from multilock.core.testing import FakeClock  # noqa: E402
from multilock.starlette import get_election, health_endpoint, leader_lifespan  # noqa: E402

#: What a FastAPI app declares once and uses in every handler that needs the election.
Election = Annotated[LeaderElection, Depends(get_election)]


def test_dependency_health_route_and_shutdown(serve: Any) -> None:
    async def body(clock: FakeClock) -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        app = FastAPI(lifespan=leader_lifespan(store, group="jobs", participant_id="api-1"))
        app.add_api_route("/health", health_endpoint(), include_in_schema=False)

        @app.get("/leader")
        async def leader(election: Election) -> dict[str, Any]:
            info = await election.current_leader()
            return {"me": election.participant_id, "leader": info and info.participant_id}

        async with serve(app) as client:
            election = app.state.multilock_election
            await election.wait_until_leader()
            assert (await client.get("/leader")).json() == {"me": "api-1", "leader": "api-1"}
            response = await client.get("/health")
            assert response.status_code == 200
            assert response.json()["is_leader"] is True
            assert "/health" not in (await client.get("/openapi.json")).json()["paths"]
        assert not election.is_leader
        assert election.health().healthy is False

    clock = FakeClock()
    clock.run(body(clock))
