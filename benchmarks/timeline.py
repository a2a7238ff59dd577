"""Where a handoff's time goes: each step of section 1's handoff, on one clock.

The handoffs are section 1's (`run.measure_handoff`, the same two elections, lease and
pauses), with each election's provider wrapped in `Stamped`: a `FaultyProvider` without
faults that notes, on ``time.perf_counter``, when each call is sent and answered and when
the provider's watch wakes its election. Per handoff, from the leader's ``resign()``:

- the core, before the release: ``resign()`` until the release is sent (stepping down,
  LOST, the release's task);
- the release and its notification: until the follower's watch wakes it (the provider,
  its driver and the store: a write, and the notification back through the driver);
- the core, the follower's round: until its acquire is sent;
- the acquire: until it is answered (one write through the provider and its driver);
- the core, the new term: until the ACQUIRED event reaches the benchmark.

The wrapper's own cost (an await and a generator step per call) is inside these figures.
A handoff in which the follower was woken by anything but its watch, or sent no acquire,
is left out and counted. Medians per step: they need not add up to the median total.

    python benchmarks/run.py --backends redis,postgres --only timeline
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from common import fmt

from multilock.core import LeaderInfo
from multilock.core.provider import Provider
from multilock.core.testing import FaultyProvider

NUMBER = 11
TITLE = "Where a handoff's time goes"
#: No target is judged here: nothing in Targets starts with this.
TARGET = "- Handoff timeline"

#: One note: (what, election index, perf_counter time).
Mark = tuple[str, int, float]
#: One handoff of section 1: (resign() called, ACQUIRED seen, index of the resigner).
Leg = tuple[float, float, int]

#: The steps, in order: (name in the results, what the report calls it).
STEPS = (
    ("before_release", "core: resign() to the release sent"),
    ("release_to_woken", "release sent to the follower's watch waking it"),
    ("woken_to_acquire", "core: woken to the acquire sent"),
    ("acquire", "acquire sent to answered"),
    ("answered_to_event", "core: answered to ACQUIRED"),
)


class Stamped(FaultyProvider):
    """*inner*, unchanged, noting the times of election *index*'s calls in *marks*."""

    def __init__(self, inner: Provider, index: int, marks: list[Mark]) -> None:
        super().__init__(inner)
        self.index, self.marks = index, marks

    def _mark(self, what: str) -> None:
        self.marks.append((what, self.index, time.perf_counter()))

    async def try_acquire(
        self, group: str, participant_id: str, lease_duration: float, metadata: Mapping[str, str]
    ) -> LeaderInfo | None:
        self._mark("acquire sent")
        try:
            return await super().try_acquire(group, participant_id, lease_duration, metadata)
        finally:
            self._mark("acquire answered")

    async def release(self, group: str, participant_id: str, token: int) -> None:
        self._mark("release sent")
        await super().release(group, participant_id, token)

    def watch(self, group: str) -> AsyncIterator[None] | None:
        inner = super().watch(group)
        return None if inner is None else self._woken(inner)

    async def _woken(self, inner: AsyncIterator[None]) -> AsyncIterator[None]:
        try:
            async for _ in inner:
                self._mark("woken")
                yield None
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()


def summarize(marks: list[Mark], legs: list[Leg]) -> dict[str, Any]:
    """Per step, the median of its milliseconds over the handoffs that had every step."""

    def first(what: str, index: int, after: float, before: float) -> float | None:
        return next(
            (t for w, i, t in marks if w == what and i == index and after <= t <= before), None
        )

    steps: dict[str, list[float]] = {name: [] for name, _ in STEPS}
    totals: list[float] = []
    for started, won, resigner in legs:
        follower = 1 - resigner
        released = first("release sent", resigner, started, won)
        woken = first("woken", follower, released or started, won)
        sent = first("acquire sent", follower, woken or started, won)
        answered = first("acquire answered", follower, sent or started, won)
        if released is None or woken is None or sent is None or answered is None:
            continue
        times = (started, released, woken, sent, answered, won)
        for (name, _), a, b in zip(STEPS, times, times[1:], strict=False):
            steps[name].append((b - a) * 1000)
        totals.append((won - started) * 1000)
    return {
        "handoffs": len(legs),
        "left_out": len(legs) - len(totals),
        "total": statistics.median(totals) if totals else None,
        **{name: statistics.median(v) if v else None for name, v in steps.items()},
    }


def report_section(results: Mapping[str, Any], note: str = "") -> list[str]:
    if not results:
        return []
    lines = [
        "",
        f"## {NUMBER}. {TITLE}",
        "",
        *([note, ""] if note else []),
        "Section 1's handoffs, each step timed on one clock (`benchmarks/timeline.py`): the "
        "core's own steps, and the two store calls on the way, each including its "
        "provider, driver and network. The median of each step, in ms; medians need not add "
        "up to the median total. Left out: handoffs in which the follower was woken by "
        "something other than its watch, or sent no acquire.",
        "",
        "| backend | handoffs (left out) | "
        + " | ".join(label for _, label in STEPS)
        + " | total |",
        "|---|---|" + "---|" * (len(STEPS) + 1),
    ]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} |" + "|" * (len(STEPS) + 1))
            continue
        cells = [fmt(r[step], 2) for step, _ in STEPS]
        lines.append(
            f"| {name} | {r['handoffs']} ({r['left_out']}) | "
            + " | ".join(cells)
            + f" | {fmt(r['total'], 2)} |"
        )
    return lines


def targets(results: Mapping[str, Any]) -> list[str]:
    """No target here: section 1 judges the handoff; this says where its time goes."""
    return []
