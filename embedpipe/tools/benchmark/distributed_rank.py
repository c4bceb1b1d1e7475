"""One rank of the ``distributed`` section: what each process ``torchrun`` starts runs.

    python -m torch.distributed.run --nproc_per_node N --master_port P \\
        -m embedpipe.tools.benchmark.distributed_rank CONFIG.json

``distributed.py`` (the driver, in the benchmark's process) writes ``CONFIG.json`` and reads
the file this writes; everything here runs in the ranks, on gloo, one torch thread each.

Every rank takes its share (``DistributedSampler``) of the same Zipf trace and runs two model-free
training loops over it, in alternating timed blocks of ``block`` steps after ``warmup`` untimed
steps of each:

- **pipe**: ``EmbeddingPipe(table, optimizer=embedpipe.optim.SGD)`` (sharded by row range when
  N > 1), ``num_workers=0``, stepped by a ``torch.optim.SGD`` holding ``pipe.parameter``. Per
  step: ``next(loader)`` (this rank's rows from its cache), ``batch["inputs_embeds"]`` (the
  rows exchange), ``(inputs_embeds * w).sum().backward()`` (the gradient exchange, in the hook),
  ``optimizer.step()`` and the wait for this rank's writeback to apply it;
- **replicated**: the whole table as a dense ``nn.Embedding`` on every rank, as DDP replicates
  it: lookup, the same loss, backward, ``all_reduce`` of the dense V x D gradient divided by N,
  ``torch.optim.SGD``.

The two exchanges of the pipe are timed by wrapping its ``Shards.rows`` and ``Shards.gradient``
(no change to the pipe's code). Rank 0 gathers every rank's record (``all_gather_object``) and
writes ``{"world": N, "ranks": [...]}`` to ``config["out"]``; ``distributed.summarise`` turns it
into medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from ... import optim
from ...pipe.handle import EmbeddingPipe
from ...ranks.shards import split
from ...store.table import Table
from .traces import TraceDataset, zipf_trace

LR = 0.1
#: The per-step columns of a record, in order (seconds, then row counts).
PIPE_COLUMNS = ("load", "read", "rows_exchange", "backward", "gradient_exchange", "step", "total")
REPLICATED_COLUMNS = ("load", "read", "backward", "all_reduce", "step", "total")


def hot_first(ids: np.ndarray, vocab: int) -> np.ndarray:
    """``ids`` relabelled by frequency in the trace: the most frequent id becomes 0, and so on
    (the rank-0 shard then holds the hot rows, as in a vocabulary sorted by frequency)."""
    order = np.argsort(-np.bincount(ids.ravel(), minlength=vocab), kind="stable")
    relabel = np.empty(vocab, dtype=np.int64)
    relabel[order] = np.arange(vocab)
    return relabel[ids]


def dataset(config: dict[str, Any], world: int) -> TraceDataset:
    """The same trace on every rank: ``batches`` local batches for each of the ``world`` ranks."""
    trace = zipf_trace(argparse.Namespace(**config), config["batches"] * world)
    ids = hot_first(trace.ids, config["vocab"]) if config["hot_first"] else trace.ids
    return TraceDataset(ids)


def forever(loader: Any) -> Generator[Any, None, None]:
    while True:
        yield from loader


def timed(method: Callable[..., Any], spent: dict[str, float], key: str) -> Callable[..., Any]:
    """``method``, adding the seconds each call takes to ``spent[key]``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start

    return call


class PipeLoop:
    """The pipe's training loop, one step at a time; see the module docstring."""

    def __init__(self, config: dict[str, Any], data: TraceDataset, w: torch.Tensor) -> None:
        self.pipe = EmbeddingPipe(
            config["table"],
            cache_rows=config["cache_rows"],
            optimizer=optim.SGD(lr=LR),
            owner="thread",  # each rank owns a shard (one rank: the whole table), its writeback here
        )
        self.opt = torch.optim.SGD([self.pipe.parameter], lr=LR)
        sampler = DistributedSampler(data, shuffle=False, drop_last=True)
        self.batches = forever(
            self.pipe.loader(data, batch_size=config["batch_size"], sampler=sampler)
        )
        self.w = w
        self.spent = {"rows_exchange": 0.0, "gradient_exchange": 0.0}
        shards = self.pipe._owner.shards  # None for one rank: nothing to exchange
        if shards is not None:
            shards.rows = timed(shards.rows, self.spent, "rows_exchange")
            shards.gradient = timed(shards.gradient, self.spent, "gradient_exchange")

    def step(self) -> list[float]:
        """One step: its seconds per PIPE_COLUMNS, then the batch's unique rows and the rows of
        the averaged gradient (every rank's batch: the rows the step updates)."""
        self.spent.update(rows_exchange=0.0, gradient_exchange=0.0)
        t0 = time.perf_counter()
        batch = next(self.batches)
        t1 = time.perf_counter()
        embeds = batch["inputs_embeds"]
        t2 = time.perf_counter()
        (embeds * self.w).sum().backward()
        t3 = time.perf_counter()
        union = self.pipe.parameter.grad.shape[0]
        self.opt.step()
        self.opt.zero_grad()
        self.pipe._owner.writeback.wait()  # this rank's rows applied (the next lookup waits so)
        t4 = time.perf_counter()
        unique = len(batch.unique_ids)
        rx, gx = self.spent["rows_exchange"], self.spent["gradient_exchange"]
        return [t1 - t0, t2 - t1, rx, t3 - t2, gx, t4 - t3, t4 - t0, unique, union]

    def counters(self) -> dict[str, int]:
        stats = self.pipe.stats()
        keys = ("remote_rows", "served_rows", "steps", "batches", *EXCHANGE_BYTES)
        return {k: stats.get(k, 0) for k in keys}  # one rank exchanges no bytes


#: The pipe's counters of the bytes a rank's exchanges send and receive (``Shards.bytes``).
EXCHANGE_BYTES = (
    "rows_sent_bytes",
    "rows_received_bytes",
    "gradient_sent_bytes",
    "gradient_received_bytes",
)


class ReplicatedLoop:
    """A dense ``nn.Embedding`` on every rank, its gradient all-reduced (what DDP does)."""

    def __init__(self, config: dict[str, Any], data: TraceDataset, w: torch.Tensor) -> None:
        self.weight = torch.nn.Parameter(Table.open(config["table"]).to_tensor())
        self.opt = torch.optim.SGD([self.weight], lr=LR)
        sampler = DistributedSampler(data, shuffle=False, drop_last=True)
        self.batches = forever(DataLoader(data, batch_size=config["batch_size"], sampler=sampler))
        self.w = w
        self.world = dist.get_world_size()

    def step(self) -> list[float]:
        """One step: its seconds per REPLICATED_COLUMNS, then the batch's unique rows."""
        t0 = time.perf_counter()
        ids = next(self.batches)["input_ids"]
        t1 = time.perf_counter()
        embeds = F.embedding(ids, self.weight)
        t2 = time.perf_counter()
        (embeds * self.w).sum().backward()
        t3 = time.perf_counter()
        dist.all_reduce(self.weight.grad)
        self.weight.grad /= self.world
        t4 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad()
        t5 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0, len(torch.unique(ids))]


def block(loop: PipeLoop | ReplicatedLoop, steps: int) -> tuple[list[list[float]], float]:
    """``steps`` steps of ``loop``, the ranks started together: each step's figures, steps/s."""
    dist.barrier()
    start = time.perf_counter()
    figures = [loop.step() for _ in range(steps)]
    return figures, steps / (time.perf_counter() - start)


def measure(config: dict[str, Any]) -> dict[str, Any]:
    """This rank's record: per-step figures and per-round rates of both loops, pipe counters."""
    world, rank = dist.get_world_size(), dist.get_rank()
    data = dataset(config, world)
    w = torch.randn(config["seq_len"], config["dim"], generator=torch.Generator().manual_seed(1))
    replicated = ReplicatedLoop(config, data, w)  # reads the table before the pipe trains it
    pipe = PipeLoop(config, data, w)
    try:
        block(pipe, config["warmup"])
        block(replicated, config["warmup"])
        before = pipe.counters()
        out: dict[str, Any] = {"pipe": [], "replicated": [], "pipe_rates": [], "rep_rates": []}
        for _ in range(config["rounds"]):
            for name, loop in (("pipe", pipe), ("rep", replicated)):
                figures, rate = block(loop, config["block"])
                out["pipe" if name == "pipe" else "replicated"] += figures
                out[f"{name}_rates"].append(rate)
        after = pipe.counters()
    finally:
        # The loops' iterators end here, not in the interpreter's teardown (with gloo's threads).
        pipe.batches.close()
        replicated.batches.close()
        pipe.pipe.close()
    table = Table.open(config["table"])
    bounds = split(table.num_rows, table.chunk_rows, world) if world > 1 else [0, table.num_rows]
    out["counters"] = {k: after[k] - before[k] for k in after}
    out["rank"], out["owned"] = rank, [int(bounds[rank]), int(bounds[rank + 1])]
    return out


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        config = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record = measure(config)
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump({"world": dist.get_world_size(), "ranks": records}, f)
    dist.barrier()  # every rank past its last exchange before any rank tears down
    dist.destroy_process_group()
    # The record is written: leave without the interpreter's teardown, where a rank has aborted
    # twice in CI ("terminate called without an active exception", no Python frame left; once
    # in 50 launches at most, not reproduced) after every pipe and group was closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
