"""The root README's marked code blocks run as written, in real processes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

#: Real seconds a child process may take to answer; a bound, never a sleep.
WAIT = 30.0


def block(name: str) -> str:
    """The Python block that follows ``<!-- readme-test: NAME -->``."""
    found = re.search(
        rf"<!-- readme-test: {re.escape(name)} -->\n```python\n(.*?)```", README.read_text(), re.S
    )
    assert found is not None, f"README has no block marked {name!r}"
    return found.group(1)


def test_sigterm_block_releases_and_exits_with_143(tmp_path: Path) -> None:
    script = tmp_path / "sigterm_example.py"
    script.write_text(block("sigterm"))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + WAIT
        line = proc.stdout.readline()  # blocks until the first term begins
        assert line.startswith("leading with token 1"), line
        assert time.monotonic() < deadline
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err


def test_logging_block_shows_the_structured_fields(tmp_path: Path) -> None:
    script = tmp_path / "logging_example.py"
    script.write_text(
        block("logging")
        + """
import asyncio
from multilock.core import InMemoryProvider, LeaderElection

async def main():
    logging.getLogger("other").warning("a record without the fields")
    async with LeaderElection(InMemoryProvider(), group="jobs", participant_id="a") as e:
        await e.wait_until_leader()

asyncio.run(main())
"""
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert "INFO jobs/a token=1 jobs/a is leader with token 1" in lines, lines
    assert "INFO jobs/a token=1 jobs/a stepped down (token 1): stopping" in lines, lines
    assert any(line.startswith("INFO jobs/a token=None election jobs/a starting") for line in lines)


@pytest.mark.parametrize("name", ["sigterm", "logging"])
def test_marked_blocks_compile(name: str) -> None:
    compile(block(name), f"README.md:{name}", "exec")


def _python_blocks() -> list[tuple[str, str]]:
    root = README.parent
    readmes = [README, *sorted(root.glob("packages/*/README.md"))]
    blocks = []
    for path in readmes:
        text = path.read_text()
        # Blocks inside list items are indented with their item.
        for i, found in enumerate(re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)):
            code = "\n".join(line[len(found.group(1)) :] for line in found.group(2).splitlines())
            blocks.append((f"{path.relative_to(root)}:{i}", code))
    return blocks


@pytest.mark.parametrize(("where", "code"), _python_blocks(), ids=lambda v: v if ":" in v else "")
def test_every_readme_python_block_compiles(where: str, code: str) -> None:
    """No README shows code that is a SyntaxError as written (``async with`` at module level)."""
    compile(code, where, "exec")
