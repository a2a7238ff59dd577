"""multilock.cli: the ``multilock`` command.

- ``multilock run --url URL --group G -- COMMAND ...``: run COMMAND only while leading.
- ``multilock status --url URL --group G [--json]``: who leads now.
- ``multilock watch --url URL --group G``: follow leadership changes.
- ``multilock demo``: several processes, a crash failover and a handoff, checked.

`main` runs the command line and returns its exit code; `cli` is the click group, for
embedding or testing with ``click.testing.CliRunner``; `ExitCode` lists the exit codes;
`run_command` is ``multilock run`` as a coroutine, for asyncio programs whose leader work
must never overlap the next leader's even when their own event loop is blocked.
"""

from ._app import cli, main
from ._common import ExitCode
from ._run import run_command

__all__ = ["ExitCode", "cli", "main", "run_command"]

__version__ = "0.1.0"
