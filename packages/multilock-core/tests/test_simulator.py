"""The deterministic simulator: a fixed set of seeds keeps every invariant, it catches a
broken store, and one seed always gives one trace.

``nox -s simulate`` runs the long campaign (millions of steps); here 100 seeds of 2000
steps (200,000 steps, about 20 s on one core) run with every test run. The broken store
(``forgetful``) is a fixture of conftest.py.
"""

import logging
import pickle
import random

import pytest

from multilock.core.testing import (
    SimulationFailure,
    SimulationReport,
    run_simulations,
    simulate,
)

SEEDS = range(100)
STEPS = 2000


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seed_keeps_every_invariant(seed):
    report = simulate(seed, steps=STEPS)
    assert report.steps == STEPS
    assert report.terms > 0
    assert sum(report.calls.values()) > STEPS / 2


def test_a_store_that_lets_a_second_participant_in_is_caught(forgetful):
    with pytest.raises(SimulationFailure) as caught:
        simulate(7, steps=500, elections=3, faults=0.0, cancel_rate=0.0, store=forgetful)
    failure = caught.value
    assert "leaders in group0 at once" in failure.invariant
    assert failure.seed == 7
    assert failure.step <= 500
    text = str(failure)
    assert "simulation seed 7 broke an invariant" in text
    assert "replay: simulate(7, steps=500, elections=3" in text
    assert 0 < len(failure.trace) <= 200
    assert "ACQUIRED token" in "\n".join(failure.trace)
    assert failure.trace[-1].split()[-1] != ""  # lines: time, who, what
    assert isinstance(failure, AssertionError)
    copy = pickle.loads(pickle.dumps(failure))  # survives a process pool
    assert copy.invariant == failure.invariant
    assert copy.trace == failure.trace


def _outcome(seed, steps):
    try:
        report = simulate(seed, steps=steps, keep_trace=True)
    except SimulationFailure as failure:
        return ("failed", failure.invariant, failure.trace)
    return ("ok", report.trace_digest, report.trace)


@pytest.mark.parametrize("seed", [3, 41])
def test_one_seed_gives_one_trace(seed):
    first, second = _outcome(seed, 1500), _outcome(seed, 1500)
    assert first[0] == "ok"
    assert len(first[2]) > 1500
    assert first == second
    assert _outcome(seed + 1, 1500)[1] != first[1]


def test_a_run_leaves_the_process_as_it_found_it():
    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    level = logging.getLogger("multilock").level
    simulate(5, steps=300)
    assert random.random() == expected
    assert logging.getLogger("multilock").level == level


def test_options_left_unset_come_from_the_seed():
    drawn = simulate(11, steps=10).config
    assert 2 <= drawn.elections <= 5
    assert 1 <= drawn.groups <= 2
    assert 1.0 <= drawn.lease_duration <= 2.0
    chosen = simulate(11, steps=10, elections=2, groups=1, faults=0.5, shared_ids=True).config
    assert (chosen.elections, chosen.groups, chosen.faults, chosen.shared_ids) == (2, 1, 0.5, True)
    assert chosen.lease_duration == drawn.lease_duration  # the others stay the seed's
    with pytest.raises(ValueError, match="groups"):
        simulate(1, steps=1, elections=2, groups=3)


def test_run_simulations_prints_a_line_per_seed_and_a_summary():
    lines = []
    failures = run_simulations([1, 2], steps=100, out=lines.append)
    assert failures == []
    assert lines[0].startswith("seed 1: ok, 100 steps")
    assert lines[-1].startswith("simulated 200 steps over 2 seeds (1..2)")
    assert "every invariant held" in lines[-1]


def test_the_report_counts_what_happened():
    report = simulate(2, steps=800, faults=1.0, cancel_rate=0.5)
    assert isinstance(report, SimulationReport)
    assert report.cancellations > 0
    assert report.faults
    assert report.virtual_seconds > 10
    assert all(token >= 1 for token in report.tokens.values())
    assert report.trace == ()  # only with keep_trace=True
    assert len(report.trace_digest) == 64
