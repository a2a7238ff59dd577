"""Tests of `multilock.celery.LeaderScheduler`, calling its ``tick`` directly.

Elections run in virtual time: each test's `FakeClock` drives one event loop thread
(through the scheduler's `create_election` hook) and judges expiry in an
`InMemoryProvider`, so a follower's tick, which waits for a term, returns at once. The
Celery app publishes to the in-memory broker (``memory://``); what beat sends is seen
through celery's ``after_task_publish`` signal. Entries are made due without waiting by
giving them a ``last_run_at`` an hour ago.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery  # type: ignore[import-untyped]
from celery.signals import after_task_publish  # type: ignore[import-untyped]

from multilock.celery import DEFAULT_GROUP, LeaderScheduler
from multilock.core import ConfigurationError, ElectionOptions, InMemoryProvider, Provider
from multilock.core.sync import LeaderElection
from multilock.core.testing import FakeClock

pytestmark = pytest.mark.timeout(30)

#: Virtual seconds.
LEASE = 15.0
#: Seconds between two runs of the test entry (wall time, as beat judges it).
EVERY = 10.0

Make = Callable[..., LeaderScheduler]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(real_grace=0.001)


@pytest.fixture
def store(clock: FakeClock) -> InMemoryProvider:
    return InMemoryProvider(clock=clock.monotonic)


@pytest.fixture
def task_name() -> str:
    return f"tests.tick-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def sent(task_name: str) -> Iterator[list[str]]:
    """The names of the tasks this test's schedulers published, in order."""
    published: list[str] = []

    def record(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if sender == task_name:
            published.append(sender)

    after_task_publish.connect(record, weak=False)
    yield published
    after_task_publish.disconnect(record)


def make_app(store: Provider | str | None, task_name: str, **conf: Any) -> Celery:
    app = Celery("multilock-celery-tests", broker="memory://", set_as_current=False)

    def tick() -> None:
        """The task beat sends; never run here."""

    app.task(name=task_name, shared=False)(tick)
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    settings: dict[str, Any] = {
        "multilock_url": store,
        "multilock_group": "beat",
        "multilock_options": {"lease_duration": LEASE},
        "beat_schedule": {
            "tick": {"task": task_name, "schedule": EVERY, "last_run_at": hour_ago},
        },
    }
    settings.update(conf)
    app.conf.update({k: v for k, v in settings.items() if v is not None})
    return app


@pytest.fixture
def make(
    clock: FakeClock, store: InMemoryProvider, task_name: str, tmp_path: Path
) -> Iterator[Make]:
    made: list[LeaderScheduler] = []

    class Scheduler(LeaderScheduler):
        def create_election(
            self, target: str | Provider, options: ElectionOptions
        ) -> LeaderElection:
            return LeaderElection(target, options, loop_factory=clock.new_event_loop)

    def make(name: str, *, lazy: bool = False, **conf: Any) -> LeaderScheduler:
        conf.setdefault("multilock_options", {"lease_duration": LEASE, "participant_id": name})
        app = make_app(store, task_name, **conf)
        scheduler = Scheduler(app, schedule_filename=str(tmp_path / f"{name}.db"), lazy=lazy)
        made.append(scheduler)
        return scheduler

    yield make
    for scheduler in reversed(made):
        scheduler.close()


def leader_now(scheduler: LeaderScheduler) -> None:
    election = scheduler.election
    assert election is not None
    election.wait_until_leader(timeout=LEASE)


# ---------------------------------------------------------------------- sending
def test_a_follower_sends_nothing_and_waits_no_longer_than_the_retry_interval(
    make: Make, sent: list[str], clock: FakeClock
) -> None:
    a = make("a", multilock_reset_on_acquire=False)
    leader_now(a)
    b = make("b", multilock_reset_on_acquire=False)
    waits = []
    for _ in range(3):
        # Each tick timed alone: between ticks the loop thread is idle, and the clock
        # (real_grace) moves on to its next timer, by as much as a machine under load
        # takes to call the next tick.
        before = clock.now
        assert b.tick() == 0.0
        waits.append(clock.now - before)
    election = b.election
    assert election is not None
    assert not election.is_leader
    # Each tick waited for a term, at most one (jittered) retry interval.
    assert all(0 < w <= election.options.retry_interval + 0.05 for w in waits), waits
    assert sent == []


def test_the_leader_delegates_to_celery_and_sends_each_due_entry_once(
    make: Make, sent: list[str], task_name: str
) -> None:
    a = make("a", multilock_reset_on_acquire=False)
    leader_now(a)
    assert a.tick() == 0  # the entry was due: sent, and beat asks to be called again
    assert sent == [task_name]
    # Not due again for EVERY seconds: celery's tick says so and sends nothing.
    assert 0 < a.tick() <= EVERY
    assert sent == [task_name]


def test_reset_on_acquire_restarts_the_schedule_from_the_start_of_the_term(
    make: Make, sent: list[str]
) -> None:
    a = make("a")  # multilock_reset_on_acquire defaults to True
    leader_now(a)
    entry = a.schedule["tick"]
    before = datetime.now(UTC)
    delay = a.tick()
    assert sent == []  # due since an hour ago by this replica's file, yet not sent
    assert EVERY - 1 < delay <= EVERY
    assert entry.last_run_at >= before


def test_a_graceful_handoff_is_at_once_and_the_new_leader_does_not_resend(
    make: Make, sent: list[str], task_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="multilock.celery")
    a = make("a", multilock_reset_on_acquire=False)
    leader_now(a)
    assert a.tick() == 0
    assert sent == [task_name]
    b = make("b")
    assert b.tick() == 0.0  # a follower
    a.close()  # releases the lease
    assert a.election is None
    a.close()  # beat closes twice on SIGTERM
    delay = b.tick()  # wakes at once as leader, restarts its schedule, sends nothing yet
    election = b.election
    assert election is not None
    assert election.is_leader
    assert sent == [task_name]
    assert EVERY - 1 < delay <= EVERY
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("multilock.celery")]
    assert any(m.startswith("ACQUIRED: beat leads group beat (token 1)") for m in messages)
    assert any(m.startswith("LOST: beat no longer leads group beat (token 1") for m in messages)
    assert any(m.startswith("ACQUIRED: beat leads group beat (token 2)") for m in messages)


def test_without_reset_a_new_leader_sends_what_its_own_file_says_is_due(
    make: Make, sent: list[str], task_name: str
) -> None:
    # The documented cost of multilock_reset_on_acquire=False: b's file has never
    # recorded a send, so the entry a has just sent is due again for b.
    a = make("a", multilock_reset_on_acquire=False)
    leader_now(a)
    assert a.tick() == 0
    b = make("b", multilock_reset_on_acquire=False)
    a.close()
    assert b.tick() == 0
    assert sent == [task_name, task_name]


def test_a_leader_that_loses_its_term_stops_sending(
    make: Make, sent: list[str], store: InMemoryProvider
) -> None:
    a = make("a", multilock_reset_on_acquire=False)
    leader_now(a)
    b = make("b", multilock_reset_on_acquire=False)
    election = a.election
    assert election is not None
    election.resign()  # the term ends (as when renewals fail); the entry is still due
    assert not election.is_leader
    leader_now(b)
    assert a.tick() == 0.0
    assert sent == []


def test_after_close_tick_sends_nothing(make: Make, sent: list[str]) -> None:
    a = make("a", multilock_reset_on_acquire=False)
    leader_now(a)
    a.close()
    assert a.tick() == a.max_interval
    assert sent == []


def test_lazy_schedulers_do_not_campaign(make: Make) -> None:
    lazy = make("a", lazy=True)
    assert lazy.election is None
    assert "leader election -> group beat on" in lazy.info
    lazy.close()


# ---------------------------------------------------------------------- configuration
def lazy_scheduler(tmp_path: Path, store: Provider | str | None, **conf: Any) -> LeaderScheduler:
    app = make_app(store, "tests.tick", **conf)
    return LeaderScheduler(app, schedule_filename=str(tmp_path / "beat.db"), lazy=True)


def test_defaults(tmp_path: Path, store: InMemoryProvider) -> None:
    app = Celery("defaults", broker="memory://", set_as_current=False)
    app.conf.multilock_url = "redis://user:secret@localhost:6379/0"
    scheduler = LeaderScheduler(app, schedule_filename=str(tmp_path / "beat.db"), lazy=True)
    assert f"group {DEFAULT_GROUP} on redis://user:***@localhost:6379/0" in scheduler.info
    assert "secret" not in scheduler.info


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"multilock_url": None}, "needs the Celery setting multilock_url"),
        ({"multilock_url": ""}, "needs the Celery setting multilock_url"),
        ({"multilock_url": 6379}, "multilock_url must be a URL (str) or a multilock Provider"),
        ({"multilock_options": [("lease_duration", 5)]}, "multilock_options must be a dict"),
        ({"multilock_options": {"lease": 5}}, "unknown election option(s) lease"),
        ({"multilock_options": {"group": "x"}}, "set the group with the Celery setting"),
        ({"multilock_options": {"lease_duration": 1, "renew_interval": 1}}, "renew_interval"),
        ({"multilock_group": "a/b"}, "multilock_group/multilock_options: group"),
        ({"multilock_reset_on_acquire": "yes"}, "multilock_reset_on_acquire must be True"),
    ],
)
def test_configuration_errors_name_the_setting(
    tmp_path: Path, store: InMemoryProvider, conf: dict[str, Any], message: str
) -> None:
    target = conf.pop("multilock_url", store)
    if target is None or target == "":
        app = make_app(None, "tests.tick", **conf)
        if target == "":
            app.conf.multilock_url = ""
        with pytest.raises(ConfigurationError) as raised:
            LeaderScheduler(app, schedule_filename=str(tmp_path / "beat.db"), lazy=True)
    else:
        with pytest.raises(ConfigurationError) as raised:
            lazy_scheduler(tmp_path, target, **conf)
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_a_bad_url_fails_at_setup(tmp_path: Path) -> None:
    app = make_app("nosuchscheme://x", "tests.tick")
    with pytest.raises(ConfigurationError):
        LeaderScheduler(app, schedule_filename=str(tmp_path / "beat.db"))
