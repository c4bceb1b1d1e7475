"""Where a frozen loader's time goes per batch: each stage in the main process and in a worker.

The main process is where a GPU's kernels are launched from, so every millisecond it spends on a
batch (receiving it, copying its rows out of the ring, the hand-off's refresh and admission,
building ``inputs_embeds``) is a millisecond the accelerator may wait. This script times each
stage of the loader, for ``num_workers`` 0 and ``--workers``, at a cache of ``--cache-frac`` of
the table and at the whole table, on the benchmark's Zipf trace and table (``embedpipe bench``'s
options of the same names)::

    python scripts/profile_handoff.py
    python scripts/profile_handoff.py --cprofile      # also the top functions, num_workers=0

How: each stage is a function or method of embedpipe (or the pickling of what a worker sends),
wrapped by a timer (``time.perf_counter``) for the run; the totals go into shared memory, one
row per process (the main process, each worker), so the workers' time comes back too. Workers
are forked, so they inherit the wrappers. Stages nest (an indented stage is part of the one above
it); "main: loop" is the whole loop per batch, "main: next()" the DataLoader's ``next()``
(waiting for a worker, receiving the batch, and the claim when it runs there). The lookahead
policy's reader is a thread of the main process: its time is the main process's too, and is
wall time, waits for the interpreter lock included. The timers add a
microsecond or two per stage. Times are per batch, medians over ``--repeats`` passes (a pass is
``--batches`` batches, after a warm-up pass); the machine may be shared, so compare rows within
one run, as ratios.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import multiprocessing
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

import embedpipe
from embedpipe.tools.benchmark.traces import TraceDataset, table_path, zipf_trace

#: (label, "module:attribute path") of every timed stage, outermost first. Labels that start with
#: "main" run in the main process, "worker" in a worker (or in the main process with no workers);
#: the indent says which stage a stage is part of. A path that does not exist is skipped.
STAGES = (
    ("main: claim", "embedpipe.pipe.loader:PipeSource.claim"),
    ("  ring copy", "embedpipe.cache.ring:BatchRing.read"),
    ("  hand-off", "embedpipe.owner.owner:Owner.hand_off"),
    ("    rows from the cache/table", "embedpipe.cache.rowcache:RowCache.current"),
    ("    admission", "embedpipe.cache.rowcache:RowCache.admit"),
    ("    rows the reader read ahead", "embedpipe.owner.lookahead:Stream.take"),
    ("main: receive (unpickle)", "multiprocessing.reduction:ForkingPickler.loads"),
    ("main: inputs_embeds", "embedpipe.worker.batch:EmbeddedBatch.__getitem__"),
    ("main, lookahead thread: batch ids", "embedpipe.owner.lookahead:Stream._ids"),
    ("main, lookahead thread: rows read", "embedpipe.owner.lookahead:Stream._fill"),
    ("worker: samples, checked one by one", "embedpipe.worker.lookup:CheckedDataset.__getitem__"),
    ("worker: samples, checked as a batch", "embedpipe.worker.lookup:CheckedDataset.__getitems__"),
    ("worker: lookup", "embedpipe.worker.lookup:Lookup.__call__"),
    ("  collate", "embedpipe.worker.collate:PadCollator.__call__"),
    ("  batch id check", "embedpipe.worker.lookup:as_ids"),
    ("  unique + inverse", "embedpipe.worker.lookup:unique_inverse"),
    ("  cache hits (seqlock)", "embedpipe.cache.rowcache:SharedRows.read"),
    ("  disk reads", "embedpipe.store.rowstore:RawRows.read"),
    ("    chunk stat/open", "embedpipe.store.rowstore:RawRows._opened"),
    ("  ring write", "embedpipe.cache.ring:BatchRing.write"),
    ("worker: send (pickle)", "multiprocessing.reduction:ForkingPickler.dumps"),
)
PROCESSES = 17  # rows of the shared totals: the main process, then up to 16 workers


class Timers:
    """Per-process, per-stage totals (seconds, calls) in shared memory that forked workers inherit."""

    def __init__(self) -> None:
        self._raw = multiprocessing.RawArray("d", PROCESSES * len(STAGES) * 2)
        self.totals = np.frombuffer(self._raw).reshape(PROCESSES, len(STAGES), 2)
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        for n, (_, where) in enumerate(STAGES):
            module_name, path = where.split(":")
            owner: Any = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            original = owner.__dict__.get(name) if isinstance(owner, type) else None
            target = getattr(owner, name, None)
            if target is None:
                continue
            raw = original if isinstance(original, classmethod) else None
            wrapped = self._timed(n, raw.__func__.__get__(owner) if raw else target)
            setattr(owner, name, staticmethod(wrapped) if raw else wrapped)
            self._undo.append(
                functools.partial(
                    setattr, owner, name, original if original is not None else target
                )
            )

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _timed(self, stage: int, function: Callable[..., Any]) -> Callable[..., Any]:
        totals = self.totals

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                info = torch.utils.data.get_worker_info()
                row = totals[0 if info is None else 1 + info.id % (PROCESSES - 1), stage]
                row[0] += time.perf_counter() - start
                row[1] += 1

        return timed


def in_ram(loader: Any, embedding: torch.nn.Embedding) -> float:
    """One pass of the plain loader + nn.Embedding: seconds per batch."""
    start = time.perf_counter()
    n = 0
    for batch in loader:
        embedding(batch["input_ids"])
        n += 1
    return (time.perf_counter() - start) / n


def profile_pass(loader: Any, timers: Timers) -> tuple[float, float, np.ndarray]:
    """One pass: seconds per batch of the loop and of ``next()``, and the stage totals per batch."""
    timers.totals[:] = 0
    n = 0
    in_next = 0.0
    start = time.perf_counter()
    iterator = iter(loader)
    while True:
        t = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            break
        in_next += time.perf_counter() - t
        batch["inputs_embeds"]
        n += 1
    loop = (time.perf_counter() - start) / n
    return loop, in_next / n, timers.totals[..., 0].copy() / n


def run(args: argparse.Namespace, folder: str) -> None:
    table = table_path(args, folder)  # the bench's table and trace, with these options
    embedding = torch.nn.Embedding.from_pretrained(embedpipe.Table.open(table).to_tensor())
    data = TraceDataset(zipf_trace(args, args.batches).ids)
    timers = Timers()
    columns = []
    for workers in (0, args.workers):
        kw: dict[str, Any] = {"num_workers": workers, "persistent_workers": workers > 0}
        plain = torch.utils.data.DataLoader(data, batch_size=args.batch_size, **kw)
        for frac in (args.cache_frac, 1.0):
            rows = max(1, round(frac * args.vocab))
            timers.install()  # before the workers fork
            try:
                with embedpipe.EmbeddingPipe(table, cache_rows=rows, owner="thread") as pipe:
                    loader = pipe.loader(data, batch_size=args.batch_size, **kw)
                    profile_pass(loader, timers)  # warm-up: workers started, cache filled
                    in_ram(plain, embedding)
                    samples = []
                    for _ in range(args.repeats):  # interleaved with the in-RAM loader
                        samples.append((in_ram(plain, embedding), *profile_pass(loader, timers)))
                    del loader
            finally:
                timers.uninstall()
            base = statistics.median(s[0] for s in samples)
            loop = statistics.median(s[1] for s in samples)
            ratio = statistics.median(s[0] / s[1] for s in samples)
            stages = np.median(np.stack([s[3] for s in samples]), axis=0)
            columns.append(
                (workers, frac, base, loop, statistics.median(s[2] for s in samples), ratio, stages)
            )
        del plain
    print_table(columns, args)
    if args.cprofile:
        print_cprofile(data, table, args)


def print_table(columns: list[tuple], args: argparse.Namespace) -> None:
    us = 1e6
    heads = [f"w={w}, cache {f:.0%}" for w, f, *_ in columns]
    width = max(len(label) for label, _ in STAGES) + 2
    print(
        f"\n### Per batch, in microseconds (dim {args.dim}, batches of {args.batch_size} x "
        f"{args.seq_len}, vocab {args.vocab:,}; medians of {args.repeats} passes of "
        f"{args.batches} batches)\n"
    )
    print("| stage".ljust(width + 2) + "|" + "|".join(f" {h:>18} " for h in heads) + "|")
    print("|" + "-" * (width + 1) + "|" + "|".join("-" * 20 for _ in heads) + "|")

    def line(label: str, values: list[str]) -> None:
        print(f"| {label:<{width}}|" + "|".join(f" {v:>18} " for v in values) + "|")

    line("in RAM loader: loop", [f"{c[2] * us:,.0f}" for c in columns])
    line("main: loop", [f"{c[3] * us:,.0f}" for c in columns])
    line("main: next()", [f"{c[4] * us:,.0f}" for c in columns])
    in_main = True
    for n, (label, _) in enumerate(STAGES):
        if not label.startswith(" "):
            in_main = label.startswith("main")
        values = []
        for c in columns:
            stages = c[6]
            # a worker's stages are summed over the workers; with none they run in the main process
            total = stages[0, n] if in_main or not c[0] else stages[1:, n].sum()
            values.append(f"{total * us:,.0f}" if total else "-")
        if any(v != "-" for v in values):
            line(label, values)
    line("batches/s vs in RAM (median)", [f"{c[5]:.2f}x" for c in columns])
    print(
        "\nWorker stages are summed over the workers: CPU time a batch costs them, which runs "
        "alongside the main process."
    )


def print_cprofile(data: Dataset, table: str, args: argparse.Namespace) -> None:
    rows = max(1, round(args.cache_frac * args.vocab))
    with embedpipe.EmbeddingPipe(table, cache_rows=rows, owner="thread") as pipe:
        loader = pipe.loader(data, batch_size=args.batch_size)
        for batch in loader:  # warm-up
            batch["inputs_embeds"]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.repeats):
            for batch in loader:
                batch["inputs_embeds"]
        profile.disable()
    print(f"\n### cProfile, num_workers=0, cache {args.cache_frac:.0%} (top 25 by own time)\n")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--vocab", type=int, default=30_522)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--batches", type=int, default=40, help="batches per pass")
    p.add_argument("--repeats", type=int, default=5, help="passes; medians are reported")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cache-frac", type=float, default=0.1, help="the small cache, of the vocab")
    p.add_argument("--cprofile", action="store_true", help="also cProfile num_workers=0")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as DataLoader workers, and as scripts/bench.py
    with tempfile.TemporaryDirectory(prefix="profile-handoff-") as folder:
        run(args, folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
