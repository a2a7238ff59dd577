"""See leader election survive a crash and a graceful handoff, in about 15 seconds.

    python samples/demo.py                      # file-system leases in a temp dir
    python samples/demo.py --url redis://127.0.0.1:6379/0 --lease 1

The same as ``multilock demo`` (package ``multilock-cli``), where the demo lives: three
participant processes elect a leader; it is SIGKILLed and a survivor takes over once its
lease runs out; the new leader resigns and another takes over at once; finally every
participant's log is checked for overlapping terms and tokens that fail to rise.
"""

from __future__ import annotations

import sys

from multilock.cli import cli


def main(argv: list[str] | None = None) -> int:
    """Run ``multilock demo`` with *argv*; exits the interpreter with its exit code.

    Bad options exit with code 2 after one line on stderr (``SystemExit``).
    """
    args = sys.argv[1:] if argv is None else argv
    cli.main(["demo", *args], prog_name="python samples/demo.py")
    return 0  # not reached: cli.main exits


if __name__ == "__main__":
    sys.exit(main())
