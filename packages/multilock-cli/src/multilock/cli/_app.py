"""The ``multilock`` command line: ``run``, ``status``, ``watch`` and ``demo``.

Options are checked before anything touches the store, with the library's own rules
(`ElectionOptions`, `validate_name`, `from_url`); then the store is asked once, within
``--timeout``, so an unreachable store fails at once. Any such error is one line on stderr
and exit code 2 (see `ExitCode`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import click

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    available_schemes,
    redact_url,
    validate_name,
)

from ._child import check_command
from ._common import (
    CliError,
    ExitCode,
    close_quietly,
    configure_logging,
    error_line,
    logging_restored,
    open_provider,
    probe,
    status_document,
)
from ._run import election_options, run_supervised
from ._supervisor import check_grace, default_grace
from ._views import describe_leader, watch_group

__all__ = ["cli", "main"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_DEFAULTS = ElectionOptions()
DEFAULT_TIMEOUT = 10.0


class _Multilock(click.Group):
    """A click group whose errors are one line, ``multilock: error: ...``, and exit 2."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            with logging_restored():
                code = super().main(args, prog_name or "multilock", complete_var, False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            click.echo(exc.ctx.get_help() if exc.ctx else exc.format_message(), err=True)
            code = ExitCode.USAGE
        except CliError as exc:
            click.echo(error_line(exc.message, exc.url), err=True)
            code = exc.exit_code
        except click.ClickException as exc:
            click.echo(error_line(exc.format_message()), err=True)
            code = exc.exit_code
        except click.Abort:
            code = 130
        sys.exit(code if isinstance(code, int) else 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``multilock`` with *argv* (default: the process's arguments); return the exit code."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="multilock")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


async def _until_signal(work: Coroutine[Any, Any, T]) -> T | None:
    """Run *work* until it ends or SIGINT/SIGTERM arrives (then cancel it and return None)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        stopper.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


# ------------------------------------------------------------------ shared options
def _store_options(fn: F) -> F:
    """Add ``--url`` (or MULTILOCK_URL), ``--group``, ``--timeout`` and ``-v``."""
    options = [
        click.option(
            "--url",
            envvar="MULTILOCK_URL",
            show_envvar=True,
            metavar="URL",
            help="The store, e.g. redis://host:6379/0 or file:///var/lib/leases.",
        ),
        click.option(
            "--group", "-g", required=True, metavar="GROUP", help="The group (lock) name."
        ),
        click.option(
            "--timeout",
            type=float,
            default=DEFAULT_TIMEOUT,
            show_default=True,
            metavar="SECONDS",
            help="How long the first call to the store may take before giving up (exit 2).",
        ),
        click.option(
            "-v", "--verbose", count=True, help="Say more on stderr (-vv: the library's logs too)."
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _check_common(url: str | None, group: str, timeout: float, verbose: int) -> str:
    configure_logging(verbose)
    if not url:
        raise click.UsageError("--url is required (or set MULTILOCK_URL)")
    try:
        validate_name(group, "--group")
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    if not timeout > 0:
        raise click.BadParameter(f"must be positive, got {timeout:g}", param_hint="'--timeout'")
    return url


def _single_process_only(url: str, command: str) -> None:
    if url.lower().startswith("memory:"):
        raise CliError(
            f"memory:// is private to one process; {command} needs a store that other "
            "processes share (file://, redis://, postgresql://, ...)"
        )


@click.group("multilock", cls=_Multilock, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="multilock-cli", prog_name="multilock")
def cli() -> None:
    """Leader election from the shell: run a command only while this process leads,
    see who leads a group, watch leadership change."""


# ------------------------------------------------------------------ run
@cli.command(context_settings={"allow_interspersed_args": False})
@_store_options
@click.option(
    "--lease",
    type=float,
    metavar="SECONDS",
    help=f"Lease duration [default: {_DEFAULTS.lease_duration:g}, the library's].",
)
@click.option(
    "--id", "participant_id", metavar="ID", help="Participant id [default: host-pid-random]."
)
@click.option(
    "--metadata",
    "-m",
    multiple=True,
    metavar="KEY=VALUE",
    help="Published with the lease (repeatable).",
)
@click.option(
    "--grace",
    type=float,
    metavar="SECONDS",
    help="Time between SIGTERM and SIGKILL [default: lease / 5].",
)
@click.option("--forever", is_flag=True, help="Run the command again in every new term.")
@click.argument("command", nargs=-1, required=True, metavar="[--] COMMAND [ARGS]...")
def run(
    url: str | None,
    group: str,
    timeout: float,
    verbose: int,
    lease: float | None,
    participant_id: str | None,
    metadata: tuple[str, ...],
    grace: float | None,
    forever: bool,
    command: tuple[str, ...],
) -> None:
    """Wait for leadership of GROUP, then run COMMAND while leading.

    COMMAND gets MULTILOCK_TOKEN (the fencing token), MULTILOCK_GROUP and
    MULTILOCK_PARTICIPANT_ID in its environment. If leadership is at risk (renewals
    failing) or lost, COMMAND gets SIGTERM, then SIGKILL, always before the lease can pass
    to another process. When COMMAND exits, leadership is released and multilock exits
    with COMMAND's status.
    """
    url = _check_common(url, group, timeout, verbose)
    options = election_options(group, participant_id, lease, metadata)
    try:
        grace = check_grace(grace if grace is not None else default_grace(options), options)
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    _single_process_only(url, "multilock run")
    check_command(command)
    raise SystemExit(asyncio.run(run_supervised(url, options, grace, forever, timeout, command)))


# ------------------------------------------------------------------ status and watch
@cli.command()
@_store_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(url: str | None, group: str, timeout: float, verbose: int, as_json: bool) -> None:
    """Show the live leader of GROUP: id, token, metadata and age.

    Exit code 0 when a leader holds a live lease, 1 when nobody does, 2 on errors.
    """
    url = _check_common(url, group, timeout, verbose)

    async def ask() -> Any:
        provider = open_provider(url)
        try:
            return await probe(provider, group, url, timeout)
        finally:
            await close_quietly(provider)

    info = asyncio.run(ask())
    if as_json:
        click.echo(json.dumps(status_document(group, info)))
    else:
        click.echo(describe_leader(group, info))
    raise SystemExit(ExitCode.OK if info is not None else ExitCode.NO_LEADER)


@cli.command()
@_store_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per change (JSON lines).")
@click.option(
    "--poll",
    type=float,
    default=2.0,
    show_default=True,
    metavar="SECONDS",
    help="Ask the store this often when it cannot notify (and as a safety net).",
)
def watch(
    url: str | None, group: str, timeout: float, verbose: int, as_json: bool, poll: float
) -> None:
    """Follow the leader of GROUP as it changes, until Ctrl-C or SIGTERM (exit 0).

    On a terminal this is a live view; otherwise one line per change.
    """
    url = _check_common(url, group, timeout, verbose)
    if not poll > 0:
        raise click.BadParameter(f"must be positive, got {poll:g}", param_hint="'--poll'")

    async def follow() -> None:
        provider = open_provider(url)
        try:
            await probe(provider, group, url, timeout)
            await _until_signal(
                watch_group(
                    provider,
                    group,
                    shown_url=redact_url(url),
                    poll_interval=poll,
                    json_lines=as_json,
                )
            )
        finally:
            await close_quietly(provider)

    asyncio.run(follow())


# ------------------------------------------------------------------ demo
@cli.command()
@click.option(
    "--url",
    metavar="URL",
    help="The store [default: file-system leases in a fresh temp dir].",
)
@click.option("--lease", type=float, default=2.0, show_default=True, metavar="SECONDS")
@click.option(
    "--participants", type=click.IntRange(2, 50), default=3, show_default=True, metavar="N"
)
def demo(url: str | None, lease: float, participants: int) -> None:
    """Three processes elect a leader; it is SIGKILLed, then resigns; times are printed.

    Every participant's log is checked at the end: no two terms overlap, tokens rise.
    """
    from ._demo import GROUP, run_demo

    try:
        options = ElectionOptions(group=GROUP, lease_duration=lease)
    except ConfigurationError as exc:
        raise CliError(f"--lease {lease:g}: {exc}") from None
    if url is None:
        if "file" not in available_schemes():
            raise CliError(
                "the demo's default store needs multilock-filesystem "
                "(pip install multilock-filesystem), or pass --url"
            )
    else:
        _single_process_only(url, "the demo")

        async def check() -> None:
            provider = open_provider(url)
            try:
                await probe(provider, GROUP, url, DEFAULT_TIMEOUT)
            finally:
                await close_quietly(provider)

        asyncio.run(check())
    raise SystemExit(run_demo(url, options, participants))
