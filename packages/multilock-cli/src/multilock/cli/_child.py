"""Start the supervised command: its own process group, and killed if the supervisor dies.

The command runs in a new process group, so that signals reach everything it starts in
that group, and a Ctrl-C on the terminal reaches only the supervisor (which forwards
SIGTERM). On Linux the command also gets ``PR_SET_PDEATHSIG = SIGKILL``: if the
supervisor dies, even by SIGKILL, the kernel kills the command at once.

The ``prctl`` call is made by a tiny trampoline (``python -I -S -c ...``) that then
``exec``s the command in the same process, not by a ``preexec_fn``: a ``preexec_fn`` forces
``fork()`` while driver threads run (gRPC for etcd, kazoo, worker threads), and a child
forked under gRPC's fork handlers was measured to die of SIGSEGV before its exec. The
trampoline costs about 25 ms per start. It checks that its parent is still the supervisor
after ``prctl`` (closing the race with a supervisor that died first) and restores
``LC_CTYPE``, which Python's C-locale coercion (PEP 538) may have changed, so the command
gets exactly the environment it was given. Other systems have no such call: there the
command is started directly, and a SIGKILLed supervisor leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from collections.abc import Mapping, Sequence

from ._common import SIGNAL_BASE, CliError, ExitCode

__all__ = ["ProcessChild", "check_command", "spawn_process"]

_CANNOT = ExitCode.CANNOT_EXECUTE

#: argv: parent pid, LC_CTYPE ("-" unset, "=VALUE" set), then the command.
_TRAMPOLINE = """\
import ctypes, os, signal, sys
parent, lc_ctype, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    os.kill(os.getpid(), signal.SIGKILL)
if lc_ctype == "-":
    os.environ.pop("LC_CTYPE", None)
else:
    os.environ["LC_CTYPE"] = lc_ctype[1:]
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"multilock: error: {argv[0]}: {exc.strerror}\\n")
    sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)
"""


def _launcher(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The argv that starts *argv*: through the trampoline on Linux, directly elsewhere."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return list(argv)
    lc_ctype = env.get("LC_CTYPE")
    marker = "-" if lc_ctype is None else "=" + lc_ctype
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), marker, *argv]


def check_command(argv: Sequence[str]) -> None:
    """Fail early, before campaigning, if the command cannot be found or executed."""
    program = argv[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise CliError(f"{program}: command not found", ExitCode.NOT_FOUND)
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise CliError(
                f"{program}: cannot execute (not an executable file)", ExitCode.CANNOT_EXECUTE
            )
    elif shutil.which(program) is None:
        raise CliError(f"{program}: command not found", ExitCode.NOT_FOUND)


class ProcessChild:
    """A running command (`Child` of the supervisor); signals go to its process group."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        return self._process.pid

    def send(self, signum: int) -> None:
        # The group outlives its leader while any member lives, and its id cannot be
        # reused meanwhile; once the group is empty this is ESRCH, ignored.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signum)

    async def wait(self) -> int:
        code = await self._process.wait()
        return SIGNAL_BASE - code if code < 0 else code


async def spawn_process(argv: Sequence[str], env: Mapping[str, str]) -> ProcessChild:
    """Start *argv* with *env* in a new process group (see the module docstring)."""
    try:
        process = await asyncio.create_subprocess_exec(
            *_launcher(argv, env), env=dict(env), process_group=0
        )
    except FileNotFoundError:
        raise CliError(f"{argv[0]}: command not found", ExitCode.NOT_FOUND) from None
    except PermissionError as exc:
        raise CliError(
            f"{argv[0]}: cannot execute: {exc.strerror}", ExitCode.CANNOT_EXECUTE
        ) from None
    except OSError as exc:
        raise CliError(f"{argv[0]}: cannot execute: {exc}", ExitCode.CANNOT_EXECUTE) from None
    return ProcessChild(process)
