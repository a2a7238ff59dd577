"""``multilock run`` behind its options: the election, the store probe, the signals."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence
from typing import Any

from multilock.core import (
    ConfigurationError,
    ElectionOptions,
    LeaderElection,
    MultilockError,
    Provider,
    validate_metadata,
    validate_name,
)

from ._child import check_command, spawn_process
from ._common import CliError, close_quietly, open_provider, parse_metadata, probe
from ._supervisor import Supervisor, default_grace
from ._watchdog import Watchdog

__all__ = ["election_options", "run_command", "run_supervised"]

log = logging.getLogger("multilock.cli")


def election_options(
    group: str, participant_id: str | None, lease: float | None, metadata: Sequence[str]
) -> ElectionOptions:
    """The options of ``run``, each error naming the option it came from."""
    fields: dict[str, Any] = {"group": group}
    try:
        if participant_id is not None:
            fields["participant_id"] = validate_name(participant_id, "--id")
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    try:
        fields["metadata"] = validate_metadata(parse_metadata(metadata))
    except ConfigurationError as exc:
        raise CliError(f"--metadata: {exc}") from None
    if lease is not None:
        fields["lease_duration"] = lease
    try:
        return ElectionOptions(**fields)
    except ConfigurationError as exc:
        raise CliError(f"--lease: {exc}") from None


async def run_supervised(
    url: str,
    options: ElectionOptions,
    grace: float,
    forever: bool,
    probe_timeout: float,
    command: Sequence[str],
) -> int:
    """Build the election, probe the store, then supervise *command* until it is done."""
    provider = open_provider(url)
    try:
        try:
            election = LeaderElection(provider, options)
        except ConfigurationError as exc:
            raise CliError(str(exc), url=url) from None
        await probe(provider, options.group, url, probe_timeout)
        async with Watchdog() as watchdog:
            supervisor = Supervisor(
                election,
                lambda env: spawn_process(command, env, watchdog),
                grace=grace,
                forever=forever,
                guard=watchdog,
            )
            return await _supervise(supervisor, options.group, options.participant_id)
    finally:
        await close_quietly(provider)


async def run_command(
    provider: Provider,
    argv: Sequence[str],
    *,
    grace: float | None = None,
    forever: bool = False,
    **election_options: Any,
) -> int:
    """Run *argv* as a subprocess only while leading, as ``multilock run`` does, from Python.

    For leader work that must never overlap the next leader's, even when this process
    cannot be scheduled (a blocked event loop, a stall, SIGSTOP): the command runs in its
    own process group, and a watchdog process kills that group at the term's deadline
    unless a renew extended it. Campaign with *election_options* (``group=...``,
    ``lease_duration=...``), wait for a term, run the command with ``MULTILOCK_TOKEN``,
    ``MULTILOCK_GROUP`` and ``MULTILOCK_PARTICIPANT_ID`` in its environment, release when
    it exits, and return its exit status (128 + N for a signal N). With *forever*, run it
    again in each new term until cancelled. *grace* (default a fifth of the lease) is the
    time between SIGTERM and SIGKILL when renewals fail. The provider stays open.
    """
    if not isinstance(provider, Provider):
        raise ConfigurationError(
            f"provider must be a multilock Provider, not {type(provider).__name__}"
        )
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigurationError(
            "argv must be a non-empty sequence of strings, like ['job', '--flag']"
        )
    try:
        check_command(argv)
    except CliError as exc:
        raise ConfigurationError(exc.message) from None
    election = LeaderElection(provider, **election_options)
    if grace is None:
        grace = default_grace(election.options)
    async with Watchdog() as watchdog:
        supervisor = Supervisor(
            election,
            lambda env: spawn_process(argv, env, watchdog),
            grace=grace,
            forever=forever,
            guard=watchdog,
        )
        try:
            return await supervisor.run()
        except CliError as exc:  # the command could not be started
            raise MultilockError(exc.message) from None


async def _supervise(supervisor: Supervisor, group: str, participant_id: str) -> int:
    """Run *supervisor* with this process's signals routed to it."""
    loop = asyncio.get_running_loop()

    def hangup() -> None:  # passed on to a running command; otherwise it stops multilock
        if not supervisor.forward(signal.SIGHUP):
            supervisor.request_stop(signal.SIGHUP)

    handlers: dict[int, Callable[[], object]] = {
        signal.SIGINT: lambda: supervisor.request_stop(signal.SIGINT),
        signal.SIGTERM: lambda: supervisor.request_stop(signal.SIGTERM),
        signal.SIGHUP: hangup,
        signal.SIGUSR1: lambda: supervisor.forward(signal.SIGUSR1),
        signal.SIGUSR2: lambda: supervisor.forward(signal.SIGUSR2),
    }
    for signum, handler in handlers.items():
        loop.add_signal_handler(signum, handler)
    try:
        log.info("campaigning for %s as %s", group, participant_id)
        return await supervisor.run()
    finally:
        for signum in handlers:
            loop.remove_signal_handler(signum)
