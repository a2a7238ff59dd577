"""Parsing, validation, exit codes and redaction, in-process with click's `CliRunner`.

Every bad input must give exactly one line on stderr, ``multilock: error: ...``, and exit
code 2, before anything is campaigned for; a URL's password never appears in any output.
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from multilock.cli import ExitCode, cli, main
from multilock.core import available_schemes
from multilock.core.sync import LeaderElection

README = Path(__file__).resolve().parents[1] / "README.md"
SECRET = "hunter2-s3cret"


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


def assert_one_line_error(result: Result, *fragments: str, code: int = ExitCode.USAGE) -> str:
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("multilock: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def store(tmp_path: Path) -> str:
    return tmp_path.as_uri()


@pytest.fixture
def memory_url() -> str:
    return f"memory://cli-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--group", "g", "--", "true"], ["--url is required", "MULTILOCK_URL"]),
        (["--url", "nosuch://x", "--group", "g", "--", "true"], ["scheme 'nosuch'"]),
        (["--url", "{store}", "--group", "a b", "--", "true"], ["--group 'a b' is invalid"]),
        (["--url", "{store}", "--group", "g", "--id", "x/y", "--", "true"], ["--id 'x/y'"]),
        (["--url", "{store}", "--group", "g", "--lease", "-1", "--", "true"], ["--lease"]),
        (["--url", "{store}", "--group", "g", "--lease", "abc", "--", "true"], ["'--lease'"]),
        (["--url", "{store}", "--group", "g", "-m", "novalue", "--", "true"], ["KEY=VALUE"]),
        (["--url", "{store}", "--group", "g", "-m", "=v", "--", "true"], ["KEY=VALUE"]),
        (["--url", "{store}", "--group", "g", "-m", "k=1", "-m", "k=2", "--", "true"], ["twice"]),
        (
            ["--url", "{store}", "--group", "g", "-m", "k=" + "x" * 4001, "--", "true"],
            ["--metadata", "4000"],
        ),
        (
            ["--url", "{store}", "--group", "g", "--lease", "1", "--grace", "0.5", "--", "true"],
            ["--grace 0.5 is too long for --lease 1", "0.318"],
        ),
        (["--url", "{store}", "--group", "g", "--grace", "0", "--", "true"], ["positive"]),
        (["--url", "{store}", "--group", "g", "--timeout", "0", "--", "true"], ["--timeout"]),
        (["--url", "{store}", "--group", "g"], ["Missing argument"]),
        (["--url", "{store}", "--group", "g", "--bogus", "--", "true"], ["--bogus"]),
        (["--url", "memory://x", "--group", "g", "--", "true"], ["memory:// is private"]),
    ],
)
def test_run_rejects_bad_input_with_one_line(
    args: list[str], fragments: list[str], store: str
) -> None:
    result = invoke("run", *(a.replace("{store}", store) for a in args))
    assert_one_line_error(result, *fragments)


def test_run_finds_missing_or_unrunnable_commands_before_campaigning(
    store: str, tmp_path: Path
) -> None:
    base = ["run", "--url", store, "--group", "g", "--"]
    assert_one_line_error(
        invoke(*base, "no-such-command-here"), "command not found", code=ExitCode.NOT_FOUND
    )
    assert_one_line_error(
        invoke(*base, str(tmp_path / "missing")), "command not found", code=ExitCode.NOT_FOUND
    )
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    assert_one_line_error(
        invoke(*base, str(script)), "cannot execute", code=ExitCode.CANNOT_EXECUTE
    )
    assert_one_line_error(
        invoke(*base, str(tmp_path)), "cannot execute", code=ExitCode.CANNOT_EXECUTE
    )
    assert not list(tmp_path.glob("*.lease.json")), "nothing may touch the store"


def test_options_after_the_command_belong_to_the_command(store: str) -> None:
    """``run ... echo --group x``: everything from COMMAND on is COMMAND's."""
    result = invoke("run", "--url", store, "--group", "g", "sh", "-c", "exit 4", "--group")
    assert result.exit_code == 4, result.stderr


def test_a_password_in_the_url_never_appears(tmp_path: Path) -> None:
    url = f"file://user:{SECRET}@example.org{tmp_path}"
    line = assert_one_line_error(invoke("status", "--url", url, "--group", "g"))
    assert SECRET not in line
    assert "***" in line


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield server.getsockname()[1]


@pytest.mark.parametrize("scheme", ["redis", "postgresql"])
def test_an_unreachable_store_is_one_line_without_the_password(scheme: str) -> None:
    if scheme not in available_schemes():
        pytest.skip(f"no provider for {scheme}:// is installed")
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"{scheme}://user:{SECRET}@127.0.0.1:{port}/0"
    for command in (["status"], ["watch"], ["run"]):
        tail = ["--", "true"] if command == ["run"] else []
        result = invoke(*command, "--url", url, "--group", "g", "--timeout", "5", *tail)
        line = assert_one_line_error(result, "cannot reach the store")
        assert SECRET not in result.output
        assert f"user:***@127.0.0.1:{port}" in line


def test_a_store_that_never_answers_times_out(silent_port: int) -> None:
    if "redis" not in available_schemes():
        pytest.skip("no provider for redis:// is installed")
    url = f"redis://:{SECRET}@127.0.0.1:{silent_port}/0"
    result = invoke("status", "--url", url, "--group", "g", "--timeout", "0.5")
    line = assert_one_line_error(result)
    assert SECRET not in result.output
    assert re.search(r"did not answer within 0\.5 s|cannot reach the store", line), line


def test_status_without_a_leader(memory_url: str) -> None:
    result = invoke("status", "--url", memory_url, "--group", "g")
    assert result.exit_code == ExitCode.NO_LEADER
    assert result.stdout == "group g: no leader\n"
    result = invoke("status", "--url", memory_url, "--group", "g", "--json")
    assert result.exit_code == ExitCode.NO_LEADER
    assert json.loads(result.stdout) == {"group": "g", "leader": None}


def test_status_shows_the_live_leader(memory_url: str) -> None:
    with LeaderElection(
        memory_url, group="g", participant_id="worker-1", metadata={"role": "cron"}
    ) as election:
        leadership = election.wait_until_leader(timeout=10)
        result = invoke("status", "--url", memory_url, "--group", "g", "--json")
        assert result.exit_code == ExitCode.OK, result.stderr
        document = json.loads(result.stdout)
        leader = document.pop("leader")
        assert document == {"group": "g"}
        assert leader.pop("age_seconds") >= 0
        assert leader == {
            "id": "worker-1",
            "token": leadership.token,
            "metadata": {"role": "cron"},
            "acquired_at": leadership.acquired_at.isoformat(),
        }
        # The URL may come from the environment instead.
        result = invoke("status", "--group", "g", env={"MULTILOCK_URL": memory_url})
        assert result.exit_code == ExitCode.OK, result.stderr
        assert "leader:      worker-1" in result.stdout
        assert f"token:       {leadership.token}" in result.stdout
        assert "metadata:    role=cron" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["watch", "--url", "{store}", "--group", "g", "--poll", "0"], ["'--poll'"]),
        (["watch", "--url", "{store}", "--group", "a/b"], ["--group"]),
        (["status", "--url", "{store}"], ["--group"]),
        (["demo", "--participants", "1"], ["--participants"]),
        (["demo", "--lease", "-1"], ["--lease -1", "lease_duration"]),
        (["demo", "--url", "memory://"], ["memory:// is private"]),
        (["nosuch"], ["No such command"]),
    ],
)
def test_other_commands_reject_bad_input(args: list[str], fragments: list[str], store: str) -> None:
    result = invoke(*(a.replace("{store}", store) for a in args))
    assert_one_line_error(result, *fragments)


@pytest.mark.parametrize("command", [[], ["run"], ["status"], ["watch"], ["demo"]])
def test_help(command: list[str]) -> None:
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "Usage: multilock" in result.stdout


def test_main_returns_the_exit_code_and_knows_its_version() -> None:
    assert main(["--version"]) == 0
    assert main(["status"]) == ExitCode.USAGE


def test_the_readme_documents_every_exit_code() -> None:
    table = README.read_text(encoding="utf-8").split("## Errors and exit codes", 1)[1]
    for code in ExitCode:
        assert re.search(rf"^\| {code.value} \|", table, re.M), f"{code.name} is not documented"
