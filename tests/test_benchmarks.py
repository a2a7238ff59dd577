"""The benchmark runner works end to end on every backend that runs here.

Numbers are not judged here (performance targets live in benchmarks/REPORT.md); this
proves the measurements run, every handoff happens and every crash timeline is safe.
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


@pytest.mark.slow
def test_benchmark_runner_measures_every_backend(tmp_path):
    report = tmp_path / "REPORT.md"
    command = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--out", str(report)]
    command += ["--backends", ",".join(BACKENDS), "--handoffs", "4"]
    command += ["--kills", "1", "--idle-leases", "2"]
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
    handoffs = text.split("## 1.")[1].split("## 2.")[0]
    crashes = text.split("## 2.")[1].split("## 3.")[0]
    for backend in BACKENDS:
        row = re.search(rf"^\| {backend} \| .*$", handoffs, re.MULTILINE)
        assert row is not None, f"no handoff row for {backend}:\n{handoffs}"
        cells = [c.strip() for c in row.group(0).strip("|").split("|")]
        assert cells[2:4] == ["4", "0"], f"{backend}: handoffs/failed are {cells[2:4]}"
        if backend != "memory":
            crash = re.search(rf"^\| {backend} \| .*$", crashes, re.MULTILINE)
            assert crash is not None, f"no crash row for {backend}"
            assert crash.group(0).rstrip(" |").endswith("ok"), crash.group(0)
