"""The fault campaign's numbers: a summary per backend (for JSON) and a printed table."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from multilock.core.testing import TimelineReport

from .campaign import FAILOVER_KINDS, HANDOFF_KINDS, KINDS, Campaign

__all__ = ["format_summaries", "summarize"]


def _stats(values: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "count": len(values),
        "p50": round(statistics.median(values), 3) if values else None,
        "max": round(max(values), 3) if values else None,
    }


def summarize(campaign: Campaign, report: TimelineReport, seed: str) -> dict[str, Any]:
    """What *campaign* did and measured; *report* judged its cluster's logs."""
    outcomes = campaign.outcomes
    by_kind = Counter(o.kind for o in outcomes)

    def times(kinds: frozenset[str]) -> dict[str, float | int | None]:
        return _stats([o.to_leader for o in outcomes if o.kind in kinds and not o.kept])

    restarts = [o for o in outcomes if o.kind == "restart"]
    slow = [o for o in outcomes if o.kind == "slow-all"]
    return {
        "backend": campaign.backend.name,
        "lease": campaign.lease,
        "seed": seed,
        "faults": len(outcomes),
        "by_kind": {kind: by_kind[kind] for kind in KINDS if by_kind[kind]},
        "not_applicable": campaign.not_applicable,
        "failovers": times(FAILOVER_KINDS),
        "handoffs": times(HANDOFF_KINDS),
        "restarts": {**times(frozenset({"restart"})), "kept": sum(o.kept for o in restarts)},
        "slow_all": {
            "kept": sum(o.kept for o in slow),
            "handed_over": sum(not o.kept for o in slow),
        },
        "step_down_lag": _stats([o.step_down_lag for o in outcomes if o.step_down_lag is not None]),
        "leaderless": {
            "total": round(sum(report.gaps), 3),
            "max": round(max(report.gaps, default=0.0), 3),
        },
        "terms": len(report.intervals),
        "seconds": round(campaign.finished - campaign.started, 1),
        "problems": report.problems,
        "outcomes": [attrs.asdict(o) for o in outcomes],
    }


def format_summaries(summaries: Sequence[dict[str, Any]]) -> str:
    """A table of the campaign's numbers, one block per backend."""

    def span(stats: dict[str, Any]) -> str:
        if not stats["count"]:
            return "0"
        return f"{stats['count']} (p50 {stats['p50']:.3f} s, max {stats['max']:.3f} s)"

    lines = ["", "multilock fault campaign: faults per backend, times from fault to next term"]
    for s in summaries:
        kinds = ", ".join(f"{k} {n}" for k, n in s["by_kind"].items())
        lines += [
            f"  {s['backend']} (lease {s['lease']:g} s, seed {s['seed']}): {s['faults']} faults "
            f"in {s['seconds']} s, {s['terms']} terms, "
            f"{'no overlap' if not s['problems'] else 'UNSAFE: ' + '; '.join(s['problems'])}",
            f"    by kind: {kinds}",
            f"    failovers {span(s['failovers'])}; handoffs {span(s['handoffs'])}; "
            f"restarts {span(s['restarts'])}, {s['restarts']['kept']} kept the term",
            f"    cut or slowed leaders logged their step-down {span(s['step_down_lag'])} "
            "after their deadline",
            f"    slow-all: {s['slow_all']['kept']} kept the leader, "
            f"{s['slow_all']['handed_over']} handed over; without a leader: "
            f"{s['leaderless']['total']:.3f} s in all, longest {s['leaderless']['max']:.3f} s",
        ]
        lines += [f"    n/a {kind}: {why}" for kind, why in s["not_applicable"].items()]
    return "\n".join(lines)
