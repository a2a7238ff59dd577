"""Redlock's listener passes each event on once, when a majority of the nodes reported it."""

from __future__ import annotations

import random

import pytest

from multilock.redis._quorum import PENDING, OncePerEvent


def deliver(seed: int, nodes: int, down: frozenset[int] = frozenset(), short: float = 0.3) -> None:
    """Events of two groups, some on every node, some (attempts that fell short, and
    their undo) on fewer than a majority; every node's copies in order, the nodes
    interleaved at random within a few events. An event on every node notifies once, at
    the copy that shows it on a majority of them; one short of a majority never does."""
    rng = random.Random(seed)
    quorum = nodes // 2 + 1
    events: list[tuple[str, str, str, frozenset[int]]] = []
    for n in range(60):
        group, attempt = rng.choice("gh"), f"a{n}"
        if rng.random() < short:  # fell short: granted by a minority, which then undoes it
            on = frozenset(rng.sample(range(nodes), rng.randint(1, quorum - 1)))
            events += [(group, "acquired", attempt, on), (group, "released", attempt, on)]
        else:
            events.append((group, rng.choice(["acquired", "released"]), attempt, frozenset()))
    notified: list[str] = []
    once = OncePerEvent(nodes, quorum, notified.append)
    queues = {
        node: [e for e, (*_, on) in enumerate(events) if not on or node in on]
        for node in range(nodes)
        if node not in down
    }
    copies: dict[int, int] = {}
    expected: list[str] = []
    while any(queues.values()):
        # A node runs at most a few events ahead of the slowest (Redis runs each script
        # within a round trip); a group keeps that many, and more, unfinished.
        slowest = min(q[0] for q in queues.values() if q)
        node = rng.choice(sorted(n for n, q in queues.items() if q and q[0] <= slowest + 3))
        event = queues[node].pop(0)
        group, kind, attempt, on = events[event]
        copies[event] = copies.get(event, 0) + 1
        before = len(notified)
        once.message(node, group, kind, attempt)
        if not on and copies[event] == quorum:
            expected.append(group)
            assert len(notified) == before + 1, f"event {event}'s majority did not notify"
        else:
            assert len(notified) == before, f"copy {copies[event]} of event {event} notified"
    assert notified == expected
    assert len(expected) == sum(1 for *_, on in events if not on)
    assert all(len(per_group) <= PENDING for per_group in once._pending.values())
    if not down and not short:
        assert once._pending == {}  # every node reported every event: nothing kept


@pytest.mark.parametrize("seed", range(20))
def test_each_event_notifies_once_when_a_majority_reported_it(seed: int) -> None:
    deliver(seed, 3)
    deliver(seed, 3, short=0)
    deliver(seed, 5)
    deliver(seed, 5, down=frozenset({1, 3}))  # nodes that never answer do not matter
    deliver(seed, 3, down=frozenset({0}))


def test_an_attempt_that_fell_short_and_its_undo_wake_nobody() -> None:
    """The race a first-copy rule lost: a follower's acquire ran on node 0 before the
    holder's release reached the others, fell short and was undone. Nobody is woken for
    it (a resigner would take it for a successor's act), and the next event is not
    mistaken for an old one: it notifies when it shows on a majority."""
    notified: list[str] = []
    once = OncePerEvent(3, 2, notified.append)
    once.message(0, "g", "released", "term")  # the holder's release, on node 0 first
    once.message(0, "g", "acquired", "short")  # a follower's try, on node 0 only
    once.message(0, "g", "released", "short")  # its undo
    assert notified == []
    once.message(1, "g", "released", "term")  # the release on a majority: wake up now
    assert notified == ["g"]
    once.message(2, "g", "released", "term")
    once.message(1, "g", "acquired", "next")  # a successor, asked node 0 last
    assert notified == ["g"]
    once.message(2, "g", "acquired", "next")
    assert notified == ["g", "g"]
    once.message(0, "g", "acquired", "next")
    assert notified == ["g", "g"]
    assert once._pending == {"g": {("acquired", "short"): {0}, ("released", "short"): {0}}}


def test_a_message_of_an_older_writer_notifies_at_every_copy() -> None:
    notified: list[str] = []
    once = OncePerEvent(3, 2, notified.append)
    for node in range(3):
        once.message(node, "g", "released", "")
    assert notified == ["g", "g", "g"]
    assert once._pending == {}


def test_a_group_keeps_a_bounded_number_of_unfinished_events() -> None:
    notified: list[str] = []
    once = OncePerEvent(3, 2, notified.append)
    once.message(0, "g", "released", "old")
    once.message(1, "g", "released", "old")  # notified; node 2 is down
    assert notified == ["g"]
    once.message(0, "g", "acquired", "short")  # fell short
    for n in range(PENDING - 2):
        once.message(0, "g", "acquired", f"a{n}")
    assert len(once._pending["g"]) == PENDING
    once.message(0, "g", "acquired", "new")  # the event that had notified goes first
    assert ("released", "old") not in once._pending["g"]
    assert ("acquired", "short") in once._pending["g"]
    once.message(1, "g", "acquired", "short")  # not evicted: still counts
    assert notified == ["g", "g"]
    once.message(2, "g", "released", "old")  # its last copy: never a new event
    assert notified == ["g", "g"]
    once = OncePerEvent(3, 2, notified.append)
    notified.clear()
    for n in range(3 * PENDING):  # node 1 and node 2 are down: nothing is ever finished
        once.message(0, "g", "acquired", f"a{n}")
    assert list(once._pending["g"]) == [
        ("acquired", f"a{n}") for n in range(2 * PENDING, 3 * PENDING)
    ]
    once.message(1, "g", "acquired", f"a{3 * PENDING - 1}")  # the newest still counts
    assert notified == ["g"]
