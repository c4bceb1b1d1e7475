"""The loop beside a simulated accelerator: what the pipe costs a training process whose model
runs elsewhere (section ``accelerator``).

On a GPU the training process spends most of a step waiting for the device, with the GIL
released (a CUDA synchronize does that). This section waits ``T`` ms per batch the same way
(``time.sleep``, between the forward read of ``inputs_embeds`` and backward), so what it measures
is what the pipe adds to the step's critical path and what its threads take from the training
process, not the host's arithmetic. Per batch::

    embeds = lookup;  wait T ms (GIL released);  embeds.sum().backward();  optimizer step

A loop whose step is bound by Python launching the kernels (a small batch on a fast GPU: a
BERT-base step of 32 x 128 tokens on an H200, docs/gpu.md) holds the GIL for most of T instead.
``--accel-hold H`` spends the first H x T of the wait in a Python loop that holds the GIL (as
launching kernels does, giving it up only at the interpreter's switch interval) and sleeps the
rest; the default 0 is the wait above.

Variants, ``--accel-dim`` floats a row, a cache of ``--accel-cache-frac``, Adagrad (lr 0.01),
``--workers`` DataLoader workers:

- (a) ``nn.Embedding(sparse=True)`` + ``torch.optim.Adagrad``, the table in RAM, ids from a
  plain DataLoader (the baseline);
- (t) embedpipe, the owner in a thread of the training process (``owner="thread"``);
- (p) embedpipe, the owner in a process of its own (``owner="process"``).

Each variant's sample is paired with a baseline sample taken just before it (as in the
throughput section); the median ratio is reported. A sample is ``--accel-batches`` batches of
one long epoch (those batches, repeated), as in a training run, not an epoch of its own: each
epoch forks the lookahead's foresight child, and the copy-on-write of the training process's
pages after that fork costs it in the batches that follow (docs/benchmarks.md). Target (the
table-service issue): >= 0.95x at T = 10 and 20 ms, 5% cache, D = 768.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ... import optim
from ...cache.policy import POLICIES
from ...pipe.handle import EmbeddingPipe
from ...store.table import Table
from .options import fraction, integer, share
from .report import md_table, quartiles, ratio, target
from .throughput import (
    CPU_HEADER,
    CPU_NOTE,
    EPOCH_PASSES,
    Variant,
    baseline_of,
    cpu_cells,
    cpu_target,
    end_epochs,
    paired_rounds,
    summary,
)
from .traces import Repeated, TraceDataset, zipf_trace

NAME = "accelerator"
QUICK = {"accel_batches": 8, "accel_repeats": 3, "accel_ms": [10]}
GOAL = 0.95
LR = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("simulated accelerator (section 'accelerator')")
    g.add_argument(
        "--accel-ms", type=float, nargs="+", default=[10.0, 20.0], help="accelerator ms a batch"
    )
    g.add_argument(
        "--accel-hold",
        type=share,
        default=0.0,
        help="share of the T ms spent holding the GIL, as a loop launching kernels does "
        "(default 0: all of it released)",
    )
    g.add_argument("--accel-dim", type=integer(1), default=768, help="floats per row")
    g.add_argument("--accel-cache-frac", type=fraction, default=0.05, help="the pipes' cache")
    g.add_argument(
        "--accel-policy",
        default="auto",
        choices=POLICIES,
        help="the pipes' cache policy",
    )
    g.add_argument("--accel-batches", type=integer(1), default=30, help="batches per pass")
    g.add_argument("--accel-repeats", type=integer(1), default=5, help="timed samples")


def accelerate(seconds: float, hold: float) -> None:
    """The accelerator's forward and backward: ``hold`` of ``seconds`` holding the GIL (Python
    launching kernels), then the rest with the GIL released (waiting for the device)."""
    end = time.perf_counter() + seconds * hold
    while time.perf_counter() < end:
        pass
    time.sleep(seconds * (1 - hold))


def in_ram(weight: torch.Tensor, seconds: float, hold: float) -> Any:
    emb = nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=True)
    adagrad = torch.optim.Adagrad(emb.parameters(), lr=LR)

    def step(batch: Any) -> None:
        embeds = emb(batch["input_ids"])
        accelerate(seconds, hold)
        embeds.sum().backward()
        adagrad.step()
        adagrad.zero_grad()

    return step


def piped(pipe: EmbeddingPipe, seconds: float, hold: float) -> Any:
    def step(batch: Any) -> None:
        embeds = batch["inputs_embeds"]
        accelerate(seconds, hold)
        embeds.sum().backward()
        pipe.step()

    return step


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    trace = zipf_trace(args, args.accel_batches)
    data = Repeated(TraceDataset(trace.head(args.accel_batches)), EPOCH_PASSES)  # one epoch
    path = os.path.join(workdir, "accelerator.zarr")
    Table.create(path, args.vocab, args.accel_dim, seed=args.seed).close()
    weight = Table.open(path).to_tensor()
    cache = max(1, round(args.accel_cache_frac * args.vocab))
    kw: dict[str, Any] = {
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "persistent_workers": True,
    }
    results = []
    for ms in args.accel_ms:
        pipes = []
        variants = [Variant(f"(a) nn.Embedding sparse + torch Adagrad, {ms:g} ms", args.workers,
                            DataLoader(data, **kw), in_ram(weight, ms / 1000, args.accel_hold), train=True)]  # fmt: skip
        for owner in ("thread", "process"):
            copy = os.path.join(workdir, f"accelerator-{owner}-{ms:g}.zarr")
            Table.from_tensor(copy, weight).close()
            pipe = EmbeddingPipe(
                copy,
                cache_rows=cache,
                optimizer=optim.Adagrad(lr=LR),
                owner=owner,
                policy=args.accel_policy,
            )
            pipes.append(pipe)
            name = f"({owner[0]}) embedpipe, owner {owner}, cache {args.accel_cache_frac:.0%}"
            if args.accel_policy != "auto":
                name += f", {args.accel_policy}"
            variants.append(
                Variant(
                    name,
                    args.workers,
                    pipe.loader(data, **kw),
                    piped(pipe, ms / 1000, args.accel_hold),
                    pipe,
                    train=True,
                )
            )
        for v in variants:
            v.pass_batches = args.accel_batches
        try:
            total = len(variants) + 2 * (len(variants) - 1) * args.accel_repeats
            with tqdm(total=total, desc=f"accelerator {ms:g} ms", unit="pass") as bar:
                for v in variants:
                    v.run()  # warm-up
                    v.before = v.counters()
                    bar.update()
                clusters = [(variants[0], variants[1:], args.accel_repeats)]
                paired_rounds(clusters, args.accel_repeats, 0.0, bar)
            results += [{**summary(v), "ms": ms} for v in variants]
        finally:
            end_epochs(variants)
            for pipe in pipes:
                pipe.close()
            del variants
            gc.collect()
    return {
        "rows": results,
        "batches": args.accel_batches,
        "repeats": args.accel_repeats,
        "hold": args.accel_hold,
        "policy": args.accel_policy,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    head = (
        f"### Beside a simulated accelerator: dim {args.accel_dim}, batches of "
        f"{args.batch_size} x {args.seq_len}, {args.workers} workers, Adagrad\n\n"
        "Each batch: the lookup, a wait of T ms (the accelerator's forward and backward: "
        + (
            f"{result.get('hold', 0.0):.0%} of it holding the GIL as a loop launching kernels "
            "does, the rest with the GIL released"
            if result.get("hold")
            else "the GIL released"
        )
        + "), backward into the rows, the optimizer step. Median batches/s "
        f"of {result['repeats']} passes over {result['batches']} batches; vs (a): the ratio to "
        "`nn.Embedding(sparse=True)` + torch Adagrad timed just before, median and quartiles.\n"
    )
    rows = [
        [
            f"{r['ms']:g}",
            r["name"],
            f"{r['batches_per_s']:.1f}",
            ratio(r["vs_baseline"]) if r["ratios"] else "1.00x",
            *cpu_cells(r, baseline_of(r, result["rows"], ("ms",))),
        ]
        for r in result["rows"]
    ]
    header = ["T ms", "variant", "batches/s", "vs (a)", *CPU_HEADER]
    return head + "\n" + md_table(header, rows) + "\n" + CPU_NOTE + "\n"


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    if result is None:
        return [target("beside a simulated accelerator, vs nn.Embedding", None, ">= 0.95x", None)]
    out = []
    hold = result.get("hold", 0.0)
    for r in result["rows"]:
        if r["ratios"]:
            x = quartiles(r["ratios"])[1]
            name = f"{r['name']}, {r['ms']:g} ms" + (f", GIL held {hold:.0%}" if hold else "")
            goal = f">= {GOAL:.2f}x" + (" (set for a wait with the GIL released)" if hold else "")
            out.append(target(f"{name} vs (a)", x, goal, x >= GOAL if not hold else None))
            out += cpu_target(r, baseline_of(r, result["rows"], ("ms",)))
    return out
