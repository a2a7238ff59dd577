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
from ._watchdog import Watchdog

__all__ = ["ProcessChild", "check_command", "spawn_process"]

_CANNOT = ExitCode.CANNOT_EXECUTE

#: argv: parent pid, LC_CTYPE ("-" unset, "=VALUE" set), the watchdog's pipe ("-" none),
#: then the command. The process group is registered with the watchdog before the exec.
_TRAMPOLINE = """\
import ctypes, os, signal, sys
parent, lc_ctype, watchdog, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    os.kill(os.getpid(), signal.SIGKILL)
if watchdog != "-":
    os.write(int(watchdog), b"group %d\\n" % os.getpgrp())
    os.close(int(watchdog))
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


def _trampolined() -> bool:
    return sys.platform.startswith("linux") and bool(sys.executable)


def _launcher(argv: Sequence[str], env: Mapping[str, str], watchdog: int | None) -> list[str]:
    """The argv that starts *argv*: through the trampoline on Linux, directly elsewhere."""
    if not _trampolined():
        return list(argv)
    lc_ctype = env.get("LC_CTYPE")
    marker = "-" if lc_ctype is None else "=" + lc_ctype
    fd = "-" if watchdog is None else str(watchdog)
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), marker, fd, *argv]


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


async def spawn_process(
    argv: Sequence[str], env: Mapping[str, str], watchdog: Watchdog | None = None
) -> ProcessChild:
    """Start *argv* with *env* in a new process group (see the module docstring).

    With a *watchdog*, the group is registered with it before the command runs: by the
    trampoline on Linux, otherwise right after the start.
    """
    fd = None if watchdog is None else watchdog.child_fd
    passed = (fd,) if fd is not None and _trampolined() else ()
    try:
        process = await asyncio.create_subprocess_exec(
            *_launcher(argv, env, fd if passed else None),
            env=dict(env),
            process_group=0,
            pass_fds=passed,
        )
    except FileNotFoundError:
        raise CliError(f"{argv[0]}: command not found", ExitCode.NOT_FOUND) from None
    except PermissionError as exc:
        raise CliError(
            f"{argv[0]}: cannot execute: {exc.strerror}", ExitCode.CANNOT_EXECUTE
        ) from None
    except OSError as exc:
        raise CliError(f"{argv[0]}: cannot execute: {exc}", ExitCode.CANNOT_EXECUTE) from None
    if watchdog is not None and not passed:
        watchdog.watch(process.pid)
    return ProcessChild(process)
