"""The token traces the benchmark runs on, the table they index, and a dataset over a trace.

Two traces, both ``(sequences, seq_len)`` int64 ids cut into batches of ``batch_size`` sequences:

- synthetic Zipf: i.i.d. tokens with P(rank r) ~ r^-s, ranks permuted over the table so popular
  rows are spread over its chunks (as in a real vocabulary);
- real text found on the machine (by default the English documentation the vim package installs),
  tokenized word-level, ranked by frequency and permuted the same way, cut into sequences in
  reading order and shuffled as ``shuffle=True`` would (words repeat within a sequence, as in text).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from ...store.table import Table

#: Where ``--text auto`` looks for English prose (vim's documentation, ~2.3M word tokens).
TEXT_GLOBS = ("/usr/share/vim/vim*/doc/*.txt",)


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


def zipf_trace(args: argparse.Namespace, batches: int) -> Trace:
    """``batches`` batches of i.i.d. tokens, P(rank r) ~ r^-zipf, ranks permuted over the table."""
    rng = np.random.default_rng(args.seed)
    p = np.arange(1, args.vocab + 1, dtype=np.float64) ** -args.zipf
    tokens = batches * args.batch_size * args.seq_len
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


def words_of(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return re.findall(r"\w+|[^\w\s]", f.read().lower())


def text_trace(files: list[str], args: argparse.Namespace, batches: int) -> Trace | None:
    """A word-level trace of real text: words and punctuation, lowercased, ranked by frequency.

    The ``vocab - 1`` most frequent tokens get their own id; rarer ones share one "[UNK]" id (as
    a tokenizer's unknown token). None when the text is shorter than one batch.
    """
    counts: Counter[str] = Counter()
    for path in files:
        counts.update(words_of(path))
    rank = {w: r for r, (w, _) in enumerate(counts.most_common(args.vocab - 1))}
    unk = args.vocab - 1
    tokens = np.concatenate([np.array([rank.get(w, unk) for w in words_of(p)]) for p in files])
    rng = np.random.default_rng(args.seed + 1)
    ids = rng.permutation(args.vocab)[tokens.astype(np.int64)]
    seqs = ids[: len(ids) // args.seq_len * args.seq_len].reshape(-1, args.seq_len)
    seqs = seqs[rng.permutation(len(seqs))][: batches * args.batch_size]
    seqs = seqs[: len(seqs) // args.batch_size * args.batch_size]
    if len(seqs) == 0:
        return None
    name = (
        f"word-level text ({len(files)} files, {len(tokens) / 1e6:.2f}M tokens, "
        f"{len(counts)} distinct words)"
    )
    return Trace(name, seqs, args.batch_size)


def table_path(args: argparse.Namespace, workdir: str) -> str:
    """The ``--vocab`` x ``--dim`` float32 table the sections share, made in ``workdir`` once."""
    path = os.path.join(workdir, "table.zarr")
    if not os.path.exists(path):
        Table.create(path, args.vocab, args.dim, seed=args.seed).close()
    return path


class TraceDataset(Dataset):
    """One sequence of the trace per sample: ``{"input_ids": (seq_len,) int64}``."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = torch.from_numpy(np.ascontiguousarray(ids))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class Repeated(Dataset):
    """``dataset`` ``times`` over, as one epoch: a pass of a section takes a stretch of it
    (``Variant.pass_batches``), as a training run's batches come from an epoch of thousands,
    not an epoch of its own."""

    def __init__(self, dataset: Dataset, times: int) -> None:
        self.dataset, self.times = dataset, times

    def __len__(self) -> int:
        return len(self.dataset) * self.times  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> object:
        return self.dataset[i % len(self.dataset)]  # type: ignore[arg-type]
