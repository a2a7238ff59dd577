"""The READMEs' code runs or type-checks as written.

- Blocks marked ``<!-- readme-test: NAME -->`` run for real, in processes of their own: the
  root README's quick start for pip users (a failover, shown by one command), the SIGTERM
  and logging examples, core's first example.
- Every ```python block of every README is type-checked by mypy, all in one run, each
  block as a module of its own. A block may leave names to the reader (``report_loop``,
  ``do_work``): `PRELUDES` declares exactly those, per README and block, and nothing else;
  a missing import or a wrong name or signature is a bug of the README, fixed there.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
READMES = [README, *sorted(ROOT.glob("packages/*/README.md"))]

#: Real seconds a child process may take to answer; a bound, never a sleep.
WAIT = 30.0
#: The demo takes a few seconds (a 2 s lease must run out once); a loaded machine is slower.
DEMO_WAIT = 120.0


def block(name: str, lang: str = "python") -> str:
    """The *lang* block that follows ``<!-- readme-test: NAME -->`` in one of the READMEs."""
    pattern = rf"<!-- readme-test: {re.escape(name)} -->\n```{lang}\n(.*?)```"
    found = [m.group(1) for path in READMES for m in re.finditer(pattern, path.read_text(), re.S)]
    assert len(found) == 1, f"{len(found)} {lang} blocks marked {name!r} in the READMEs, want 1"
    return found[0]


# ---------------------------------------------------------------- blocks that run
@pytest.mark.slow  # four processes, a 2 s lease to run out
def test_quickstart_for_pip_users_shows_a_failover(tmp_path: Path) -> None:
    """The quick start is ``pip install`` of two distributions, then one command."""
    lines = [line for line in block("quickstart", "bash").splitlines() if line.strip()]
    assert len(lines) == 2, f"want the pip line and ONE command, got {lines}"
    install, command = (shlex.split(line, comments=True) for line in lines)
    assert install[:2] == ["pip", "install"], lines[0]
    distributions = install[2:]
    assert sorted(distributions) == ["multilock-cli", "multilock-filesystem"], (
        "the quick start installs the command and the file-system store only"
    )
    for dist in distributions:  # installed here (editable), as pip would from PyPI
        importlib.metadata.distribution(dist)

    # The command runs as a pip user's shell would find it: on PATH, outside the repository.
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    executable = shutil.which(command[0], path=env["PATH"])
    assert executable is not None, f"{command[0]!r} is not on PATH"
    proc = subprocess.Popen(
        [executable, *command[1:]],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a hung demo's participants can be killed with it
    )
    try:
        out, err = proc.communicate(timeout=DEMO_WAIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{lines[1]!r} did not finish in {DEMO_WAIT} s:\n{out}\n{err}")
    assert proc.returncode == 0, f"{lines[1]!r} failed ({proc.returncode}):\n{out}\n{err}"
    assert re.search(r"^failover: \S+ leads with token 2, [\d.]+ s after the kill", out, re.M), out
    assert re.search(r"^handoff: \S+ leads with token 3", out, re.M), out
    assert "no overlap, tokens rising: 1 " in out, out
    # The store it used is served by what the pip line installs (core comes with them).
    backend = re.search(r"^backend: ([a-z][a-z0-9+.-]*)://", out, re.M)
    assert backend is not None, out
    providers = {
        ep.name: canonicalize_name(ep.dist.name)
        for ep in importlib.metadata.entry_points(group="multilock.providers")
        if ep.dist is not None
    }
    assert providers.get(backend.group(1)) in {"multilock-core", *distributions}, providers


def test_core_intro_block_leads_on_memory(tmp_path: Path) -> None:
    script = tmp_path / "core_intro.py"
    script.write_text(block("core-intro"))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "leading with fencing token 1\n", result.stdout


def test_holders_block_locks_then_limits_to_two(tmp_path: Path) -> None:
    script = tmp_path / "holders.py"
    script.write_text(block("holders"))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["a holds the lock with token 1", "b holds the lock with token 2"], lines
    slots = [line.rsplit(" ", 1)[1] for line in lines[2:]]
    assert len(slots) == 4, lines
    assert sorted(slots) == ["0", "0", "1", "1"], lines  # two at a time, each slot twice


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


@pytest.mark.parametrize("name", ["sigterm", "logging", "core-intro"])
def test_marked_blocks_compile(name: str) -> None:
    compile(block(name), f"README.md:{name}", "exec")


# ---------------------------------------------------------------- every python block
@attrs.frozen
class Block:
    where: str  # "packages/multilock-redis/README.md:1": the README and the block's index
    line: int  # the README line of the block's first line of code
    code: str

    @property
    def module(self) -> str:
        return "readme_" + re.sub(r"\W", "_", self.where.removesuffix(".md").lower())


def _python_blocks() -> list[Block]:
    blocks = []
    for path in READMES:
        text = path.read_text()
        # Blocks inside list items are indented with their item.
        for i, found in enumerate(re.finditer(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)):
            code = "\n".join(line[len(found.group(1)) :] for line in found.group(2).splitlines())
            line = text.count("\n", 0, found.start(2)) + 1
            blocks.append(Block(f"{path.relative_to(ROOT)}:{i}", line, code + "\n"))
    return blocks


BLOCKS = _python_blocks()

_REPORT_LOOP = "async def report_loop(leadership: object) -> None: ..."
_POLL_OUTBOX = "async def poll_outbox(leadership: object) -> None: ..."
_URL = 'url = "redis://localhost:6379/0"'

#: What a block leaves to the reader, declared so that mypy can check the rest. Only names
#: the block uses and does not define; an import the block needs belongs in the block.
PRELUDES: dict[str, str] = {
    "README.md:0": "async def write_report(**kw: object) -> None: ...",
    "README.md:1": "def do_work(token: int) -> None: ...",
    "README.md:3": "from multilock.core import LeaderElection\nelection: LeaderElection",
    "README.md:6": "async def write_report(**kw: object) -> None: ...",
    "README.md:7": "async def transcode(video: object, **kw: object) -> None: ...",
    "README.md:8": "async def process_orders(shard: int, **kw: object) -> None: ...",
    "README.md:9": (
        "def report_parts() -> list[str]: return []\n"
        "def write(part: str, **kw: object) -> None: ...\n"
        "video: object\n"
        "def transcode(video: object, **kw: object) -> None: ...\n"
        "def process_orders(shard: int, **kw: object) -> None: ..."
    ),
    "packages/multilock-apscheduler/README.md:0": (
        "async def write_report(**kw: object) -> None: ..."
    ),
    "packages/multilock-apscheduler/README.md:1": "def nightly_report(*args: object) -> None: ...",
    "packages/multilock-azure-blob/README.md:0": _REPORT_LOOP,
    "packages/multilock-consul/README.md:0": _REPORT_LOOP,
    "packages/multilock-django/README.md:1": (
        "def batches() -> list[object]: return []\n"
        "def write(batch: object, **kw: object) -> None: ..."
    ),
    "packages/multilock-etcd/README.md:0": _REPORT_LOOP,
    "packages/multilock-opentelemetry/README.md:0": _REPORT_LOOP,
    "packages/multilock-postgres/README.md:0": _REPORT_LOOP,
    "packages/multilock-prometheus/README.md:0": _REPORT_LOOP,
    "packages/multilock-redis/README.md:0": "async def do_the_work(token: int) -> None: ...",
    "packages/multilock-redis/README.md:1": (
        "from redis.asyncio import Redis\nmy_redis_client: Redis\nmy_client: Redis"
    ),
    "packages/multilock-s3/README.md:0": _REPORT_LOOP,
    "packages/multilock-sqlserver/README.md:0": _REPORT_LOOP,
    "packages/multilock-starlette/README.md:0": (
        "async def publish_pending(**kw: object) -> None: ..."
    ),
    "packages/multilock-starlette/README.md:1": _POLL_OUTBOX,
    "packages/multilock-starlette/README.md:2": (
        "from contextlib import AbstractAsyncContextManager\n"
        "def create_pool() -> AbstractAsyncContextManager[object]: raise NotImplementedError\n"
        f"{_URL}\n{_POLL_OUTBOX}"
    ),
    "packages/multilock-starlette/README.md:3": f"{_URL}\n{_POLL_OUTBOX}",
    "packages/multilock-zookeeper/README.md:1": (
        "from kazoo.client import KazooClient\nmy_kazoo_client: KazooClient"
    ),
}

#: Frameworks that ship no type information: their names are Any in the snippets (the
#: multilock packages type their own use of them).
UNTYPED = ["apscheduler.*", "azure.identity.*", "celery.*", "consul.*", "django.*", "kazoo.*"]


def _defined(source: str) -> set[str]:
    """The names a module defines at top level, imports left out."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Type-check every block in ONE mypy run; each block's errors at their README lines."""
    mypy_api = pytest.importorskip("mypy.api")
    folder = tmp_path_factory.mktemp("readme_blocks")
    config = folder / "mypy.ini"
    config.write_text(
        "[mypy]\n"
        "python_version = 3.11\n"
        "check_untyped_defs = True\n"  # snippets rarely annotate: check their bodies anyway
        f"cache_dir = {folder / '.mypy_cache'}\n"
        f"[mypy-{','.join(UNTYPED)}]\n"
        "ignore_missing_imports = True\n"
    )
    files, offsets = [], {}
    for b in BLOCKS:
        prelude = PRELUDES.get(b.where, "")
        prelude = prelude + "\n" if prelude else ""
        path = folder / f"{b.module}.py"
        path.write_text(prelude + b.code)
        files.append(str(path))
        offsets[path.name] = (b, prelude.count("\n"))
    out, err, _ = mypy_api.run(
        ["--config-file", str(config), "--no-color-output", "--no-error-summary", *files]
    )
    assert not err.strip(), err
    errors: dict[str, list[str]] = {b.where: [] for b in BLOCKS}
    for line in out.splitlines():
        found = re.match(r"(?:.*/)?([^/:]+\.py):(\d+): (error|note): (.*)", line)
        assert found is not None, f"unexpected mypy output: {line}"
        b, offset = offsets[found.group(1)]
        if found.group(3) == "note":
            continue
        at = int(found.group(2)) - offset
        where = f"line {b.line + at - 1}" if at > 0 else "its prelude in tests/test_readme.py"
        errors[b.where].append(f"{b.where.split(':')[0]} {where}: {found.group(4)}")
    return errors


@pytest.mark.parametrize("b", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_readme_python_block_compiles(b: Block) -> None:
    """No README shows code that is a SyntaxError as written (``async with`` at module level)."""
    compile(b.code, b.where, "exec")


@pytest.mark.parametrize("b", BLOCKS, ids=[b.where for b in BLOCKS])
def test_every_readme_python_block_type_checks(b: Block, mypy_errors: dict[str, list[str]]) -> None:
    assert not mypy_errors[b.where], "mypy:\n" + "\n".join(mypy_errors[b.where])


def test_preludes_declare_only_what_their_block_leaves_to_the_reader() -> None:
    by_where = {b.where: b for b in BLOCKS}
    for where, prelude in PRELUDES.items():
        assert where in by_where, f"PRELUDES[{where!r}]: no such block (did the README change?)"
        code = by_where[where].code
        for name in sorted(_defined(prelude)):
            assert re.search(rf"\b{re.escape(name)}\b", code), (
                f"PRELUDES[{where!r}] declares {name}, which the block does not use"
            )
            assert name not in _defined(code), (
                f"PRELUDES[{where!r}] declares {name}, which the block defines itself"
            )
