"""Reach the app's election from a request, and answer health checks from it.

`health_endpoint` reports `LeaderElection.health()`: 200 while the election runs well
(following, or leading with renewals on time), 503 otherwise, so a load balancer or a
Kubernetes probe stops trusting a replica whose election has stopped or cannot renew.
The answer is local state only: no store round trip per probe.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

# Imported at run time, not only for type checking: FastAPI reads these annotations to
# know what to inject.
from starlette.requests import Request
from starlette.responses import JSONResponse

from multilock.core import ConfigurationError, LeaderElection, MultilockError

from ._lifespan import APP_STATE_ATTRIBUTE, STATE_KEY

__all__ = ["get_election", "health_endpoint"]

ElectionGetter = Callable[[Request], LeaderElection | None]


def _find_election(request: Request) -> LeaderElection | None:
    """The election of *request*'s app: the lifespan state's, else ``app.state``'s, else None."""
    election = getattr(request.state, STATE_KEY, None)
    if not isinstance(election, LeaderElection):
        election = getattr(request.app.state, APP_STATE_ATTRIBUTE, None)
    return election if isinstance(election, LeaderElection) else None


def get_election(request: Request) -> LeaderElection:
    """The app's election; raise `MultilockError` if no `leader_lifespan` has started one.

    A FastAPI dependency: ``election: Annotated[LeaderElection, Depends(get_election)]``.
    """
    election = _find_election(request)
    if election is None:
        raise MultilockError(
            "no leader election on this app: pass lifespan=leader_lifespan(...) to it"
        )
    return election


def health_endpoint(
    election_getter: ElectionGetter | None = None,
) -> Callable[[Request], Awaitable[JSONResponse]]:
    """Return an endpoint answering ``{"healthy", "state", "is_leader", "detail"}``.

    Status 200 when ``election.health()`` is healthy, 503 when not, and 503 when there is
    no election (the lifespan has not started one). *election_getter* maps the request to
    the election; by default it finds the one `leader_lifespan` started. Mount it
    with ``app.add_api_route("/health", health_endpoint())`` (FastAPI) or
    ``Route("/health", health_endpoint())`` (Starlette).
    """
    if election_getter is not None and not callable(election_getter):
        raise ConfigurationError(
            "election_getter must be a function of the request, not "
            f"{type(election_getter).__name__}"
        )
    getter = _find_election if election_getter is None else election_getter

    async def health(request: Request) -> JSONResponse:
        election = getter(request)
        if election is None:
            body = {
                "healthy": False,
                "state": None,
                "is_leader": False,
                "detail": "no leader election is running for this app",
            }
            return JSONResponse(body, status_code=503)
        report = election.health()
        body = {
            "healthy": report.healthy,
            "state": report.state.value,
            "is_leader": report.is_leader,
            "detail": report.detail,
        }
        return JSONResponse(body, status_code=200 if report.healthy else 503)

    return health
