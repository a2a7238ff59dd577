"""multilock.starlette: leader election in the lifespan of a FastAPI or Starlette app.

- `leader_lifespan`: pass it as ``lifespan=``; it campaigns while the app runs, runs
  leader-only work in the background, and releases leadership on shutdown (SIGTERM).
- `get_election`: the app's `LeaderElection` from a request (a FastAPI dependency).
- `health_endpoint`: 200/503 from ``election.health()``, for probes and load balancers.
"""

from ._health import get_election, health_endpoint
from ._lifespan import leader_lifespan

__all__ = ["get_election", "health_endpoint", "leader_lifespan"]

__version__ = "0.1.0"
