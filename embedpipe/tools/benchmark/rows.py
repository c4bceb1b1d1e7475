"""Rows read from disk per cache policy, against Belady's optimum, one epoch from a cold cache.

Counted at batch granularity on each trace (the synthetic Zipf one and, if found, real text): a
batch reads each of its unique ids that is not cached, once. For each cache size (``--cache-fracs``
of the vocabulary) and each policy, the rows read over the trace and the ratio to Belady's
optimum (MIN with bypass), the limit for any cache of that size. A real ``EmbeddingPipe``
iterated over the first ``--check-batches`` batches of the Zipf trace checks the simulation of
"lru" and "lookahead" through its ``stats()["rows_read"]``: ``policy="auto"`` where a miss is
read from the disk (a training pipe, or a frozen table larger than half the memory); a frozen
pipe whose table fits in memory runs ``auto`` as LFU (NOTE [ A frozen table that fits in
memory ] in ``pipe/defaults.py``), and the benchmark's table fits.

Targets (issue 9): the default policy (``auto``) reads <= 1.05x the optimum at every size, on both
traces.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ...pipe.handle import EmbeddingPipe
from .. import simulate
from . import report as md
from .options import fraction, integer
from .report import target
from .traces import Trace, TraceDataset, table_path, text_files, text_trace, zipf_trace

NAME = "rows"
#: ``--quick`` caps: the same cache sizes, fewer batches.
QUICK = {"batches": 150, "check_batches": 60}
#: The target ratio of the default policy to Belady's optimum.
GOAL = 1.05
#: The policies a real pipe checks the simulation of.
CHECKED = ("lru", "lookahead")
DISAGREE = (
    "DISAGREE; a lookahead pipe reads more than the simulation when its foresight child runs "
    "behind the loop, as on a loaded machine"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("rows read (section 'rows')")
    g.add_argument(
        "--batches", type=integer(1), default=500, help="batches of each rows-read trace"
    )
    g.add_argument(
        "--cache-fracs",
        type=fraction,
        nargs="+",
        default=[0.02, 0.05, 0.10, 0.20],
        help="cache sizes, as fractions of the vocabulary",
    )
    g.add_argument(
        "--lookahead", type=integer(1), default=64, help="batches a lookahead policy sees ahead"
    )
    g.add_argument(
        "--check-frac",
        type=fraction,
        default=0.05,
        help="cache size at which a real EmbeddingPipe checks the simulation",
    )
    g.add_argument(
        "--check-batches", type=integer(1), default=200, help="batches of the real-pipe check"
    )
    g.add_argument(
        "--text",
        nargs="+",
        default=["auto"],
        help="text files (or folders of *.txt) for the real-text trace; "
        "'auto' looks for vim's documentation, 'none' skips it",
    )


def rows_read_pipe(
    path: str,
    ids: np.ndarray,
    batch_size: int,
    cache_rows: int,
    policy: str,
    window: int,
    num_workers: int = 0,
) -> int:
    """A real frozen EmbeddingPipe over ``ids``: its ``stats()["rows_read"]``. At each batch
    the loop lets the foresight child fill the window and the reader thread read the misses of
    the batches in flight (up to 10 s), as a model's step gives them time to, so the count does
    not depend on how a loaded machine schedules them against a loop that does no work
    (measured: 1.08-1.13x Belady without the wait, where the reader fell behind and handed the
    misses back to the workers; 0.96x with it, or with a 20 ms step instead; the speed is the
    throughput section's)."""
    with EmbeddingPipe(  # a thread: the loop waits on its reader (``stream.caught_up``)
        path, cache_rows=cache_rows, policy=policy, lookahead=window, owner="thread"
    ) as pipe:
        loader = pipe.loader(TraceDataset(ids), batch_size=batch_size, num_workers=num_workers)
        for batch in loader:
            stream = pipe._owner.stream
            deadline = time.monotonic() + 10
            while stream is not None and not stream.caught_up:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            batch["inputs_embeds"]
        return pipe.stats()["rows_read"]


def columns(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(policy, heading) of each column: every policy the simulator knows, the optimum first."""
    w = args.workers
    headings = {
        "belady": "Belady (optimal)",
        "worker_lru": f"cachetools LRU, {w} workers x C",
        "worker_lru_split": f"cachetools LRU, {w} workers x C/{w}",
        "lazy": "lazy (no cache)",
    }
    return [(p, headings.get(p, f"embedpipe {p}")) for p in simulate.POLICIES]


def traces(args: argparse.Namespace) -> list[Trace]:
    """The Zipf trace and, if its files are found, the real-text one."""
    out = [zipf_trace(args, args.batches)]
    files = text_files(args.text)
    text = text_trace(files, args, args.batches) if files else None
    return out if text is None else [*out, text]


def trace_table(
    trace: Trace, args: argparse.Namespace, path: str | None, bar: tqdm
) -> dict[str, Any]:
    """Rows read per policy and cache size on ``trace``; with ``path``, the real-pipe check."""
    sets = simulate.batch_sets(trace.ids, trace.batch_size)
    sizes = [max(1, round(frac * args.vocab)) for frac in args.cache_fracs]

    def progress(policy: str, cache_rows: int) -> None:
        bar.set_postfix_str(f"{trace.name[:9]} {cache_rows} {policy}")
        bar.update()

    curve = simulate.miss_ratio_curve(
        sets,
        args.vocab,
        sizes,
        window=args.lookahead,
        workers=args.workers,
        progress=progress,
    )
    result: dict[str, Any] = {
        "trace": trace.name,
        "batches": len(sets),
        "unique_per_batch": curve["lazy"] / len(sets),
        "distinct_ids": len(np.unique(np.concatenate(sets))),
        "sizes": [
            {
                "frac": frac,
                "cache_rows": c,
                **{p: reads[i] for p, reads in curve["rows_read"].items()},
            }
            for i, (frac, c) in enumerate(zip(args.cache_fracs, sizes, strict=True))
        ],
    }
    if path is not None:  # the real pipe against the simulation, on the first batches
        c = max(1, round(args.check_frac * args.vocab))
        head = trace.head(args.check_batches)
        n = len(head) // trace.batch_size
        check: dict[str, Any] = {"cache_rows": c, "frac": args.check_frac, "batches": n}
        for policy in CHECKED:
            bar.set_postfix_str(f"{trace.name[:9]} pipe {policy}")
            check[policy] = {
                "pipe": rows_read_pipe(path, head, trace.batch_size, c, policy, args.lookahead),
                "sim": simulate.rows_read(sets[:n], args.vocab, c, policy, window=args.lookahead),
            }
            bar.update()
        # with workers: batches in flight leave their misses to the owner (lookahead.py)
        bar.set_postfix_str(f"{trace.name[:9]} pipe lookahead, {args.workers} workers")
        check["workers"] = {
            "pipe": rows_read_pipe(
                path, head, trace.batch_size, c, "lookahead", args.lookahead, args.workers
            ),
            "belady": simulate.rows_read(sets[:n], args.vocab, c, "belady"),
        }
        result["check"] = check
    return result


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Rows read on every trace; the real-pipe check on the first (Zipf)."""
    found = traces(args)
    steps = len(found) * len(args.cache_fracs) * len(simulate.POLICIES) + len(CHECKED) + 1
    with tqdm(total=steps, desc="rows read", unit="run") as bar:
        tables = [
            trace_table(t, args, table_path(args, workdir) if i == 0 else None, bar)
            for i, t in enumerate(found)
        ]
    return {"traces": tables}


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    parts = []
    for r in result["traces"]:
        parts.append(
            f"### Rows read from disk: {r['trace']}\n\n"
            f"{r['batches']} batches of {args.batch_size} x {args.seq_len} tokens, one epoch from "
            f"a cold cache, {r['unique_per_batch']:.0f} unique ids per batch on average, "
            f"{r['distinct_ids']:,} distinct ids in all (reads no cache avoids). Rows read from "
            "disk over the trace, and the ratio to Belady's optimum.\n"
        )
        cols = columns(args)
        rows = []
        for s in r["sizes"]:
            cells = [f"{s['frac']:.0%} ({s['cache_rows']:,})"]
            cells += [f"{s[k]:,} ({s[k] / max(1, s['belady']):.2f}x)" for k, _ in cols]
            rows.append(cells)
        parts.append(md.md_table(["cache (rows)", *(h for _, h in cols)], rows))
        if "check" in r:
            ch = r["check"]
            agree = all(ch[p]["pipe"] == ch[p]["sim"] for p in CHECKED)
            both = ", ".join(f"{p} {ch[p]['pipe']:,} vs {ch[p]['sim']:,}" for p in CHECKED)
            w = ch["workers"]
            parts.append(
                f"\nA real EmbeddingPipe at {ch['frac']:.0%} ({ch['cache_rows']:,} rows, "
                f"num_workers=0, first {ch['batches']} batches): `stats()['rows_read']` vs the "
                f"simulation: {both} ({'agree' if agree else DISAGREE}). With {args.workers} "
                f"workers, lookahead read {w['pipe']:,} rows, "
                f"{w['pipe'] / max(1, w['belady']):.2f}x Belady's {w['belady']:,} (the batches in "
                "flight share what the owner reads for them; their buffers are memory beyond the "
                "cache, as the ring is).\n"
            )
    return "\n".join(parts)


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Rows read by the default policy over Belady's, per trace and cache size (None: not run)."""
    if result is None:
        return [target("rows read, auto / Belady, Zipf and text", None, f"<= {GOAL:.2f}x", None)]
    out = []
    for r in result["traces"]:
        kind = "Zipf" if r["trace"].startswith("synthetic") else "text"
        for s in r["sizes"]:
            x = s["auto"] / max(1, s["belady"])
            out.append(
                target(
                    f"rows read, auto / Belady, {kind}, cache {s['frac']:.0%}",
                    x,
                    f"<= {GOAL:.2f}x",
                    x <= GOAL,
                )
            )
        if "check" in r:  # the real pipe, with workers
            ch = r["check"]
            x = ch["workers"]["pipe"] / max(1, ch["workers"]["belady"])
            out.append(
                target(
                    f"rows read, real pipe with workers / Belady, {kind}, cache {ch['frac']:.0%}",
                    x,
                    f"<= {GOAL:.2f}x",
                    x <= GOAL,
                )
            )
    return out
