"""Host memory of each way of holding rows, computed from the shapes, and peak RSS so far.

embedpipe's pipe as :func:`embedpipe.cache.budget.pipe_memory` counts it (the frozen pipe of policy
"auto": cached rows, per-slot bookkeeping, the per-table-row index) and its workers' batch ring
(``workers x (prefetch_factor + 2) x ring_rows`` rows whatever the cache size). The per-worker
``cachetools.LRUCache`` holds each row as a numpy array (its data and ~112 bytes of header) plus
~100 bytes of LRU entry, in every worker.
"""

from __future__ import annotations

import argparse
import resource
from typing import Any

from ...cache.budget import pipe_memory
from . import report as md

NAME = "memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the sizes are ``--vocab``, ``--dim``, ``--workers`` and ``--cache-fracs``."""


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    row = args.dim * 4  # float32
    sizes = []
    for frac in [*args.cache_fracs, 1.0]:
        c = max(1, round(frac * args.vocab))
        pipe = pipe_memory(args.vocab, args.dim, "float32", c, num_workers=args.workers)
        sizes.append(
            {
                "frac": frac,
                "cache_rows": c,
                "embedpipe": pipe["total"] - pipe["ring"],
                "embedpipe_ring": pipe["ring"],
                "worker_lru": args.workers * c * (row + 212),
            }
        )
    return {"table": args.vocab * row, "sizes": sizes}


def peak_rss() -> dict[str, float]:
    """Peak resident memory (MiB) so far of this process and of its largest exited child."""
    return {
        "main_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "worker_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    head = (
        f"### Memory (table {md.mib(result['table'])}: {args.vocab:,} x {args.dim} float32)\n\n"
        "Computed from the shapes: embedpipe's frozen pipe (cached rows, per-slot bookkeeping, "
        "the per-table-row index, as `embedpipe.cache.budget.pipe_memory` counts them), the batch "
        "ring of its workers (prefetch factor 2), and a per-worker cachetools LRU of the same "
        "size in every worker.\n"
    )
    header = [
        "cache (rows)",
        "embedpipe cache",
        "of table",
        f"+ ring ({args.workers} workers)",
        f"cachetools LRU, {args.workers} workers x C",
    ]
    rows = [
        [
            f"{s['frac']:.0%} ({s['cache_rows']:,})",
            md.mib(s["embedpipe"]),
            f"{s['embedpipe'] / result['table']:.1%}",
            md.mib(s["embedpipe_ring"]),
            md.mib(s["worker_lru"]),
        ]
        for s in result["sizes"]
    ]
    return head + "\n" + md.md_table(header, rows) + "\n"


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """None: the peak-memory target is measured by the cold section on a whole pipeline."""
    return []
