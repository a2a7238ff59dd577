"""`leader_only`: a function called only while this process leads its group."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test.utils import override_settings

from multilock.core import ConfigurationError, Leadership, RunStatus
from multilock.core.sync import LeaderElection
from multilock.django import close_elections, current_leadership, leader_only


@pytest.fixture(autouse=True)
def fresh_elections() -> Iterator[None]:
    close_elections()
    yield
    close_elections()


def test_runs_only_while_leading(store_url: str) -> None:
    calls: list[Leadership | None] = []

    @leader_only("cleanup")
    def cleanup(day: str, *, dry_run: bool = False) -> str:
        calls.append(current_leadership())
        return f"{day} {dry_run}"

    # Another participant leads: the function is not called.
    with LeaderElection(store_url, group="cleanup") as other:
        other.wait_until_leader(timeout=5)
        cleanup.start()
        assert cleanup("monday").status is RunStatus.NOT_LEADER
        assert calls == []
    # It released on exit; this process takes over and calls it.
    leadership = cleanup.election.wait_until_leader(timeout=5)
    result = cleanup("tuesday", dry_run=True)
    assert (result.status, result.value) == (RunStatus.COMPLETED, "tuesday True")
    assert calls == [leadership]
    assert cleanup.__name__ == "cleanup"
    assert current_leadership() is None  # only inside the call


def test_one_election_per_group_and_prefix() -> None:
    with override_settings(MULTILOCK={"URL": "memory://", "GROUP_PREFIX": "site."}):

        @leader_only("jobs")
        def first() -> None: ...

        @leader_only("jobs")
        def second() -> None: ...

        assert first.election is second.election
        assert first.election.group == "site.jobs"


def test_close_elections_releases(store_url: str) -> None:
    @leader_only("solo")
    def solo() -> int:
        return 1

    solo.election.wait_until_leader(timeout=5)
    assert solo().value == 1
    election = solo.election
    close_elections()
    assert election.closed
    assert solo.election is not election  # a later use starts a new one


def test_lost_during_the_call(store_url: str) -> None:
    @leader_only("short")
    def short() -> None:
        leadership = current_leadership()
        assert leadership is not None
        # Another thread resigns (stop() or resign() wait for this call to return).
        threading.Thread(target=short.election.resign).start()
        leadership.lost.wait(5)
        leadership.check()  # raises LeadershipLost: the call ends as LOST

    short.election.wait_until_leader(timeout=5)
    assert short().status is RunStatus.LOST


def test_bad_group_and_settings() -> None:
    with pytest.raises(ConfigurationError, match="'no spaces' is invalid"):
        leader_only("no spaces")
    with override_settings(MULTILOCK={"URL": "nosuch://"}):

        @leader_only("g")
        def job() -> None: ...

        with pytest.raises(ImproperlyConfigured, match="nosuch"):
            job()
