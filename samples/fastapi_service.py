"""A FastAPI service whose replicas elect one leader for their background work.

    python samples/fastapi_service.py --url redis://localhost:6379/0 --port 8001
    python samples/fastapi_service.py --url redis://localhost:6379/0 --port 8002

Every replica serves requests; only the leader prints ``leader work tick ...``. Stop the
leader with Ctrl-C or SIGTERM: uvicorn runs the app's lifespan shutdown, which releases
leadership, and the other replica starts ticking at once. Kill it with SIGKILL and the
other takes over when the lease expires. Endpoints:

- ``/health``: 200 while the election runs well, 503 otherwise (for probes);
- ``/leader``: who leads the group, as the store sees it;
- ``/metrics``: Prometheus metrics, ``multilock_is_leader{group}`` among them.

Needs ``pip install multilock-starlette multilock-prometheus multilock-redis fastapi uvicorn``.
The URL may also come from ``MULTILOCK_URL``, which keeps a password out of ``ps``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI
from prometheus_client import make_asgi_app

import multilock.prometheus
from multilock.core import LeaderElection, Leadership
from multilock.starlette import get_election, health_endpoint, leader_lifespan

#: Declare once; any handler that takes an ``election: Election`` gets the app's election.
Election = Annotated[LeaderElection, Depends(get_election)]


def build_app(
    url: str, group: str, lease: float, interval: float, participant: str | None
) -> FastAPI:
    async def leader_work(leadership: Leadership) -> None:
        """Runs only on the leader; cancelled the moment the term ends, restarted next term."""
        while True:
            leadership.check()  # raises LeadershipLost once the term is over
            # Real work would pass leadership.token to what it writes (fencing).
            print(
                f"leader work tick {leadership.participant_id} token={leadership.token}",
                flush=True,
            )
            await asyncio.sleep(interval)

    options: dict[str, Any] = {"lease_duration": lease}
    if participant:
        options["participant_id"] = participant
    app = FastAPI(lifespan=leader_lifespan(url, group=group, run=leader_work, **options))
    app.add_api_route("/health", health_endpoint(), include_in_schema=False)

    @app.get("/leader")
    async def leader(election: Election) -> dict[str, Any]:
        info = await election.current_leader()  # asks the store
        return {
            "group": election.group,
            "leader": info.participant_id if info else None,
            "token": info.token if info else None,
            "me": election.participant_id,
            "is_leader": election.is_leader,
        }

    multilock.prometheus.instrument()  # every election of this process reports to it
    app.mount("/metrics", make_asgi_app())
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/fastapi_service.py")
    parser.add_argument(
        "--url", default=os.environ.get("MULTILOCK_URL"), help="store URL (or MULTILOCK_URL)"
    )
    parser.add_argument("--group", default="fastapi-service", help="group name")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--lease", type=float, default=10.0, help="lease seconds (default 10)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between ticks")
    parser.add_argument("--id", help="participant id (default: host-pid-random)")
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url or set MULTILOCK_URL (e.g. redis://localhost:6379/0)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = build_app(args.url, args.group, args.lease, args.interval, args.id)
    # uvicorn turns SIGTERM and Ctrl-C into the lifespan shutdown: leadership is released.
    uvicorn.run(app, host=args.host, port=args.port, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
