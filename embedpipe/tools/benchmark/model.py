"""The real-model figure: a small BERT's training step, table behind the pipe against in RAM.

A ``BertForSequenceClassification`` built from a ``BertConfig`` (no download), whose hidden size
is the table's width, trains one step per batch (forward, backward, AdamW on the dense weights
and the table's own step) in three ways over the same batches of the Zipf trace, with the same
``--workers``:

- pipe: the word embeddings offloaded with ``embedpipe.hf.offload``, looked up through an
  ``EmbeddingPipe`` with a cache of ``--model-cache-frac`` (``policy="auto"``) and trained by
  ``embedpipe.optim.SGD``; AdamW holds the pipe's parameter, so its step steps the table;
- in RAM, sparse: ``nn.Embedding(sparse=True)`` in the model and ``torch.optim.SGD`` on it;
- in RAM, dense: the same with a dense gradient.

Each round times one pass of each, in turn, after an untimed warm-up pass; the ratios of the
pipe to each in-RAM run are taken within a round, and their median and quartiles are reported.
This is where the pipe's cost is hidden behind the model's: the other sections show it bare.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ... import hf, optim
from ...pipe.handle import EmbeddingPipe
from . import report as md
from .options import fraction, integer
from .traces import TraceDataset, zipf_trace

NAME = "model"
QUICK = {"model_batches": 8, "model_repeats": 3}
WAYS = ("pipe", "sparse", "dense")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("real model (section 'model'; needs transformers)")
    g.add_argument(
        "--model-hidden", type=integer(1), default=128, help="hidden size (= table width)"
    )
    g.add_argument("--model-layers", type=integer(1), default=2, help="encoder layers")
    g.add_argument("--model-heads", type=integer(1), default=2, help="attention heads")
    g.add_argument("--model-seq-len", type=integer(2), default=64, help="tokens per sequence")
    g.add_argument("--model-batches", type=integer(1), default=12, help="batches per timed pass")
    g.add_argument("--model-repeats", type=integer(1), default=5, help="timed rounds")
    g.add_argument(
        "--model-cache-frac", type=fraction, default=0.05, help="cache of the pipe's run"
    )


class Labelled(TraceDataset):
    """One sequence per sample with a label (its first id's parity): what a classifier trains on."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "labels": self.ids[i, 0] % 2}


def bert(args: argparse.Namespace, sparse: bool) -> torch.nn.Module:
    """The same initial model each call; ``sparse`` makes its word embeddings sparse."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.model_hidden,
        num_hidden_layers=args.model_layers,
        num_attention_heads=args.model_heads,
        intermediate_size=4 * args.model_hidden,
        max_position_embeddings=max(512, args.model_seq_len),
        num_labels=2,
    )
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(config)
    model.get_input_embeddings().sparse = sparse
    return model


def train_pass(
    model: torch.nn.Module,
    batches: Iterable[Any],
    optimizers: list[torch.optim.Optimizer],
    inputs: Callable[[Any], dict[str, torch.Tensor]],
) -> float:
    """One step per batch (forward, backward, every optimizer's step): batches/s of the pass."""
    n = 0
    start = time.perf_counter()
    for batch in batches:
        out = model(**inputs(batch), labels=batch["labels"])
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        out.loss.backward()
        for opt in optimizers:
            opt.step()
        n += 1
    return n / (time.perf_counter() - start)


def in_ram(args: argparse.Namespace, sparse: bool, data: Dataset, kw: dict) -> Callable[[], float]:
    """A pass of the model with ``nn.Embedding`` in RAM: AdamW on the rest, torch SGD on it."""
    model = bert(args, sparse)
    embedding = model.get_input_embeddings().weight
    dense = [p for p in model.parameters() if p is not embedding]
    opts = [torch.optim.AdamW(dense, lr=1e-3), torch.optim.SGD([embedding], lr=0.1)]
    loader = DataLoader(data, batch_size=args.batch_size, **kw)
    return lambda: train_pass(model, loader, opts, lambda b: {"input_ids": b["input_ids"]})


def piped(
    args: argparse.Namespace, model: torch.nn.Module, pipe: EmbeddingPipe, data: Dataset, kw: dict
) -> Callable[[], float]:
    """A pass of the offloaded model through ``pipe``: AdamW holds the table's gradient too."""
    opts = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    loader = pipe.loader(data, batch_size=args.batch_size, **kw)
    return lambda: train_pass(model, loader, opts, lambda b: {"inputs_embeds": b["inputs_embeds"]})


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Batches/s of each way and the pipe's ratios to the in-RAM ones; skipped without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (pip install 'embedpipe[hf]')"}
    trace_args = argparse.Namespace(**{**vars(args), "seq_len": args.model_seq_len})
    data = Labelled(zipf_trace(trace_args, args.model_batches).ids)
    kw: dict[str, Any] = {"num_workers": args.workers, "persistent_workers": args.workers > 0}
    cache_rows = max(1, round(args.model_cache_frac * args.vocab))
    model = bert(args, sparse=False)
    table = hf.offload(model, os.path.join(workdir, "bert-words.zarr"))
    rates: dict[str, list[float]] = {w: [] for w in WAYS}
    with contextlib.ExitStack() as stack:
        stack.enter_context(table)
        pipe = stack.enter_context(
            EmbeddingPipe(table, cache_rows=cache_rows, policy="auto", optimizer=optim.SGD(lr=0.1))
        )
        passes: dict[str, Callable[[], float]] = {
            "pipe": piped(args, model, pipe, data, kw),
            "sparse": in_ram(args, True, data, kw),
            "dense": in_ram(args, False, data, kw),
        }
        total = len(WAYS) * (args.model_repeats + 1)
        with tqdm(total=total, desc="model", unit="pass") as bar:
            for r in range(args.model_repeats + 1):  # round 0 warms up (workers, caches)
                for way in WAYS:
                    bar.set_postfix_str(f"round {r} {way}")
                    rate = passes[way]()
                    if r:
                        rates[way].append(rate)
                    bar.update()
        stats = pipe.stats()
        del passes
        gc.collect()  # persistent workers exit with their loaders
    return {
        "config": {
            "hidden": args.model_hidden,
            "layers": args.model_layers,
            "heads": args.model_heads,
            "seq_len": args.model_seq_len,
            "batches": args.model_batches,
            "cache_rows": cache_rows,
            "workers": args.workers,
        },
        "batches_per_s": {w: statistics.median(rates[w]) for w in WAYS},
        "samples": rates,
        "vs_sparse": md.quartiles([p / s for p, s in zip(rates["pipe"], rates["sparse"])]),
        "vs_dense": md.quartiles([p / d for p, d in zip(rates["pipe"], rates["dense"])]),
        "hit_rate": stats["hits"] / max(1, stats["hits"] + stats["misses"]),
        "table_steps": stats["steps"],  # one per pipe batch: AdamW's step stepped the table
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    if "skipped" in result:
        return f"### Real model: skipped ({result['skipped']})\n"
    c, rate = result["config"], result["batches_per_s"]
    head = (
        f"### Real model: BERT, hidden {c['hidden']}, {c['layers']} layers, vocab {args.vocab:,}, "
        f"batches of {args.batch_size} x {c['seq_len']}\n\n"
        f"One training step per batch (forward, backward, AdamW + the table's SGD), {c['workers']} "
        f"workers, median batches/s of {len(result['samples']['pipe'])} rounds over "
        f"{c['batches']} batches; the pipe's ratios are taken within each round (median and "
        f"quartiles). Pipe cache: {c['cache_rows']:,} rows, hit rate {result['hit_rate']:.1%}.\n"
    )
    rows = [
        ["embedpipe, cache " + f"{c['cache_rows']:,} rows", f"{rate['pipe']:.1f}", "-", "-"],
        ["nn.Embedding(sparse=True) in RAM", f"{rate['sparse']:.1f}", "", ""],
        ["nn.Embedding dense in RAM", f"{rate['dense']:.1f}", "", ""],
    ]
    rows[0][2], rows[0][3] = md.ratio(result["vs_sparse"]), md.ratio(result["vs_dense"])
    table = md.md_table(["run", "batches/s", "pipe vs sparse", "pipe vs dense"], rows)
    return head + "\n" + table + "\n"


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """No target: the issue asks for the figure, not a bound."""
    return []
