"""``multilock run``: the command is dead by the term's deadline even when its supervisor is frozen.

Three ``multilock run --forever`` supervisors (real processes) share a fresh group on each
backend; seeded faults hit the leader (see harness/freezes.py): its supervisor SIGSTOPped
past the lease, its command SIGSTOPped, both, or its supervisor SIGKILLed. The commands'
own tick logs must never show two commands running at once, and tokens must rise run
after run. A frozen supervisor's command must die before the supervisor is thawed, killed
by the watchdog, which says how late after the deadline it was.

Short mode (the default, in the test command): each kind once per backend, in a seeded
order. Long mode (``nox -s freezes``): ``MULTILOCK_FREEZES=100`` makes
`test_freezes_campaign` throw 100 supervisor freezes per backend plus a tenth as many of
each other kind, every backend at once (a thread each, with its own group and
supervisors); ``MULTILOCK_FREEZES_BACKENDS`` (comma-separated) narrows it.
``MULTILOCK_FREEZES_SEED`` (default 1) picks the sequence; ``MULTILOCK_FREEZES_OUT`` names a
JSON file for the summary, written with a Markdown table beside it (``.md``); the summary
is also printed when the module ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import PLUGINS, Backend, missing_provider, skip_or_fail
from harness.freezes import (
    CONTROL_KIND,
    TICK_PROGRAM,
    FreezeRun,
    Tick,
    check_ticks,
    format_summaries,
    markdown_table,
    parse_ticks,
    plan,
    summarize,
    watchdog_lines,
)

FREEZES = int(os.environ.get("MULTILOCK_FREEZES", "0")) or None
SEED = os.environ.get("MULTILOCK_FREEZES_SEED", "1")
OUT = os.environ.get("MULTILOCK_FREEZES_OUT")
#: The backends of this suite: every one whose server runs here (ZooKeeper's lease is its
#: harness lease, 2 s, with ``session_timeout=2`` in the URL).
NAMES = ["filesystem", "redis", "postgres", "etcd", "zookeeper"]
SELECTED = [n.strip() for n in os.environ.get("MULTILOCK_FREEZES_BACKENDS", "").split(",") if n]

SUMMARIES: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not SUMMARIES:
        return
    summaries = [SUMMARIES[name] for name in sorted(SUMMARIES)]
    if OUT:
        document = {"freezes_per_backend": FREEZES, "seed": SEED, "backends": summaries}
        Path(OUT).write_text(json.dumps(document, indent=2) + "\n")
        Path(OUT).with_suffix(".md").write_text(markdown_table(summaries) + "\n")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(format_summaries(summaries))


def _campaign(backend: Backend, workdir: Path, stop: threading.Event) -> dict[str, Any]:
    """Run the faults on *backend*; the summary, with ``error`` when the run failed."""
    rng = random.Random(f"{SEED}:{backend.name}")
    run = FreezeRun(backend.name, backend.url, backend.lease, workdir, rng, stop=stop)
    error = None
    with run:
        try:
            run.run(plan(FREEZES, rng))
        except AssertionError as exc:
            error = str(exc)
        except Exception:
            error = traceback.format_exc()
        summary = summarize(run, run.report(), SEED)
    if error is not None:
        summary["error"] = error
    return summary


# -- the checker itself --------------------------------------------------------------------


def _ticks(*lines: tuple[float, int, int]) -> list[Tick]:
    return [Tick(t, pid, token) for t, pid, token in lines]


def test_checker_catches_an_overlap() -> None:
    """Two synthetic logs whose runs overlap by 5 ms, and by a tie: both are caught."""
    a = (b"10.000000 100 7\n10.015000 100 7\n10.030000 100 7\n", "r1")
    b = (b"10.025000 200 8\n10.040000 200 8\n10.05", "r2")  # a torn last line waits
    logs = {}
    for data, name in (a, b):
        ticks, bad, used = parse_ticks(data)
        assert not bad
        logs[name] = ticks
    assert used == len(b[0]) - len(b"10.05")
    report = check_ticks(logs)
    assert not report.ok
    assert len(report.overlaps) == 1
    assert report.overlaps[0].seconds == pytest.approx(0.005)
    assert "OVERLAP of 5.0 ms" in report.describe()

    tie = check_ticks({"r1": _ticks((1.0, 1, 1), (2.0, 1, 1)), "r2": _ticks((2.0, 2, 2))})
    assert len(tie.overlaps) == 1  # the allowance is 0: equal timestamps overlap

    apart = check_ticks(
        {"r1": _ticks((1.0, 1, 1), (2.0, 1, 1), (5.0, 3, 3)), "r2": _ticks((2.001, 2, 2))}
    )
    assert apart.ok, apart.describe()
    assert apart.gaps() == pytest.approx([0.001, 2.999])


def test_checker_catches_a_long_run_overlapping_a_later_one() -> None:
    """A run that outlives several later runs overlaps each of them, not only the next."""
    report = check_ticks(
        {
            "r1": _ticks((1.0, 1, 1), (9.0, 1, 1)),
            "r2": _ticks((2.0, 2, 2), (3.0, 2, 2)),
            "r3": _ticks((4.0, 3, 3), (5.0, 3, 3)),
        }
    )
    assert [(o.earlier.token, o.later.token) for o in report.overlaps] == [(1, 2), (1, 3)]


def test_checker_catches_token_problems() -> None:
    report = check_ticks(
        {
            "r1": _ticks((1.0, 1, 5), (2.0, 1, 5), (7.0, 4, 6)),
            "r2": _ticks((3.0, 2, 4), (4.0, 3, 4), (5.0, 5, 6)),
        },
        malformed=["r2: b'garbage'"],
    )
    assert not report.overlaps
    problems = "\n".join(report.problems)
    assert "token 4 (r2) began after token 5 (r1): tokens must rise" in problems
    assert "r2 token 4: 2 processes" in problems
    assert "token 6 ran in ['r1', 'r2']" in problems
    assert "not a tick" in problems


def test_watchdog_lines_parse_what_the_watchdog_writes() -> None:
    """The watchdog's own format strings, filled in as it fills them."""
    from multilock.cli._watchdog import _PROGRAM

    line = "multilock: watchdog: %s: sent SIGKILL to process group %s\n"
    why = "the term's deadline passed %.1f ms ago without a renewal"
    assert line.replace("\n", "\\n") in _PROGRAM
    assert why in _PROGRAM
    text = (
        "multilock: info: x\n"
        + line % (why % 3.25, "4242")
        + line % ("the supervisor is gone", "7, 9")
    )
    assert watchdog_lines(text) == [
        (why % 3.25, (4242,), 3.2),
        ("the supervisor is gone", (7, 9), None),
    ]


def test_checker_catches_two_real_commands(tmp_path: Path) -> None:
    """Two tick commands run at once, as two leaders' would: the checker must say so."""
    program = tmp_path / "tick.py"
    program.write_text(TICK_PROGRAM)
    logs = {name: tmp_path / f"{name}.ticks" for name in ("r1", "r2")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-I", "-S", str(program), str(path)],
            env={**os.environ, "MULTILOCK_TOKEN": str(token)},
        )
        for token, path in enumerate(logs.values(), 1)
    ]
    try:
        deadline = time.monotonic() + 30
        while not all(p.exists() and p.read_bytes().count(b"\n") >= 3 for p in logs.values()):
            assert time.monotonic() < deadline, "the tick commands did not tick"
            time.sleep(0.01)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    report = check_ticks({name: parse_ticks(p.read_bytes())[0] for name, p in logs.items()})
    assert len(report.overlaps) == 1, report.describe()


@pytest.mark.slow
def test_the_scenario_catches_a_frozen_watchdog(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Negative control: stop the leading supervisor AND its watchdog past the lease.

    Nothing can kill the command then (a frozen cgroup holding both would do this): the
    next leader's command starts beside it, and the run must fail on the overlap.
    """
    if missing_provider("filesystem"):
        skip_or_fail(str(missing_provider("filesystem")))
    url = tmp_path_factory.mktemp("locks").as_uri()
    rng = random.Random(f"{SEED}:control")
    with (
        FreezeRun("filesystem", url, 1.0, tmp_path_factory.mktemp("control"), rng) as run,
        pytest.raises(AssertionError, match="OVERLAP") as caught,
    ):
        run.run([CONTROL_KIND])
    assert "tokens must rise" not in str(caught.value)


# -- the scenario on every backend ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", NAMES, indirect=True)
def test_freezes(backend: Backend, tmp_path: Path) -> None:
    """Each fault kind once on *backend* (the short mode)."""
    if FREEZES is not None:
        pytest.skip("long mode: test_freezes_campaign runs every backend at once")
    summary = _campaign(backend, tmp_path, threading.Event())
    SUMMARIES[backend.name] = summary
    assert "error" not in summary, summary["error"]
    assert summary["overlaps"] == 0
    assert not summary["problems"]


def _backend(name: str, request: pytest.FixtureRequest, factory: pytest.TempPathFactory) -> Backend:
    """The `Backend` conftest.py's ``backend`` fixture gives for *name*, several at once."""
    reason = missing_provider(name)
    if reason is not None:
        skip_or_fail(reason)
    if name == "filesystem":
        return Backend(name, factory.mktemp("locks").as_uri())
    if name in ("redis", "postgres"):
        server = request.getfixturevalue(f"{name}_server")
        return Backend(name, server.url, (server,))
    return PLUGINS[name].make(request, factory)


@pytest.mark.slow
@pytest.mark.timeout(60 * max(FREEZES or 0, 10))
def test_freezes_campaign(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The long mode: every selected backend in a thread of its own, all at once."""
    if FREEZES is None:
        pytest.skip("long mode only (MULTILOCK_FREEZES=N, e.g. nox -s freezes)")
    names = SELECTED or NAMES
    unknown = sorted(set(names) - set(NAMES))
    assert not unknown, f"MULTILOCK_FREEZES_BACKENDS: unknown {unknown}, known {NAMES}"
    backends = [_backend(name, request, tmp_path_factory) for name in names]
    stop = threading.Event()
    results: dict[str, dict[str, Any]] = {}

    def work(backend: Backend) -> None:
        try:
            workdir = tmp_path_factory.mktemp(f"freezes-{backend.name}")
            results[backend.name] = _campaign(backend, workdir, stop)
        except BaseException:
            results[backend.name] = {"backend": backend.name, "error": traceback.format_exc()}

    threads = [threading.Thread(target=work, args=(b,), daemon=True) for b in backends]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        stop.set()  # on a timeout or Ctrl-C: every wait gives up, every run cleans up
    SUMMARIES.update(results)
    failed = {name: s["error"] for name, s in results.items() if "error" in s}
    assert not failed, "\n\n".join(f"{name}: {error}" for name, error in failed.items())
    assert all(s["overlaps"] == 0 and not s["problems"] for s in results.values())
