"""Benchmark multilock's backends, compare it with its peers, and write a Markdown report.

    python benchmarks/run.py [--backends memory,filesystem,redis,redlock,postgres,etcd,
                                         s3,azure_blob,zookeeper]
                             [--handoffs 100] [--kills 5] [--idle-leases 20] [--lease 1.0]
                             [--peers all|none] [--peer-poll 0.25]
                             [--scale 1000] [--scale-small 100]
                             [--scale-backends memory,redis,postgres]
                             [--scale-workers 4] [--scale-lease 5] [--scale-window S]
                             [--groups 10000] [--groups-backends redis,postgres]
                             [--groups-lease 15] [--groups-window S]
                             [--sigterm 20] [--sigterm-lease 2]
                             [--sigterm-backends redis,postgres,etcd,zookeeper,filesystem]
                             [--locks 1000] [--lock-handoffs 100] [--lock-lease 2]
                             [--rebalance 5] [--rebalance-backends redis,postgres]
                             [--rebalance-shards 64] [--rebalance-participants 4]
                             [--rebalance-lease 2] [--rebalance-window S]
                             [--plot PNG (default: failover.png beside --out)]
                             [--out benchmarks/REPORT.md]
                             [--timeline 60]
                             [--only locks,rebalance,timeline]

Starts its own throwaway servers (redis-server, postgres, etcd, moto's S3, Azurite,
ZooKeeper) with the integration harness and stops them, by the PID it started, whatever
happens. Azure Blob leases last 15 to 60 s, so azure_blob runs with a 15 s lease and
fewer samples (see `LIMITS`). Three measurements per backend:

1. graceful handoff latency: ``resign()`` of the leader until the other election's ACQUIRED
   event, two elections in this process, each with its own provider on the same URL; then
   ping-pong: the same, but each new leader resigns `PINGPONG_HOLD` after it won, so the
   leadership goes back to an election that is still in its hold-off; and the store's own
   round trip (``roundtrip.py``), to see how many a handoff costs;
2. crash failover: a 3-process `Cluster`, SIGKILL the leader, time until the next
   ``acquired`` log line (both on ``time.monotonic``);
3. the store operations caused by one idle follower (its provider wrapped in
   `FaultyProvider`), and for Redis the server's own command counts as a cross-check.

Then, on the same servers and lease: the peers (``peers.py``: tooz and kazoo), the scale
run (``scale.py``), one process leading many groups (``groups.py``), SIGTERM of a leader
process with and without ``stop_on_signals`` (``sigterm.py``), lock acquire and release
beside python-redis-lock and pottery (``locks.py``), shard rebalancing over participant
processes (``rebalance.py``), the failover picture (``plot.py``) and where a handoff's
time goes (``timeline.py``).

``--only locks,rebalance,timeline`` runs just those sections (on the servers of ``--backends``) and
merges them into the report at ``--out``, replacing their earlier versions and keeping
every other section's numbers as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration"))

import floor  # noqa: E402
import groups  # noqa: E402
import locks  # noqa: E402
import peers  # noqa: E402
import plot  # noqa: E402
import rebalance  # noqa: E402
import roundtrip  # noqa: E402
import scale  # noqa: E402
import sigterm  # noqa: E402
import timeline  # noqa: E402
from backends import Backends  # noqa: E402
from common import (  # noqa: E402
    ALL_BACKENDS,
    FILE_POLL,
    HANDOFF_RETRY,
    PINGPONG_HOLD,
    WATCH_POLLS,
    plan,
    say,
    summary,
)
from peers import RedisCounter, per_second  # noqa: E402
from report import merge_sections, write_report  # noqa: E402

from multilock.core import EventKind, LeaderElection, from_url  # noqa: E402
from multilock.core.provider import Provider  # noqa: E402
from multilock.core.testing import Cluster, FaultyProvider  # noqa: E402


# --------------------------------------------------------------------------- 1. handoff
async def _wait(predicate: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.002)
    return True


#: The backends whose watch polls, and how often (seconds).
POLLS = {**WATCH_POLLS, "filesystem": FILE_POLL}
#: The sections `--only` can run alone (and merge into an existing report).
ONLY = ("locks", "rebalance", "timeline")


async def measure_handoff(
    url: str,
    count: int,
    lease: float,
    hold: float | None = None,
    poll: float = 0.0,
    wrap: Callable[[Provider, int], Provider] | None = None,
    legs: list[timeline.Leg] | None = None,
) -> dict[str, Any]:
    """*count* resign() -> the other's ACQUIRED latencies (ms) of two elections on *url*.

    With *hold* None (the handoff phase), each handoff waits until the resigner is back
    from its hold-off and following, and with a watch that polls every *poll* seconds,
    until that watch has read the new term too, then a random part of *poll*. With *hold*
    in seconds (the ping-pong phase), each new leader resigns *hold* after its ACQUIRED,
    so the leadership goes back to an election that resigned only a moment ago, well
    within its hold-off. *wrap(provider, index)*, if given, wraps each election's provider;
    *legs*, if given, gets (resign() called, ACQUIRED seen, the resigner) of each sample.
    """
    rng = random.Random(7)
    phase = "handoff" if hold is None else "pingpong"
    notify_delay: float | None = None
    providers: list[Provider] = [from_url(url), from_url(url)]
    if wrap is not None:
        providers = [wrap(provider, i) for i, provider in enumerate(providers)]
    elections = [
        LeaderElection(
            provider,
            group=f"bench-{phase}",
            participant_id=f"{phase}-{i}",
            lease_duration=lease,
            retry_interval=HANDOFF_RETRY,
        )
        for i, provider in enumerate(providers)
    ]
    acquired: list[asyncio.Queue[float]] = [asyncio.Queue(), asyncio.Queue()]
    seen: list[str | None] = [None, None]  # the leader each election last observed

    async def pump(i: int) -> None:
        async for event in elections[i].events(EventKind.ACQUIRED | EventKind.LEADER_CHANGED):
            if event.kind is EventKind.ACQUIRED:
                acquired[i].put_nowait(time.perf_counter())
            else:
                seen[i] = None if event.leader is None else event.leader.participant_id

    def back(i: int) -> Callable[[], bool]:
        # The resigner *i* has seen the other lead, which ends its hold-off: it follows.
        # (A campaign round alone is not enough: the watch wakes it for its own release,
        # and that round, inside the hold-off, sees nobody leading yet.)
        return lambda: seen[i] == elections[1 - i].participant_id

    latencies: list[float] = []
    failures = 0
    pumps = [asyncio.create_task(pump(i)) for i in (0, 1)]
    try:
        for election in elections:
            await election.start()
        if not await _wait(lambda: any(e.is_leader for e in elections), lease * 10):
            raise RuntimeError("no leader at all")
        # Let the follower settle on its watch: a polling watch (S3, Azure) takes its
        # baseline with its first read, and a release before that read goes unseen.
        await _wait(lambda: all(e.statistics().acquire_attempts for e in elections), lease * 5)
        await asyncio.sleep(HANDOFF_RETRY + 1.0)
        # How long a follower's watch may take to see a release: 0 when the store
        # notifies, the poll interval when the watch polls (a public provider property).
        notify_delay = providers[1].notify_delay
        # Ping-pong's first leg hands over to a follower that is not holding off: it only
        # starts the game, and is not a sample.
        for leg in range(count if hold is None else count + 1):
            leader = 0 if elections[0].is_leader else 1
            other = 1 - leader
            for queue in acquired:
                while not queue.empty():
                    queue.get_nowait()
            seen[leader] = None
            started = time.perf_counter()
            await elections[leader].resign()
            try:
                won = await asyncio.wait_for(acquired[other].get(), lease * 3)
            except TimeoutError:
                failures += 1
                await _wait(lambda: any(e.is_leader for e in elections), lease * 5)
                continue
            if hold is None or leg:
                latencies.append(won - started)
                if legs is not None:
                    legs.append((started, won, leader))
            if hold is None:
                await _wait(back(leader), HANDOFF_RETRY + lease * 3)
                # A polling watch may have last read the store before the new term began;
                # one poll later it has read the term, so it will see its release. Then a
                # random phase of the polls, as a real handoff would meet them.
                await asyncio.sleep(0.02 + poll + rng.uniform(0, poll))
            else:
                # Ping-pong: the new leader holds its term for *hold*, then resigns at once.
                await asyncio.sleep(max(0.0, won + hold - time.perf_counter()))
    finally:
        for election in elections:
            await election.stop()
        for task in pumps:
            task.cancel()
        for provider in providers:
            await provider.aclose()
    return {**summary([x * 1000 for x in latencies], failures), "notify_delay": notify_delay}


# --------------------------------------------------------------------------- 2. crash
def _acquired_at(cluster: Cluster, token: int) -> float:
    for record in cluster.records():
        if record["event"] == "acquired" and int(record["token"]) == token:
            return float(record["t"])
    raise RuntimeError(f"no acquired line for token {token}")


def _started(cluster: Cluster, name: str, after: float) -> bool:
    return any(
        r["event"] == "started" and r["participant"] == name and float(r["t"]) >= after
        for r in cluster.records()
    )


def measure_crash(cluster: Cluster, kills: int, lease: float, judge: bool = True) -> dict[str, Any]:
    """SIGKILL *cluster*'s leader *kills* times; judge the timeline if its logs allow."""
    rng = random.Random(7)
    failovers: list[float] = []
    with cluster:
        member, token, _ = cluster.wait_for_leader(timeout=30 + lease * 5)
        time.sleep(lease)  # everyone started and following
        for _ in range(kills):
            time.sleep(rng.uniform(0.05, lease / 3))  # a random point of the renew cycle
            killed_at = cluster.kill(member)
            new, new_token, _ = cluster.wait_for_leader(timeout=lease * 10 + 10, newer_than=token)
            failovers.append(_acquired_at(cluster, new_token) - killed_at)
            relaunched_at = time.monotonic()
            cluster.launch(member)
            deadline = time.monotonic() + 30
            while not _started(cluster, member.name, relaunched_at):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{member.name} did not restart:\n{cluster.tail()}")
                time.sleep(0.02)
            time.sleep(0.2)  # its first campaign round
            member, token = new, new_token
        report = cluster.check() if judge else None
    return {
        "count": len(failovers),
        "mean": statistics.fmean(failovers),
        "max": max(failovers),
        "min": min(failovers),
        "timeline_ok": "n/a" if report is None else report.ok,
        "problems": [] if report is None else report.problems[:3],
    }


async def measure_idle(
    name: str, url: str, leases: int, lease: float, redis_url: str | None
) -> dict[str, Any]:
    leader_provider = from_url(url)
    follower_provider = FaultyProvider(from_url(url))
    leader = LeaderElection(
        leader_provider, group="bench-idle", participant_id="idle-leader", lease_duration=lease
    )
    follower = LeaderElection(
        follower_provider, group="bench-idle", participant_id="idle-follower", lease_duration=lease
    )
    counter = RedisCounter(redis_url) if redis_url else None
    result: dict[str, Any] = {}
    try:
        await leader.start()
        await asyncio.wait_for(leader.wait_until_leader(), lease * 10)
        if counter is not None:
            await asyncio.sleep(lease)
            alone_base = await asyncio.to_thread(counter.snapshot)
            alone = leases / 2 * lease
            await asyncio.sleep(alone)
            result["server_leader_only"] = per_second(
                await asyncio.to_thread(counter.snapshot), alone_base, alone
            )
        await follower.start()
        await asyncio.sleep(lease * 2)  # past start-up: subscribe, first rounds
        before = Counter(follower_provider.calls)
        base = await asyncio.to_thread(counter.snapshot) if counter is not None else None
        began = time.monotonic()
        await asyncio.sleep(leases * lease)
        elapsed = time.monotonic() - began
        calls = Counter(follower_provider.calls)
        calls.subtract(before)
        if counter is not None and base is not None:
            result["server_with_follower"] = per_second(
                await asyncio.to_thread(counter.snapshot), base, elapsed
            )
        result.update(
            seconds=elapsed,
            calls={k: v for k, v in calls.items() if v},
            still_leader=leader.is_leader and not follower.is_leader,
        )
    finally:
        await follower.stop()
        await leader.stop()
        await follower_provider.aclose()
        await leader_provider.aclose()
        if counter is not None:
            counter.close()
    say(
        f"{name}: idle follower {dict(result.get('calls', {}))} in {result.get('seconds', 0):.1f} s"
    )
    return result


# --------------------------------------------------------------------------- main
async def run_async(
    urls: dict[str, str], args: argparse.Namespace, results: dict[str, dict[str, Any]]
) -> None:
    for name, url in urls.items():
        p = plan(name, args)
        say(f"{name}: {p['handoffs']} handoffs and ping-pongs, lease {p['lease']:g} s")
        try:
            results[name]["handoff"] = await measure_handoff(
                url, p["handoffs"], p["lease"], poll=POLLS.get(name, 0.0)
            )
        except Exception as exc:
            results[name]["handoff_error"] = repr(exc)
        say(f"{name}: handoff {results[name].get('handoff') or results[name].get('handoff_error')}")
        try:
            results[name]["pingpong"] = await measure_handoff(
                url, p["handoffs"], p["lease"], hold=PINGPONG_HOLD
            )
        except Exception as exc:
            results[name]["pingpong_error"] = repr(exc)
        pingpong = results[name].get("pingpong") or results[name].get("pingpong_error")
        say(f"{name}: ping-pong {pingpong}")
        try:
            trip = await roundtrip.measure(name, url)
        except Exception as exc:
            results[name]["round_trip_error"] = repr(exc)[:300]
        else:
            if trip is not None:
                results[name]["round_trip"] = trip
                say(f"{name}: round trip {trip}")
        try:
            raw = await floor.measure(name, url, p["handoffs"])
        except Exception as exc:
            results[name]["floor_error"] = repr(exc)[:300]
        else:
            if raw is not None:
                results[name]["floor"] = raw
                say(f"{name}: the driver's floor {raw}")


async def run_idle(
    urls: dict[str, str],
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    redis_url: str | None,
) -> None:
    if not urls:
        return
    say(f"idle follower on {', '.join(urls)} at once")
    names = list(urls)
    plans = {n: plan(n, args) for n in names}
    outcomes = await asyncio.gather(
        *(
            measure_idle(
                n,
                urls[n],
                plans[n]["idle_leases"],
                plans[n]["lease"],
                redis_url if n == "redis" else None,
            )
            for n in names
        ),
        return_exceptions=True,
    )
    for name, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            results[name]["idle_error"] = repr(outcome)
        else:
            results[name]["idle"] = outcome


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    if args.only:
        return run_only(args, names)
    scale_names = [n.strip() for n in args.scale_backends.split(",") if n.strip()]
    scale_names = [n for n in scale_names if n in names] if args.scale else []
    group_names = [n.strip() for n in args.groups_backends.split(",") if n.strip()]
    group_names = [n for n in group_names if n in names] if args.groups else []

    # SIGTERM/SIGINT: unwind through the finally below, which stops the servers.
    def interrupted(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, interrupted)
    began = time.monotonic()
    # PostgreSQL starts with the harness's 200 connections; the scale and groups phases
    # raise it only for a provider that holds a connection per watch (scale.LEGACY).
    backends = Backends(names)
    results: dict[str, dict[str, Any]] = {n: {"plan": plan(n, args)} for n in names}
    loads: list[tuple[str, tuple[float, float, float]]] = []

    def phase(label: str) -> None:
        loads.append((label, os.getloadavg()))
        say(f"phase: {label} (load {loads[-1][1][0]:.2f})")

    try:
        say(f"starting servers for {', '.join(names)}")
        backends.start()
        phase("handoff")
        asyncio.run(run_async(backends.urls, args, results))
        phase("crash")
        run_crashes(backends.urls, args, results)
        phase("idle")
        redis_url = backends.redis.url if backends.redis is not None else None
        # A longer lease (Azure's 15 s) makes a long, mostly sleeping idle phase: it goes
        # on in the background, on its own server, while the phases below run.
        slow = {n: u for n, u in backends.urls.items() if plan(n, args)["lease"] > args.lease}
        fast = {n: u for n, u in backends.urls.items() if n not in slow}
        asyncio.run(run_idle(fast, args, results, redis_url))
        background = threading.Thread(
            target=lambda: asyncio.run(run_idle(slow, args, results, None)), daemon=True
        )
        background.start()
        sections: list[str] = []
        extra: dict[str, Any] = {}
        if args.peers == "all":
            phase("peers")
            extra["peers"] = peers.run_all(backends.urls, args, measure_crash, results)
            sections += peers.report_section(extra["peers"], args)
        probes: dict[str, dict[str, Any]] = {}
        if scale_names:
            extra["scale"] = run_scale(backends, scale_names, args, phase, probes)
            sections += scale.report_section(extra["scale"], args)
        if group_names:
            extra["groups"] = run_groups(backends, group_names, args, phase, probes)
            sections += groups.report_section(extra["groups"], args)
        sigterm_names = [n.strip() for n in args.sigterm_backends.split(",") if n.strip()]
        if args.sigterm:
            phase("sigterm")
            extra["sigterm"] = sigterm.run(
                backends.urls, sigterm_names, args.sigterm, args.sigterm_lease
            )
            trips = {n: r.get("round_trip") for n, r in results.items()}
            sections += sigterm.report_section(extra["sigterm"], trips)
        sections += run_holders(backends.urls, args, phase, extra)
        if args.plot:
            sections += plot.run(backends.urls, args, phase)
        sections += run_timeline(backends.urls, args, phase, extra)  # 11, after the picture
        background.join()
        phase("report")
        text = write_report(args, results, time.monotonic() - began, sections, loads, extra)
    finally:
        backends.close()
    Path(args.out).write_text(text)
    say(f"wrote {args.out} after {time.monotonic() - began:.0f} s")
    print(text[text.index("## Targets") :])
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backends", default=",".join(ALL_BACKENDS))
    parser.add_argument("--handoffs", type=int, default=100)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--idle-leases", type=int, default=20)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--peers", choices=("all", "none"), default="all")
    parser.add_argument("--peer-poll", type=float, default=0.25, help="tooz's poll period")
    parser.add_argument("--scale", type=int, default=1000, help="participants; 0: skip")
    parser.add_argument(
        "--scale-small", type=int, default=100, help="a second, smaller size; 0: skip"
    )
    parser.add_argument("--scale-backends", default="memory,redis,postgres")
    parser.add_argument("--scale-workers", type=int, default=4)
    parser.add_argument("--scale-lease", type=float, default=5.0)
    parser.add_argument("--scale-window", type=float, default=None)
    parser.add_argument("--groups", type=int, default=10000, help="groups led; 0: skip")
    parser.add_argument("--groups-backends", default="redis,postgres")
    parser.add_argument("--groups-lease", type=float, default=15.0)
    parser.add_argument("--groups-window", type=float, default=None)
    parser.add_argument("--sigterm", type=int, default=20, help="SIGTERM rounds; 0: skip")
    parser.add_argument("--sigterm-backends", default="redis,postgres,etcd,zookeeper,filesystem")
    parser.add_argument("--sigterm-lease", type=float, default=2.0)
    parser.add_argument("--locks", type=int, default=1000, help="uncontended rounds; 0: skip")
    parser.add_argument("--lock-handoffs", type=int, default=100)
    parser.add_argument("--lock-lease", type=float, default=2.0)
    parser.add_argument("--rebalance", type=int, default=5, help="rounds; 0: skip")
    parser.add_argument("--rebalance-backends", default="redis,postgres")
    parser.add_argument("--rebalance-shards", type=int, default=64)
    parser.add_argument("--rebalance-participants", type=int, default=4)
    parser.add_argument("--rebalance-lease", type=float, default=2.0)
    parser.add_argument("--rebalance-window", type=float, default=None)
    parser.add_argument("--timeline", type=int, default=60, help="handoffs timed; 0: skip")
    parser.add_argument("--plot", default=None, help="default: failover.png beside --out")
    parser.add_argument("--plot-backend", default="postgres")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "REPORT.md"))
    parser.add_argument(
        "--only", default="", help="comma-separated sections to run and merge into --out: "
        f"{','.join(ONLY)}; the others keep their numbers"
    )  # fmt: skip
    args = parser.parse_args(argv)
    unknown = {s.strip() for s in args.only.split(",") if s.strip()} - set(ONLY)
    if unknown:
        parser.error(f"--only takes {', '.join(ONLY)}, not {', '.join(sorted(unknown))}")
    args.argv = sys.argv[1:] if argv is None else argv
    if args.plot is None:
        args.plot = str(Path(args.out).with_name("failover.png"))
    return args


def run_holders(
    urls: dict[str, str],
    args: argparse.Namespace,
    phase: Callable[[str], None],
    extra: dict[str, Any],
    note: Callable[[], str] = str,
) -> list[str]:
    """Sections 8 and 9: lock acquire/release beside its peers, and shard rebalancing.

    *note()*, called after each phase began, gives a line for the section's top (``--only``
    says there when and how the section was measured).
    """
    sections: list[str] = []
    if args.locks and "redis" in urls:
        phase("locks")
        extra["locks"] = locks.run(urls["redis"], args.locks, args.lock_handoffs, args.lock_lease)
        sections += locks.report_section(extra["locks"], note=note())
    names = [n.strip() for n in args.rebalance_backends.split(",") if n.strip()]
    if args.rebalance and any(n in urls for n in names):
        phase("rebalance")
        extra["rebalance"] = rebalance.run(
            urls, names, args.rebalance, args.rebalance_shards, args.rebalance_participants,
            args.rebalance_lease, args.rebalance_window,
        )  # fmt: skip
        sections += rebalance.report_section(extra["rebalance"], note=note())
    return sections


def run_timeline(
    urls: dict[str, str],
    args: argparse.Namespace,
    phase: Callable[[str], None],
    extra: dict[str, Any],
    note: Callable[[], str] = str,
) -> list[str]:
    """Section 11: section 1's handoffs again, each step timed (``timeline.py``)."""
    if not args.timeline:
        return []
    phase("timeline")
    results: dict[str, Any] = {}
    for name, url in urls.items():
        marks: list[timeline.Mark] = []
        legs: list[timeline.Leg] = []

        def wrap(provider: Provider, index: int, marks: list[timeline.Mark] = marks) -> Provider:
            return timeline.Stamped(provider, index, marks)

        p = plan(name, args)
        lease, poll, count = p["lease"], POLLS.get(name, 0.0), min(args.timeline, p["handoffs"])
        try:
            asyncio.run(measure_handoff(url, count, lease, poll=poll, wrap=wrap, legs=legs))
        except Exception as exc:
            results[name] = {"error": repr(exc)[:300]}
        else:
            results[name] = timeline.summarize(marks, legs)
        say(f"{name}: timeline {results[name]}")
    extra["timeline"] = results
    return timeline.report_section(results, note=note())


def run_only(args: argparse.Namespace, names: list[str]) -> int:
    """Run only the sections of ``--only`` and merge them into the report at ``--out``,
    which keeps every other section as it was."""
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    args.locks = args.locks if "locks" in only else 0
    args.rebalance = args.rebalance if "rebalance" in only else 0
    args.timeline = args.timeline if "timeline" in only else 0
    began = time.monotonic()
    backends = Backends(names)
    loads: list[str] = []
    command = " ".join(["python benchmarks/run.py", *args.argv])
    when = time.strftime("%Y-%m-%d %H:%M %Z")

    def phase(label: str) -> None:
        loads.append(" / ".join(f"{x:.2f}" for x in os.getloadavg()))
        say(f"phase: {label} (load {loads[-1]})")

    def note() -> str:
        return (
            f"Measured in a run of its own on {when}, `{command}`, on the same machine; "
            f"load average (1/5/15 min) at the start of this section: {loads[-1]} (2 cores, "
            "shared with other jobs)."
        )

    def interrupted(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, interrupted)
    extra: dict[str, Any] = {}
    try:
        say(f"starting servers for {', '.join(names)}")
        backends.start()
        sections = run_holders(backends.urls, args, phase, extra, note)
        sections += run_timeline(backends.urls, args, phase, extra, note)
    finally:
        backends.close()
    out = Path(args.out)
    text = merge_sections(out.read_text() if out.exists() else "", sections, extra)
    out.write_text(text)
    say(f"merged {', '.join(sorted(only))} into {out} after {time.monotonic() - began:.0f} s")
    return 0


def run_crashes(urls: dict[str, str], args: argparse.Namespace, results: dict[str, Any]) -> None:
    for name, url in urls.items():
        if name == "memory":
            results[name]["crash_error"] = "n/a (the store lives in one process)"
            continue
        p = plan(name, args)
        say(f"{name}: crash failover, {p['kills']} kills, lease {p['lease']:g} s")
        try:
            cluster = Cluster(url, "bench-crash", size=3, lease=p["lease"])
            results[name]["crash"] = measure_crash(cluster, p["kills"], p["lease"])
        except Exception as exc:
            results[name]["crash_error"] = f"error: {exc!r}"[:300]
        say(f"{name}: crash {results[name].get('crash') or results[name].get('crash_error')}")


def _store(backends: Backends, name: str, url: str) -> scale.StoreStats:
    server = {"redis": backends.redis, "postgres": backends.postgres}.get(name)
    return scale.StoreStats(name, url, server.pid if server is not None else None)


def _probe(backends: Backends, name: str, probes: dict[str, dict[str, Any]]) -> bool:
    """Whether *name*'s provider holds a connection per watch (probed once per run)."""
    if name not in ("redis", "postgres"):
        return False
    if name not in probes:
        url = backends.urls[name]
        try:
            probes[name] = scale.probe(url, _store(backends, name, url))
        except Exception as exc:
            probes[name] = {"error": repr(exc)[:300], "legacy": False}
        say(f"{name}: watch probe {probes[name]}")
    return bool(probes[name]["legacy"])


def run_scale(
    backends: Backends,
    names: list[str],
    args: argparse.Namespace,
    phase: Callable[[str], None],
    probes: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        phase(f"scale {name}")
        legacy = _probe(backends, name, probes)
        if legacy and name == "postgres":
            backends.ensure_postgres_ceiling(scale.postgres_ceiling(args.scale))
        url = "memory://scale" if name == "memory" else backends.urls[name]
        store = _store(backends, name, url)
        out[name] = {"probe": probes.get(name), "runs": []}
        sizes = [args.scale]
        if name in ("redis", "postgres") and 0 < args.scale_small < args.scale:
            sizes.insert(0, args.scale_small)
        for n in sizes:
            say(f"{name}: {n} participants over {args.scale_workers} workers")
            with tempfile.TemporaryDirectory(prefix="multilock-scale-") as tmp:
                try:
                    run = scale.measure(
                        name, url, n, args.scale_workers, args.scale_lease, store, Path(tmp),
                        args.scale_window, legacy=legacy, failovers=n == args.scale,
                    )  # fmt: skip
                except Exception as exc:
                    run = {"n": n, "legacy": legacy, "error": repr(exc)[:300]}
            out[name]["runs"].append(run)
            say(f"{name}: scale {run}")
    return out


def run_groups(
    backends: Backends,
    names: list[str],
    args: argparse.Namespace,
    phase: Callable[[str], None],
    probes: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        phase(f"groups {name}")
        legacy = _probe(backends, name, probes)
        if legacy and args.groups > groups.LEGACY_MAX[name]:
            out[name] = {
                "n": args.groups,
                "skipped": f"skipped: this provider holds a server connection per watch (the "
                f"watch probe: {probes[name]['per_watch']:.2f} per extra watch), so "
                f"{args.groups} groups would need as many; the run goes only to "
                f"{groups.LEGACY_MAX[name]} such connections on {name}",
            }
            say(f"{name}: groups {out[name]}")
            continue
        if legacy and name == "postgres":
            backends.ensure_postgres_ceiling(scale.postgres_ceiling(args.groups))
        url = "memory://groups" if name == "memory" else backends.urls[name]
        store = _store(backends, name, url)
        say(f"{name}: one process leading {args.groups} groups, lease {args.groups_lease:g} s")
        with tempfile.TemporaryDirectory(prefix="multilock-groups-") as tmp:
            try:
                out[name] = groups.measure(
                    name, url, args.groups, args.groups_lease, store, Path(tmp),
                    args.groups_window, legacy=legacy,
                )  # fmt: skip
            except Exception as exc:
                out[name] = {"n": args.groups, "error": repr(exc)[:300]}
        say(f"{name}: groups {out[name]}")
    return out


if __name__ == "__main__":
    sys.exit(main())
