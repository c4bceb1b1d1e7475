"""Markdown helpers of the benchmark's report: tables, sizes, ratios with quartiles, targets.

Every section of the benchmark (``rows``, ``throughput``, ``model``, ``memory``, ``cold``) gives
its figures as a dict; these helpers turn them into the markdown the driver prints on stdout.
"""

from __future__ import annotations

import statistics
from typing import Any


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table whose columns are padded to their widest cell (readable as plain text)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``xs`` (one value: itself three times)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, median, q3 = statistics.quantiles(xs, n=4)
    return q1, median, q3


def ratio(qs: tuple[float, float, float]) -> str:
    """A median ratio with its quartiles: ``0.95x (0.90-1.01)``."""
    q1, q2, q3 = qs
    return f"{q2:.2f}x ({q1:.2f}-{q3:.2f})"


def target(text: str, measured: float | None, goal: str, met: bool | None) -> dict[str, Any]:
    """One row of the Targets table; ``measured=None`` when the section did not run."""
    return {"target": text, "measured": measured, "goal": goal, "met": met}


def targets_table(rows: list[dict[str, Any]]) -> str:
    """The Targets table: each target, the measured figure, the goal, and met / not met."""
    cells = []
    for r in rows:
        measured = r["measured"]
        shown = "not measured" if measured is None else f"{measured:.2f}x"
        verdict = "-" if r["met"] is None else ("met" if r["met"] else "NOT MET")
        cells.append([r["target"], shown, r["goal"], verdict])
    return md_table(["target", "measured", "goal", "met"], cells)
