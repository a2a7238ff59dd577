"""Section 1's handoff for two versions of multilock, side by side in one run.

    python benchmarks/compare.py REV [--backends redis,postgres,etcd,zookeeper,memory]
                                     [--rounds 4] [--handoffs 100] [--lease 1.0]

Checks REV (a commit, or a folder holding a checkout) out into a temporary worktree,
starts the servers once, then runs ``run.measure_handoff`` in child processes, taking
turns: REV's packages, this checkout's, and beside them, in the same rounds, the driver's
floor (``floor.py``, where there is one) and on ZooKeeper kazoo's ``Election``. Each
round alternates the order, so a machine that slows down or speeds up during the run
weighs on every column alike. Prints a Markdown table: each column's median p50 over
its runs, with their range. A shared machine drifts by tens of
percent between runs, so only figures of one run compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "integration"))
sys.path.insert(0, str(ROOT / "benchmarks"))

#: Backends with a driver's floor in ``floor.py``.
FLOORS = ("redis", "postgres", "etcd", "filesystem", "zookeeper")


def child(kind: str, url: str, count: int, lease: float) -> None:
    """Measure one column once and print its summary (``common.summary``) as JSON."""
    if kind.startswith("floor:"):
        import floor

        result = asyncio.run(floor.measure(kind.partition(":")[2], url, count))
    elif kind == "kazoo":
        import peers

        result = peers.measure_handoff("kazoo", url, count, lease, 0.25)
    else:
        import run

        result = asyncio.run(run.measure_handoff(url, count, lease))
    print(json.dumps(result))


def packages_path(tree: Path) -> str:
    return os.pathsep.join(str(p) for p in sorted(tree.glob("packages/*/src")))


def measure(kind: str, url: str, args: argparse.Namespace, tree: Path | None) -> float:
    """One column's p50 (ms) in a child process, with *tree*'s packages if given."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if tree is not None:  # that tree's packages first, ahead of this checkout's installs
        env["PYTHONPATH"] = packages_path(tree)
    command = [sys.executable, __file__, "--child", kind, url, str(args.handoffs)]
    command += ["--lease", str(args.lease)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{kind} on {url} failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result or result.get("p50") is None:
        raise RuntimeError(f"{kind} on {url} measured nothing: {result}")
    return float(result["p50"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("rev", nargs="?", help="the version to compare with (commit or folder)")
    parser.add_argument("--backends", default="redis,postgres,etcd,zookeeper,memory")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--handoffs", type=int, default=100)
    parser.add_argument("--lease", type=float, default=1.0)
    parser.add_argument("--child", nargs=3, metavar=("KIND", "URL", "COUNT"))
    args = parser.parse_args(argv)
    if args.child:
        kind, url, count = args.child
        child(kind, url, int(count), args.lease)
        return 0
    if not args.rev:
        parser.error("name the version to compare with")
    from backends import Backends

    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    with tempfile.TemporaryDirectory(prefix="multilock-compare-") as scratch:
        before = Path(args.rev)
        if not before.is_dir():
            before = Path(scratch) / "before"
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.rev],
                check=True,
                capture_output=True,
            )
        servers = Backends(names)
        rows: list[str] = []
        try:
            servers.start()
            for name in names:
                url = servers.urls[name]
                # Both versions run from their own trees: the installed packages may be
                # another checkout's (an editable install of the main worktree).
                columns: dict[str, Path | None] = {"before": before, "after": ROOT}
                if name in FLOORS:
                    columns["floor"] = None
                if name == "zookeeper":
                    columns["kazoo"] = None
                got: dict[str, list[float]] = {c: [] for c in columns}
                for turn in range(args.rounds):
                    order = list(columns) if turn % 2 == 0 else list(columns)[::-1]
                    for column in order:
                        kind = {"floor": f"floor:{name}", "kazoo": "kazoo"}.get(column, "multilock")
                        got[column].append(measure(kind, url, args, columns[column]))
                rows.append(row(name, got))
                print(rows[-1], flush=True)
        finally:
            servers.close()
            if before.parent == Path(scratch):
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)],
                    capture_output=True,
                )
    print()
    print(f"Handoff p50 in ms: before = {args.rev}, after = this checkout. Each column ran")
    print(f"{args.rounds} times ({args.handoffs} handoffs each), the columns taking turns;")
    print("each cell is the median of its runs' p50s, with their range.")
    print()
    print("| backend | before | after | after / before | driver's floor | kazoo Election |")
    print("|---|---|---|---|---|---|")
    for line in rows:
        print(line)
    return 0


def _cell(p50s: list[float]) -> tuple[float, str]:
    if not p50s:
        return 0.0, "n/a"
    middle = statistics.median(p50s)
    return middle, f"{middle:.2f} ({min(p50s):.2f}-{max(p50s):.2f})"


def row(name: str, got: dict[str, list[float]]) -> str:
    before, before_cell = _cell(got["before"])
    after, after_cell = _cell(got["after"])
    ratio = f"{after / before:.2f}" if before else "n/a"
    floor_cell = _cell(got.get("floor", []))[1]
    kazoo_cell = _cell(got.get("kazoo", []))[1]
    return f"| {name} | {before_cell} | {after_cell} | {ratio} | {floor_cell} | {kazoo_cell} |"


if __name__ == "__main__":
    sys.exit(main())
