"""Loader throughput (batches/s) of the model-free loop, each variant as a ratio to its baseline.

The loop does only what the pipe adds: lookup, hand-off and building ``inputs_embeds`` (frozen),
plus ``inputs_embeds.sum().backward()`` and the table's step (training), over the first batches
of the Zipf trace, for ``num_workers`` 0 and ``--workers``. Variants:

- frozen, against (a) a plain DataLoader of ids + ``nn.Embedding`` with the whole table in RAM:
  (b) embedpipe lazy (``cache_rows=0``), (c) a per-worker ``cachetools.LRUCache`` of
  ``--tput-cache-frac`` in a plain DataLoader's ``collate_fn`` (misses read with ``Table.read``),
  (d) embedpipe ``policy="auto"`` with a cache of ``--tput-cache-frac``, (e) embedpipe with
  ``cache_rows = vocab``;
- training, against (a) ``nn.Embedding(sparse=True)`` + ``torch.optim.SGD`` in RAM: the same
  with a dense gradient, (d) embedpipe auto with a cache of ``--train-cache-frac`` +
  ``embedpipe.optim.SGD``, (e) embedpipe with ``cache_rows = vocab`` + SGD.

Loaders keep their workers and make one untimed warm-up pass (caches warm, workers started). A
pass is the next batches of one long epoch (the section's batches, repeated: ``Repeated``), as in
a training run, not an epoch of its own: each epoch of a lookahead pipe forks its foresight child,
and the training process then pays for the copy-on-write of every page it writes.
Then, round after round, each variant's sample (passes until ``--min-time`` seconds) is taken
right after a sample of its baseline, and the ratio is taken within that pair: the machine is
shared and its speed drifts by several times within a minute, which a ratio of samples seconds
apart cancels. The median and quartiles of the ratios are reported.

Targets (issue 9): frozen (d) at 10% >= 0.95x; training (d) at 5% >= 0.9x and (e) >= 1.0x.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cachetools
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ... import optim
from ...pipe.handle import EmbeddingPipe
from ...store.table import Table
from ..simulate import lru_lookup
from . import report as md
from .cpu import CpuMeter
from .options import fraction, integer
from .report import target
from .traces import Repeated, Trace, TraceDataset, table_path, zipf_trace

NAME = "throughput"
#: Passes of a variant's batches in one epoch of its loader (``Repeated``, ``Variant.pass_batches``).
EPOCH_PASSES = 64
QUICK = {"tput_batches": 20, "repeats": 5, "min_time": 0.2, "train_batches": 8, "train_repeats": 5}
#: The ``pipe.stats()`` counters kept per variant (over its timed passes).
COUNTERS = ("batches", "hits", "misses", "rows_read", "rows_written", "evictions", "refreshed")
#: (variant prefix, goal) of the targets: the ratio to the baseline must reach the goal.
GOALS = {"(d) frozen": 0.95, "(d) train": 0.9, "(e) train": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("throughput (section 'throughput')")
    g.add_argument("--tput-batches", type=integer(1), default=50, help="batches per frozen pass")
    g.add_argument(
        "--tput-cache-frac", type=fraction, default=0.10, help="cache of frozen (c) and (d)"
    )
    g.add_argument("--repeats", type=integer(1), default=9, help="timed samples (frozen)")
    g.add_argument("--train-batches", type=integer(1), default=12, help="batches per training pass")
    g.add_argument("--train-cache-frac", type=fraction, default=0.05, help="cache of training (d)")
    g.add_argument("--train-repeats", type=integer(1), default=5, help="timed training samples")
    g.add_argument(
        "--min-time",
        type=float,
        default=0.3,
        help="a timed sample repeats passes until this many seconds have gone by",
    )


class LRUCollate:
    """The obvious cache: a ``cachetools.LRUCache`` of rows in each worker, misses read from the
    table with ``Table.read``. Sends the unique rows and the inverse index (not (B, L, D))."""

    def __init__(self, path: str, cache_rows: int) -> None:
        self.path = path
        self.cache_rows = cache_rows
        self.table: Table | None = None
        self.cache: cachetools.LRUCache | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "table": None, "cache": None}

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if self.table is None or self.cache is None:
            self.table = Table.open(self.path)
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
    pipe: EmbeddingPipe | None = None
    train: bool = False
    rates: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    before: dict[str, int] | None = None
    cpu: CpuMeter = field(default_factory=CpuMeter)  # over the timed samples
    timed_batches: int = 0
    #: Batches a pass takes from one long epoch (0: a pass is an epoch of its own). Each epoch
    #: of a lookahead pipe forks its foresight child, whose copy-on-write pages the training
    #: process pays for in the batches after; a training run's epochs are thousands of batches.
    pass_batches: int = 0
    epoch: Iterator[Any] | None = None

    def batches(self) -> Iterator[Any]:
        """A pass's batches: the loader's epoch, or the next ``pass_batches`` of the one running."""
        if not self.pass_batches:
            yield from self.loader
            return
        for _ in range(self.pass_batches):
            batch = next(self.epoch, None) if self.epoch is not None else None
            if batch is None:  # the epoch is over (or none began): the next one
                self.epoch = iter(self.loader)
                batch = next(self.epoch)
            yield batch

    @property
    def baseline(self) -> bool:
        return self.name.startswith("(a)")

    def run(self, min_seconds: float = 0.0, timed: bool = False) -> float:
        """Passes over the loader until ``min_seconds`` have gone by (one at least): batches/s.
        A ``timed`` sample adds to the variant's CPU meter."""
        n = 0
        if timed:
            self.cpu.start()
        start = time.perf_counter()
        with torch.enable_grad() if self.train else torch.no_grad():
            while n == 0 or time.perf_counter() - start < min_seconds:
                for batch in self.batches():
                    self.step(batch)
                    n += 1
        rate = n / (time.perf_counter() - start)
        if timed:
            self.cpu.stop()
            self.timed_batches += n
        return rate

    def counters(self) -> dict[str, int] | None:
        if self.pipe is None:
            return None
        stats = self.pipe.stats()
        return {k: stats[k] for k in COUNTERS}


def end_epochs(variants: list[Variant]) -> None:
    """Drop the variants' running epochs (``pass_batches``), so that their DataLoader
    iterators and foresight children end before the pipes close."""
    for v in variants:
        v.epoch = None
    gc.collect()


def embed_step(batch: Any) -> Any:
    return batch["inputs_embeds"]


def backward_step(pipe: EmbeddingPipe) -> Callable[[Any], None]:
    """Backward through a batch, then the table's step (backward only adds to its gradient)."""

    def step(batch: Any) -> None:
        batch["inputs_embeds"].sum().backward()
        pipe.step()

    return step


def in_ram_step(sparse: bool, weight: torch.Tensor) -> Callable[[Any], None]:
    """``nn.Embedding`` over a copy of ``weight`` trained by ``torch.optim.SGD(lr=0.1)``."""
    emb = nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=sparse)
    sgd = torch.optim.SGD(emb.parameters(), lr=0.1)

    def step(batch: Any) -> None:
        sgd.zero_grad()
        emb(batch["input_ids"]).sum().backward()
        sgd.step()

    return step


def make_variants(
    tables: dict[str, str], args: argparse.Namespace, weight: torch.Tensor, trace: Trace
) -> list[Variant]:
    """Every variant, baselines first, for ``num_workers`` 0 and ``--workers``."""
    bs = args.batch_size
    frozen = Repeated(TraceDataset(trace.head(args.tput_batches)), EPOCH_PASSES)
    train = Repeated(TraceDataset(trace.head(args.train_batches)), EPOCH_PASSES)
    cache = max(1, round(args.tput_cache_frac * args.vocab))
    train_cache = max(1, round(args.train_cache_frac * args.vocab))
    pct, train_pct = f"{args.tput_cache_frac:.0%}", f"{args.train_cache_frac:.0%}"
    out: list[Variant] = []
    for w in sorted({0, args.workers}):
        kw: dict[str, Any] = {"num_workers": w, "persistent_workers": w > 0}

        def pipe(name: str, rows: int, path: str, w: int = w, kw: dict = kw) -> Variant:
            trains = name.startswith("(d) train") or name.startswith("(e) train")
            p = EmbeddingPipe(
                path,
                cache_rows=rows,
                policy="auto",
                optimizer=optim.SGD(lr=0.1) if trains else None,
            )
            step = backward_step(p) if trains else embed_step
            loader = p.loader(train if trains else frozen, batch_size=bs, **kw)
            return Variant(name, w, loader, step, p, trains)

        emb = nn.Embedding.from_pretrained(weight, freeze=True)
        lru = LRUCollate(tables["frozen"], cache)
        plain_train = DataLoader(train, batch_size=bs, **kw)
        out += [
            Variant(
                "(a) frozen: nn.Embedding in RAM",
                w,
                DataLoader(frozen, batch_size=bs, **kw),
                lambda b, e=emb: e(b["input_ids"]),
            ),
            pipe("(b) frozen: embedpipe lazy (cache 0)", 0, tables["frozen"]),
            Variant(
                f"(c) frozen: cachetools LRU {pct} per worker",
                w,
                DataLoader(frozen, batch_size=bs, collate_fn=lru, **kw),
                lambda b: F.embedding(b["inverse"], b["rows"]),
            ),
            pipe(f"(d) frozen: embedpipe auto, cache {pct}", cache, tables["frozen"]),
            pipe("(e) frozen: embedpipe, cache = vocab", args.vocab, tables["frozen"]),
            Variant(
                "(a) train: nn.Embedding sparse + torch SGD",
                w,
                plain_train,
                in_ram_step(True, weight),
                train=True,
            ),
            Variant(
                "(a') train: nn.Embedding dense + torch SGD",
                w,
                plain_train,
                in_ram_step(False, weight),
                train=True,
            ),
            pipe(
                f"(d) train: embedpipe auto, cache {train_pct} + SGD",
                train_cache,
                tables[f"train-d-{w}"],
            ),
            pipe("(e) train: embedpipe, cache = vocab + SGD", args.vocab, tables[f"train-e-{w}"]),
        ]
    for v in out:
        v.pass_batches = args.train_batches if v.train else args.tput_batches
    return out


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Median batches/s of every variant, and its ratio to its baseline; see the module docstring."""
    trace = zipf_trace(args, max(args.tput_batches, args.train_batches))
    path = table_path(args, workdir)
    weight = Table.open(path).to_tensor()
    tables = {"frozen": path}
    for w in sorted({0, args.workers}):
        for kind in "de":  # a trained pipe holds its table's writer lock: one copy each
            tables[f"train-{kind}-{w}"] = dst = os.path.join(workdir, f"train-{kind}-{w}.zarr")
            shutil.copytree(path, dst)
    variants = make_variants(tables, args, weight, trace)
    clusters = []  # (baseline, the others, repeats) per (workers, training)
    for w in sorted({0, args.workers}):
        for train in (False, True):
            members = [v for v in variants if v.workers == w and v.train == train]
            base = next(v for v in members if v.baseline)
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
            paired_rounds(clusters, max(args.repeats, args.train_repeats), args.min_time, bar)
        rows = [summary(v) for v in variants]
    finally:
        end_epochs(variants)
        for v in variants:
            if v.pipe is not None:
                v.pipe.close()
        del variants, clusters
        gc.collect()  # persistent workers exit with their loaders
    return {
        "batches": args.tput_batches,
        "train_batches": args.train_batches,
        "repeats": args.repeats,
        "train_repeats": args.train_repeats,
        "min_time": args.min_time,
        "rows": rows,
    }


def paired_rounds(
    clusters: list[tuple[Variant, list[Variant], int]], rounds: int, min_time: float, bar: Any
) -> None:
    """Each round, every variant of each (baseline, variants, repeats) cluster is timed right
    after a sample of its baseline, and their ratio kept (see the module docstring)."""
    for r in range(rounds):
        for base, others, repeats in clusters:
            if r >= repeats:
                continue
            for v in others:
                bar.set_postfix_str(f"round {r + 1} {v.name[:34]} w={v.workers}")
                base.rates.append(base.run(min_time, timed=True))
                v.rates.append(v.run(min_time, timed=True))
                v.ratios.append(v.rates[-1] / base.rates[-1])
                bar.update(2)


def summary(v: Variant) -> dict[str, Any]:
    """A variant's figures: median rate, ratios to its baseline, pipe counters over timed passes."""
    after = v.counters()
    timed = (
        {k: after[k] - v.before[k] for k in COUNTERS}
        if after is not None and v.before is not None
        else None
    )
    return {
        "name": v.name,
        "workers": v.workers,
        "train": v.train,
        "batches_per_s": statistics.median(v.rates),
        "samples": v.rates,
        "vs_baseline": md.quartiles(v.ratios or [1.0]),
        "ratios": v.ratios,
        "counters": timed,
        **cpu_per_batch(v),
    }


#: The CPU columns of a section's table, what they mean, and the target on the training process.
CPU_HEADER = ["CPU ms/batch: training process", "all processes", "training vs (a)"]
CPU_NOTE = (
    "\nCPU ms/batch over the timed samples (`cpu.py`): the training process alone (all its "
    "threads), and all processes (its DataLoader workers, the owner process, the lookahead's "
    "child); training vs (a): the training process's CPU a batch against the baseline's.\n"
)


def baseline_of(row: dict[str, Any], rows: list[dict[str, Any]], same: tuple[str, ...]) -> Any:
    """The (a) row with the same values of ``same`` as ``row``."""
    return next(
        (b for b in rows if b["name"].startswith("(a)") and all(b[k] == row[k] for k in same)),
        None,
    )


def cpu_cells(row: dict[str, Any], base: dict[str, Any] | None) -> list[str]:
    own, every = row.get("cpu_ms_own"), row.get("cpu_ms_all")
    if own is None:
        return ["-", "-", "-"]
    vs = "-"
    if base is not None and base.get("cpu_ms_own"):
        vs = f"{own / base['cpu_ms_own']:.2f}x"
    return [f"{own:.1f}", f"{every:.1f}", vs]


def cpu_per_batch(v: Variant) -> dict[str, float | None]:
    """CPU ms a batch over the timed samples: the training process's, and its whole tree's
    (workers, owner process, lookahead child: ``cpu.py``)."""
    n = v.timed_batches
    return {
        "cpu_ms_own": 1000 * v.cpu.own / n if n else None,
        "cpu_ms_all": 1000 * v.cpu.tree / n if n else None,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    head = (
        f"### Throughput: dim {args.dim}, batches of {args.batch_size} x {args.seq_len} tokens\n\n"
        f"Median batches/s of {result['repeats']} samples (training: {result['train_repeats']}), "
        f"each at least {result['min_time']:g} s of passes over the first {result['batches']} "
        f"batches (training: {result['train_batches']}), taken in turn from one long epoch of "
        "them repeated, after a warm-up pass. vs (a): the ratio "
        "to the baseline with the same workers (frozen: nn.Embedding in RAM; training: "
        "nn.Embedding(sparse=True) + torch SGD) timed just before it, median and quartiles over "
        "the samples. Rows read, written and refreshed (re-copied at hand-off because a step "
        "changed them after the lookup) per batch and the hit rate (over unique ids) from "
        "`pipe.stats()` over the timed passes.\n"
    )
    header = ["variant", "workers", "batches/s", "vs (a)", "rows read/batch", "hit rate"]
    header += ["rows written/batch", "refreshed/batch", *CPU_HEADER]
    rows = []
    for r in result["rows"]:
        base = baseline_of(r, result["rows"], ("workers", "train"))
        c = r["counters"]
        extra = ["-"] * 4
        if c and c["batches"]:
            looked = c["hits"] + c["misses"]
            extra = [
                f"{c['rows_read'] / c['batches']:.0f}",
                f"{c['hits'] / looked:.1%}" if looked else "-",
                f"{c['rows_written'] / c['batches']:.0f}" if r["train"] else "-",
                f"{c['refreshed'] / c['batches']:.0f}" if r["train"] else "-",
            ]
        shown = md.ratio(r["vs_baseline"]) if r["ratios"] else "1.00x"
        cells = [r["name"], str(r["workers"]), f"{r['batches_per_s']:.1f}", shown, *extra]
        rows.append(cells + cpu_cells(r, base))
    return head + "\n" + md.md_table(header, rows) + "\n" + CPU_NOTE + "\n"


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Frozen (d), training (d) and (e) against their baselines, per worker count."""
    if result is None:
        return [
            target(f"throughput {prefix}", None, f">= {goal:.2f}x", None)
            for prefix, goal in GOALS.items()
        ]
    out = []
    for r in result["rows"]:
        goal = next((g for prefix, g in GOALS.items() if r["name"].startswith(prefix)), None)
        if goal is not None:
            x = r["vs_baseline"][1]
            text = f"{r['name']}, {r['workers']} workers, vs (a)"
            out.append(target(text, x, f">= {goal:.2f}x", x >= goal))
            if r["workers"] > 0:
                out += cpu_target(r, baseline_of(r, result["rows"], ("workers", "train")))
    return out


def cpu_target(row: dict[str, Any], base: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The training process's CPU a batch at or below the baseline's (issue 22), with workers."""
    if base is None or not base.get("cpu_ms_own") or row.get("cpu_ms_own") is None:
        return []
    x = row["cpu_ms_own"] / base["cpu_ms_own"]
    return [target(f"{row['name']}: training process CPU/batch vs (a)", x, "<= 1.00x", x <= 1.0)]
