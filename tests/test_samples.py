"""Run every sample as a user would, in a real subprocess, and read what it prints."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

SAMPLES = Path(__file__).resolve().parents[1] / "samples"

Spawn = Callable[..., "Sample"]


def run_sample(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class Sample:
    """A sample running in the background; its output is collected by reader threads."""

    def __init__(self, name: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SAMPLES / name), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: list[str] = []
        self._err: list[str] = []
        self._changed = threading.Condition()
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self._lines)),
            threading.Thread(target=self._read, args=(self.proc.stderr, self._err)),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str], into: list[str]) -> None:
        with stream:
            for line in stream:
                with self._changed:
                    into.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def stdout(self) -> str:
        with self._changed:
            return "".join(self._lines)

    @property
    def stderr(self) -> str:
        with self._changed:
            return "".join(self._err)

    def wait_for(self, pattern: str, timeout: float) -> str:
        """Wait until a line of stdout matches *pattern*; return stdout so far."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(re.search(pattern, line) for line in self._lines):
                left = deadline - time.monotonic()
                if left <= 0 or not self._readers[0].is_alive():
                    self.kill()
                    pytest.fail(
                        f"no line matching {pattern!r} within {timeout} s; "
                        f"stdout:\n{''.join(self._lines)}\nstderr:\n{''.join(self._err)}"
                    )
                self._changed.wait(min(left, 0.5))
            return "".join(self._lines)

    def finish(self, timeout: float = 20) -> tuple[str, str]:
        """Wait for the sample to exit by itself; return all its output."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"did not exit within {timeout} s; stdout:\n{self.stdout}")
        for reader in self._readers:
            reader.join(10)
        return self.stdout, self.stderr

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Sample]]:
    """Start samples in the background; whatever is still running at teardown is killed."""
    started: list[Sample] = []

    def start(name: str, *args: str) -> Sample:
        started.append(Sample(name, *args))
        return started[-1]

    yield start
    for sample in started:
        sample.kill()
        sample.finish()


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------- demo
@pytest.mark.slow
def test_demo_fails_over_hands_off_and_checks_the_logs() -> None:
    started = time.monotonic()
    proc = run_sample("demo.py", "--lease", "1", timeout=45)
    elapsed = time.monotonic() - started
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert re.search(r"^backend: file:///", out, re.M), out
    assert len(re.findall(r"demo-p\d \(pid \d+\)", out)) == 3, out

    failover = re.search(
        r"^failover: (demo-p\d) leads with token (\d+), ([\d.]+) s after", out, re.M
    )
    assert failover, out
    # The dead leader's lease (1 s) must run out; then a follower needs at most one retry.
    assert 0 < float(failover[3]) <= 1.0 + 1.0 + 1.0, out

    handoff = re.search(r"^handoff: (demo-p\d) leads with token (\d+), ([\d.]+) s after", out, re.M)
    assert handoff, out
    assert handoff[1] != failover[1], "the resigning leader must hand over to another process"
    assert int(handoff[2]) > int(failover[2])
    assert float(handoff[3]) < 2.0, out

    verdict = re.search(r"^no overlap, tokens rising: (.+)$", out, re.M)
    assert verdict, out
    tokens = [int(t) for t in re.findall(r"(\d+) \(demo-p\d\)", verdict[1])]
    assert len(tokens) >= 3
    assert tokens == sorted(set(tokens)), verdict[0]
    assert elapsed < 30, f"the demo took {elapsed:.1f} s"


@pytest.mark.slow
def test_demo_kills_every_participant_on_ctrl_c(spawn: Spawn) -> None:
    demo = spawn("demo.py", "--lease", "1")
    seen = demo.wait_for(r"leader: demo-p\d \(token \d+\)", timeout=30)
    pids = [int(p) for p in re.findall(r"demo-p\d \(pid (\d+)\)", seen)]
    tmp = re.search(r"^backend: file://(\S+)/leases", seen, re.M)
    assert len(pids) == 3, seen
    assert tmp, seen
    assert all(process_exists(pid) for pid in pids)

    demo.proc.send_signal(signal.SIGINT)
    out, err = demo.finish()
    assert demo.proc.returncode == 130, f"stdout:\n{out}\nstderr:\n{err}"
    assert "interrupted" in err
    alive = [pid for pid in pids if process_exists(pid)]
    assert not alive, f"participants left running: {alive}"
    assert not Path(tmp[1]).exists(), "the demo's temp dir was left behind"


def test_demo_is_importable_as_a_function() -> None:
    """A CLI can load the demo and call ``main(argv)``; importing it starts nothing."""
    spec = importlib.util.spec_from_file_location("multilock_demo", SAMPLES / "demo.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--participants", "1"])
    assert exit_info.value.code == 2


def test_demo_rejects_bad_options() -> None:
    proc = run_sample("demo.py", "--participants", "1", timeout=30)
    assert proc.returncode == 2
    assert "--participants" in proc.stderr
    proc = run_sample("demo.py", "--lease", "-1", timeout=30)
    assert proc.returncode == 2
    assert "lease" in proc.stderr


# ---------------------------------------------------------------- async and sync basics
@pytest.mark.parametrize("sample", ["async_basic.py", "sync_basic.py"])
def test_basic_sample_leads_works_and_stops(sample: str) -> None:
    proc = run_sample(sample, "--seconds", "1.5", "--interval", "0.2", timeout=30)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "on memory://" in out
    lines = out.splitlines()

    def first(pattern: str) -> int:
        index = next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)
        assert index is not None, f"no line matching {pattern!r} in:\n{out}"
        return index

    acquired = first(r"event: ACQUIRED, this process leads with token 1$")
    first(r"event: LEADER_CHANGED, \S+ leads \(token 1\)$")
    batches = [line for line in lines if re.search(r"work: batch \d+ done with token 1$", line)]
    assert len(batches) >= 3, out
    stop = first(r"1\.5 s are up, stopping")
    lost = first(r"event: LOST, the term with token 1 ended$")
    stopped = first(r"stopped: 1 term\(s\) won")
    assert acquired < lost < stopped
    assert stop < lost
    # The work ends before the lease is released and stop() returns. The sync sample's
    # work is a thread that sees `leadership.lost` set as LOST is emitted, and another
    # thread prints the event: their two lines may come in either order.
    work_end = first(r"work: (cancelled|leadership ended)")
    assert work_end < (stopped if sample == "sync_basic.py" else lost), out


@pytest.mark.parametrize("sample", ["async_basic.py", "sync_basic.py"])
def test_basic_sample_stops_cleanly_on_ctrl_c(sample: str, spawn: Spawn) -> None:
    running = spawn(sample, "--interval", "0.1")
    running.wait_for(r"work: batch 2 done", timeout=20)
    running.proc.send_signal(signal.SIGINT)
    out, err = running.finish()
    assert running.proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "event: LOST, the term with token 1 ended" in out
    assert "interrupted: leadership released" in out
    assert "Traceback" not in err


@pytest.mark.parametrize("sample", ["async_basic.py", "sync_basic.py"])
def test_basic_samples_share_a_file_backend(sample: str, tmp_path: Path, spawn: Spawn) -> None:
    """Two copies on one directory: the second leads only after the first stops."""
    url = tmp_path.as_uri()
    args = ["--url", url, "--lease", "1", "--interval", "0.2"]
    first = spawn(sample, *args, "--seconds", "3")
    first.wait_for(r"event: ACQUIRED, this process leads with token 1", timeout=20)
    second = spawn(sample, *args, "--seconds", "5")
    seen = second.wait_for(r"event: ACQUIRED, this process leads with token 2", timeout=20)
    assert re.search(r"event: LEADER_CHANGED, \S+ leads \(token 1\)", seen), seen
    first_out, first_err = first.finish()
    assert first.proc.returncode == 0, first_err
    assert "event: LOST, the term with token 1 ended" in first_out
    second_out, second_err = second.finish()
    assert second.proc.returncode == 0, second_err
    assert "event: LOST, the term with token 2 ended" in second_out


def test_basic_sample_reports_a_bad_url() -> None:
    for sample in ("async_basic.py", "sync_basic.py"):
        proc = run_sample(sample, "--url", "nosuch://x", "--seconds", "1", timeout=30)
        assert proc.returncode == 1, proc.stderr
        assert "no multilock provider is installed for the scheme 'nosuch'" in proc.stderr


# ---------------------------------------------------------------- fencing
def test_fencing_rejects_the_deposed_leaders_late_write() -> None:
    proc = run_sample("fencing.py", "--lease", "0.5", timeout=30)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "worker-a leads with token 1" in out
    assert "worker-b leads with token 2" in out
    assert re.search(r"worker-a steps down .* is_leader=False", out), out
    assert "fenced store: REJECTED total=90 from worker-a (token 1 < highest seen 2)" in out
    assert re.search(r"naive store ?: accepted total=90 from worker-a \(token 1\)", out), out
    assert "fenced store: total=120" in out
    assert "naive store:  total=90" in out
    # worker-a stepped down before worker-b took over.
    assert out.index("worker-a steps down") < out.index("worker-b leads")


# ---------------------------------------------------------------- lock, semaphore, shards
def test_lock_job_runs_the_job_once_and_releases() -> None:
    proc = run_sample("lock_job.py", "--steps", "3", "--step-seconds", "0.1", timeout=30)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "on memory://" in out
    assert "acquired 'nightly-report' with token 1" in out
    assert len(re.findall(r"job: step \d/3 written with token 1$", out, re.M)) == 3, out
    assert out.rstrip().endswith("job done; 'nightly-report' released"), out


def test_lock_job_runs_one_process_at_a_time(tmp_path: Path, spawn: Spawn) -> None:
    """A holder, a waiter that gives up (--timeout), a waiter that gets in after Ctrl-C."""
    report = tmp_path / "report.txt"
    args = ["--url", (tmp_path / "leases").as_uri(), "--output", str(report), "--lease", "1"]
    first = spawn("lock_job.py", *args, "--steps", "100", "--step-seconds", "0.2")
    first.wait_for(r"acquired 'nightly-report' with token 1 ", timeout=20)

    skipped = run_sample("lock_job.py", *args, "--timeout", "0.3", timeout=30)
    assert skipped.returncode == 0, skipped.stderr
    assert re.search(
        r"skipped: lock 'nightly-report' not acquired within 0.3 s: held by "
        r"\S+ \(token 1\)",
        skipped.stdout,
    ), skipped.stdout

    second = spawn("lock_job.py", *args, "--steps", "2", "--step-seconds", "0.1")
    second.wait_for(r"waiting for the lock", timeout=20)
    first.wait_for(r"job: step 3/100 written", timeout=20)
    first.proc.send_signal(signal.SIGINT)  # Ctrl-C: the block ends and releases the lock
    out, err = first.finish()
    assert first.proc.returncode == 130, f"stdout:\n{out}\nstderr:\n{err}"
    assert "SIGINT received: lock released" in out
    out, err = second.finish()
    assert second.proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "acquired 'nightly-report' with token 2 " in out
    tokens = [int(line.split()[0]) for line in report.read_text().splitlines()]
    assert tokens[-2:] == [2, 2]
    assert tokens == sorted(tokens)  # the holders never interleaved
    assert set(tokens) == {1, 2}


SLOT_LINE = re.compile(
    r"^(\d\d:\d\d:\d\d\.\d{3}) \[(\d+) worker-\d+\] job \d+: (started|finished) in slot (\d+)"
    r"(?: with token (\d+))?$",
    re.M,
)


def test_semaphore_workers_stay_within_the_limit_across_processes(
    tmp_path: Path, spawn: Spawn
) -> None:
    args = ["--url", (tmp_path / "leases").as_uri(), "--limit", "2", "--workers", "3"]
    args += ["--jobs", "2", "--job-seconds", "0.3"]
    runs = [spawn("semaphore_workers.py", *args) for _ in range(2)]
    outs = []
    for run in runs:
        out, err = run.finish(timeout=40)
        assert run.proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
        assert "all workers done (0 stopped early)" in out
        outs.append(out)
    events = SLOT_LINE.findall("".join(outs))
    assert len(events) == 2 * 2 * 3 * 2, outs  # started and finished, per job, everywhere
    # Per slot, in time order (a finish before a start at the same millisecond: it
    # was printed inside the block, before the release), jobs never overlap.
    by_slot: dict[str, list[tuple[str, bool, str, str]]] = {}
    for stamp, _pid, what, slot, token in events:
        by_slot.setdefault(slot, []).append((stamp, what == "started", what, token))
    assert set(by_slot) <= {"0", "1"}
    for slot, seen in by_slot.items():
        seen.sort()
        assert [what for _, _, what, _ in seen] == ["started", "finished"] * (len(seen) // 2), slot
        tokens = [int(token) for _, _, what, token in seen if what == "started"]
        assert tokens == sorted(set(tokens)), f"slot {slot}: tokens {tokens}"


def test_semaphore_workers_in_one_process() -> None:
    proc = run_sample("semaphore_workers.py", "--job-seconds", "0.1", timeout=30)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "3 workers share 'encoders' (limit 2) on memory://" in out
    assert len(re.findall(r"job \d: started in slot [01] with token \d+$", out, re.M)) == 6


def test_sharded_pool_in_one_process_owns_every_shard() -> None:
    proc = run_sample(
        "sharded_pool.py", "--shards", "4", "--seconds", "1.5", "--interval", "0.2", timeout=30
    )
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert "(4 shards) on memory://" in out
    assert "owns [0, 1, 2, 3]" in out
    assert len(re.findall(r"shard \d: work started with token 1$", out, re.M)) == 4, out
    assert len(re.findall(r"shard \d: work stopped after \d+ batches$", out, re.M)) == 4, out
    assert out.rstrip().endswith("left: every shard released"), out


def test_sharded_pool_shares_the_shards_between_processes(tmp_path: Path, spawn: Spawn) -> None:
    """A second process joins and takes half; it leaves and the first takes all back."""
    args = ["--url", (tmp_path / "leases").as_uri(), "--shards", "4", "--lease", "1"]
    args += ["--interval", "0.2"]
    first = spawn("sharded_pool.py", *args, "--seconds", "40")
    first.wait_for(r"owns \[0, 1, 2, 3\]$", timeout=20)
    second = spawn("sharded_pool.py", *args, "--seconds", "4")
    second.wait_for(r"owns \[\d, \d\]$", timeout=20)
    first.wait_for(r"owns \[\d, \d\]$", timeout=20)
    out, err = second.finish(timeout=30)
    assert second.proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "left: every shard released" in out
    taken = {int(s) for s in re.findall(r"shard (\d): work started", out)}
    assert len(taken) == 2, out

    deadline = time.monotonic() + 20  # the first takes the released shards back
    while first.stdout.count("owns [0, 1, 2, 3]") < 2:
        assert time.monotonic() < deadline, first.stdout
        time.sleep(0.1)
    first.proc.send_signal(signal.SIGINT)
    out, err = first.finish()
    assert first.proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "interrupted: every shard released" in out
    # Each shard the second held came back with a higher token.
    for shard in taken:
        tokens = [int(t) for t in re.findall(rf"shard {shard}: work started with token (\d+)", out)]
        assert len(tokens) == 2, out
        assert tokens[1] > tokens[0], out
