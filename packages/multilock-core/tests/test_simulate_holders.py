"""The deterministic simulator's semaphore and shards worlds: a fixed set of seeds keeps
every invariant, the checker catches a broken store and a broken balance, and one seed
always gives one trace.

``nox -s simulate_holders`` runs the long campaign; here a few seeds of each kind run with
every test run (about 10 s on one core). The broken store (``forgetful``) is a fixture of
conftest.py.
"""

import contextlib
import logging
import pickle
import random

import pytest

from multilock.core import _lock, _observe
from multilock.core._shards import Shards
from multilock.core.testing import (
    HoldersReport,
    SimulationFailure,
    run_holder_simulations,
    simulate_holders,
)
from multilock.core.testing._simulate_holders import main

SEMAPHORE_SEEDS = range(8)
SHARDS_SEEDS = range(6)  # seeds 2 and 4 caught get_leader coroutines dropped unawaited
STEPS = 600


#: What the participants of each kind of world do, at least once in a run.
ENDS = {"semaphore": "released", "shards": "left"}


@pytest.mark.parametrize(
    ("kind", "seed"),
    [("semaphore", seed) for seed in SEMAPHORE_SEEDS] + [("shards", seed) for seed in SHARDS_SEEDS],
)
def test_a_seed_keeps_every_invariant(kind, seed):
    report = simulate_holders(seed, steps=STEPS, kind=kind)
    assert report.steps == STEPS
    assert report.holds > 0
    assert report.outcomes.get(ENDS[kind], 0) > 0
    assert report.settled > 0  # quiet episodes after which the waiters or balance were checked


def test_a_store_that_lets_a_second_holder_into_a_slot_is_caught(forgetful):
    with pytest.raises(SimulationFailure) as caught:
        simulate_holders(
            3,
            steps=400,
            kind="semaphore",
            participants=4,
            limit=2,
            faults=0.0,
            cancel_rate=0.0,
            store=forgetful,
        )
    failure = caught.value
    assert "semaphore 's'" in failure.invariant
    assert "at once" in failure.invariant
    assert failure.seed == 3
    text = str(failure)
    assert "simulation seed 3 broke an invariant" in text
    assert (
        "replay: simulate_holders(3, steps=400, kind='semaphore', participants=4, limit=2" in text
    )
    assert "store=<the same store factory>" in text
    assert 0 < len(failure.trace) <= 200
    assert isinstance(failure, AssertionError)
    copy = pickle.loads(pickle.dumps(failure))  # survives a process pool
    assert copy.invariant == failure.invariant
    assert copy.trace == failure.trace


def test_a_store_that_lets_a_second_owner_into_a_shard_is_caught(forgetful):
    with pytest.raises(SimulationFailure) as caught:
        simulate_holders(
            3, steps=400, kind="shards", participants=3, count=6, faults=0.0, cancel_rate=0.0,
            store=forgetful,
        )  # fmt: skip
    assert "shards 'w'" in caught.value.invariant
    assert "owners at once" in caught.value.invariant


def test_shards_that_never_count_the_members_are_caught_unbalanced(monkeypatch):
    async def never_counts(self):
        return None  # every participant believes it is alone: share = count

    monkeypatch.setattr(Shards, "_count_members", never_counts)
    with pytest.raises(SimulationFailure) as caught:
        simulate_holders(
            1, steps=400, kind="shards", participants=3, count=6, faults=0.0, cancel_rate=0.0
        )
    assert caught.value.invariant.startswith("balance: shards 'w'")


async def _watch_without_cancelling(self):
    await self.held.wait_lost()  # and lets the block run on


async def _stop_nothing(elections):
    return None


@pytest.mark.parametrize(
    ("target", "broken", "expected"),
    [
        (_lock.Holding, ("_watch", _watch_without_cancelling), "it was not cancelled"),
        (_lock, ("stop_all", _stop_nothing), "every election a holder starts must stop"),
    ],
)
def test_a_semaphore_that_breaks_its_promises_is_caught(monkeypatch, target, broken, expected):
    monkeypatch.setattr(target, *broken)
    with pytest.raises(SimulationFailure) as caught:
        simulate_holders(1, steps=300, kind="semaphore", faults=1.0)
    assert expected in caught.value.invariant


def _outcome(seed, kind, steps):
    try:
        report = simulate_holders(seed, steps=steps, kind=kind, keep_trace=True)
    except SimulationFailure as failure:
        return ("failed", failure.invariant, failure.trace)
    return ("ok", report.trace_digest, report.trace)


@pytest.mark.parametrize(("kind", "seed"), [("semaphore", 5), ("shards", 0)])
def test_one_seed_gives_one_trace(kind, seed):
    first, second = _outcome(seed, kind, 400), _outcome(seed, kind, 400)
    assert len(first[2]) > 200
    assert first == second
    assert _outcome(seed + 1, kind, 400)[1:] != first[1:]


def test_a_run_leaves_the_process_as_it_found_it():
    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    logger = logging.getLogger("multilock")
    level, handlers, observers = logger.level, list(logger.handlers), _observe._observers
    for kind in ("semaphore", "shards"):
        with contextlib.suppress(SimulationFailure):
            simulate_holders(5, steps=100, kind=kind)
    assert random.random() == expected
    assert (logger.level, logger.handlers, _observe._observers) == (level, handlers, observers)


def _config(seed, **options):
    try:
        return simulate_holders(seed, **options).config
    except SimulationFailure as failure:  # the config is the point here
        return failure.config


def test_options_left_unset_come_from_the_seed():
    drawn = _config(11, steps=5, kind="semaphore")
    assert 2 <= drawn.participants <= 6
    assert 1 <= drawn.limit <= 3
    assert drawn.count is None
    assert 1.0 <= drawn.lease_duration <= 2.0
    chosen = _config(11, steps=5, participants=2, limit=5, faults=0.5)
    assert (chosen.participants, chosen.limit, chosen.faults) == (2, 5, 0.5)
    assert chosen.lease_duration == drawn.lease_duration  # the others stay the seed's
    shards = _config(11, steps=5, kind="shards")
    assert 2 <= shards.participants <= 5
    assert 2 <= shards.count <= 12
    assert shards.limit is None
    with pytest.raises(ValueError, match="count is for kind='shards'"):
        simulate_holders(1, steps=1, kind="semaphore", count=3)
    with pytest.raises(ValueError, match="limit is for kind='semaphore'"):
        simulate_holders(1, steps=1, kind="shards", limit=3)
    with pytest.raises(ValueError, match="kind"):
        simulate_holders(1, steps=1, kind="lock")


def test_the_report_counts_what_happened():
    report = simulate_holders(2, steps=150, kind="semaphore", faults=1.0, cancel_rate=0.5)
    assert isinstance(report, HoldersReport)
    assert report.cancellations > 0
    assert report.faults
    assert report.terms >= report.holds > 0
    assert report.virtual_seconds > 10
    assert all(group.startswith("s.slot-") for group in report.tokens)
    assert report.trace == ()  # only with keep_trace=True
    assert len(report.trace_digest) == 64


def test_run_holder_simulations_prints_a_line_per_run_and_a_summary():
    lines = []
    failures = run_holder_simulations([1, 2], steps=20, out=lines.append)
    assert failures == []
    assert lines[0].startswith("semaphore seed 1: ok, 20 steps")
    assert lines[1].startswith("shards seed 1: ok, 20 steps")
    assert lines[-1].startswith("simulated 80 steps of semaphore, shards over 2 seeds (1..2)")
    assert "every invariant held" in lines[-1]


def test_main_runs_a_campaign(capsys):
    assert main(["--seeds", "4,5", "--steps", "10", "--kind", "shards", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "shards seed 4: ok" in out
    assert "every invariant held" in out
