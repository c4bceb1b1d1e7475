"""Training runs shared by the end-to-end tests: the same tiny BERT trained two ways.

``train_reference`` keeps the word embeddings in the model (``nn.Embedding``) and trains them with a
torch optimizer; ``train_offloaded`` takes them out into a Table and trains them through an
EmbeddingPipe. Everything else (model, data, dense optimizer, order) is identical, so the tables
must agree.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertForSequenceClassification

import embedpipe
from embedpipe.pipe import EmbeddingPipe

from .conftest import tiny_bert_config

VOCAB = 1000
SEQ = 16
#: The parity runs' pipe: a 5% cache, 2 workers each 4 batches ahead.
PARITY = dict(cache_rows=VOCAB // 20, num_workers=2, prefetch_factor=4)


def zipf_dataset(n: int, seed: int = 0, vocab: int = VOCAB, padded: bool = False) -> list[dict]:
    """``n`` samples of Zipf-distributed token ids (a few ids in every batch), with labels."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        ids = np.minimum(rng.zipf(1.2, SEQ), vocab - 1).astype(np.int64)
        mask = np.ones(SEQ, dtype=np.int64)
        if padded:  # right padding with id 0, as a tokenizer does
            length = int(rng.integers(SEQ // 2, SEQ + 1))
            ids[length:], mask[length:] = 0, 0
        samples.append(
            {
                "input_ids": torch.from_numpy(ids),
                "attention_mask": torch.from_numpy(mask),
                "labels": torch.tensor(i % 2),
            }
        )
    return samples


def tiny_model(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(tiny_bert_config(VOCAB)).eval()  # eval: no dropout


REFERENCE_OPTIMIZERS = {
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr),
    "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr),
    "adam": lambda p, lr: torch.optim.SparseAdam(p, lr=lr),
}
PIPE_OPTIMIZERS = {
    "sgd": lambda lr: embedpipe.optim.SGD(lr=lr),
    "adagrad": lambda lr: embedpipe.optim.Adagrad(lr=lr),
    "adam": lambda lr: embedpipe.optim.Adam(lr=lr),
}


def dense_optimizer(model):
    """SGD on everything but the word embeddings (and an offloaded table's gradient parameter)."""
    params = [p for n, p in model.named_parameters() if "word_embeddings" not in n]
    return torch.optim.SGD(params, lr=0.05)


def train_reference(
    data, optimizer: str, lr: float, batch_size: int = 8, accumulate: int = 1, device: str = "cpu"
):
    """The baseline: nn.Embedding in the model, trained by the matching torch optimizer.

    Returns the trained table (on the CPU), the model and the torch optimizer's state for the table.
    """
    model = tiny_model().to(device)
    emb = model.bert.embeddings.word_embeddings
    if optimizer == "adam":  # SparseAdam needs sparse gradients
        emb.sparse = True
    emb_opt = REFERENCE_OPTIMIZERS[optimizer]([emb.weight], lr)
    dense = dense_optimizer(model)
    for i, start in enumerate(range(0, len(data), batch_size)):
        batch = torch.utils.data.default_collate(data[start : start + batch_size])
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
        out.loss.backward()
        if (i + 1) % accumulate == 0:  # .grad sums `accumulate` batches
            dense.step()
            dense.zero_grad()
            emb_opt.step()
            emb_opt.zero_grad()
    return emb.weight.detach().cpu().clone(), model, emb_opt.state[emb.weight]


def train_offloaded(
    data,
    optimizer: str | None,
    lr: float,
    path,
    *,
    batch_size: int = 8,
    cache_rows: int = 50,
    num_workers: int = 0,
    accumulate: int = 1,
    make_table: bool = True,
    device: str = "cpu",
    **options,
):
    """The same training with the table in ``path`` behind an EmbeddingPipe. The table steps
    by ``pipe.step()`` when the dense optimizer does (every ``accumulate`` batches).

    ``options`` go to the loader (DataLoader keywords) or the pipe (``consistency``...).
    ``make_table=False``: the table is there already (``initial_table``). ``device``: the model's,
    where each batch moves (``batch.to(device)``).
    """
    model = tiny_model().to(device)
    if make_table:
        initial_table(path)
    pipe_keys = {
        "consistency",
        "max_staleness",
        "padding_idx",
        "policy",
        "check_finite",
        "owner",
    }
    pipe_options = {k: v for k, v in options.items() if k in pipe_keys}
    loader_options = {k: v for k, v in options.items() if k not in pipe_keys}
    dense = dense_optimizer(model)
    opt = PIPE_OPTIMIZERS[optimizer](lr) if optimizer else None
    with EmbeddingPipe(path, cache_rows=cache_rows, optimizer=opt, **pipe_options) as pipe:
        loader = pipe.loader(data, batch_size=batch_size, num_workers=num_workers, **loader_options)
        for i, batch in enumerate(loader):
            if device != "cpu":
                batch = batch.to(device, non_blocking=True)
            out = model(
                inputs_embeds=batch["inputs_embeds"],
                attention_mask=batch["attention_mask"],
                labels=batch["labels"],
            )
            out.loss.backward()
            if (i + 1) % accumulate == 0:
                dense.step()
                dense.zero_grad()
                pipe.step()  # the dense optimizer does not hold the table (gradient.py)
    stats = pipe.stats()  # after close: every step applied
    table = embedpipe.Table.open(path)
    return table.to_tensor(), model, stats, table


def initial_table(path) -> None:
    """The table the tiny model starts from, at ``path``."""
    weight = tiny_model().bert.embeddings.word_embeddings.weight.detach().clone()
    embedpipe.Table.from_tensor(path, weight, chunk_rows=64).close()


def adagrad_reference(weight: np.ndarray, batches: list[torch.Tensor], steps: int, lr: float = 0.5):
    """nn.Embedding + torch Adagrad on the loss sum(embeds**2), one step per batch of ids, for
    ``steps`` batches: the table and Adagrad's ``sum``."""
    embedding = torch.nn.Embedding(*weight.shape, _weight=torch.from_numpy(weight.copy()))
    optimizer = torch.optim.Adagrad(embedding.parameters(), lr=lr)
    for ids in batches[:steps]:
        (embedding(ids) ** 2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    total = optimizer.state[embedding.weight]["sum"] if steps else torch.zeros(weight.shape)
    return embedding.weight.detach(), total


SMALL_V, SMALL_D = 100, 4


def small_table(folder, compressor: str = "none") -> str:
    """A 100 x 4 table whose row i is i*4 .. i*4+3, over 100, in chunks of 16 rows; its path."""
    weight = np.arange(SMALL_V * SMALL_D, dtype=np.float32).reshape(SMALL_V, SMALL_D) / 100
    embedpipe.Table.from_tensor(
        folder / "t.zarr", weight, chunk_rows=16, compressor=compressor
    ).close()
    return folder / "t.zarr"


def small_samples(n: int, bad: dict[int, int] | None = None) -> list[dict]:
    """``n`` samples of 3 ids for :func:`small_table`; ``bad`` puts an id at sample index."""
    out = [{"input_ids": torch.tensor([i % SMALL_V, (3 * i) % SMALL_V, 7])} for i in range(n)]
    for index, value in (bad or {}).items():
        out[index]["input_ids"] = torch.tensor([1, value, 2])
    return out


def same_dense_params(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa if "word_embeddings" not in k)


def run_cli(*args: object) -> subprocess.CompletedProcess:
    """``embedpipe ARGS`` in this process, as the command's ``main`` runs it: its exit code and
    what it printed (a new process would spend about 4 s importing torch for each case; the
    tests that need a real process start one)."""
    from embedpipe.tools.cli import main

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors and --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["embedpipe", *argv], code, out.getvalue(), err.getvalue())


def slow(*values: object) -> Any:
    """One case of a parametrized grid, run in the slow group (``--run-slow -m slow``, as CI
    does) rather than by the README's test command."""
    return pytest.param(*values, marks=pytest.mark.slow)


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset: each worker streams its share of the samples."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        yield from self.samples[worker::workers]
