"""A plain asyncio service that exports its leader election to Prometheus.

    python samples/metrics_service.py --url redis://localhost:6379/0 --metrics-port 9100
    python samples/metrics_service.py --url redis://localhost:6379/0 --metrics-port 9101
    curl -s localhost:9100/metrics | grep '^multilock_'

Run it twice: one process leads and prints ``leader tick`` lines with its health, and
``multilock_is_leader`` is 1 on its /metrics, 0 on the other's. Stop the leader with
Ctrl-C or ``kill`` (SIGTERM): it releases its lease before exiting (status 130 or 143),
the other takes over at once (well before the lease could expire), and its
``multilock_failover_seconds`` shows how long it took from the release message to winning.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

import prometheus_client

import multilock.prometheus
from multilock.core import (
    EventKind,
    EventStream,
    LeaderElection,
    Leadership,
    MultilockError,
    from_url,
    redact_url,
    stop_on_signals,
)


def say(text: str) -> None:
    print(text, flush=True)


async def leader_work(leadership: Leadership, election: LeaderElection, interval: float) -> None:
    """Fake leader-only work: one tick per *interval*, cancelled the moment the term ends."""
    tick = 0
    while True:
        leadership.check()  # raises LeadershipLost once the term is over
        tick += 1
        # What a health endpoint would answer (no I/O): unhealthy when renewals fall behind.
        health = election.health()
        status = "healthy" if health.healthy else "UNHEALTHY"
        say(f"leader tick {tick} (token {leadership.token}); {status}: {health.detail}")
        await asyncio.sleep(interval)


async def report_leaders(changes: EventStream) -> None:
    """Say who leads each time that changes, as this replica sees it."""
    async for event in changes:
        say(f"leader is {'nobody' if event.leader is None else event.leader.participant_id}")


async def run(args: argparse.Namespace) -> None:
    # Before the first election is created: every election of the process reports to it.
    multilock.prometheus.instrument()
    server, _ = prometheus_client.start_http_server(args.metrics_port)  # a daemon thread
    say(f"metrics on port {server.server_port}")
    # stop_on_signals: SIGTERM/SIGINT stop the election (releasing the lease), then the
    # process exits with status 143/130. Whoever builds the provider closes it.
    async with (
        from_url(args.url) as provider,
        stop_on_signals(),
        LeaderElection(provider, group=args.group, lease_duration=args.lease) as election,
    ):
        say(f"{election.participant_id} campaigns for {args.group!r} on {redact_url(args.url)}")
        # Subscribed before the first campaign round runs: no change of leader is missed.
        changes = election.events(EventKind.LEADER_CHANGED)
        reporting = asyncio.create_task(report_leaders(changes))
        try:
            await election.run_while_leader(leader_work, election, args.interval)
        finally:
            reporting.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python samples/metrics_service.py")
    parser.add_argument(
        "--url",
        default=os.environ.get("MULTILOCK_URL", "memory://"),
        help="backend URL (default $MULTILOCK_URL, else memory://)",
    )
    parser.add_argument("--group", default="metrics-service", help="group name")
    parser.add_argument(
        "--metrics-port", type=int, default=9100, help="port of /metrics (default 9100; 0: any)"
    )
    parser.add_argument("--lease", type=float, default=10.0, help="lease seconds (default 10)")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between leader ticks (default 1)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(run(args))
    except MultilockError as exc:  # bad URL or options
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
