"""The benchmark runner works end to end on every backend that runs here.

Numbers are not judged here (performance targets live in benchmarks/REPORT.md); this
proves the measurements run: every handoff and ping-pong hand-back happens, every crash
timeline is safe, every peer (tooz, kazoo) is measured, the scale run reaches a leader and
fails over on each of its backends, one process leads many groups on Redis and PostgreSQL,
a SIGTERM'd leader process hands over with and without `stop_on_signals`, the failover
picture is drawn, and each handoff is cut into its steps.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = [
    "memory", "filesystem", "redis", "redlock", "postgres", "etcd", "s3", "azure_blob", "zookeeper",
]  # fmt: skip
PEERS = [
    ("multilock", "redis"), ("tooz", "redis"), ("multilock", "zookeeper"),
    ("tooz", "zookeeper"), ("kazoo", "zookeeper"),
]  # fmt: skip
SCALE = ["memory", "redis", "postgres"]
GROUPS = ["redis", "postgres"]


def section(text: str, number: int) -> str:
    return text.split(f"\n## {number}.")[1].split("\n## ")[0]


def cells(text: str, *first: str) -> list[str]:
    pattern = r"^\| " + r" \| ".join(re.escape(f) for f in first) + r" \| .*$"
    row = re.search(pattern, text, re.MULTILINE)
    assert row is not None, f"no row {first}:\n{text}"
    return [c.strip() for c in row.group(0).strip("|").split("|")]


@pytest.mark.slow
def test_benchmark_runner_measures_everything(tmp_path):
    report, picture = tmp_path / "REPORT.md", tmp_path / "failover.png"
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--out", str(report)]
    command += ["--backends", ",".join(BACKENDS), "--handoffs", "4"]
    command += ["--kills", "1", "--idle-leases", "2", "--plot", str(picture)]
    command += ["--scale", "12", "--scale-workers", "2", "--scale-lease", "1"]
    command += ["--scale-window", "1", "--scale-small", "6"]
    command += ["--groups", "40", "--groups-lease", "1", "--groups-window", "1"]
    command += ["--sigterm", "2", "--sigterm-backends", "redis", "--sigterm-lease", "1"]
    command += ["--locks", "20", "--lock-handoffs", "2", "--rebalance", "1"]
    command += ["--rebalance-backends", "redis", "--rebalance-window", "2"]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "integration")},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    handoff, pingpong = section(text, 1).split("\n### Ping-pong")
    for backend in BACKENDS:
        row = cells(handoff, backend)
        assert row[3:5] == ["4", "0"], f"{backend}: handoffs/failed are {row[3:5]}"
        row = cells(pingpong, backend)
        assert row[3:5] == ["4", "0"], f"{backend}: ping-pong hand-backs/failed are {row[3:5]}"
        if backend != "memory":
            crash = cells(section(text, 2), backend)
            assert crash[-1] == "ok", crash

    floor = section(text, 1).split("### The driver's floor")[1].split("\n### ")[0]
    for backend in ("redis", "postgres", "etcd", "filesystem", "zookeeper"):
        row = cells(floor, backend)
        assert row[2:4] == ["4", "0"], f"{backend}: floor handoffs/failed are {row[2:4]}"
        float(row[4])  # the floor's p50
        float(row[8])  # multilock's p50 less the floor's

    peers = section(text, 4)
    for system, backend in PEERS:
        row = cells(peers, system, backend)
        assert row[4] == "4 (0)", f"{system} on {backend}: handoffs (failed) {row[4]}"
        for value in (row[2], row[3], row[5], row[6], row[7]):
            float(value)  # a number, not "n/a" or an error

    scale = section(text, 5)
    assert "12 participants" in scale
    for backend in SCALE:
        row = cells(scale, backend, "12")
        assert row[2] == ("1" if backend == "memory" else "2"), row
        float(row[5])  # time to the first leader
        float(row[14])  # the graceful failover
        if backend != "memory":
            float(row[15])  # the crash failover: a worker SIGKILLed
            float(cells(scale, backend, "6")[9])  # the smaller run's RSS per participant

    groups = section(text, 6)
    assert "40 groups" in groups
    for backend in GROUPS:
        row = cells(groups, backend)
        assert row[1] == "40", row
        float(row[3])  # until all lead
        assert row[11] == "40", f"{backend}: fewest leading {row[11]}"
        assert float(row[17]) > 0, f"{backend}: client CPU ms per call {row[17]}"

    stops = section(text, 7)
    row = cells(stops, "redis", "`stop_on_signals`")
    assert row[2] == "2", row
    assert row[6:8] == ["0", "143"], f"SIGTERM with stop_on_signals: failed/exit {row[6:8]}"
    float(row[3])  # p50
    row = cells(stops, "redis", "`default SIGTERM`")
    assert row[6:8] == ["0", "-15"], f"default SIGTERM: failed/exit {row[6:8]}"

    assert "![failover timeline](failover.png)" in section(text, 10)
    rounds, handoffs = section(text, 8).split("Contended handoff")
    for peer in ("multilock", "python-redis-lock", "pottery"):
        float(cells(rounds, peer)[5])
        assert cells(handoffs, peer)[1] == "2"
    row = cells(section(text, 9), "redis")
    assert row[1] == "1"
    float(row[2])
    float(row[6])
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    steps = section(text, 11)
    for backend in BACKENDS:
        row = cells(steps, backend)
        assert row[1].startswith("4 ("), f"{backend}: timed handoffs {row[1]}"
        float(row[-1])  # the total: at least one handoff had every step


def test_timeline_cuts_a_handoff_at_its_own_participants_steps():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import timeline

    marks = [
        ("release sent", 0, 10.0001),
        ("woken", 0, 10.0003),  # the resigner's own watch: not the follower's wake
        ("acquire sent", 0, 10.0004),  # the resigner's look-again: not the follower's
        ("woken", 1, 10.0010),
        ("acquire sent", 1, 10.0013),
        ("acquire answered", 1, 10.0020),
        ("release sent", 1, 20.0002),  # a handoff whose follower never woke: left out
    ]
    legs = [(10.0, 10.0026, 0), (20.0, 20.0100, 1)]
    result = timeline.summarize(marks, legs)
    assert (result["handoffs"], result["left_out"]) == (2, 1)
    expected = {
        "before_release": 0.1,
        "release_to_woken": 0.9,
        "woken_to_acquire": 0.3,
        "acquire": 0.7,
        "answered_to_event": 0.6,
        "total": 2.6,
    }
    assert result == {
        "handoffs": 2,
        "left_out": 1,
        **{k: pytest.approx(v) for k, v in expected.items()},
    }
    lines = timeline.report_section({"redis": result})
    assert cells("\n".join(lines), "redis") == [
        "redis",
        "2 (1)",
        *(f"{expected[name]:.2f}" for name, _ in timeline.STEPS),
        "2.60",
    ]


def test_a_missed_handoff_target_says_whether_the_floor_and_the_core_already_miss_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import report

    def handoff(p50: float) -> dict[str, float]:
        return {"p50": p50, "p95": p50, "p99": p50, "notify_delay": 0.0}

    def floor(p50: float) -> dict[str, object]:
        return {"p50": p50, "p99": p50, "operation": "the steps"}

    results = {
        "memory": {"handoff": handoff(0.8)},
        # 1.2 + 0.8 = 2.0 > 1.5: no provider could meet the target here.
        "redis": {"handoff": handoff(2.9), "floor": floor(1.2)},
        # 0.5 + 0.8 = 1.3 <= 1.5: the provider's own cost makes the miss.
        "postgres": {"handoff": handoff(2.6), "floor": floor(0.5)},
        # Met: nothing to explain.
        "etcd": {"handoff": handoff(2.0), "floor": floor(1.9)},
    }
    lines = {line.split(":")[0]: line for line in report._handoff_targets(results, {})}
    redis = lines["- Handoff on redis"]
    assert "NOT met" in redis
    assert "the floor and the core's share add up to about 2.00 ms, above the target" in redis
    postgres = lines["- Handoff on postgres"]
    assert "add up to about 1.30 ms, within the target: the rest is the provider's" in postgres
    etcd = lines["- Handoff on etcd"]
    assert "**met**" in etcd
    assert "What bounds it" not in etcd


def test_compare_runs_two_versions_and_the_baselines_side_by_side():
    # HEAD against this checkout: both columns must measure, beside the driver's floor
    # (Redis, ZooKeeper) and kazoo's Election (ZooKeeper), each run in turn.
    command = [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "HEAD"]
    command += ["--backends", "redis,zookeeper", "--rounds", "2", "--handoffs", "4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    number = r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)"
    redis = cells(result.stdout, "redis")
    assert all(re.fullmatch(number, c) for c in (redis[1], redis[2], redis[4])), redis
    assert redis[5] == "n/a"
    zookeeper = cells(result.stdout, "zookeeper")
    assert all(re.fullmatch(number, c) for c in (*zookeeper[1:3], *zookeeper[4:6])), zookeeper
    worktrees = subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True
    )
    assert "multilock-compare-" not in worktrees.stdout, "the worktree was left behind"


def test_herd_counts_the_store_commands_of_each_handoff():
    # Two followers: every handoff is one release (a script) and a try by each follower
    # (a script each) at the least, so fewer than 3 scripts per handoff is a broken count.
    command = [sys.executable, str(ROOT / "benchmarks" / "herd.py")]
    command += ["--followers", "2", "--handoffs", "3", "--lease", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^handoff p50 \d+\.\d\d ms", result.stdout, re.MULTILINE), result.stdout
    scripts = float(cells(result.stdout, "evalsha")[1])
    assert scripts >= 3.0, result.stdout
    assert float(cells(result.stdout, "del")[1]) == 1.0  # one release per handoff
