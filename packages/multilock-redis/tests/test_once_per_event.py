"""Redlock's listener passes on the first copy of each event, whichever node sends it."""

from __future__ import annotations

import random

import pytest

from multilock.redis._quorum import OncePerEvent


def deliver(seed: int, nodes: int, down: frozenset[int] = frozenset()) -> None:
    """Events of two groups, every node's copies in order, the nodes interleaved at
    random: each event must notify once, at its first copy."""
    rng = random.Random(seed)
    events = [(rng.choice("gh"), rng.choice(["acquired", "released"])) for _ in range(60)]
    notified: list[str] = []
    once = OncePerEvent(nodes, notified.append)
    for node in range(nodes):
        once.resubscribed(node)
    queues = {node: list(range(len(events))) for node in range(nodes) if node not in down}
    first_copy: list[str] = []
    seen: set[int] = set()
    while queues:
        node = rng.choice(sorted(queues))
        event = queues[node].pop(0)
        if not queues[node]:
            del queues[node]
        before = len(notified)
        once.message(node, *events[event])
        if event not in seen:
            seen.add(event)
            first_copy.append(events[event][0])
            assert len(notified) == before + 1, f"event {event}'s first copy did not notify"
        else:
            assert len(notified) == before, f"a copy of event {event} notified again"
    assert notified == first_copy
    if not down:
        assert once._ahead == {}  # every node sent every copy: nothing kept


@pytest.mark.parametrize("seed", range(20))
def test_each_event_notifies_once_at_its_first_copy(seed: int) -> None:
    deliver(seed, 3)
    deliver(seed, 5, down=frozenset({1, 3}))  # a node that never answers does not matter


def test_a_node_subscribed_anew_is_level_with_the_others() -> None:
    notified: list[str] = []
    once = OncePerEvent(3, notified.append)
    for node in range(3):
        once.resubscribed(node)
    for node in (0, 1):  # node 2 is disconnected: it misses two events
        once.message(node, "g", "released")
        once.message(node, "g", "released")
    assert notified == ["g", "g"]
    once.resubscribed(2)
    once.message(2, "g", "released")  # a third release: node 2's copy comes first
    assert notified == ["g", "g", "g"]
    once.message(0, "g", "released")
    once.message(1, "g", "released")
    assert notified == ["g", "g", "g"]
    assert once._ahead == {}


def test_a_node_subscribed_late_reports_new_events_at_once() -> None:
    notified: list[str] = []
    once = OncePerEvent(3, notified.append)
    once.resubscribed(0)
    once.message(0, "g", "acquired")  # before node 1 and node 2 subscribed
    once.resubscribed(1)
    once.resubscribed(2)
    once.message(2, "g", "acquired")  # a new term, node 2 first
    assert notified == ["g", "g"]
