"""``multilock run``, ``status`` and ``watch`` as real processes on file-system leases.

Every command runs as ``python -m multilock.cli``; the supervised command is
``child_program.py``, which logs its start, SIGTERM and end with ``time.monotonic()`` (one
clock for every process of the machine). Every wait is on a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

pytestmark = pytest.mark.slow

CHILD = Path(__file__).with_name("child_program.py")
#: Generous: interpreters start slowly on a loaded machine.
STARTUP = 30.0


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.01)


def is_dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (it runs no more code either way)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def read_events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line]


class Runner:
    """Start ``python -m multilock.cli ...`` processes; kill what is left at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.url = (tmp / "leases").as_uri() + "?poll_interval=0.1"
        self.procs: list[subprocess.Popen[str]] = []

    def cli(self, *args: str, stdout: int | IO[str] | None = None) -> subprocess.Popen[str]:
        err = open(self.tmp / f"stderr-{len(self.procs)}.txt", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "multilock.cli", *args],
            stdout=stdout if stdout is not None else subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
        err.close()
        self.procs.append(proc)
        return proc

    def stderr(self, proc: subprocess.Popen[str]) -> str:
        return (self.tmp / f"stderr-{self.procs.index(proc)}.txt").read_text()

    def run(
        self, group: str, log: Path, *child_args: str, options: tuple[str, ...] = (), url: str = ""
    ) -> subprocess.Popen[str]:
        return self.cli(
            "run", "--url", url or self.url, "--group", group, *options,
            "--", sys.executable, str(CHILD), str(log), *child_args,
        )  # fmt: skip

    def status(self, group: str) -> tuple[int, dict[str, Any]]:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "multilock.cli",
                "status",
                "--json",
                "-g",
                group,
                "--url",
                self.url,
            ],
            capture_output=True,
            text=True,
            timeout=STARTUP,
            check=False,
        )
        return proc.returncode, json.loads(proc.stdout)

    def finish(self, proc: subprocess.Popen[str], timeout: float = STARTUP) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"did not exit within {timeout} s; stderr:\n{self.stderr(proc)}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[Runner]:
    runner = Runner(tmp_path)
    yield runner
    runner.close()


def started(log: Path, count: int = 1) -> list[dict[str, Any]]:
    return [e for e in read_events(log) if e["event"] == "start"][:count] if count else []


def wait_started(log: Path, count: int = 1, timeout: float = STARTUP) -> list[dict[str, Any]]:
    return wait_until(
        lambda: (s := started(log, count)) and len(s) == count and s,
        timeout,
        f"{count} start(s) in {log.name}",
    )


def test_the_command_sees_its_term_and_its_status_is_passed_on(
    runner: Runner, tmp_path: Path
) -> None:
    log = tmp_path / "child.jsonl"
    proc = runner.run("g", log, "--hold", "0", "--exit", "3", options=("--id", "worker-1"))
    assert runner.finish(proc) == 3, runner.stderr(proc)
    (start,) = started(log)
    assert (start["group"], start["id"]) == ("g", "worker-1")
    assert start["token"] >= 1
    # Released at once: the store shows nobody.
    assert runner.status("g") == (1, {"group": "g", "leader": None})
    # A command killed by a signal: 128 + the signal, as shells report it.
    proc = runner.cli("run", "--url", runner.url, "--group", "g", "--", "sh", "-c", "kill -9 $$")
    assert runner.finish(proc) == 128 + signal.SIGKILL


def test_two_supervisors_never_run_their_commands_at_once(runner: Runner, tmp_path: Path) -> None:
    logs = {name: tmp_path / f"{name}.jsonl" for name in ("a", "b")}
    procs = {
        name: runner.run(
            "turns", log, "--hold", "0.3", options=("--lease", "1", "--forever", "--id", name)
        )
        for name, log in logs.items()
    }

    def runs() -> list[dict[str, Any]]:
        return sorted((e for log in logs.values() for e in read_events(log)), key=lambda e: e["t"])

    wait_until(
        lambda: (
            {e["id"] for e in runs() if e["event"] == "end"} == {"a", "b"}
            and sum(e["event"] == "end" for e in runs()) >= 4
        ),
        STARTUP,
        "four runs, by both supervisors",
    )
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        # 143: stopped between runs, or its command died of the SIGTERM; 0: its command
        # happened to end by itself just then (the status is the command's).
        assert runner.finish(proc) in (0, 128 + signal.SIGTERM), runner.stderr(proc)
    running: dict[str, Any] | None = None
    tokens: list[int] = []
    for event in runs():
        if event["event"] == "start":
            assert running is None, f"{event['id']} started while {running} ran"
            running = event
            tokens.append(event["token"])
        elif event["event"] in ("end", "term"):
            assert running is not None
            assert running["pid"] == event["pid"]
            running = None
    assert tokens == sorted(set(tokens)), "every run has a new, larger token"


def test_sigterm_is_forwarded_and_the_lease_released(runner: Runner, tmp_path: Path) -> None:
    log = tmp_path / "child.jsonl"
    proc = runner.run("g", log, "--term-exit", "5", options=("--lease", "2"))
    wait_started(log)
    assert runner.status("g")[0] == 0
    proc.send_signal(signal.SIGTERM)
    assert runner.finish(proc) == 5, runner.stderr(proc)
    assert [e["event"] for e in read_events(log)] == ["start", "term"]
    assert runner.status("g") == (1, {"group": "g", "leader": None})


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(
    runner: Runner, tmp_path: Path
) -> None:
    log = tmp_path / "child.jsonl"
    proc = runner.run("g", log, "--ignore-term", options=("--lease", "2", "--grace", "0.3"))
    (start,) = wait_started(log)
    proc.send_signal(signal.SIGINT)
    assert runner.finish(proc) == 128 + signal.SIGKILL, runner.stderr(proc)
    assert is_dead(start["pid"])
    assert [e["event"] for e in read_events(log)] == ["start", "term"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_the_supervisor_kills_the_command(runner: Runner, tmp_path: Path) -> None:
    log = tmp_path / "child.jsonl"
    proc = runner.run("g", log, options=("--lease", "2"))
    (start,) = wait_started(log)
    assert not is_dead(start["pid"])
    proc.kill()
    proc.wait()
    wait_until(lambda: is_dead(start["pid"]), 10, "the command dies with its supervisor")


def test_forever_runs_the_command_again_in_each_new_term(runner: Runner, tmp_path: Path) -> None:
    log = tmp_path / "child.jsonl"
    proc = runner.run("g", log, "--hold", "0.05", options=("--lease", "0.5", "--forever"))
    starts = wait_started(log, 3)
    tokens = [s["token"] for s in starts]
    assert tokens == sorted(set(tokens)), tokens
    proc.send_signal(signal.SIGTERM)
    assert runner.finish(proc) in (0, 128 + signal.SIGTERM), runner.stderr(proc)


def test_the_command_is_dead_before_another_candidate_runs(runner: Runner, tmp_path: Path) -> None:
    """Cut one supervisor off the store; its command must die before the other's starts.

    Supervisor A reaches the lease directory through a symlink; B by its real path. Turning
    the symlink into one to a plain file makes every store call of A fail (it is root-proof,
    unlike permissions), while B keeps working. A's command ignores SIGTERM, so only the
    SIGKILL at A's deadline stops it; B can acquire only once the lease has expired.
    """
    real = tmp_path / "leases"
    real.mkdir()
    link = tmp_path / "via-link"
    link.symlink_to(real, target_is_directory=True)
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    options = ("--lease", "2")
    a = runner.run("cut", log_a, "--ignore-term", options=options, url=link.as_uri())
    (start_a,) = wait_started(log_a)
    b = runner.run(
        "cut", log_b, options=(*options, "-v"), url=real.as_uri() + "?poll_interval=0.05"
    )

    died_at: list[float] = []

    def observe() -> None:  # time A's command's death on the machine's monotonic clock
        while not is_dead(start_a["pid"]):
            time.sleep(0.001)
        died_at.append(time.monotonic())

    observer = threading.Thread(target=observe, daemon=True)
    observer.start()
    # B must be campaigning before A is cut off, so that it takes over as early as it can.
    wait_until(lambda: "campaigning" in runner.stderr(b), STARTUP, "b campaigns")
    plain = tmp_path / "not-a-directory"
    plain.write_text("")
    swap = tmp_path / "swap"
    swap.symlink_to(plain)
    os.replace(swap, link)  # A is cut off from here on

    (start_b,) = wait_started(log_b)
    observer.join(10)
    assert died_at, "A's command never died"
    assert died_at[0] < start_b["t"], "A's command was alive when B's started"
    print(f"A's command died {start_b['t'] - died_at[0]:.3f} s before B's started")
    assert start_b["token"] > start_a["token"]
    assert runner.finish(a) == 75, runner.stderr(a)
    assert "SIGKILL" in runner.stderr(a)
    assert [e["event"] for e in read_events(log_a)] == ["start", "term"]
    b.send_signal(signal.SIGTERM)
    assert runner.finish(b) == 128 + signal.SIGTERM


def test_watch_prints_a_line_per_change(runner: Runner, tmp_path: Path) -> None:
    watch = runner.cli(
        "watch", "--url", runner.url, "--group", "w", "--json", "--poll", "0.2",
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert watch.stdout is not None
    lines: list[dict[str, Any]] = []

    def read() -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            lines.append(json.loads(line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_until(lambda: lines, STARTUP, "watch reports the group")
    assert lines[0]["leader"] is None
    log = tmp_path / "child.jsonl"
    proc = runner.run("w", log, options=("--lease", "1", "--id", "watched", "-m", "k=v"))
    (start,) = wait_started(log)
    wait_until(lambda: len(lines) >= 2, STARTUP, "watch reports the leader")
    leader = lines[1]["leader"]
    assert (leader["id"], leader["token"], leader["metadata"]) == (
        "watched",
        start["token"],
        {"k": "v"},
    )
    proc.send_signal(signal.SIGTERM)
    runner.finish(proc)
    wait_until(lambda: len(lines) >= 3, STARTUP, "watch reports the release")
    assert lines[2]["leader"] is None
    watch.send_signal(signal.SIGTERM)
    assert runner.finish(watch) == 0, runner.stderr(watch)
    reader.join(5)
    assert runner.stderr(watch) == ""


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("multilock")
    if not script.exists():
        pytest.skip("multilock-cli is not installed in this interpreter's environment")
    proc = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("multilock, version ")
