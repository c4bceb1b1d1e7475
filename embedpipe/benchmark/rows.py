"""Rows read from disk per cache policy, against Belady's optimum, one epoch from a cold cache.

Counted at batch granularity on each trace (the synthetic Zipf one and, if found, real text): a
batch reads each of its unique ids that is not cached, once. For each cache size (``--cache-fracs``
of the vocabulary) and each policy, the rows read over the trace and the ratio to Belady's
optimum (MIN with bypass), the limit for any cache of that size. A real ``EmbeddingPipe``
iterated over the first ``--check-batches`` batches of the Zipf trace checks the simulation of
"lru" and "auto" through its ``stats()["rows_read"]``.

Targets (issue 9): the default policy (``auto``) reads <= 1.05x the optimum at every size, on both
traces.
"""

from __future__ import annotations

import argparse
import heapq
from collections.abc import Callable
from typing import Any

import cachetools
import numpy as np
from tqdm.auto import tqdm

from ..cache import RowCache, SharedRows
from ..pipe import EmbeddingPipe
from ..policy import make_policy
from . import report as md
from .options import fraction, integer
from .report import target
from .traces import Trace, TraceDataset, table_path, text_files, text_trace, zipf_trace

NAME = "rows"
#: ``--quick`` caps: the same cache sizes, fewer batches.
QUICK = {"batches": 150, "check_batches": 60}
#: The target ratio of the default policy to Belady's optimum.
GOAL = 1.05
PIPE_POLICIES = ("lru", "lfu", "auto")


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


def rows_read_lazy(sets: list[np.ndarray]) -> int:
    return sum(len(u) for u in sets)


def rows_read_embedpipe(sets: list[np.ndarray], vocab: int, cache_rows: int, policy: str) -> int:
    """embedpipe's own cache code on the trace: the worker's cache read, then the hand-off's admit.

    With ``num_workers=0`` each lookup happens after the previous batch's hand-off, as here.
    Rows have width 1 (the policy never looks at them) and the table is never touched.
    """
    shared = SharedRows(vocab, cache_rows, 1, np.float32)
    cache = RowCache(
        shared,
        make_policy(policy, cache_rows, vocab),
        fetch=lambda ids, name: np.zeros((len(ids), 1), np.float32),
        store=lambda ids, rows, name: None,
    )
    read = 0
    for u in sets:
        rows, hit = shared.read(u)
        read += len(u) - int(hit.sum())
        cache.admit(u, rows)
    return read


def lru_lookup(cache: cachetools.LRUCache, ids: list[int]) -> list[int]:
    """The per-worker LRU's lookup: touch the hits, return the misses (not yet inserted)."""
    misses = []
    for i in ids:
        if cache.get(i) is None:  # get() of a hit moves it to the front
            misses.append(i)
    return misses


def rows_read_worker_lru(sets: list[np.ndarray], cache_rows: int, workers: int) -> int:
    """Per-worker ``cachetools.LRUCache``: worker w sees batches w, w+workers, ... (as the
    DataLoader hands them out) and keeps its own cache of ``cache_rows`` rows."""
    if cache_rows < 1:
        return rows_read_lazy(sets)
    caches = [cachetools.LRUCache(maxsize=cache_rows) for _ in range(workers)]
    read = 0
    for t, u in enumerate(sets):
        cache = caches[t % workers]
        misses = lru_lookup(cache, u.tolist())
        read += len(misses)
        for i in misses:
            cache[i] = True
    return read


def next_uses(sets: list[np.ndarray]) -> list[np.ndarray]:
    """For each batch t and each id in it, the next batch after t that uses the id (or len)."""
    n = len(sets)
    ids = np.concatenate(sets)
    when = np.repeat(np.arange(n), [len(u) for u in sets])
    order = np.lexsort((when, ids))  # by id, then by batch
    nxt_sorted = np.full(len(ids), n, dtype=np.int64)
    same = ids[order][1:] == ids[order][:-1]
    nxt_sorted[:-1][same] = when[order][1:][same]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    return np.split(nxt, np.cumsum([len(u) for u in sets])[:-1])


def rows_read_belady(
    sets: list[np.ndarray], nexts: list[np.ndarray], vocab: int, cache_rows: int
) -> int:
    """Belady's MIN at batch granularity, with bypass: after each batch the cache keeps, of the
    rows it held and the rows just read, the ``cache_rows`` whose next use is soonest (a row never
    used again is not kept). A max-heap on next use with lazy deletion: O(log C) per access.
    """
    end = len(sets)
    cached = np.zeros(vocab, dtype=bool)
    due = np.full(vocab, -1, dtype=np.int64)  # next use of each cached id
    heap: list[tuple[int, int]] = []  # (-next use, id); stale when it disagrees with due[id]
    size = read = 0
    for u, nxt in zip(sets, nexts, strict=True):
        hit = cached[u]
        read += len(u) - int(hit.sum())
        hit_ids, hit_next = u[hit], nxt[hit]
        due[hit_ids] = hit_next
        for i, n in zip(hit_ids.tolist(), hit_next.tolist(), strict=True):
            heapq.heappush(heap, (-n, i))
        for i, n in zip(u[~hit].tolist(), nxt[~hit].tolist(), strict=True):
            if n >= end or cache_rows == 0:
                continue  # never used again: bypass
            if size >= cache_rows:
                while True:  # the cached row used furthest in the future
                    neg, j = heap[0]
                    if cached[j] and due[j] == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= n:
                    continue  # every cached row is needed no later than this one
                heapq.heappop(heap)
                cached[j] = False
                size -= 1
            cached[i] = True
            due[i] = n
            heapq.heappush(heap, (-n, i))
            size += 1
        if len(heap) > 4 * cache_rows + 4096:  # drop the stale entries
            live = np.flatnonzero(cached)
            heap = list(zip((-due[live]).tolist(), live.tolist(), strict=True))
            heapq.heapify(heap)
    return read


def rows_read_keep_best(
    sets: list[np.ndarray],
    cache_rows: int,
    key: Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray],
) -> int:
    """A cache that, after each batch t, keeps the ``cache_rows`` rows of lowest
    ``key(t, u, candidates, held)`` among the rows it held and the rows batch t read (``u``);
    ``held`` says which candidates were cached. Vectorised per batch (O(C + U) numpy).
    """
    cached = np.empty(0, dtype=np.int64)
    read = 0
    for t, u in enumerate(sets):
        read += len(u) - int(np.isin(u, cached, assume_unique=True).sum())
        cand = np.union1d(cached, u)
        k = key(t, u, cand, np.isin(cand, cached, assume_unique=True))
        if len(cand) > cache_rows:
            cand = cand[np.argpartition(k, cache_rows - 1)[:cache_rows]]
        cached = cand
    return read


def rows_read_freq_admit(sets: list[np.ndarray], vocab: int, cache_rows: int) -> int:
    """Candidate: LFU with per-id counts that survive eviction, so a missed row replaces a cached
    one only if more batches have used it (ties: the cached row stays)."""
    counts = np.zeros(vocab, dtype=np.int64)

    def key(t: int, u: np.ndarray, cand: np.ndarray, held: np.ndarray) -> np.ndarray:
        counts[u] += 1
        return -2 * counts[cand] - held

    return rows_read_keep_best(sets, cache_rows, key)


def rows_read_lookahead(
    sets: list[np.ndarray], nexts: list[np.ndarray], vocab: int, cache_rows: int, window: int
) -> int:
    """Candidate: Belady within the next ``window`` batches (the sampler's order is known that far
    ahead); rows not used within the window rank after those that are, by past frequency, and
    rows known never to be used again rank last."""
    end = len(sets)
    counts = np.zeros(vocab, dtype=np.int64)
    due = np.zeros(vocab, dtype=np.int64)

    def key(t: int, u: np.ndarray, cand: np.ndarray, held: np.ndarray) -> np.ndarray:
        counts[u] += 1
        due[u] = nexts[t]
        d = due[cand]
        seen = np.where(d < end, d.astype(np.float64), np.inf)
        return np.where(d <= t + window, seen, 1e15 - counts[cand])

    return rows_read_keep_best(sets, cache_rows, key)


def rows_read_pipe(
    path: str, ids: np.ndarray, batch_size: int, cache_rows: int, policy: str
) -> int:
    """A real EmbeddingPipe over ``ids`` (num_workers=0, frozen): its ``stats()["rows_read"]``."""
    with EmbeddingPipe(path, cache_rows=cache_rows, policy=policy) as pipe:
        for batch in pipe.loader(TraceDataset(ids), batch_size=batch_size):
            batch["inputs_embeds"]
        return pipe.stats()["rows_read"]


def columns(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(key, heading) of each policy column, Belady's optimum first."""
    w = args.workers
    return [
        ("belady", "Belady (optimal)"),
        ("lru", "embedpipe lru"),
        ("lfu", "embedpipe lfu"),
        ("auto", "embedpipe auto"),
        ("worker_lru", f"cachetools LRU, {w} workers x C"),
        ("worker_lru_split", f"cachetools LRU, {w} workers x C/{w}"),
        ("lazy", "lazy (no cache)"),
        ("freq_admit", "freq-admit LFU (sim)"),
        ("lookahead", f"lookahead {args.lookahead} (sim)"),
    ]


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
    sets = [np.unique(trace.batch(t)) for t in range(trace.num_batches)]
    nexts = next_uses(sets)
    lazy = rows_read_lazy(sets)
    v = args.vocab
    result: dict[str, Any] = {
        "trace": trace.name,
        "batches": len(sets),
        "unique_per_batch": lazy / len(sets),
        "distinct_ids": len(np.unique(np.concatenate(sets))),
        "sizes": [],
    }
    runs: dict[str, Callable[[int], int]] = {
        "belady": lambda c: rows_read_belady(sets, nexts, v, c),
        **{p: (lambda c, p=p: rows_read_embedpipe(sets, v, c, p)) for p in PIPE_POLICIES},
        "worker_lru": lambda c: rows_read_worker_lru(sets, c, args.workers),
        "worker_lru_split": lambda c: rows_read_worker_lru(sets, c // args.workers, args.workers),
        "lazy": lambda c: lazy,
        "freq_admit": lambda c: rows_read_freq_admit(sets, v, c),
        "lookahead": lambda c: rows_read_lookahead(sets, nexts, v, c, args.lookahead),
    }
    for frac in args.cache_fracs:
        c = max(1, round(frac * v))
        row: dict[str, Any] = {"frac": frac, "cache_rows": c}
        for key, run_one in runs.items():
            bar.set_postfix_str(f"{trace.name[:9]} {frac:g} {key}")
            row[key] = run_one(c)
            bar.update()
        result["sizes"].append(row)
    if path is not None:  # the real pipe against the simulation, on the first batches
        c = max(1, round(args.check_frac * v))
        head = trace.head(args.check_batches)
        n = len(head) // trace.batch_size
        check: dict[str, Any] = {"cache_rows": c, "frac": args.check_frac, "batches": n}
        for policy in ("lru", "auto"):
            bar.set_postfix_str(f"{trace.name[:9]} pipe {policy}")
            check[policy] = {
                "pipe": rows_read_pipe(path, head, trace.batch_size, c, policy),
                "sim": rows_read_embedpipe(sets[:n], v, c, policy),
            }
            bar.update()
        result["check"] = check
    return result


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Rows read on every trace; the real-pipe check on the first (Zipf)."""
    found = traces(args)
    steps = len(found) * len(args.cache_fracs) * len(columns(args)) + 2
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
            agree = all(ch[p]["pipe"] == ch[p]["sim"] for p in ("lru", "auto"))
            both = ", ".join(f"{p} {ch[p]['pipe']:,} vs {ch[p]['sim']:,}" for p in ("lru", "auto"))
            parts.append(
                f"\nA real EmbeddingPipe at {ch['frac']:.0%} ({ch['cache_rows']:,} rows, "
                f"num_workers=0, first {ch['batches']} batches): `stats()['rows_read']` vs the "
                f"simulation: {both} ({'agree' if agree else 'DISAGREE'}).\n"
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
    return out
