"""A dataset that tokenizes in ``__getitem__``, the common pattern (section ``tokenized``; needs
transformers).

Most training sets hold raw text and tokenize each sample as the DataLoader asks for it, with a
Hugging Face fast tokenizer; then the workers' time goes to the tokenizer as well as to the
lookup, and the pipe's work in the workers competes with it. This section builds such a dataset
and times it through the pipe and through a plain DataLoader feeding ``nn.Embedding``, with
``--workers`` workers:

- the tokenizer: a WordPiece of ``--vocab`` pieces trained with ``tokenizers`` on the ``--text``
  files (synthetic Zipf words when there are none: nothing is downloaded), wrapped as a
  ``transformers.PreTrainedTokenizerFast``;
- the dataset: passages of ``--seq-len`` words of that text, shuffled, the first
  ``--tok-batches`` batches' worth, each tokenized at every read, truncated and padded to
  ``--seq-len`` tokens;
- frozen: (a) ``nn.Embedding`` in RAM against (d) embedpipe ``policy="auto"`` with a cache of
  ``--tput-cache-frac``; training (``inputs_embeds.sum().backward()`` and the step): (a)
  ``nn.Embedding(sparse=True)`` + torch SGD against (d) embedpipe with ``--train-cache-frac`` +
  ``embedpipe.optim.SGD``.

Samples are paired with their baseline as in the throughput section; the CPU columns too.
"""

from __future__ import annotations

import argparse
import gc
import os
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ... import optim
from ...pipe.handle import EmbeddingPipe
from ...store.table import Table
from . import report as md
from .options import integer
from .throughput import (
    CPU_HEADER,
    CPU_NOTE,
    EPOCH_PASSES,
    Variant,
    backward_step,
    baseline_of,
    cpu_cells,
    embed_step,
    end_epochs,
    in_ram_step,
    paired_rounds,
    summary,
)
from .traces import Repeated, text_files, words_of

NAME = "tokenized"
QUICK = {"tok_batches": 8, "tok_repeats": 3}
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
#: The most words of text the tokenizer is trained on (and passages drawn from).
MOST_WORDS = 3_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tokenizing dataset (section 'tokenized'; needs transformers)")
    g.add_argument("--tok-batches", type=integer(1), default=30, help="batches per pass")
    g.add_argument("--tok-repeats", type=integer(1), default=5, help="timed samples")


class TokenizingDataset(Dataset):
    """Raw passages, tokenized at each read (the pattern this section measures)."""

    def __init__(self, tokenizer: Any, passages: list[str], seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.passages = passages
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.passages)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(
            self.passages[i],
            truncation=True,
            max_length=self.seq_len,
            padding="max_length",
            return_tensors="pt",
        )
        return {"input_ids": encoded["input_ids"][0]}


def corpus(args: argparse.Namespace) -> tuple[list[str], str]:
    """Passages of ``--seq-len`` words of the ``--text`` files (at most :data:`MOST_WORDS`
    words), shuffled; synthetic Zipf words where there is no text; and where they come from."""
    words: list[str] = []
    files = text_files(args.text)
    read = 0
    for path in files:
        if len(words) >= MOST_WORDS:
            break
        words += words_of(path)
        read += 1
    source = f"{read} text files ({len(words):,} words)"
    rng = np.random.default_rng(args.seed)
    if len(words) < args.batch_size * args.seq_len:  # no text here: words drawn by a Zipf law
        ranks = rng.zipf(args.zipf, 2000 * args.seq_len) % 50_000
        words = [f"w{r}" for r in ranks.tolist()]
        source = "synthetic Zipf words"
    n = args.seq_len
    passages = [" ".join(words[i : i + n]) for i in range(0, len(words) - n + 1, n)]
    return [passages[i] for i in rng.permutation(len(passages))], source


def make_tokenizer(passages: list[str], vocab: int) -> Any:
    """A WordPiece trained on ``passages``, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab, special_tokens=SPECIAL)
    wordpiece.train_from_iterator(passages, trainer, length=len(passages))
    return PreTrainedTokenizerFast(
        tokenizer_object=wordpiece, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]",
    )  # fmt: skip


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"skipped": "transformers is not installed (pip install 'embedpipe[hf]')"}
    passages, source = corpus(args)
    tokenizer = make_tokenizer(passages, args.vocab)
    data = TokenizingDataset(
        tokenizer, passages[: args.tok_batches * args.batch_size], args.seq_len
    )
    vocab = len(tokenizer)
    epoch = Repeated(data, EPOCH_PASSES)  # a pass: the next tok_batches of it (throughput.py)
    path = os.path.join(workdir, "tokenized.zarr")
    Table.create(path, vocab, args.dim, seed=args.seed).close()
    weight = Table.open(path).to_tensor()
    w = args.workers
    kw: dict[str, Any] = {
        "batch_size": args.batch_size,
        "num_workers": w,
        "persistent_workers": True,
    }
    frozen_pipe = EmbeddingPipe(path, cache_rows=max(1, round(args.tput_cache_frac * vocab)))
    trained = os.path.join(workdir, "tokenized-train.zarr")
    Table.from_tensor(trained, weight).close()
    train_pipe = EmbeddingPipe(
        trained,
        cache_rows=max(1, round(args.train_cache_frac * vocab)),
        optimizer=optim.SGD(lr=0.1),
    )
    emb = nn.Embedding.from_pretrained(weight, freeze=True)
    variants = [
        Variant("(a) frozen: nn.Embedding in RAM", w, DataLoader(epoch, **kw),
                lambda b, e=emb: e(b["input_ids"])),
        Variant(f"(d) frozen: embedpipe auto, cache {args.tput_cache_frac:.0%}", w,
                frozen_pipe.loader(epoch, **kw), embed_step, frozen_pipe),
        Variant("(a) train: nn.Embedding sparse + torch SGD", w, DataLoader(epoch, **kw),
                in_ram_step(True, weight), train=True),
        Variant(f"(d) train: embedpipe auto, cache {args.train_cache_frac:.0%} + SGD", w,
                train_pipe.loader(epoch, **kw), backward_step(train_pipe), train_pipe, train=True),
    ]  # fmt: skip
    for v in variants:
        v.pass_batches = args.tok_batches
    clusters = [(variants[0], [variants[1]], args.tok_repeats)]
    clusters.append((variants[2], [variants[3]], args.tok_repeats))
    try:
        with tqdm(total=len(variants) + 4 * args.tok_repeats, desc=NAME, unit="pass") as bar:
            for v in variants:
                v.run()  # warm-up
                v.before = v.counters()
                bar.update()
            paired_rounds(clusters, args.tok_repeats, args.min_time, bar)
        rows = [summary(v) for v in variants]
    finally:
        end_epochs(variants)
        frozen_pipe.close()
        train_pipe.close()
        del variants, clusters
        gc.collect()
    tokens = np.concatenate([data[i]["input_ids"].numpy() for i in range(len(data))])
    return {
        "source": source,
        "vocab": vocab,
        "unique_per_batch": float(
            np.mean([len(np.unique(b)) for b in np.array_split(tokens, args.tok_batches)])
        ),
        "batches": args.tok_batches,
        "repeats": args.tok_repeats,
        "rows": rows,
    }


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    if "skipped" in result:
        return f"### Tokenizing dataset: skipped ({result['skipped']})\n"
    head = (
        f"### Tokenizing dataset: a WordPiece of {result['vocab']:,} pieces on "
        f"{result['source']}, tokenized in `__getitem__`, batches of {args.batch_size} x "
        f"{args.seq_len}, {args.workers} workers, dim {args.dim}\n\n"
        f"{result['unique_per_batch']:.0f} unique ids a batch. Median batches/s of "
        f"{result['repeats']} samples over {result['batches']} batches; vs (a): the ratio to the "
        "same dataset feeding `nn.Embedding` in RAM, timed just before, median and quartiles.\n"
    )
    rows = []
    for r in result["rows"]:
        shown = md.ratio(r["vs_baseline"]) if r["ratios"] else "1.00x"
        base = baseline_of(r, result["rows"], ("train",))
        rows.append([r["name"], f"{r['batches_per_s']:.1f}", shown, *cpu_cells(r, base)])
    table = md.md_table(["variant", "batches/s", "vs (a)", *CPU_HEADER], rows)
    return head + "\n" + table + "\n" + CPU_NOTE


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    return []  # figures beside the targets of the throughput section, not a target of their own
