"""Benchmark embedpipe against the alternatives, side by side in one run on the same token trace.

What it measures, all on one Zipf-like token trace (``--zipf`` exponent,
ids permuted so that popular rows are spread over the table; batches of ``--batch-size`` x
``--seq-len`` tokens):

1. **Rows read from disk per cache policy**, for several cache sizes (``--cache-fracs`` of the
   vocabulary), counted at batch granularity (a batch reads each of its unique ids at most once):

   - embedpipe's shared cache with ``policy="lru"``, ``"lfu"`` and ``"auto"``, computed with
     embedpipe's own cache code (``SharedRows``/``RowCache`` and the policy from
     ``embedpipe.policy.make_policy``, rows of width 1, no disk) in the order a loader with
     ``num_workers=0`` runs it (lookup of batch t after the hand-off of batch t-1). For one size
     (``--check-frac``, first ``--check-batches`` batches) a real ``EmbeddingPipe`` is iterated
     over the trace and its ``stats()["rows_read"]`` is shown next to the simulation;
   - the obvious per-worker ``cachetools.LRUCache``: ``--workers`` workers, worker w sees
     batches w, w+workers, ... (as a DataLoader hands them out), each with a cache of the size
     (so ``workers`` times the memory) and, second baseline, of size / workers (same memory);
   - lazy loading (no cache: every unique id of every batch is read);
   - Belady's optimal policy (MIN with bypass: after each batch keep the rows used soonest
     again; next-use indices and a heap), the lower bound for any cache of that size;
   - two candidate policies, simulated here only (not in embedpipe): LFU whose counts survive
     eviction and that admits a missed row only if it is more frequent than the row it would
     evict ("freq-admit LFU"), and Belady restricted to the next ``--lookahead`` batches (what a
     policy that reads the sampler's order can do), ranking the other rows by past frequency.

   If a body of real text is found (``--text``; by default the English documentation the vim
   package installs under /usr/share/vim) the same table is also made for a word-level token
   trace of that text.
2. **Throughput** (batches/s, median of ``--repeats`` samples, each at least ``--min-time``
   seconds of passes over the first ``--tput-batches`` batches) of iterating a loader with the
   model-free work only (lookup, hand-off, building ``inputs_embeds``), for ``num_workers`` 0
   and ``--workers``:
   (a) the whole table in RAM as ``nn.Embedding`` (a plain DataLoader yields ids, the embedding
   runs in the main process), (b) embedpipe lazy loading (``cache_rows=0``), (c) a per-worker
   ``cachetools.LRUCache`` of ``--tput-cache-frac`` in a plain DataLoader ``collate_fn`` that reads
   misses with ``Table.read`` and sends the unique rows and the inverse index, (d) embedpipe with
   a cache of ``--tput-cache-frac`` and ``policy="auto"``, (e) embedpipe with
   ``cache_rows = vocab``. Training (``--train-batches``, ``--train-repeats``): each batch
   ``inputs_embeds.sum().backward()`` then ``pipe.step()`` with ``embedpipe.optim.SGD(lr=0.1)``
   for (d) and (e), against ``nn.Embedding`` (dense gradient, and ``sparse=True``) with
   ``torch.optim.SGD``.
   Loaders keep their workers (``persistent_workers``) and make one untimed warm-up pass, so
   caches are warm and workers started; the variants then take turns within each round, so a
   noisy neighbour slows them all alike. Ratios are against (a) with the same workers, each
   sample against a sample of (a) taken just before it; the median and quartiles are reported.
3. **Memory**: host bytes of each cache (embedpipe: rows, index, and the batch ring of its
   workers; per-worker LRU: its rows in every worker) against the table, and the peak RSS of the
   main process and of the largest child process (a DataLoader worker).

Run it (about 3-4 minutes on 2 cores with the defaults; ``--quick`` takes about 45 s)::

    python scripts/bench.py
    python scripts/bench.py --quick
    python scripts/bench.py --vocab 50257 --dim 128 --text none --json results.json

Tables go to stdout as markdown, progress bars to stderr. The tables on disk are made in a fresh
temporary folder (under ``--dir`` if given) that is deleted at the end. The main process uses one
torch thread (``torch.set_num_threads(1)``), as DataLoader workers do.
"""

from __future__ import annotations

import argparse
import gc
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
from collections.abc import Callable
from dataclasses import dataclass, field
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
#: The ``pipe.stats()`` counters kept per throughput variant (over its timed passes).
COUNTERS = ("batches", "hits", "misses", "rows_read", "rows_written", "evictions", "refreshed")


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
    p.add_argument("--batches", type=int, default=500, help="batches in the rows-read trace")
    p.add_argument(
        "--cache-fracs",
        type=float,
        nargs="+",
        default=[0.01, 0.02, 0.05, 0.10, 0.25],
        help="cache sizes of the rows-read table, as fractions of the vocabulary",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="workers of the per-worker LRU baseline and of the multi-worker throughput runs",
    )
    p.add_argument(
        "--lookahead", type=int, default=32, help="batches the simulated lookahead policy sees"
    )
    p.add_argument(
        "--check-frac",
        type=float,
        default=0.05,
        help="cache size at which a real EmbeddingPipe checks the simulation",
    )
    p.add_argument("--check-batches", type=int, default=200, help="batches of the real-pipe check")
    p.add_argument(
        "--text",
        nargs="+",
        default=["auto"],
        help="text files (or folders of *.txt) for a second, real-text rows-read table; "
        "'auto' looks for vim's documentation, 'none' skips it",
    )
    p.add_argument("--tput-batches", type=int, default=50, help="batches per throughput pass")
    p.add_argument(
        "--tput-cache-frac", type=float, default=0.05, help="cache of throughput variant (d)"
    )
    p.add_argument("--repeats", type=int, default=9, help="timed samples; the median is reported")
    p.add_argument(
        "--train-batches", type=int, default=12, help="batches per training throughput pass"
    )
    p.add_argument("--train-repeats", type=int, default=5, help="timed training samples")
    p.add_argument(
        "--min-time",
        type=float,
        default=0.3,
        help="a timed sample repeats passes until this many seconds have gone by",
    )
    p.add_argument("--skip-policy", action="store_true", help="skip the rows-read tables")
    p.add_argument("--skip-throughput", action="store_true", help="skip the throughput tables")
    p.add_argument("--quick", action="store_true", help="a ~45 s smoke run (fewer, smaller runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="make the temporary folder here (none: the system's tmp)")
    p.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.batches = min(args.batches, 150)
        args.cache_fracs = [0.02, 0.10]
        args.check_batches = min(args.check_batches, 60)
        args.tput_batches = min(args.tput_batches, 20)
        args.repeats = min(args.repeats, 3)
        args.min_time = min(args.min_time, 0.1)
        args.train_batches = min(args.train_batches, 3)
        args.train_repeats = min(args.train_repeats, 2)
    if min(args.cache_fracs) <= 0 or not 0 < args.check_frac <= 1:
        p.error("cache fractions must be > 0 (and --check-frac <= 1)")
    if min(args.workers, args.batches, args.tput_batches, args.train_batches) < 1:
        p.error("--workers, --batches, --tput-batches and --train-batches must be >= 1")
    if min(args.repeats, args.train_repeats, args.lookahead) < 1:
        p.error("--repeats, --train-repeats and --lookahead must be >= 1")
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

    def head(self, batches: int) -> np.ndarray:
        """The sequences of the first ``batches`` batches."""
        return self.ids[: min(batches, self.num_batches) * self.batch_size]

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
    """The files ``--text`` names: 'none', 'auto' (see TEXT_GLOBS), or files/folders/globs."""
    if spec == ["none"]:
        return []
    patterns = TEXT_GLOBS if spec == ["auto"] else spec
    files: list[str] = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if os.path.isdir(path):
                files += sorted(glob.glob(os.path.join(path, "*.txt")))
            else:
                files.append(path)
    return files


def _words(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return re.findall(r"\w+|[^\w\s]", f.read().lower())


def text_trace(files: list[str], args: argparse.Namespace) -> Trace | None:
    """A word-level trace of real text: words and punctuation, lowercased, ranked by frequency.

    The ``vocab - 1`` most frequent tokens get their own id; rarer ones share one "[UNK]" id (as
    a tokenizer's unknown token). Ranks are permuted over the table as in the synthetic trace.
    The token stream is cut into sequences in reading order, and the sequences are shuffled (as a
    DataLoader with ``shuffle=True`` would), so words repeat within a sequence as in real text.
    """
    counts: Counter[str] = Counter()
    for path in files:
        counts.update(_words(path))
    rank = {w: r for r, (w, _) in enumerate(counts.most_common(args.vocab - 1))}
    unk = args.vocab - 1
    tokens = np.concatenate([np.array([rank.get(w, unk) for w in _words(p)]) for p in files])
    rng = np.random.default_rng(args.seed + 1)
    ids = rng.permutation(args.vocab)[tokens.astype(np.int64)]
    seqs = ids[: len(ids) // args.seq_len * args.seq_len].reshape(-1, args.seq_len)
    seqs = seqs[rng.permutation(len(seqs))][: args.batches * args.batch_size]
    seqs = seqs[: len(seqs) // args.batch_size * args.batch_size]
    if len(seqs) == 0:
        return None
    name = (
        f"word-level text ({len(files)} files, {len(tokens) / 1e6:.2f}M tokens, "
        f"{len(counts)} distinct words)"
    )
    return Trace(name, seqs, args.batch_size)


# ----------------------------------------------------------------------------- rows read
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


def rows_read_belady_check(
    sets: list[np.ndarray], nexts: list[np.ndarray], vocab: int, cache_rows: int
) -> int:
    """Belady again, by argpartition instead of a heap: the two must agree."""
    due = np.zeros(vocab, dtype=np.int64)

    def key(t: int, u: np.ndarray, cand: np.ndarray, held: np.ndarray) -> np.ndarray:
        due[u] = nexts[t]
        return due[cand]

    return rows_read_keep_best(sets, cache_rows, key)


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
    table_path: str, ids: np.ndarray, batch_size: int, cache_rows: int, policy: str
) -> int:
    """A real EmbeddingPipe over ``ids`` (num_workers=0, frozen): its ``stats()["rows_read"]``."""
    with embedpipe.EmbeddingPipe(table_path, cache_rows=cache_rows, policy=policy) as pipe:
        for batch in pipe.loader(TraceDataset(ids), batch_size=batch_size):
            batch["inputs_embeds"]
        return pipe.stats()["rows_read"]


def policy_columns(args: argparse.Namespace) -> list[tuple[str, str]]:
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


def policy_table(
    trace: Trace, args: argparse.Namespace, table_path: str, bar: tqdm, check: bool
) -> dict[str, Any]:
    """Rows read per policy and cache size on ``trace``; see the module docstring."""
    sets = trace.unique_sets()
    nexts = next_uses(sets)
    lazy = rows_read_lazy(sets)
    v = args.vocab
    result: dict[str, Any] = {
        "trace": trace.name,
        "batches": len(sets),
        "tokens": int(trace.ids.size),
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
        for key, run in runs.items():
            bar.set_postfix_str(f"{trace.name[:9]} {frac:g} {key}")
            row[key] = run(c)
            bar.update()
        result["sizes"].append(row)
    c = max(1, round(args.check_frac * v))
    checks: dict[str, Any] = {"cache_rows": c, "frac": args.check_frac}
    checks["belady"] = {
        "heap": rows_read_belady(sets, nexts, v, c),
        "argpartition": rows_read_belady_check(sets, nexts, v, c),
    }
    bar.update()
    if check:  # the real pipe against the simulation, on the first check_batches batches
        head = trace.head(args.check_batches)
        checks["batches"] = len(head) // trace.batch_size
        for policy in ("lru", "auto"):
            bar.set_postfix_str(f"{trace.name[:9]} pipe {policy}")
            checks[policy] = {
                "pipe": rows_read_pipe(table_path, head, trace.batch_size, c, policy),
                "sim": rows_read_embedpipe(sets[: checks["batches"]], v, c, policy),
            }
            bar.update()
    result["check"] = checks
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
        missed = set(misses)
        found = {i: self.cache[i] for i in keys if i not in missed}  # before inserts evict them
        if misses:
            for i, row in zip(misses, self.table.read(np.array(misses)), strict=True):
                self.cache[i] = found[i] = row
        rows = torch.from_numpy(np.stack([found[i] for i in keys]))
        return {"input_ids": ids, "inverse": inverse, "rows": rows}


@dataclass
class Variant:
    """A loader and what the loop does with each of its batches."""

    name: str
    workers: int
    loader: Any
    step: Callable[[Any], Any]
    pipe: embedpipe.EmbeddingPipe | None = None
    train: bool = False
    rates: list[float] = field(default_factory=list)
    before: dict[str, int] | None = None

    def run(self, min_seconds: float = 0.0) -> float:
        """Passes over the loader until ``min_seconds`` have gone by (one at least): batches/s."""
        n = 0
        start = time.perf_counter()
        with torch.enable_grad() if self.train else torch.no_grad():
            while n == 0 or time.perf_counter() - start < min_seconds:
                for batch in self.loader:
                    self.step(batch)
                    n += 1
        return n / (time.perf_counter() - start)

    def counters(self) -> dict[str, int] | None:
        if self.pipe is None:
            return None
        stats = self.pipe.stats()
        return {k: stats[k] for k in COUNTERS}


def embed_step(batch: Any) -> Any:
    return batch["inputs_embeds"]


def backward_step(pipe: embedpipe.EmbeddingPipe) -> Callable[[Any], None]:
    """Backward through a batch, then the table's step (backward only adds to its gradient)."""

    def step(batch: Any) -> None:
        batch["inputs_embeds"].sum().backward()
        pipe.step()

    return step


def make_variants(
    tables: dict[str, str], args: argparse.Namespace, weight: torch.Tensor, trace: Trace
) -> list[Variant]:
    """Every throughput variant, frozen ones first, for ``num_workers`` 0 and ``--workers``."""
    bs = args.batch_size
    frozen = TraceDataset(trace.head(args.tput_batches))
    train = TraceDataset(trace.head(args.train_batches))
    cache = max(1, round(args.tput_cache_frac * args.vocab))
    pct = f"{args.tput_cache_frac:.0%}"
    out: list[Variant] = []
    for w in sorted({0, args.workers}):
        kw: dict[str, Any] = {"num_workers": w, "persistent_workers": w > 0}

        def pipe(
            name: str, rows: int, path: str, opt: Any = None, w: int = w, kw: dict = kw
        ) -> Variant:
            p = embedpipe.EmbeddingPipe(path, cache_rows=rows, policy="auto", optimizer=opt)
            data = train if opt is not None else frozen
            step = backward_step(p) if opt is not None else embed_step
            return Variant(name, w, p.loader(data, batch_size=bs, **kw), step, p, opt is not None)

        emb = nn.Embedding.from_pretrained(weight, freeze=True)
        plain = DataLoader(frozen, batch_size=bs, **kw)
        lru = DataLoader(
            frozen, batch_size=bs, collate_fn=LRUCollate(tables["frozen"], cache), **kw
        )
        out += [
            Variant("(a) nn.Embedding in RAM", w, plain, lambda b, e=emb: e(b["input_ids"])),
            pipe("(b) embedpipe lazy (cache 0)", 0, tables["frozen"]),
            Variant(
                f"(c) cachetools LRU {pct} per worker",
                w,
                lru,
                lambda b: F.embedding(b["inverse"], b["rows"]),
            ),
            pipe(f"(d) embedpipe auto, cache {pct}", cache, tables["frozen"]),
            pipe("(e) embedpipe, cache = vocab", args.vocab, tables["frozen"]),
        ]
        plain_train = DataLoader(train, batch_size=bs, **kw)
        for sparse in (False, True):
            e = nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=sparse)
            o = torch.optim.SGD(e.parameters(), lr=0.1)

            def step(b: dict, e: nn.Embedding = e, o: torch.optim.Optimizer = o) -> None:
                o.zero_grad()
                e(b["input_ids"]).sum().backward()
                o.step()

            kind = "sparse" if sparse else "dense"
            out.append(
                Variant(
                    f"(a) train: nn.Embedding {kind} + torch SGD", w, plain_train, step, train=True
                )
            )
        sgd = embedpipe.optim.SGD(lr=0.1)
        out += [
            pipe(
                f"(d) train: embedpipe auto, cache {pct} + SGD", cache, tables[f"train-d-{w}"], sgd
            ),
            pipe(
                "(e) train: embedpipe, cache = vocab + SGD", args.vocab, tables[f"train-e-{w}"], sgd
            ),
        ]
    return out


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, median, q3 = statistics.quantiles(xs, n=4)
    return q1, median, q3


def throughput(
    trace: Trace, table_path: str, folder: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Median batches/s of every variant, and its ratio to (a); see the module docstring.

    Each sample of a variant is taken right after a sample of its baseline (a) (same workers,
    frozen or training), and the ratio is taken within that pair: the machine is shared and its
    speed drifts by several times within a minute, which a ratio of samples seconds apart cancels.
    """
    weight = embedpipe.Table.open(table_path).to_tensor()
    tables = {"frozen": table_path}
    for w in sorted({0, args.workers}):
        for kind in "de":  # a trained pipe holds its table's writer lock: one copy each
            tables[f"train-{kind}-{w}"] = dst = os.path.join(folder, f"train-{kind}-{w}.zarr")
            shutil.copytree(table_path, dst)
    variants = make_variants(tables, args, weight, trace)
    ratios: dict[int, list[float]] = {id(v): [] for v in variants}
    clusters = []  # (baseline, the others, repeats) per (workers, training)
    for w in sorted({0, args.workers}):
        for train in (False, True):
            members = [v for v in variants if v.workers == w and v.train == train]
            base = next(v for v in members if v.name.startswith("(a)"))
            others = [v for v in members if v is not base]
            clusters.append((base, others, args.train_repeats if train else args.repeats))
    total = len(variants) + sum(2 * len(o) * r for _, o, r in clusters)
    try:
        with tqdm(total=total, desc="throughput", unit="pass") as bar:
            for v in variants:  # warm-up: workers started, caches filled
                bar.set_postfix_str(f"warm-up {v.name[:34]} w={v.workers}")
                v.run()
                v.before = v.counters()
                bar.update()
            for r in range(max(args.repeats, args.train_repeats)):
                for base, others, repeats in clusters:
                    if r >= repeats:
                        continue
                    for v in others:
                        bar.set_postfix_str(f"round {r + 1} {v.name[:34]} w={v.workers}")
                        base.rates.append(base.run(args.min_time))
                        v.rates.append(v.run(args.min_time))
                        ratios[id(v)].append(v.rates[-1] / base.rates[-1])
                        bar.update(2)
        rows = []
        for v in variants:
            after = v.counters()
            timed = (
                {k: after[k] - v.before[k] for k in COUNTERS}
                if after is not None and v.before is not None
                else None
            )
            rows.append(
                {
                    "name": v.name,
                    "workers": v.workers,
                    "train": v.train,
                    "batches_per_s": statistics.median(v.rates),
                    "samples": v.rates,
                    "vs_a": quartiles(ratios[id(v)] or [1.0]),
                    "ratios": ratios[id(v)],
                    "counters": timed,
                }
            )
    finally:
        for v in variants:
            if v.pipe is not None:
                v.pipe.close()
        del variants, clusters
        gc.collect()  # persistent workers exit with their loaders
    return {"batches": args.tput_batches, "train_batches": args.train_batches, "rows": rows}


# ----------------------------------------------------------------------------- memory
def memory_table(args: argparse.Namespace) -> dict[str, Any]:
    """Host bytes of each way of holding rows, computed from the shapes (float32)."""
    row = args.dim * 4
    ring = args.workers * 3 * min(args.vocab, DEFAULT_RING_ROWS) * row  # prefetch_factor 2
    sizes = []
    for frac in [*args.cache_fracs, 1.0]:
        c = max(1, round(frac * args.vocab))
        sizes.append(
            {
                "frac": frac,
                "cache_rows": c,
                # rows + slot_id + version + dirty/state_loaded; slot_of + last_updated per row
                "embedpipe": c * (row + 16 + 2) + args.vocab * 8,
                "embedpipe_ring": ring,
                # a numpy row (its data + ~112 bytes of header) and ~100 bytes of LRU entry
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


# ----------------------------------------------------------------------------- output
def md_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)]
    )


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_policy(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n### Rows read from disk: {result['trace']}\n")
    print(
        f"{result['batches']} batches of {args.batch_size} x {args.seq_len} tokens, "
        f"{result['unique_per_batch']:.0f} unique ids per batch on average, "
        f"{result['distinct_ids']:,} distinct ids in all (reads no cache avoids). "
        "Rows read from disk over the trace, and the ratio to Belady's optimum.\n"
    )
    cols = policy_columns(args)
    rows = []
    for s in result["sizes"]:
        cells = [f"{s['frac']:.0%} ({s['cache_rows']:,})"]
        cells += [f"{s[k]:,} ({s[k] / max(1, s['belady']):.2f}x)" for k, _ in cols]
        rows.append(cells)
    print(md_table(["cache (rows)", *(h for _, h in cols)], rows))
    ch = result["check"]
    same = ch["belady"]["heap"] == ch["belady"]["argpartition"]
    line = (
        f"\nChecks at {ch['frac']:.0%} ({ch['cache_rows']:,} rows): Belady by heap "
        f"{ch['belady']['heap']:,}, by argpartition {ch['belady']['argpartition']:,} "
        f"({'agree' if same else 'DISAGREE'})"
    )
    if "lru" in ch:
        pols = [p for p in ("lru", "auto") if p in ch]
        agree = all(ch[p]["pipe"] == ch[p]["sim"] for p in pols)
        parts = ", ".join(f"{p} {ch[p]['pipe']:,} vs {ch[p]['sim']:,}" for p in pols)
        line += (
            f"; a real EmbeddingPipe (num_workers=0, first {ch['batches']} batches) "
            f"`stats()['rows_read']` vs the simulation: {parts} ({'agree' if agree else 'DISAGREE'})"
        )
    print(line + ".")


def print_throughput(result: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\n### Throughput: dim {args.dim}, batches of {args.batch_size} x {args.seq_len} tokens\n"
    )
    print(
        f"Median batches/s of {args.repeats} samples (training: {args.train_repeats}), each at "
        f"least {args.min_time:g} s of passes over the first {result['batches']} batches "
        f"(training: {result['train_batches']}), after a warm-up pass. vs (a): the ratio to "
        "nn.Embedding in RAM with the same workers (training: to the dense-gradient one) timed "
        "just before it, median and quartiles over the samples. Rows read, written and refreshed (re-copied "
        "at hand-off because a step changed them after the lookup) per batch and the hit rate "
        "(over unique ids) from `pipe.stats()` over the timed passes.\n"
    )
    header = [
        "variant",
        "workers",
        "batches/s",
        "vs (a)",
        "rows read/batch",
        "hit rate",
        "rows written/batch",
        "refreshed/batch",
    ]
    rows = []
    for r in result["rows"]:
        c = r["counters"]
        if c and c["batches"]:
            looked = c["hits"] + c["misses"]
            extra = [
                f"{c['rows_read'] / c['batches']:.0f}",
                f"{c['hits'] / looked:.1%}" if looked else "-",
                f"{c['rows_written'] / c['batches']:.0f}" if r["train"] else "-",
                f"{c['refreshed'] / c['batches']:.0f}" if r["train"] else "-",
            ]
        else:
            extra = ["-"] * 4
        q1, q2, q3 = r["vs_a"]
        ratio = f"{q2:.2f}x ({q1:.2f}-{q3:.2f})" if r["ratios"] else "1.00x"
        rows.append([r["name"], str(r["workers"]), f"{r['batches_per_s']:.1f}", ratio, *extra])
    print(md_table(header, rows))


def print_memory(result: dict[str, Any], rss: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n### Memory (table {mib(result['table'])}: {args.vocab:,} x {args.dim} float32)\n")
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
            mib(s["embedpipe"]),
            f"{s['embedpipe'] / result['table']:.1%}",
            mib(s["embedpipe_ring"]),
            mib(s["worker_lru"]),
        ]
        for s in result["sizes"]
    ]
    print(md_table(header, rows))
    phases = "; ".join(
        f"after {phase}: main {r['main_mib']:.0f} MiB, largest child {r['worker_mib']:.0f} MiB"
        for phase, r in rss.items()
    )
    print(f"\nPeak RSS ({phases}). RSS counts shared memory in every process that touches it.")


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        # not platform.platform(): it runs `uname -p` in a child, which would count as a worker
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
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
    torch.set_num_threads(1)  # the workers and the main process share the cores
    env = environment()
    print(f"## embedpipe benchmark\n\n`{json.dumps(env)}`\n")
    print(f"args: `{' '.join(sys.argv[1:]) if argv is None else ' '.join(argv)}`")
    results: dict[str, Any] = {"env": env, "args": vars(args), "rss": {}}
    folder = tempfile.mkdtemp(prefix="embedpipe-bench-", dir=args.dir)
    try:
        table_path = os.path.join(folder, "table.zarr")
        embedpipe.Table.create(table_path, args.vocab, args.dim, seed=args.seed).close()
        zipf = zipf_trace(args)
        if not args.skip_policy:
            traces = [(zipf, True)]
            files = text_files(args.text)
            text = text_trace(files, args) if files else None
            if text is not None:
                traces.append((text, False))
            per_trace = len(args.cache_fracs) * len(policy_columns(args)) + 1
            steps = sum(per_trace + (2 if check else 0) for _, check in traces)
            results["policy"] = []
            with tqdm(total=steps, desc="rows read", unit="run") as bar:
                for trace, check in traces:
                    results["policy"].append(policy_table(trace, args, table_path, bar, check))
            for result in results["policy"]:
                print_policy(result, args)
            results["rss"]["rows-read tables"] = peak_rss()
        if not args.skip_throughput:
            results["throughput"] = throughput(zipf, table_path, folder, args)
            print_throughput(results["throughput"], args)
            results["rss"]["throughput"] = peak_rss()
        results["memory"] = memory_table(args)
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
