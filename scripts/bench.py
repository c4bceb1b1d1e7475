"""Benchmark embedpipe against the alternatives, side by side in one run on the same token trace.

What it measures (DESIGN.md section 7), all on one Zipf-like token trace:

1. **Rows read from disk per cache policy** for several cache sizes (``--cache-fracs`` of the
   vocabulary): embedpipe's shared cache with ``policy="lru"``, ``"lfu"`` and ``"auto"``; the
   obvious per-worker ``cachetools.LRUCache`` (``--workers`` workers, each seeing every
   ``workers``-th batch, with a cache of that size each and, as a second baseline, of
   size / workers each so that the memory is the same); lazy loading (no cache: every unique id
   of every batch is read); and Belady's optimal policy (evict the row whose next use is furthest
   in the future, at batch granularity, with bypass), which no cache of that size can beat.
   embedpipe's numbers come from its own cache code (``SharedRows``/``RowCache`` with the policy
   from ``embedpipe.policy.make_policy``, rows of width 1, no disk), and for one size
   (``--check-frac``) also from a real ``EmbeddingPipe`` iterated over the trace
   (``num_workers=0``, frozen table, ``pipe.stats()["rows_read"]``), to show the two agree.
   If a body of real text is found (``--text``, by default the English documentation that the
   vim package installs) the same table is made for a word-level token trace of that text.
2. **Throughput** (batches/s, median of ``--repeats``) of iterating a loader over the first
   ``--tput-batches`` batches of the trace with the model-free work only (lookup, hand-off,
   building ``inputs_embeds``), for ``num_workers`` 0 and ``--workers``:
   (a) the whole table in RAM as ``nn.Embedding`` (a plain DataLoader yields ids, the embedding
   runs in the main process), (b) embedpipe lazy loading (``cache_rows=0``), (c) a per-worker
   ``cachetools.LRUCache`` in a plain DataLoader ``collate_fn`` that reads misses with
   ``Table.read`` and sends the unique rows and the inverse index, (d) embedpipe with a cache of
   ``--tput-cache-frac`` and ``policy="auto"``, (e) embedpipe with ``cache_rows >= vocab``; and a
   training variant (``batch["inputs_embeds"].sum().backward()`` every batch) of
   ``embedpipe.optim.SGD(lr=0.1)`` against ``nn.Embedding`` (dense and ``sparse=True``) with
   ``torch.optim.SGD``. Each loader keeps its workers (``persistent_workers``) and runs one
   untimed warm-up pass, so caches are warm; the variants then take turns within each repeat,
   so a noisy neighbour slows them all alike. Ratios are against (a) with the same workers.
3. **Memory**: host bytes of each cache (rows, index and, for embedpipe, the batch ring) against
   the table, and the peak RSS of the main process and of any one worker.

Run it (about 3-4 minutes on 2 cores with the defaults; ``--quick`` takes about 30 s)::

    python scripts/bench.py
    python scripts/bench.py --quick
    python scripts/bench.py --vocab 50257 --dim 128 --json results.json

Tables go to stdout as markdown, progress bars to stderr. The tables on disk are made in a fresh
temporary folder (under ``--dir`` if given) that is deleted at the end.
"""

from __future__ import annotations

import argparse
import glob
import heapq
import json
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cachetools
import numpy as np
import torch
import torch.nn.functional as F
import zarr
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

import embedpipe
from embedpipe.cache import RowCache, SharedRows
from embedpipe.loader import DEFAULT_RING_ROWS
from embedpipe.policy import make_policy

#: Where ``--text auto`` looks for English prose (vim's documentation, ~2.3M word tokens).
TEXT_GLOBS = ("/usr/share/vim/vim*/doc/*.txt",)
PIPE_POLICIES = ("lru", "lfu", "auto")


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--vocab", type=int, default=30_522, help="rows in the table (vocabulary)")
    p.add_argument("--dim", type=int, default=256, help="floats per row (float32)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per batch")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the synthetic trace")
    p.add_argument("--batches", type=int, default=500, help="batches in the policy trace")
    p.add_argument(
        "--cache-fracs",
        type=float,
        nargs="+",
        default=[0.01, 0.02, 0.05, 0.10, 0.25],
        help="cache sizes for the policy table, as fractions of the vocabulary",
    )
    p.add_argument(
        "--check-frac",
        type=float,
        default=0.05,
        help="cache size at which a real EmbeddingPipe checks the simulated rows read",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="workers of the per-worker LRU baseline and of the multi-worker throughput runs",
    )
    p.add_argument(
        "--text",
        nargs="+",
        default=["auto"],
        help="text files (or folders of *.txt) for a second, real-text policy table; "
        "'auto' looks for vim's documentation, 'none' skips it",
    )
    p.add_argument("--tput-batches", type=int, default=100, help="batches per throughput pass")
    p.add_argument(
        "--tput-cache-frac", type=float, default=0.05, help="cache of throughput variant (d)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed passes; the median is reported")
    p.add_argument("--skip-policy", action="store_true", help="skip the rows-read tables")
    p.add_argument("--skip-throughput", action="store_true", help="skip the throughput tables")
    p.add_argument("--quick", action="store_true", help="a ~30 s smoke run (fewer, smaller runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="make the temporary folder here (default: the system's tmp)")
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.batches = min(args.batches, 150)
        args.cache_fracs = [0.02, 0.10]
        args.tput_batches = min(args.tput_batches, 30)
        args.repeats = min(args.repeats, 2)
    if min(args.cache_fracs) <= 0 or not 0 < args.check_frac <= 1:
        p.error("cache fractions must be > 0 (and --check-frac <= 1)")
    if args.workers < 1:
        p.error("--workers must be >= 1")
    return args


# ----------------------------------------------------------------------------- traces
@dataclass
class Trace:
    """Token ids ``(batches * batch_size, seq_len)``; batch t is rows t*B .. (t+1)*B."""

    name: str
    ids: np.ndarray
    batch_size: int

    @property
    def num_batches(self) -> int:
        return len(self.ids) // self.batch_size

    def batch(self, t: int) -> np.ndarray:
        return self.ids[t * self.batch_size : (t + 1) * self.batch_size]

    def unique_sets(self, batches: int | None = None) -> list[np.ndarray]:
        """The sorted unique ids of each batch: what a lookup reads (all of it, or the misses)."""
        n = self.num_batches if batches is None else min(batches, self.num_batches)
        return [np.unique(self.batch(t)) for t in range(n)]


def zipf_trace(args: argparse.Namespace) -> Trace:
    """I.i.d. tokens with P(rank r) ~ r^-s, ranks permuted over the table (popular rows spread)."""
    rng = np.random.default_rng(args.seed)
    p = np.arange(1, args.vocab + 1, dtype=np.float64) ** -args.zipf
    tokens = args.batches * args.batch_size * args.seq_len
    ranks = rng.choice(args.vocab, size=tokens, p=p / p.sum())
    ids = rng.permutation(args.vocab)[ranks]
    return Trace(f"synthetic Zipf s={args.zipf}", ids.reshape(-1, args.seq_len), args.batch_size)


def text_files(spec: list[str]) -> list[str]:
    if spec == ["none"]:
        return []
    patterns = TEXT_GLOBS if spec == ["auto"] else spec
    files: list[str] = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            files += (
                sorted(glob.glob(os.path.join(path, "*.txt"))) if os.path.isdir(path) else [path]
            )
    return files


def text_trace(files: list[str], args: argparse.Namespace, batches: int) -> Trace | None:
    """A word-level trace of real text: words and punctuation, lowercased, ranked by frequency.

    The ``vocab - 1`` most frequent tokens get their own id; rarer ones share one "[UNK]" id (as
    a tokenizer's unknown token). Ranks are permuted over the table as in the synthetic trace.
    The token stream is cut into sequences in reading order, and the sequences are shuffled (as a
    DataLoader with ``shuffle=True`` would), so words repeat within a sequence as in real text.
    """
    text = "".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    counts = Counter(words)
    rank = {w: r for r, (w, _) in enumerate(counts.most_common(args.vocab - 1))}
    unk = args.vocab - 1
    tokens = np.fromiter((rank.get(w, unk) for w in words), dtype=np.int64, count=len(words))
    rng = np.random.default_rng(args.seed + 1)
    ids = rng.permutation(args.vocab)[tokens]
    seqs = ids[: len(ids) // args.seq_len * args.seq_len].reshape(-1, args.seq_len)
    seqs = seqs[rng.permutation(len(seqs))][: batches * args.batch_size]
    if len(seqs) < args.batch_size:
        return None
    distinct = len(counts)
    name = f"text ({len(files)} files, {len(words) / 1e6:.2f}M tokens, {distinct} distinct)"
    return Trace(name, seqs[: len(seqs) // args.batch_size * args.batch_size], args.batch_size)


# ----------------------------------------------------------------------------- rows read
def rows_read_lazy(sets: list[np.ndarray]) -> int:
    return sum(len(u) for u in sets)


def rows_read_embedpipe(sets: list[np.ndarray], vocab: int, cache_rows: int, policy: str) -> int:
    """embedpipe's own cache code on the trace: the worker's read, then the hand-off's admit.

    With ``num_workers=0`` each lookup happens after the previous batch's hand-off, as here.
    Rows have width 1 (the policy never looks at them) and the table is never touched.
    """
    shared = SharedRows(vocab, cache_rows, 1, torch.float32)
    cache = RowCache(
        shared,
        make_policy(policy, cache_rows),
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


def rows_read_belady(sets: list[np.ndarray], nexts: list[np.ndarray], cache_rows: int) -> int:
    """Belady's MIN at batch granularity: after each batch the cache keeps, of the rows it held
    and the rows just read, the ``cache_rows`` whose next use is soonest (a row never used again
    is not kept). A max-heap on next use with lazy deletion; O(log C) per access.
    """
    end = len(sets)
    vocab = int(max(u.max() for u in sets if len(u))) + 1
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
            if n >= end:
                continue  # never used again: bypass
            if size >= cache_rows:
                while True:  # the cached row used furthest in the future
                    neg, j = heap[0]
                    if cached[j] and due[j] == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= n:
                    continue  # every cached row is needed sooner than this one
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


def rows_read_belady_check(sets: list[np.ndarray], nexts: list[np.ndarray], cache_rows: int) -> int:
    """The same optimum computed another way (keep the C soonest with argpartition), to check."""
    end = len(sets)
    ids = np.empty(0, dtype=np.int64)
    due = np.empty(0, dtype=np.int64)
    read = 0
    for u, nxt in zip(sets, nexts, strict=True):
        held = np.isin(u, ids, assume_unique=True)
        read += len(u) - int(held.sum())
        others = ~np.isin(ids, u, assume_unique=True)
        ids = np.concatenate([ids[others], u])
        due = np.concatenate([due[others], nxt])
        live = due < end
        ids, due = ids[live], due[live]
        if len(ids) > cache_rows:
            keep = np.argpartition(due, cache_rows - 1)[:cache_rows] if cache_rows else []
            ids, due = ids[keep], due[keep]
    return read


def rows_read_pipe(
    table_path: str, trace: Trace, batches: int, cache_rows: int, policy: str
) -> dict[str, int]:
    """A real EmbeddingPipe over the trace (num_workers=0, frozen): its stats()."""
    data = TraceDataset(trace.ids[: batches * trace.batch_size])
    with embedpipe.EmbeddingPipe(table_path, cache_rows=cache_rows, policy=policy) as pipe:
        for batch in pipe.loader(data, batch_size=trace.batch_size):
            batch["inputs_embeds"]
        return pipe.stats()


def policy_table(
    trace: Trace, args: argparse.Namespace, table_path: str, bar: tqdm
) -> dict[str, Any]:
    """Rows read per policy and cache size on ``trace``; see the module docstring."""
    sets = trace.unique_sets()
    nexts = next_uses(sets)
    lazy = rows_read_lazy(sets)
    distinct = len(np.unique(np.concatenate(sets)))
    result: dict[str, Any] = {
        "trace": trace.name,
        "batches": len(sets),
        "tokens": int(trace.ids.size),
        "unique_per_batch": lazy / len(sets),
        "distinct_ids": distinct,
        "lazy": lazy,
        "sizes": [],
    }
    for frac in args.cache_fracs:
        c = max(1, round(frac * args.vocab))
        row: dict[str, Any] = {"frac": frac, "cache_rows": c, "lazy": lazy}
        bar.set_postfix_str(f"{trace.name[:10]} {frac:g} belady")
        row["belady"] = rows_read_belady(sets, nexts, c)
        bar.update()
        for policy in PIPE_POLICIES:
            bar.set_postfix_str(f"{trace.name[:10]} {frac:g} {policy}")
            row[policy] = rows_read_embedpipe(sets, args.vocab, c, policy)
            bar.update()
        bar.set_postfix_str(f"{trace.name[:10]} {frac:g} cachetools")
        row["worker_lru"] = rows_read_worker_lru(sets, c, args.workers)
        row["worker_lru_split"] = rows_read_worker_lru(sets, c // args.workers, args.workers)
        bar.update()
        result["sizes"].append(row)
    # The checks: the real pipe agrees with the simulation; the two Belady codes agree.
    c = max(1, round(args.check_frac * args.vocab))
    check: dict[str, Any] = {"cache_rows": c, "frac": args.check_frac}
    for policy in PIPE_POLICIES:
        bar.set_postfix_str(f"{trace.name[:10]} check {policy}")
        stats = rows_read_pipe(table_path, trace, len(sets), c, policy)
        check[policy] = {
            "pipe": stats["rows_read"],
            "sim": rows_read_embedpipe(sets, args.vocab, c, policy),
        }
        bar.update()
    check["belady"] = {
        "heap": rows_read_belady(sets, nexts, c),
        "argpartition": rows_read_belady_check(sets, nexts, c),
    }
    bar.update()
    result["check"] = check
    return result


# ----------------------------------------------------------------------------- throughput
class TraceDataset(Dataset):
    """One sequence of the trace per sample: ``{"input_ids": (seq_len,) int64}``."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = torch.from_numpy(np.ascontiguousarray(ids))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class LRUCollate:
    """The obvious cache: a ``cachetools.LRUCache`` of rows in each worker, misses read from the
    table with ``Table.read``. Sends the unique rows and the inverse index (not (B, L, D))."""

    def __init__(self, table_path: str, cache_rows: int) -> None:
        self.table_path = table_path
        self.cache_rows = cache_rows
        self.table: embedpipe.Table | None = None
        self.cache: cachetools.LRUCache | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "table": None, "cache": None}

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if self.table is None:
            self.table = embedpipe.Table.open(self.table_path)
            self.cache = cachetools.LRUCache(maxsize=self.cache_rows)
        ids = torch.stack([s["input_ids"] for s in samples])
        unique, inverse = torch.unique(ids, return_inverse=True)
        keys = unique.tolist()
        misses = lru_lookup(self.cache, keys)
        if misses:
            for i, row in zip(misses, self.table.read(np.array(misses)), strict=True):
                self.cache[i] = row
        rows = torch.from_numpy(np.stack([self.cache[i] for i in keys]))
        return {"input_ids": ids, "inverse": inverse, "rows": rows}


@dataclass
class Variant:
    """A loader and what the loop does with each of its batches."""

    name: str
    workers: int
    loader: Any
    step: Callable[[Any], None]
    pipe: embedpipe.EmbeddingPipe | None = None
    train: bool = False

    def run(self) -> tuple[int, float]:
        """One pass over the loader: (batches, seconds)."""
        n = 0
        start = time.perf_counter()
        with torch.enable_grad() if self.train else torch.no_grad():
            for batch in self.loader:
                self.step(batch)
                n += 1
        return n, time.perf_counter() - start


def loader_kwargs(workers: int) -> dict[str, Any]:
    return {"num_workers": workers, "persistent_workers": workers > 0}


def make_variants(
    data: TraceDataset, paths: dict[str, str], args: argparse.Namespace, weight: torch.Tensor
) -> list[Variant]:
    """Every throughput variant, for ``num_workers`` 0 and ``--workers``."""
    bs = args.batch_size
    cache = max(1, round(args.tput_cache_frac * args.vocab))
    variants = []
    for w in sorted({0, args.workers}):
        kw = loader_kwargs(w)
        plain = DataLoader(data, batch_size=bs, **kw)
        emb = nn.Embedding.from_pretrained(weight.clone(), freeze=True)
        variants.append(
            Variant("(a) nn.Embedding in RAM", w, plain, lambda b, e=emb: e(b["input_ids"]))
        )

        def pipe_variant(name: str, rows: int, path: str, train: bool = False) -> Variant:
            opt = embedpipe.optim.SGD(lr=0.1) if train else None
            pipe = embedpipe.EmbeddingPipe(path, cache_rows=rows, policy="auto", optimizer=opt)
            loader = pipe.loader(data, batch_size=bs, **kw)
            if train:
                step = lambda b: b["inputs_embeds"].sum().backward()  # noqa: E731
            else:
                step = lambda b: b["inputs_embeds"]  # noqa: E731
            return Variant(name, w, loader, step, pipe, train)

        variants.append(pipe_variant("(b) embedpipe lazy (cache 0)", 0, paths["frozen"]))
        lru = DataLoader(data, batch_size=bs, collate_fn=LRUCollate(paths["frozen"], cache), **kw)
        variants.append(
            Variant(
                f"(c) per-worker cachetools LRU {args.tput_cache_frac:.0%}",
                w,
                lru,
                lambda b: F.embedding(b["inverse"], b["rows"]),
            )
        )
        variants.append(
            pipe_variant(f"(d) embedpipe auto {args.tput_cache_frac:.0%}", cache, paths["frozen"])
        )
        variants.append(pipe_variant("(e) embedpipe cache = vocab", args.vocab, paths["frozen"]))

        # Training: SGD(lr=0.1) on sum(inputs_embeds).
        for sparse in (False, True):
            emb_t = nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=sparse)
            opt = torch.optim.SGD(emb_t.parameters(), lr=0.1)

            def train_step(
                b: dict, e: nn.Embedding = emb_t, o: torch.optim.Optimizer = opt
            ) -> None:
                o.zero_grad()
                e(b["input_ids"]).sum().backward()
                o.step()

            name = "sparse" if sparse else "dense"
            variants.append(
                Variant(
                    f"(a) train: nn.Embedding {name} + torch SGD", w, plain, train_step, train=True
                )
            )
        for label, rows in (
            (f"auto {args.tput_cache_frac:.0%}", cache),
            ("cache = vocab", args.vocab),
        ):
            path = paths[f"train-{label}-{w}"]
            variants.append(pipe_variant(f"(d/e) train: embedpipe {label} + SGD", rows, path, True))
    return variants


def throughput(
    trace: Trace, table_path: str, folder: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Median batches/s of every variant; see the module docstring."""
    batches = min(args.tput_batches, trace.num_batches)
    data = TraceDataset(trace.ids[: batches * trace.batch_size])
    weight = embedpipe.Table.open(table_path).to_tensor()
    paths = {"frozen": table_path}
    cache_label = f"auto {args.tput_cache_frac:.0%}"
    for w in sorted({0, args.workers}):
        for label in (cache_label, "cache = vocab"):  # each trained pipe writes its own copy
            paths[f"train-{label}-{w}"] = dst = os.path.join(folder, f"train-{len(paths)}.zarr")
            shutil.copytree(table_path, dst)
    variants = make_variants(data, paths, args, weight)
    samples: dict[int, list[float]] = {i: [] for i in range(len(variants))}
    try:
        with tqdm(total=len(variants) * (args.repeats + 1), desc="throughput", unit="pass") as bar:
            for v in variants:  # warm-up: workers started, caches filled
                bar.set_postfix_str(f"warm-up {v.name[:30]} w={v.workers}")
                v.run()
                bar.update()
            for r in range(args.repeats):
                for i, v in enumerate(variants):
                    bar.set_postfix_str(f"repeat {r + 1} {v.name[:30]} w={v.workers}")
                    n, seconds = v.run()
                    samples[i].append(n / seconds)
                    bar.update()
        rows = []
        for i, v in enumerate(variants):
            stats = v.pipe.stats() if v.pipe is not None else None
            rows.append(
                {
                    "name": v.name,
                    "workers": v.workers,
                    "train": v.train,
                    "batches_per_s": statistics.median(samples[i]),
                    "samples": samples[i],
                    "stats": stats,
                }
            )
    finally:
        for v in variants:
            if v.pipe is not None:
                v.pipe.close()
        del variants  # persistent workers exit with their loaders
    for row in rows:
        base = next(
            r
            for r in rows
            if r["workers"] == row["workers"]
            and r["name"].startswith("(a)")
            and r["train"] == row["train"]
        )
        row["ratio_to_a"] = row["batches_per_s"] / base["batches_per_s"]
    return {"batches": batches, "rows": rows}


# ----------------------------------------------------------------------------- memory
def memory_table(args: argparse.Namespace) -> dict[str, Any]:
    """Host bytes of each way of holding rows (computed from the shapes, float32)."""
    row = args.dim * 4
    table = args.vocab * row
    ring = args.workers * 3 * min(args.vocab, DEFAULT_RING_ROWS) * row  # prefetch_factor 2
    sizes = []
    for frac in [*args.cache_fracs, 1.0]:
        c = max(1, round(frac * args.vocab))
        sizes.append(
            {
                "frac": frac,
                "cache_rows": c,
                # rows + slot_id + version (shared), slot_of (shared) + last_updated (owner)
                "embedpipe": c * row + c * 16 + args.vocab * 8 + c * 2,
                "embedpipe_ring": ring,
                # one numpy row (112 bytes of header) + an LRU entry (~100 bytes) per row, per worker
                "worker_lru": args.workers * c * (row + 112 + 100),
            }
        )
    return {"table": table, "sizes": sizes}


def peak_rss() -> dict[str, float]:
    """Peak resident memory (MiB) of this process and of the largest child that has exited."""
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return {"main_mib": self_kb / 1024, "worker_mib": child_kb / 1024}


# ----------------------------------------------------------------------------- output
def md_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: (
        "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    )  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_policy(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n### Rows read from disk: {result['trace']}\n")
    print(
        f"{result['batches']} batches of {args.batch_size} x {args.seq_len} tokens, "
        f"{result['unique_per_batch']:.0f} unique ids per batch on average, "
        f"{result['distinct_ids']} distinct ids in all (the compulsory reads). "
        f"Rows read, and in brackets the ratio to Belady's optimum.\n"
    )
    cols = [
        ("belady", "Belady (optimal)"),
        ("lru", "embedpipe lru"),
        ("lfu", "embedpipe lfu"),
        ("auto", "embedpipe auto"),
        ("worker_lru", f"cachetools LRU x{args.workers} workers (C each)"),
        ("worker_lru_split", f"cachetools LRU x{args.workers} (C/{args.workers} each)"),
        ("lazy", "lazy (no cache)"),
    ]
    rows = []
    for s in result["sizes"]:
        cells = [f"{s['frac']:.0%} ({s['cache_rows']})"]
        for key, _ in cols:
            cells.append(f"{s[key]:,} ({s[key] / max(1, s['belady']):.2f}x)")
        rows.append(cells)
    print(md_table(["cache (rows)", *(c[1] for c in cols)], rows))
    ch = result["check"]
    agree = all(ch[p]["pipe"] == ch[p]["sim"] for p in PIPE_POLICIES)
    parts = ", ".join(f"{p} {ch[p]['pipe']:,} vs {ch[p]['sim']:,}" for p in PIPE_POLICIES)
    print(
        f"\nCheck at {ch['frac']:.0%} ({ch['cache_rows']} rows), real EmbeddingPipe "
        f"(num_workers=0) vs simulation: {parts} -> {'agree' if agree else 'DISAGREE'}. "
        f"Belady heap {ch['belady']['heap']:,} vs argpartition "
        f"{ch['belady']['argpartition']:,} -> "
        f"{'agree' if ch['belady']['heap'] == ch['belady']['argpartition'] else 'DISAGREE'}."
    )


def print_throughput(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n### Throughput: {result['batches']} batches of {args.batch_size} x {args.seq_len} "
        f"tokens, dim {args.dim}, median of {args.repeats} passes (warm caches)\n"
    )
    header = ["variant", "workers", "batches/s", "vs (a)", "rows read/batch", "hit rate"]
    rows = []
    for r in result["rows"]:
        st = r["stats"]
        if st is not None and st["batches"]:
            read = f"{st['rows_read'] / st['batches']:.0f}"
            looked = st["hits"] + st["misses"]
            hit = f"{st['hits'] / looked:.1%}" if looked else "-"
        else:
            read = hit = "-"
        rows.append(
            [
                r["name"],
                str(r["workers"]),
                f"{r['batches_per_s']:.1f}",
                f"{r['ratio_to_a']:.2f}x",
                read,
                hit,
            ]
        )
    print(md_table(header, rows))
    print(
        "\nvs (a): against nn.Embedding in RAM with the same workers (frozen rows against the "
        "frozen (a), training rows against the dense-gradient (a)); rows read/batch and hit rate "
        "over all passes, warm-up included."
    )


def print_memory(result: dict[str, Any], rss: dict[str, float], args: argparse.Namespace) -> None:
    print(f"\n### Memory (table {mib(result['table'])}: {args.vocab} x {args.dim} float32)\n")
    rows = [
        [
            f"{s['frac']:.0%} ({s['cache_rows']})",
            mib(s["embedpipe"]),
            f"{s['embedpipe'] / result['table']:.1%}",
            mib(s["embedpipe_ring"]),
            mib(s["worker_lru"]),
        ]
        for s in result["sizes"]
    ]
    header = [
        "cache (rows)",
        "embedpipe cache",
        "of table",
        f"+ ring ({args.workers} workers)",
        f"cachetools LRU x{args.workers} (C each)",
    ]
    print(md_table(header, rows))
    print(
        f"\nPeak RSS: main process {rss['main_mib']:.0f} MiB, largest worker "
        f"{rss['worker_mib']:.0f} MiB (shared memory counted in each process that touches it)."
    )


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "cachetools": cachetools.__version__,
        "embedpipe": embedpipe.__version__,
    }


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)  # the workers and the main process share 2 cores
    env = environment()
    print(f"## embedpipe benchmark\n\n{json.dumps(env)}\n")
    print(f"args: {' '.join(sys.argv[1:]) or '(defaults)'}")
    results: dict[str, Any] = {"env": env, "args": vars(args)}
    folder = tempfile.mkdtemp(prefix="embedpipe-bench-", dir=args.dir)
    try:
        table_path = os.path.join(folder, "table.zarr")
        embedpipe.Table.create(table_path, args.vocab, args.dim, seed=args.seed).close()
        zipf = zipf_trace(args)
        if not args.skip_policy:
            traces = [zipf]
            files = text_files(args.text)
            text = text_trace(files, args, args.batches) if files else None
            if text is not None:
                traces.append(text)
            steps = len(traces) * (len(args.cache_fracs) * 5 + len(PIPE_POLICIES) + 1)
            results["policy"] = []
            with tqdm(total=steps, desc="rows read", unit="run") as bar:
                for trace in traces:
                    results["policy"].append(policy_table(trace, args, table_path, bar))
            for result in results["policy"]:
                print_policy(result, args)
        if not args.skip_throughput:
            results["throughput"] = throughput(zipf, table_path, folder, args)
            print_throughput(results["throughput"], args)
        results["memory"] = memory_table(args)
        results["rss"] = peak_rss()
        print_memory(results["memory"], results["rss"], args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    print(f"\nTotal time: {results['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
