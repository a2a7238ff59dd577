#!/usr/bin/env python3
"""Run a project task with nothing installed but Python >= 3.11.

    python3 dev.py demo     # the three-process failover demo
    python3 dev.py test     # the whole test suite, as CI runs it
    python3 dev.py SESSION  # any nox session (see noxfile.py); extra arguments follow

It keeps nox in its own virtual environment (.venv-dev) so the system Python stays clean.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
ENV = ROOT / ".venv-dev"
BIN = ENV / ("Scripts" if os.name == "nt" else "bin")
ALIASES = {"test": "ci"}


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):  # noqa: UP036 (this file may run on an older Python)
        sys.exit("multilock needs Python 3.11 or newer")
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    session, rest = ALIASES.get(argv[0], argv[0]), argv[1:]
    nox = BIN / "nox"
    if not nox.exists():
        print("dev.py: creating .venv-dev with nox ...", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(ENV)
        subprocess.run([BIN / "python", "-m", "pip", "install", "-q", "nox>=2024.4"], check=True)
    command = [str(nox), "-f", str(ROOT / "noxfile.py"), "-s", session]
    if rest:
        command += ["--", *rest]
    return subprocess.run(command, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
