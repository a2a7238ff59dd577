"""The ``multilock`` command against every backend that works across processes.

Two ``multilock run`` supervisors (real processes) compete for one fresh group; the
winner's command waits for a release file. ``multilock status --json`` must name the
winner with the token its command received; releasing the winner hands the group to the
other supervisor, whose command gets a larger token. The store URL travels in
``MULTILOCK_URL``, so a password never shows in the process list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from harness import Backend

pytestmark = pytest.mark.slow

#: Interpreters (and some drivers) start slowly on a loaded machine.
STARTUP = 30.0
#: A command that records its token and waits for its release file.
CHILD = (
    'echo "$MULTILOCK_TOKEN $MULTILOCK_PARTICIPANT_ID $MULTILOCK_GROUP" > "$0.started"; '
    'while [ ! -e "$0.release" ]; do sleep 0.02; done'
)


def _cli(backend: Backend, *args: str, **kwargs: Any) -> Any:
    env = {**os.environ, "MULTILOCK_URL": backend.url}
    return subprocess.Popen([sys.executable, "-m", "multilock.cli", *args], env=env, **kwargs)


def _status(backend: Backend, group: str) -> tuple[int, dict[str, Any]]:
    proc = _cli(backend, "status", "--group", group, "--json", stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=STARTUP)
    return proc.returncode, json.loads(out)


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()}" for p in sorted(tmp_path.glob("*.err")))


def _wait_for_file(paths: list[Path], timeout: float) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in paths:
            if path.exists() and path.read_text().strip():
                return path
        time.sleep(0.01)
    pytest.fail(
        f"none of {[p.name for p in paths]} appeared within {timeout} s\n" + _logs(paths[0].parent)
    )


def test_run_status_and_handoff(backend: Backend, tmp_path: Path) -> None:
    if not backend.multiprocess:
        pytest.skip(f"{backend.name}: the store lives in one process")
    group = f"cli-{uuid.uuid4().hex[:12]}"
    base = {name: tmp_path / name for name in ("a", "b")}
    procs = {}
    for name, path in base.items():
        with path.with_suffix(".err").open("w") as err:
            procs[name] = _cli(
                backend, "run", "-v", "--group", group, "--id", name,
                "--lease", f"{backend.lease:g}", "--", "sh", "-c", CHILD, str(path), stderr=err,
            )  # fmt: skip
    try:
        first = _wait_for_file([p.with_suffix(".started") for p in base.values()], STARTUP)
        winner = first.stem
        other = "b" if winner == "a" else "a"
        token, participant, seen_group = first.read_text().split()
        assert (participant, seen_group) == (winner, group)

        code, document = _status(backend, group)
        assert code == 0, (document, _logs(tmp_path))
        leader = document["leader"]
        assert (leader["id"], leader["token"]) == (winner, int(token))
        assert not base[other].with_suffix(".started").exists(), "two commands ran at once"

        base[winner].with_suffix(".release").touch()  # the winner's command exits: handoff
        assert procs[winner].wait(STARTUP) == 0, _logs(tmp_path)
        second = _wait_for_file([base[other].with_suffix(".started")], STARTUP)
        next_token, participant, _ = second.read_text().split()
        assert participant == other
        assert int(next_token) > int(token)

        code, document = _status(backend, group)
        assert (code, document["leader"]["id"]) == (0, other)
        base[other].with_suffix(".release").touch()
        assert procs[other].wait(STARTUP) == 0, _logs(tmp_path)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
