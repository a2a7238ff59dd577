"""``leader_run`` in this process on a ``memory://`` store: arguments, runs, errors, release."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test.utils import override_settings

from multilock.core import LeaderInfo, from_url
from multilock.core.sync import LeaderElection
from multilock.django import _leader_run


def leader_run(*args: str, **options: Any) -> None:
    call_command("leader_run", *args, verbosity=0, **options)


def leader_of(url: str, group: str) -> str | None:
    """Who holds *group* per the store (asked directly: an election would campaign)."""

    async def ask() -> LeaderInfo | None:
        async with from_url(url) as provider:
            return await provider.get_leader(group)

    info = asyncio.run(ask())
    return None if info is None else info.participant_id


def test_runs_the_command_once_as_leader_then_releases(store_url: str, probe: Any) -> None:
    leader_run("reports", "--", "probe", "hello")
    assert len(probe.RUNS) == 1
    token, thread, word = probe.RUNS[0]
    assert token is not None  # current_leadership() inside the command
    assert token >= 1
    assert thread == "multilock-leader-run"  # not the main thread: it stays free for signals
    assert word == "hello"  # the command's own arguments reached it
    assert leader_of(store_url, "reports") is None  # released on completion


def test_tokens_rise_from_run_to_run(store_url: str, probe: Any) -> None:
    leader_run("reports", "--", "probe")
    leader_run("reports", "--", "probe")
    assert probe.RUNS[1][0] > probe.RUNS[0][0]


def test_group_prefix_and_options(probe: Any) -> None:
    url = "memory://prefixed-test"
    with override_settings(MULTILOCK={"URL": url, "GROUP_PREFIX": "site."}):
        seen: list[tuple[str, float]] = []
        probe.HOOK.append(lambda lead: seen.append((lead.group, lead.time_left)))
        leader_run("reports", "--lease-duration", "4", "--", "probe")
    [(group, time_left)] = seen
    assert group == "site.reports"
    assert 2 < time_left < 4  # the lease given on the command line


def test_forever_reruns_in_one_term_until_the_command_fails(store_url: str, probe: Any) -> None:
    with pytest.raises(CommandError, match="probe failed at run 3"):
        leader_run("reports", "--forever", "--", "probe", "--fail-at", "3")
    assert len(probe.RUNS) == 3
    assert len({token for token, _, _ in probe.RUNS}) == 1  # one term
    assert leader_of(store_url, "reports") is None  # released after the failure


def test_options_may_follow_the_group(store_url: str, probe: Any) -> None:
    # --every after GROUP, and a "--" inside the command's own arguments.
    with pytest.raises(CommandError, match="probe failed at run 2"):
        leader_run("reports", "--every", "0.001", "--", "probe", "--fail-at", "2", "--", "w")
    assert [word for _, _, word in probe.RUNS] == ["w", "w"]


def test_loss_during_a_once_run_is_an_error(
    store_url: str, probe: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    elections: list[LeaderElection] = []

    class Recorded(LeaderElection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            elections.append(self)

    monkeypatch.setattr(_leader_run, "LeaderElection", Recorded)
    # The command waits for its term to end; another thread makes it resign meanwhile.
    probe.HOOK.append(lambda leadership: threading.Thread(target=elections[0].resign).start())
    with pytest.raises(CommandError, match="ended before 'probe' returned"):
        leader_run("reports", "--", "probe", "--until-lost")
    assert len(probe.RUNS) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["reports"], "name the command to run after --"),
        (["reports", "--"], "name the command to run after --"),
        (["reports", "--", "no_such_command"], "unknown command 'no_such_command'"),
        (["reports", "--", "probe", "--bogus"], "probe: Error: unrecognized arguments: --bogus"),
        (["reports", "--every", "0", "--", "probe"], "must be a positive number of seconds"),
        (["reports", "--every", "soon", "--", "probe"], "not a number of seconds"),
        (["reports", "--lease-duration", "-1", "--", "probe"], "positive number of seconds"),
        (["reports", "--every", "1", "--forever", "--", "probe"], "not allowed with"),
        (["bad group", "--", "probe"], "group 'bad group' is invalid"),
        (["reports", "--lease-duration", "1", "--", "probe"], None),  # fine: 1 s is allowed
    ],
)
def test_argument_errors_come_before_campaigning(
    store_url: str, probe: Any, args: list[str], message: str | None
) -> None:
    if message is None:
        leader_run(*args)
        assert len(probe.RUNS) == 1
        return
    with pytest.raises(CommandError) as caught:
        leader_run(*args)
    assert message in str(caught.value)
    assert probe.RUNS == []


def test_lease_override_that_breaks_the_options(probe: Any) -> None:
    options = {"lease_duration": 30, "renew_interval": 10}
    with (
        override_settings(MULTILOCK={"URL": "memory://", "OPTIONS": options}),
        pytest.raises(CommandError, match="renew_interval is too long for lease_duration"),
    ):
        leader_run("reports", "--lease-duration", "5", "--", "probe")
    assert probe.RUNS == []


def test_settings_errors_are_command_errors(probe: Any) -> None:
    with (
        override_settings(MULTILOCK={"URL": "nosuch://host"}),
        pytest.raises(CommandError, match=r"leader_run: MULTILOCK.*'nosuch'"),
    ):
        leader_run("reports", "--", "probe")


def test_sigterm_stops_releases_and_exits_143(store_url: str, probe: Any) -> None:
    # leader_run runs in pytest's main thread here, so it handles signals; the command
    # (in its worker thread) sends SIGTERM to this process, then waits for its term to end.
    probe.HOOK.append(lambda leadership: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as caught:
        leader_run("reports", "--every", "60", "--", "probe", "--until-lost")
    assert caught.value.code == 128 + signal.SIGTERM
    assert len(probe.RUNS) == 1  # and it returned: the term ended (lost was set)
    assert leader_of(store_url, "reports") is None  # released
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
