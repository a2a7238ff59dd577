"""A timeline picture of a graceful handoff and a crash failover, from a real `Cluster` run.

Three participant processes on one backend: the first leader resigns (SIGUSR1), then the
next leader is SIGKILLed. Their event logs, judged by `Cluster.check()`, give each term's
start and end on the machine's monotonic clock; matplotlib (Agg) draws one row per
participant, one bar per term labelled with its fencing token, the resign and kill
instants, and the leaderless gap after each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import say

from multilock.core.testing import Cluster

#: The section's number and title in the report (the last numbered section).
NUMBER = 10
TITLE = "A failover, drawn"


def run(urls: dict[str, str], args: Any, phase: Callable[[str], None]) -> list[str]:
    backend = args.plot_backend if args.plot_backend in urls else None
    backend = backend or next((n for n in urls if n not in ("memory", "azure_blob")), None)
    if backend is None:
        return []
    phase("plot")
    out = Path(args.plot)
    try:
        data = record(urls[backend], args.lease)
        out.parent.mkdir(parents=True, exist_ok=True)
        draw(data, out, backend)
    except Exception as exc:
        say(f"plot failed: {exc!r}")
        return ["", f"## {NUMBER}. {TITLE}", "", f"Not drawn: error {exc!r}"[:400]]
    gaps = f"handoff {data['handoff_gap'] * 1000:.1f} ms, crash {data['crash_gap']:.3f} s"
    say(f"plot: {out} ({gaps})")
    image = os.path.relpath(out.resolve(), Path(args.out).resolve().parent)
    return report_section(data, image, backend)


def record(url: str, lease: float) -> dict[str, Any]:
    """Run the cluster through a resign and a kill; return the terms and the instants."""
    with Cluster(url, "bench-plot", size=3, lease=lease) as cluster:
        first, token, _ = cluster.wait_for_leader(timeout=30 + lease * 5)
        time.sleep(lease * 1.5)  # everyone following, a few renewals on the bar
        resigned_at = cluster.resign(first)
        second, token, _ = cluster.wait_for_leader(timeout=lease * 10, newer_than=token)
        time.sleep(lease * 1.5)
        killed_at = cluster.kill(second)
        _third, token, _ = cluster.wait_for_leader(timeout=lease * 10 + 10, newer_than=token)
        time.sleep(lease)
        report = cluster.check()
        names = [m.name for m in cluster.members]
    if not report.ok:
        raise RuntimeError(f"unsafe timeline: {report.problems}")
    terms = [
        {"who": i.participant, "token": i.token, "start": i.start, "end": i.end}
        for i in report.intervals
    ]
    return {
        "names": names,
        "terms": terms,
        "resigned_at": resigned_at,
        "killed_at": killed_at,
        "handoff_gap": _next_start(terms, resigned_at) - resigned_at,
        "crash_gap": _next_start(terms, killed_at) - killed_at,
        "lease": lease,
    }


def _next_start(terms: list[dict[str, Any]], after: float) -> float:
    return float(min(t["start"] for t in terms if t["start"] > after))


def draw(data: dict[str, Any], out: Path, backend: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, terms = data["names"], data["terms"]
    handoff_pad = max(0.02, data["handoff_gap"] * 4)
    panels = [
        ("graceful handoff: leader resigns", data["resigned_at"], data["handoff_gap"],
         "resign", handoff_pad, 1000.0, "ms"),
        ("crash failover: leader SIGKILLed", data["killed_at"], data["crash_gap"],
         "SIGKILL", data["lease"] * 0.6, 1.0, "s"),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.8))
    colors = ["tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:red", "tab:brown"]
    for ax, (title, at, gap, what, pad, scale, unit) in zip(axes, panels, strict=True):
        lo, hi = -pad, gap + pad
        for row, name in enumerate(names):
            for i, term in enumerate(t for t in terms if t["who"] == name):
                start = max((term["start"] - at) * scale, lo * scale)
                end = min((term["end"] - at) * scale, hi * scale)
                if end <= start:
                    continue
                color = colors[(row + i) % len(colors)]
                ax.broken_barh([(start, end - start)], (row - 0.3, 0.6), color=color, alpha=0.8)
                ax.text((start + end) / 2, row, f"token {term['token']}", ha="center",
                        va="center", fontsize=8, color="white", weight="bold")  # fmt: skip
        ax.axvline(0, color="red", linestyle="--", linewidth=1)
        ax.text(0, len(names) - 0.45, f" {what}", color="red", fontsize=9, va="bottom")
        ax.annotate(
            "", xy=(gap * scale, -0.7), xytext=(0, -0.7),
            arrowprops={"arrowstyle": "<->", "color": "black"},
        )  # fmt: skip
        label = (
            f"{what} to the next term: {gap * scale:.1f} {unit}"
            if unit == "ms"
            else (f"{what} to the next term: {gap:.3f} s (the lease must expire)")
        )
        ax.text(gap * scale / 2, -0.95, label, ha="center", va="top", fontsize=9)
        ax.set_xlim(lo * scale, hi * scale)
        ax.set_ylim(-1.4, len(names) - 0.1)
        ax.set_yticks(range(len(names)), [n.rsplit("-", 1)[-1] for n in names])
        ax.set_xlabel(f"{unit} after the {what}")
        ax.set_title(title, fontsize=10)
    fig.suptitle(
        f"multilock on {backend}, lease {data['lease']:g} s: 3 participant processes, "
        "terms as the processes logged them",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def report_section(data: dict[str, Any] | None, image: str, backend: str) -> list[str]:
    if data is None:
        return []
    return [
        "",
        f"## {NUMBER}. {TITLE}",
        "",
        f"A 3-process `Cluster` on {backend} (lease {data['lease']:g} s) from this run: the "
        f"first leader resigns, the next leader takes over {data['handoff_gap'] * 1000:.1f} ms "
        f"later; that leader is SIGKILLed, and the next one leads {data['crash_gap']:.3f} s "
        "later (its lease had to expire). Rows are participants, bars are terms labelled "
        "with their fencing tokens, as the processes logged them on one monotonic clock.",
        "",
        f"![failover timeline]({image})",
    ]
