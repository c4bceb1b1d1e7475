"""Fine-tune a small BERT classifier whose word-embedding table lives on disk, behind embedpipe.

The model is a ``BertForSequenceClassification`` built from a ``BertConfig`` (no download): by
default BERT-base's vocabulary (30,522 ids) with a small encoder (hidden 128, 2 layers, 2 heads),
so the word-embedding table is most of the parameters. ``embedpipe.hf.offload`` moves that table
into a zarr table (a temporary folder, or ``--table PATH``); an :class:`embedpipe.EmbeddingPipe`
looks its rows up inside the DataLoader workers through a shared cache of ``--cache-rows`` rows
and trains them with a sparse optimizer (``--optimizer``), while torch's AdamW trains the rest:
each ``AdamW.step()`` also steps the table (the pipe's gradient is a parameter of the model).

The task is synthetic but learnable: sequences of Zipf-distributed token ids, label 1 when one of
a few marker ids occurs in the sequence, 0 otherwise. The loss starts at ln 2 = 0.693 and falls.

Every ``--log-every`` steps and at the end it prints the loss, the accuracy, the throughput
(samples/s and tokens/s; tokens are the non-padding ones) and the cache hit rate of the interval;
at the end the accuracy on held-out samples, ``pipe.stats()``, the accelerator memory the table
no longer takes (``embedpipe.hf.embedding_bytes``) and, on CUDA, the peak memory. ``--baseline``
runs the same training again with the table inside the model as ``nn.Embedding`` and the matching
torch optimizer (SGD, Adagrad, SparseAdam), for comparison.

Run it (well under two minutes on 2 CPU cores)::

    python scripts/train_bert.py
    python scripts/train_bert.py --baseline --bf16 --device cuda --steps 1000 --batch-size 128
    python scripts/train_bert.py --quick --num-workers 0      # a few seconds: a smoke test

Results go to stdout; see docs/training.md for what the lines mean.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

import embedpipe
import embedpipe.hf
from embedpipe.pipe.handle import OWNERS
from embedpipe.tools.benchmark.options import integer

PAD, CLS = 0, 1  # ids 0 and 1 are [PAD] and [CLS]; words are ids 2 .. vocab-1
NUM_MARKERS = 8
ZIPF_EXPONENT = 1.1

#: Learning rate of the table per --optimizer, when --lr is not given.
DEFAULT_LR = {"adagrad": 0.05, "adam": 1e-3, "sgd": 0.5}
#: Sizes the defaults take (the README's command) and those --quick takes; a flag given wins.
DEFAULTS = dict(
    vocab=30522, hidden=128, layers=2, heads=2, steps=150, batch_size=32, seq_len=64, eval=512
)
QUICK = dict(vocab=5000, hidden=64, layers=2, heads=2, steps=30, batch_size=16, seq_len=32, eval=64)


# ----------------------------------------------------------------------------- arguments
class Parser(argparse.ArgumentParser):
    """argparse, with the error on one line (exit status 2) instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(
        description="Fine-tune a small BERT classifier with its word embeddings on disk (embedpipe)."
    )
    d, q = DEFAULTS, QUICK
    size = p.add_argument_group("model and data (default / with --quick)")
    size.add_argument(
        "--vocab", type=integer(1), help=f"vocabulary size ({d['vocab']} / {q['vocab']})"
    )
    size.add_argument(
        "--hidden", type=integer(1), help=f"hidden size ({d['hidden']} / {q['hidden']})"
    )
    size.add_argument(
        "--layers", type=integer(1), help=f"encoder layers ({d['layers']} / {q['layers']})"
    )
    size.add_argument(
        "--heads", type=integer(1), help=f"attention heads ({d['heads']} / {q['heads']})"
    )
    size.add_argument(
        "--steps", type=integer(1), help=f"training steps ({d['steps']} / {q['steps']})"
    )
    size.add_argument(
        "--batch-size",
        type=integer(1),
        help=f"samples per step ({d['batch_size']} / {q['batch_size']})",
    )
    size.add_argument(
        "--seq-len",
        type=integer(1),
        help=f"tokens per sample, [CLS] and padding included ({d['seq_len']} / {q['seq_len']})",
    )
    size.add_argument(
        "--eval",
        type=integer(0),
        help=f"held-out samples scored at the end ({d['eval']} / {q['eval']})",
    )
    size.add_argument(
        "--quick", action="store_true", help="the small sizes: a smoke test of seconds"
    )

    train = p.add_argument_group("training")
    train.add_argument(
        "--optimizer",
        choices=sorted(DEFAULT_LR),
        default="adagrad",
        help="sparse optimizer of the table; --baseline uses torch's Adagrad, SparseAdam or SGD "
        "(default: adagrad)",
    )
    train.add_argument(
        "--lr",
        type=positive_float,
        help="learning rate of the table (default: "
        + ", ".join(f"{k} {v:g}" for k, v in sorted(DEFAULT_LR.items()))
        + ")",
    )
    train.add_argument(
        "--dense-lr",
        type=positive_float,
        default=1e-3,
        help="AdamW learning rate of the other parameters (default: 1e-3)",
    )
    train.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    train.add_argument(
        "--bf16",
        action="store_true",
        help="run the forward under torch.autocast(bfloat16); slower than float32 on CPUs "
        "without bfloat16 units",
    )
    train.add_argument(
        "--seed", type=int, default=0, help="seeds data, model and dropout (default: 0)"
    )
    train.add_argument(
        "--log-every", type=integer(1), help="steps between progress lines (default: steps / 10)"
    )
    train.add_argument(
        "--baseline",
        action="store_true",
        help="then train again with the table in the model as nn.Embedding, for comparison",
    )

    pipe = p.add_argument_group("embedpipe")
    pipe.add_argument(
        "--table",
        help="write the table to this new path and keep it (default: a temporary folder, "
        "deleted at the end)",
    )
    pipe.add_argument(
        "--cache-rows", type=integer(0), help="rows in the shared cache (default: 5%% of --vocab)"
    )
    pipe.add_argument(
        "--num-workers", type=integer(0), default=2, help="DataLoader worker processes (default: 2)"
    )
    pipe.add_argument(
        "--owner",
        choices=OWNERS,
        default="auto",
        help="where the table's owner runs: a thread of the training process or a process of its "
        "own (default: auto, a process when the cache holds less than the table; docs/service.md)",
    )
    pipe.add_argument(
        "--max-staleness",
        type=integer(1),
        help="bounded consistency: a batch may miss the last K steps' updates of its rows and "
        "waits for none of them (default: exact, a batch's rows are final; docs/consistency.md)",
    )

    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.vocab < 2 + NUM_MARKERS + 2:
        p.error(f"--vocab must be at least {2 + NUM_MARKERS + 2} ([PAD], [CLS], markers, words)")
    if args.seq_len < 3:
        p.error("--seq-len must be at least 3 ([CLS] and a word or two)")
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    if args.cache_rows is None:
        args.cache_rows = max(1, args.vocab // 20)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if args.log_every is None:
        args.log_every = max(1, args.steps // 10)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        p.error(f"--device {args.device} is not usable here: {str(e).splitlines()[0]}")
    args.device = device
    if args.table is not None and os.path.exists(args.table):
        p.error(f"--table {args.table} exists; give a new path (offload writes a new table)")
    return args


# ----------------------------------------------------------------------------- data
class MarkerTask(Dataset):
    """Zipf-distributed token ids; label 1 when one of a few marker ids occurs in the sequence.

    Each sample is ``[CLS]`` + 50-100% of ``seq_len - 1`` words, right-padded with ``[PAD]``:
    ``input_ids`` and ``attention_mask`` (seq_len,) int64, ``labels`` () int64. Word frequencies
    follow Zipf's law over a fixed random order of the ids, so frequent words are spread over the
    whole table as in a real vocabulary. The markers are 8 fixed ids that occur nowhere else: a
    positive sample holds one to three of them, a negative one none.
    """

    def __init__(self, vocab: int, seq_len: int, num_samples: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        order = np.random.default_rng(1234).permutation(np.arange(2, vocab))  # rank -> id
        markers = order[len(order) // 4 :][:NUM_MARKERS]  # same markers for every split
        words = order[~np.isin(order, markers)]  # the markers occur only where inserted
        p = 1.0 / np.arange(1, len(words) + 1) ** ZIPF_EXPONENT
        ids = words[rng.choice(len(words), size=(num_samples, seq_len), p=p / p.sum())]
        ids[:, 0] = CLS
        lengths = rng.integers((seq_len + 1) // 2, seq_len + 1, size=num_samples)
        positions = np.arange(seq_len)
        mask = positions[None, :] < lengths[:, None]
        labels = rng.integers(0, 2, size=num_samples)
        for i in np.flatnonzero(labels):
            where = rng.choice(
                np.arange(1, lengths[i]), size=min(rng.integers(1, 4), lengths[i] - 1)
            )
            ids[i, where] = rng.choice(markers, size=len(where))
        ids[~mask] = PAD
        self.input_ids = torch.from_numpy(ids.astype(np.int64))
        self.attention_mask = torch.from_numpy(mask.astype(np.int64))
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[i],
            "attention_mask": self.attention_mask[i],
            "labels": self.labels[i],
        }


# ----------------------------------------------------------------------------- model
def build_model(args: argparse.Namespace) -> BertForSequenceClassification:
    """The same initial model every time it is called with the same arguments."""
    config = BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=max(512, args.seq_len),
        num_labels=2,
        pad_token_id=PAD,
    )
    torch.manual_seed(args.seed)
    return BertForSequenceClassification(config)


def table_optimizer(args: argparse.Namespace) -> embedpipe.optim.RowOptimizer:
    return {
        "sgd": embedpipe.optim.SGD,
        "adagrad": embedpipe.optim.Adagrad,
        "adam": embedpipe.optim.Adam,
    }[args.optimizer](lr=args.lr)


def torch_table_optimizer(args: argparse.Namespace, embedding: torch.nn.Embedding):
    """The torch optimizer embedpipe's sparse optimizer matches (``embedpipe.optim``'s table)."""
    if args.optimizer == "adam":
        embedding.sparse = True  # SparseAdam takes sparse gradients only
        return torch.optim.SparseAdam([embedding.weight], lr=args.lr)
    if args.optimizer == "adagrad":
        return torch.optim.Adagrad([embedding.weight], lr=args.lr)
    return torch.optim.SGD([embedding.weight], lr=args.lr)


# ----------------------------------------------------------------------------- training
@dataclass
class Result:
    name: str
    seconds: float = 0.0
    samples: int = 0
    tokens: int = 0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    eval_loss: float = float("nan")
    eval_acc: float = float("nan")
    peak_bytes: int | None = None
    rates: list[float] = field(default_factory=list)  # samples/s of each progress interval
    extra: dict[str, Any] = field(default_factory=dict)


def train(
    result: Result,
    model: torch.nn.Module,
    batches: Iterable[Mapping[str, Any]],
    optimizers: list[torch.optim.Optimizer],
    inputs: Callable[[Mapping[str, Any]], dict[str, torch.Tensor]],
    args: argparse.Namespace,
    hit_rate: Callable[[], tuple[int, int]] | None = None,
) -> None:
    """Run the steps, printing a progress line every ``--log-every`` steps and at the last.

    ``inputs(batch)`` gives the model's input keyword (``inputs_embeds`` or ``input_ids``);
    ``hit_rate()`` the pipe's cumulative (hits, misses), for the interval's cache hit rate.
    """
    device = args.device
    torch.manual_seed(args.seed)  # the same dropout masks in both runs
    model.train()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = tokens = 0
    counts = hit_rate() if hit_rate else (0, 0)
    start = tick = time.perf_counter()
    for step, batch in enumerate(batches, 1):
        tokens += int(batch["attention_mask"].sum())  # on the host: no device sync
        batch = to_device(batch, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            out = model(
                **inputs(batch), attention_mask=batch["attention_mask"], labels=batch["labels"]
            )
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        out.loss.backward()  # offloaded: adds to the table's gradient, as to a .grad
        for opt in optimizers:
            opt.step()  # offloaded: AdamW's step also takes the table's gradient as one step

        loss_sum += out.loss.detach().float() * len(batch["labels"])
        correct += (out.logits.argmax(-1) == batch["labels"]).sum()
        seen += len(batch["labels"])
        if step % args.log_every and step != args.steps:
            continue
        loss = loss_sum.item() / seen  # waits for the device
        now = time.perf_counter()
        line = (
            f"[{result.name}] step {step:>{len(str(args.steps))}}/{args.steps}  loss {loss:.4f}  "
            f"acc {correct.item() / seen:.3f}  {seen / (now - tick):7,.1f} samples/s  "
            f"{tokens / (now - tick):9,.0f} tokens/s"
        )
        if hit_rate:
            hits, misses = hit_rate()
            interval = (hits - counts[0], misses - counts[1])
            line += f"  cache hit rate {interval[0] / max(1, sum(interval)):.3f}"
            counts = (hits, misses)
        print(line, flush=True)
        result.rates.append(seen / (now - tick))
        if math.isnan(result.first_loss):
            result.first_loss = loss
        result.last_loss = loss
        result.samples += seen
        result.tokens += tokens
        loss_sum.zero_()
        correct.zero_()
        seen = tokens = 0
        tick = now
    result.seconds = time.perf_counter() - start


def to_device(batch: Mapping[str, Any], device: torch.device) -> Mapping[str, Any]:
    """An EmbeddedBatch moves itself (its (U, D) rows, not (B, L, D)); a plain dict field by field."""
    if isinstance(batch, embedpipe.EmbeddedBatch):
        return batch.to(device, non_blocking=True)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(
    result: Result,
    model: torch.nn.Module,
    batches: Iterable[Mapping[str, Any]],
    inputs: Callable[[Mapping[str, Any]], dict[str, torch.Tensor]],
    args: argparse.Namespace,
) -> None:
    """Loss and accuracy on held-out samples (no gradient: the pipe's lookups are read-only)."""
    model.eval()
    loss = correct = seen = 0
    for batch in batches:
        batch = to_device(batch, args.device)
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            out = model(
                **inputs(batch), attention_mask=batch["attention_mask"], labels=batch["labels"]
            )
        loss += out.loss.float().item() * len(batch["labels"])
        correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
        seen += len(batch["labels"])
    if seen:
        result.eval_loss, result.eval_acc = loss / seen, correct / seen


def loader_options(args: argparse.Namespace) -> dict[str, Any]:
    """DataLoader keywords both runs share: the same shuffled order from the same seed."""
    options: dict[str, Any] = dict(
        batch_size=args.batch_size,
        num_workers=args.num_workers,
        pin_memory=args.device.type == "cuda",
        generator=torch.Generator().manual_seed(args.seed),
    )
    if args.num_workers:
        options["prefetch_factor"] = 4
    return options


def start_peak_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def run_offloaded(args: argparse.Namespace, data: Dataset, held_out: Dataset, path: str) -> Result:
    """Train with the word embeddings in a table at ``path``, behind an EmbeddingPipe."""
    result = Result("embedpipe")
    start_peak_memory(args.device)
    model = build_model(args)
    result.extra["saved"] = embedpipe.hf.embedding_bytes(model, args.optimizer)
    # Offload on the CPU, before the model goes to the device and before building the optimizer.
    # The pipe pads with, and never updates, the padding_idx that offload recorded in the table.
    table = embedpipe.hf.offload(model, path)
    model.to(args.device)
    pipe = embedpipe.EmbeddingPipe(
        table,
        cache_rows=args.cache_rows,
        optimizer=table_optimizer(args),
        owner=args.owner,
        consistency="exact" if args.max_staleness is None else "bounded",
        max_staleness=args.max_staleness,
    )
    # Built after the pipe: model.parameters() then holds the table's gradient (pipe.parameter,
    # attached in the embedding's place), and AdamW's step() steps the table with the sparse
    # optimizer at its own learning rate (AdamW's betas and weight decay do not apply to it).
    dense = torch.optim.AdamW(model.parameters(), lr=args.dense_lr)
    with table, pipe:
        print(
            f"[{result.name}] {pipe!r}  table {table.num_rows:,} x {table.dim} {table.dtype}",
            flush=True,
        )

        def hit_rate() -> tuple[int, int]:
            stats = pipe.stats()
            return stats["hits"], stats["misses"]

        loader = pipe.loader(data, shuffle=True, **loader_options(args))
        train(
            result,
            model,
            loader,
            [dense],
            lambda b: {"inputs_embeds": b["inputs_embeds"]},
            args,
            hit_rate=hit_rate,
        )
        evaluate(
            result,
            model,
            pipe.loader(held_out, **loader_options(args)),
            lambda b: {"inputs_embeds": b["inputs_embeds"]},
            args,
        )
        result.peak_bytes = peak_memory(args.device)
    result.extra["stats"] = pipe.stats()  # after close(): every update is on disk
    result.extra["disk_bytes"] = table.nbytes_on_disk()
    result.extra["table"] = f"{table.num_rows:,} x {table.dim} {table.dtype}"
    return result


def run_baseline(args: argparse.Namespace, data: Dataset, held_out: Dataset) -> Result:
    """The same training with the word embeddings in the model as nn.Embedding."""
    result = Result("baseline")
    start_peak_memory(args.device)
    model = build_model(args).to(args.device)
    embedding = model.get_input_embeddings()
    dense = torch.optim.AdamW(
        [p for p in model.parameters() if p is not embedding.weight], lr=args.dense_lr
    )
    optimizers = [dense, torch_table_optimizer(args, embedding)]
    print(
        f"[{result.name}] nn.Embedding {tuple(embedding.weight.shape)} in the model, "
        f"{type(optimizers[1]).__name__}(lr={args.lr})",
        flush=True,
    )
    train(
        result,
        model,
        DataLoader(data, shuffle=True, **loader_options(args)),
        optimizers,
        lambda b: {"input_ids": b["input_ids"]},
        args,
    )
    evaluate(
        result,
        model,
        DataLoader(held_out, **loader_options(args)),
        lambda b: {"input_ids": b["input_ids"]},
        args,
    )
    result.peak_bytes = peak_memory(args.device)
    result.extra["weight"] = embedding.weight.detach().cpu()
    return result


# ----------------------------------------------------------------------------- report
def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def steady_rate(result: Result) -> float:
    """The median samples/s of the progress intervals after the first (which holds the start:
    the workers' first batches, the device's first kernels)."""
    return float(np.median(result.rates[1:] or result.rates))


def summary(result: Result) -> str:
    line = (
        f"[{result.name}] done: {result.samples:,} samples in {result.seconds:.1f} s, "
        f"{result.samples / result.seconds:,.1f} samples/s ({steady_rate(result):,.1f} the median "
        f"interval after the first), {result.tokens / result.seconds:,.0f} tokens/s; "
        f"loss {result.first_loss:.4f} -> {result.last_loss:.4f}"
    )
    if not math.isnan(result.eval_loss):
        line += f"; held-out loss {result.eval_loss:.4f} acc {result.eval_acc:.3f}"
    return line


def report(args: argparse.Namespace, offloaded: Result, baseline: Result | None, path: str) -> None:
    print(summary(offloaded))
    s = offloaded.extra["stats"]
    print(
        f"[{offloaded.name}] cache: hit rate {s['hits'] / max(1, s['hits'] + s['misses']):.3f} "
        f"({s['hits']:,} hits, {s['misses']:,} misses over unique ids per batch), "
        f"{s['rows_read']:,} rows read, {s['rows_written']:,} rows written, "
        f"{s['evictions']:,} evictions, {s['refreshed']:,} refreshed, {s['steps']:,} optimizer steps"
    )
    where = "kept" if args.table else "temporary, deleted at exit"
    print(
        f"[{offloaded.name}] table {offloaded.extra['table']} at {path} ({where}): "
        f"{mib(offloaded.extra['disk_bytes'])} on disk"
    )
    copies = {
        "sgd": "weight + gradient",
        "adagrad": "weight + gradient + sum",
        "adam": "weight + gradient + 2 moments",
    }
    print(
        f"accelerator memory the table no longer uses: {mib(offloaded.extra['saved'])} "
        f"({copies[args.optimizer]}, embedpipe.hf.embedding_bytes(model, {args.optimizer!r}))"
    )
    if baseline is not None:
        print(summary(baseline))
        with embedpipe.Table.open(path) as table:
            diff = (table.to_tensor() - baseline.extra["weight"]).abs().max().item()
        print(
            f"embedpipe vs baseline: {offloaded.seconds / baseline.seconds:.2f}x the time "
            f"({steady_rate(offloaded) / steady_rate(baseline):.2f}x the samples/s after the "
            "first interval), "
            f"final loss {offloaded.last_loss:.4f} vs {baseline.last_loss:.4f}, trained tables "
            + ("bitwise equal" if diff == 0 else f"differ by at most {diff:.2g}")
        )
    if offloaded.peak_bytes is not None:
        line = f"torch.cuda.max_memory_allocated: embedpipe {mib(offloaded.peak_bytes)}"
        if baseline is not None and baseline.peak_bytes is not None:
            line += (
                f", baseline {mib(baseline.peak_bytes)} "
                f"({mib(baseline.peak_bytes - offloaded.peak_bytes)} saved)"
            )
        print(line)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = MarkerTask(args.vocab, args.seq_len, args.steps * args.batch_size, seed=args.seed)
    held_out = MarkerTask(args.vocab, args.seq_len, args.eval, seed=args.seed + 1)
    params = build_model(args).num_parameters()
    embedding_params = args.vocab * args.hidden
    print(
        f"BERT vocab {args.vocab:,} hidden {args.hidden} layers {args.layers} heads {args.heads}: "
        f"{params:,} parameters, {embedding_params / params:.0%} in the word embeddings; "
        f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens on {args.device}"
        f"{' (bf16 autocast)' if args.bf16 else ''}, {args.num_workers} workers, "
        f"cache {args.cache_rows:,} rows, {args.optimizer} lr {args.lr:g}, owner {args.owner}",
        flush=True,
    )
    with contextlib.ExitStack() as stack:
        if args.table is None:
            folder = tempfile.mkdtemp(prefix="train_bert-")
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
            path = os.path.join(folder, "vocab.zarr")
        else:
            path = os.path.abspath(args.table)
        offloaded = run_offloaded(args, data, held_out, path)
        baseline = run_baseline(args, data, held_out) if args.baseline else None
        report(args, offloaded, baseline, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
