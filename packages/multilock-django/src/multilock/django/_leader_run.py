"""``manage.py leader_run``: run another management command only while this replica leads.

::

    python manage.py leader_run GROUP [--every SECONDS | --forever]
                                      [--lease-duration SECONDS] -- COMMAND [ARGS...]

Every replica runs the same line; the one that leads GROUP runs COMMAND (through
``call_command``), the others wait, and one of them takes over when the leader stops or
dies. Without ``--every``/``--forever`` each replica runs COMMAND once, in its own term,
then releases the group and exits: a lock around a one-off job (migrations at start-up).

Threads: COMMAND runs in a worker thread, so that the main thread stays free for the
SIGTERM/SIGINT handler (`multilock.core.sync.stop_on_signals`), which stops the election
(telling COMMAND through its `Leadership`), waits for COMMAND to return (at most until
the term's deadline), releases the group, and exits with 128 + the signal number.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from django.core.exceptions import ImproperlyConfigured  # type: ignore[import-untyped]
from django.core.management import call_command, get_commands, load_command_class  # type: ignore[import-untyped]
from django.core.management.base import (  # type: ignore[import-untyped]
    BaseCommand,
    CommandError,
    CommandParser,
)
from django.db import connections  # type: ignore[import-untyped]

from multilock.core import ConfigurationError, ElectionState, Leadership, MultilockError, RunStatus
from multilock.core.sync import LeaderElection, stop_on_signals

from ._current import leading
from ._settings import multilock_settings

__all__ = ["LeaderRunCommand"]

log = logging.getLogger(__name__)


class _Parser(CommandParser):  # type: ignore[misc]
    """Split the arguments at the first ``--``: what follows is COMMAND's, untouched.

    argparse alone cannot take options of ``leader_run`` after GROUP and still leave
    everything after ``--`` to COMMAND. Both ``manage.py`` and ``call_command`` parse with
    ``parse_args``, so this works for both.
    """

    def parse_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        words = list(args) if args is not None else []
        tail: list[str] = []
        if "--" in words:
            cut = words.index("--")
            words, tail = words[:cut], words[cut + 1 :]
        parsed: argparse.Namespace = super().parse_args(words, namespace)
        parsed.command = [*parsed.command, *tail]
        return parsed


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return value


def _check_command(name: str, args: Sequence[str]) -> None:
    """Refuse an unknown COMMAND or arguments it rejects now, not once elected."""
    app = get_commands().get(name)
    if app is None:
        raise CommandError(f"leader_run: unknown command {name!r}")
    command = app if isinstance(app, BaseCommand) else load_command_class(app, name)
    try:
        command.create_parser("manage.py", name).parse_args(list(args))
    except CommandError as exc:
        raise CommandError(f"leader_run: {name}: {exc}") from None


def _signals_stop_elections() -> AbstractContextManager[object]:
    """SIGTERM/SIGINT stop the elections (releasing the group) and exit with 128 + signum.

    Only in the main thread, where Python runs signal handlers: not when ``call_command``
    runs ``leader_run`` from another thread.
    """
    if threading.current_thread() is threading.main_thread():
        return stop_on_signals()
    return contextlib.nullcontext()


def _stopped(election: LeaderElection) -> bool:
    return election.closed or election.state in (ElectionState.STOPPING, ElectionState.STOPPED)


def _in_worker_thread(fn: Callable[[], None]) -> None:
    """Call *fn* in a daemon thread and wait; re-raise what it raised.

    The wait (``join``) lets signal handlers run in this thread meanwhile.
    """
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=target, name="multilock-leader-run", daemon=True)
    thread.start()
    thread.join()
    if raised:
        raise raised[0]


class _Run:
    """One ``leader_run``: campaign, run COMMAND in each term as asked, report."""

    def __init__(
        self,
        election: LeaderElection,
        command: str,
        args: Sequence[str],
        every: float | None,
        say: Callable[[str], None],
    ) -> None:
        self.election = election
        self.command = command
        self.args = list(args)
        self.every = every
        self.say = say

    def campaign(self) -> None:
        """Win terms and run COMMAND in them until done (once) or stopped (repeating)."""
        election = self.election
        self.say(f"campaigning for {election.group!r} as {election.participant_id}")
        while True:
            try:
                election.wait_until_leader()
                result = election.run_if_leader(self.term)
            except MultilockError:
                if _stopped(election):
                    return
                raise
            if _stopped(election) or result.status is RunStatus.COMPLETED:
                return
            if result.status is RunStatus.LOST:
                if self.every is None:
                    raise CommandError(
                        f"leader_run: the leadership of {election.group!r} ended before "
                        f"{self.command!r} returned; it may not have finished, and it is not "
                        "run again"
                    )
                self.say(f"the term of {election.group!r} ended; campaigning again")

    def term(self, leadership: Leadership) -> None:
        """Run COMMAND in *leadership*'s term: once, or on schedule until the term ends."""
        self.say(f"leading {leadership.group!r} with token {leadership.token}")
        with leading(leadership):
            while True:
                started = time.monotonic()
                self.run_once()
                if self.every is None:
                    return
                # Start to start; a run longer than the interval is followed at once.
                delay = max(0.0, started + self.every - time.monotonic())
                if leadership.lost.wait(delay):
                    return

    def run_once(self) -> None:
        log.debug("running %s %s", self.command, self.args)
        try:
            call_command(self.command, *self.args)
        finally:
            # This thread's database connections: each run starts with fresh ones, as
            # ``manage.py`` would, instead of reusing one idle since the last run.
            connections.close_all()


class LeaderRunCommand(BaseCommand):  # type: ignore[misc]
    help = (
        "Run a management command only while this replica leads GROUP. Every replica runs "
        "the same line; the leader runs the command, the others wait and take over when it "
        "stops or dies. Once by default (each replica in turn: a lock); --every SECONDS "
        "repeats it on the leader, --forever reruns it whenever it returns. SIGTERM/SIGINT "
        "stop the election, release the group and exit with 128 + the signal number. The "
        "command learns that the term ended through multilock.django.current_leadership()."
    )

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.__class__ = _Parser  # adds behaviour only: see _Parser
        return parser

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "group", help="the group to lead (MULTILOCK['GROUP_PREFIX'] is put in front)"
        )
        parser.add_argument(
            "command",
            nargs="*",
            metavar="-- COMMAND [ARGS]",
            help="the management command to run while leading, and its arguments, after --",
        )
        repeat = parser.add_mutually_exclusive_group()
        repeat.add_argument(
            "--every",
            type=_seconds,
            metavar="SECONDS",
            help="while leading, start the command every SECONDS (start to start; a late "
            "run is followed at once, missed starts are not made up); a new leader runs it "
            "at once",
        )
        repeat.add_argument(
            "--forever",
            action="store_true",
            help="while leading, run the command again each time it returns",
        )
        parser.add_argument(
            "--lease-duration",
            type=_seconds,
            metavar="SECONDS",
            help="the lease, overriding MULTILOCK['OPTIONS']['lease_duration'] (default 15)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not options["command"]:
            raise CommandError(
                "leader_run: name the command to run after --, "
                "e.g. manage.py leader_run reports -- clearsessions"
            )
        name, *command_args = options["command"]
        _check_command(name, command_args)
        try:
            config = multilock_settings()
        except ImproperlyConfigured as exc:
            raise CommandError(f"leader_run: {exc}") from None
        overrides = {}
        if options["lease_duration"] is not None:
            overrides["lease_duration"] = options["lease_duration"]
        try:
            election_options = config.election_options(options["group"], **overrides)
            election = LeaderElection(config.url, election_options)
        except ConfigurationError as exc:
            raise CommandError(f"leader_run: {exc}") from None

        every = 0.0 if options["forever"] else options["every"]
        verbose = options["verbosity"] >= 1

        def say(text: str) -> None:
            log.info("%s", text)
            if verbose:
                self.stderr.write(f"leader_run: {text}")

        run = _Run(election, name, command_args, every, say)
        with _signals_stop_elections(), election:  # the election releases and closes on exit
            _in_worker_thread(run.campaign)
