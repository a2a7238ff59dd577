"""Semaphore and shards holders under faults: never more holders than allowed, and takeover.

Four member processes per backend and scenario (see harness/holders_campaign.py), each
behind its own TCP proxy: a ``Semaphore`` of limit 2 whose holders take and release slots,
or ``Shards`` participants over 12 shards. Seeded faults hit a random current holder:
SIGKILL (relaunched), SIGSTOP for 1.1 to 1.6 leases, or a network cut (connections reset,
or black-holed) for over a lease. The checker reads every member's hold log on one
monotonic clock: never more than *limit* slot holds at once nor two on one slot, never two
owners of one shard, tokens rising per slot and per shard. After each fault the victim's
units must have newer terms, and every slot or shard must be held again, within a bound;
then the run must be whole again (the victim back); at the quiet end every shard is owned
and none by a member over ``ceil(12 / live)``.

Short mode (the default, in the test command): each fault kind once per backend and
scenario, in a seeded order. Long mode (``nox -s holders``): ``MULTILOCK_HOLDERS_FAULTS=100``
makes `test_holders_campaign` throw 100 faults per backend and scenario (each kind at least
once), every backend and scenario at once (a thread each, with its own name and members);
``MULTILOCK_HOLDERS_BACKENDS`` and ``MULTILOCK_HOLDERS_SCENARIOS`` (comma-separated) narrow
it, ``MULTILOCK_HOLDERS_JOBS=2`` runs two at a time (on a small machine). ``MULTILOCK_HOLDERS_SEED``
(default 1) picks the sequence; ``MULTILOCK_HOLDERS_OUT`` names a JSON file for the summary,
written with a Markdown table beside it (``.md``) and the members' logs in a directory
beside it (``<name>-logs/<backend>-<scenario>-*/``: pytest's temporary directories do not last); the
summary is also printed when the module ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import tempfile
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import PLUGINS, Backend, missing_provider, skip_or_fail
from harness.holders_campaign import (
    CONTROL_KIND,
    KINDS,
    SCENARIOS,
    Hold,
    HoldersRun,
    HoldLog,
    check_holds,
    format_summaries,
    markdown_table,
    plan,
    summarize,
)
from harness.holders_campaign import parse_lines as parse_hold_lines
from multilock.core import InMemoryProvider, Shards
from multilock.core.testing import FakeClock

FAULTS = int(os.environ.get("MULTILOCK_HOLDERS_FAULTS", "0")) or None
SEED = os.environ.get("MULTILOCK_HOLDERS_SEED", "1")
OUT = os.environ.get("MULTILOCK_HOLDERS_OUT")
#: ZooKeeper's lease is its harness lease, 2 s (``session_timeout=2`` in the URL).
NAMES = ["redis", "postgres", "etcd", "zookeeper"]
SELECTED = [n.strip() for n in os.environ.get("MULTILOCK_HOLDERS_BACKENDS", "").split(",") if n]
CHOSEN = [n.strip() for n in os.environ.get("MULTILOCK_HOLDERS_SCENARIOS", "").split(",") if n]
#: How many runs (backend and scenario) go at once in long mode (default: all).
JOBS = int(os.environ.get("MULTILOCK_HOLDERS_JOBS", "0")) or None

SUMMARIES: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not SUMMARIES:
        return
    summaries = [SUMMARIES[key] for key in sorted(SUMMARIES)]
    if OUT:
        document = {"faults_per_run": FAULTS, "seed": SEED, "runs": summaries}
        Path(OUT).write_text(json.dumps(document, indent=2) + "\n")
        Path(OUT).with_suffix(".md").write_text(markdown_table(summaries) + "\n")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(format_summaries(summaries))


def _campaign(
    backend: Backend, scenario: str, workdir: Path, stop: threading.Event
) -> dict[str, Any]:
    """Run the faults of *scenario* on *backend*: the summary, with ``error`` if it failed."""
    rng = random.Random(f"{SEED}:{backend.name}:{scenario}")
    error = None
    with HoldersRun(backend, scenario, workdir, rng, stop=stop) as run:
        try:
            run.run(plan(KINDS, FAULTS, rng))
        except AssertionError as exc:
            error = str(exc)
        except Exception:
            error = traceback.format_exc()
        run.finish()  # every member releases and logs its ends: the final check sees all
        report = run.report()
        summary = summarize(run, report, SEED)
        if error is None and not report.ok:
            error = f"the final check found:\n{report.describe()}"
        if error is None and run.late:
            error = f"liveness: {run.late}"
    if error is not None:
        summary["error"] = error
    return summary


# -- the checker itself --------------------------------------------------------------------


def _hold(
    member: str, unit: int, token: int, start: float, end: float, pid: int = 0, **extra: Any
) -> Hold:
    return Hold(
        member=member,
        pid=pid or 100 + int(member[1:]),
        unit=unit,
        token=token,
        start=start,
        end=end,
        ended_by=extra.pop("ended_by", "release"),
        deadline=extra.pop("deadline", end),
        logged_end=extra.pop("logged_end", end),
        valid_until=extra.pop("valid_until", end),
        **extra,
    )


def test_checker_catches_more_holders_than_the_limit() -> None:
    """Three slot holds at once on a semaphore of limit 2 (on slots 0, 1 and 0)."""
    report = check_holds(
        [
            _hold("m0", 0, 1, 1.0, 5.0),
            _hold("m1", 1, 1, 2.0, 6.0),
            _hold("m2", 0, 2, 4.0, 7.0),
        ],
        "semaphore",
        2,
    )
    assert not report.ok
    assert len(report.excess) == 1
    when, holds = report.excess[0]
    assert when == 4.0
    assert {h.member for h in holds} == {"m0", "m1", "m2"}
    assert [(a.member, b.member) for a, b in report.overlaps] == [("m0", "m2")]
    assert "MORE THAN THE LIMIT" in report.describe()
    assert "OVERLAP of 1000.0 ms" in report.describe()


def test_checker_counts_a_tie_and_every_later_hold() -> None:
    """Equal times overlap (allowance 0); a long hold overlaps each later one, not only
    the next; handovers apart by a microsecond are fine."""
    tie = check_holds([_hold("m0", 3, 1, 1.0, 2.0), _hold("m1", 3, 2, 2.0, 3.0)], "shards", 12)
    assert len(tie.overlaps) == 1
    long = check_holds(
        [
            _hold("m0", 5, 1, 1.0, 9.0),
            _hold("m1", 5, 2, 2.0, 3.0),
            _hold("m2", 5, 3, 4.0, 5.0),
        ],
        "shards",
        12,
    )
    assert [(a.token, b.token) for a, b in long.overlaps] == [(1, 2), (1, 3)]
    apart = check_holds(
        [_hold("m0", 0, 1, 1.0, 2.0), _hold("m1", 0, 2, 2.000001, 3.0)], "semaphore", 1
    )
    assert apart.ok, apart.describe()
    assert apart.gaps == pytest.approx((0.000001,))


def test_checker_catches_token_problems_and_two_slots_of_one_holder() -> None:
    report = check_holds(
        [
            _hold("m0", 0, 5, 1.0, 2.0),
            _hold("m1", 0, 4, 3.0, 4.0),  # token fell on slot 0
            _hold("m2", 1, 7, 1.0, 3.0, pid=42),
            _hold("m2", 0, 9, 2.5, 2.9, pid=42),  # m2 holds slot 0 and 1 at once
            _hold("m3", 2, 1, 5.0, 6.0),  # no slot 2 in a semaphore of 2
        ],
        "semaphore",
        2,
    )
    problems = "\n".join(report.problems)
    assert "unit 0: token 4 (m1) began after token 9 (m2): tokens must rise" in problems
    assert "m2 (pid 42) held two slots at once" in problems
    assert "unit out of range" in problems
    assert report.violations >= 3


def test_hold_log_closes_holds_as_the_members_log_them() -> None:
    """A killed member's hold ends at its last logged deadline (a successor before it is an
    overlap, after it is not); a frozen member's at its valid_until, not when it woke up."""

    def rec(event: str, t: float, member: str, pid: int, **fields: Any) -> dict[str, Any]:
        return {"event": event, "t": t, "member": member, "pid": pid, **fields}

    records = [
        rec("started", 0.0, "m0", 10),
        rec("begin", 1.0, "m0", 10, unit=0, token=1, deadline=1.9),
        rec("renew", 1.3, "m0", 10, unit=0, token=1, deadline=2.2),
        # m0 is SIGKILLed at 1.5: no end; its hold lasts until 2.2, its last deadline.
        rec("begin", 2.1, "m1", 11, unit=0, token=2, deadline=3.0),
        # m1 frozen from 2.2 to 4.5: it logs its end at 4.5, valid until 3.0.
        rec("end", 4.5, "m1", 11, unit=0, token=2, valid_until=3.0, reason="lost"),
        rec("begin", 3.2, "m2", 12, unit=0, token=3, deadline=4.1),
        rec("end", 3.5, "m2", 12, unit=0, token=3, valid_until=4.1, reason="release"),
    ]
    log = HoldLog().feed_all(records)
    holds = {h.token: h for h in log.holds()}
    assert holds[1].end == 2.2
    assert holds[1].ended_by == "deadline"
    assert not holds[1].closed
    assert holds[2].end == 3.0
    assert holds[2].ended_by == "lost"
    assert holds[3].end == 3.5
    report = check_holds(log.holds(), "semaphore", 1)
    assert [(a.token, b.token) for a, b in report.overlaps] == [(1, 2)]  # 2.1 < 2.2
    assert not report.problems

    fine = HoldLog().feed_all([*records[:3], rec("begin", 2.3, "m1", 11, unit=0, token=2,
                                                 deadline=3.0)])  # fmt: skip
    assert check_holds(fine.holds(), "semaphore", 1).ok

    broken = HoldLog().feed_all([rec("end", 1.0, "m0", 10, unit=0, token=1, valid_until=1.0)])
    assert broken.problems
    assert "never begun" in broken.problems[0]


def test_parse_lines_leaves_a_torn_line_and_reports_garbage() -> None:
    data = b'{"t": 1.0, "event": "started"}\nnot json\n[1]\n{"t": 2.0, "ev'
    records, bad, used = parse_hold_lines(data)
    assert records == [{"t": 1.0, "event": "started"}]
    assert bad == [b"not json", b"[1]"]
    assert used == len(data) - len(b'{"t": 2.0, "ev')


def test_shards_participant_id_names_every_election_of_the_participant() -> None:
    """The ids the store shows for a participant's shards and member slot are its own.

    Found by the campaign's logs (one member process, many ids). The fix proposed: in
    `holder_options`, draw one default participant id for all the groups when the caller
    gives none; then `_count_members` can count distinct ids, not slots (a participant
    that wins several member slots at once after an outage, before `acquire_one` stops the
    others, is counted once).
    """
    clock = FakeClock()

    async def main() -> None:
        store = InMemoryProvider(clock=clock.monotonic)
        async with Shards(store, "ids", 4, lease_duration=3) as shards:
            await asyncio.sleep(5)
            assert sorted(shards.owned) == [0, 1, 2, 3]
            owners = {view.participant_id for view in shards.owned.values()}
            members = [await store.get_leader(f"ids.member-{k}") for k in range(4)]
            holders = {m.participant_id for m in members if m is not None}
            assert owners | holders == {shards.participant_id}

    clock.run(main())


# -- the negative control ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_checker_catches_holders_that_ignore_the_loss(
    redis_server: Any, tmp_path: Path
) -> None:
    """Negative control: members that ignore the loss of their slot (``--ignore-loss``).

    A holder is SIGSTOPped for 3 to 3.5 leases: its slot is taken meanwhile, and once
    thawed it holds on until its planned release. The checker must find the overlap of
    two holds of one slot, and a third hold beside them.
    """
    backend = Backend("redis", redis_server.url, (redis_server,))
    rng = random.Random(f"{SEED}:control")
    with HoldersRun(backend, "semaphore", tmp_path, rng, ignore_loss=True) as run:
        with pytest.raises(AssertionError, match="holds ran until"):
            run.run([CONTROL_KIND])
        run.finish()
        report = run.report()
    assert report.overlaps, report.describe()
    assert report.excess, report.describe()
    liar = report.overlaps[0][0]
    assert liar.ended_by == "ignored-loss", report.describe()


# -- the scenarios on every backend --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("backend", NAMES, indirect=True)
def test_holders(backend: Backend, scenario: str, tmp_path: Path) -> None:
    """Each fault kind once on *backend* in *scenario* (the short mode)."""
    if FAULTS is not None:
        pytest.skip("long mode: test_holders_campaign runs every backend at once")
    summary = _campaign(backend, scenario, tmp_path, threading.Event())
    SUMMARIES[f"{backend.name}:{scenario}"] = summary
    assert "error" not in summary, summary["error"]
    assert summary["violations"] == 0


def _backend(name: str, request: pytest.FixtureRequest, factory: pytest.TempPathFactory) -> Backend:
    """The `Backend` conftest.py's ``backend`` fixture gives for *name*, several at once."""
    reason = missing_provider(name)
    if reason is not None:
        skip_or_fail(reason)
    if name in ("redis", "postgres"):
        server = request.getfixturevalue(f"{name}_server")
        return Backend(name, server.url, (server,))
    return PLUGINS[name].make(request, factory)


@pytest.mark.slow
@pytest.mark.timeout(60 * max(FAULTS or 0, 10))
def test_holders_campaign(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The long mode: every selected backend and scenario in a thread of its own, at once."""
    if FAULTS is None:
        pytest.skip("long mode only (MULTILOCK_HOLDERS_FAULTS=N, e.g. nox -s holders)")
    names = SELECTED or NAMES
    unknown = sorted(set(names) - set(NAMES))
    assert not unknown, f"MULTILOCK_HOLDERS_BACKENDS: unknown {unknown}, known {NAMES}"
    scenarios = CHOSEN or list(SCENARIOS)
    unknown = sorted(set(scenarios) - set(SCENARIOS))
    assert not unknown, f"MULTILOCK_HOLDERS_SCENARIOS: unknown {unknown}, known {list(SCENARIOS)}"
    backends = [_backend(name, request, tmp_path_factory) for name in names]
    stop = threading.Event()
    results: dict[str, dict[str, Any]] = {}
    slots = threading.BoundedSemaphore(JOBS or len(backends) * len(scenarios))

    def work(backend: Backend, scenario: str) -> None:
        key = f"{backend.name}:{scenario}"
        try:
            with slots:
                if stop.is_set():
                    return
                if OUT:  # kept for a post-mortem, a fresh directory per run
                    logs = Path(OUT).with_name(f"{Path(OUT).stem}-logs")
                    logs.mkdir(parents=True, exist_ok=True)
                    prefix = f"{backend.name}-{scenario}-"
                    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=logs))
                else:
                    workdir = tmp_path_factory.mktemp(f"holders-{backend.name}-{scenario}")
                results[key] = _campaign(backend, scenario, workdir, stop)
        except BaseException:
            results[key] = {
                "backend": backend.name,
                "scenario": scenario,
                "error": traceback.format_exc(),
            }

    threads = [
        threading.Thread(target=work, args=(b, s), daemon=True) for b in backends for s in scenarios
    ]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        stop.set()  # on a timeout or Ctrl-C: every wait gives up, every run cleans up
    SUMMARIES.update(results)
    failed = {key: s["error"] for key, s in results.items() if "error" in s}
    assert not failed, "\n\n".join(f"{key}: {error}" for key, error in failed.items())
    assert all(s["violations"] == 0 for s in results.values())
