"""What the framework tests share: one tiny BERT, one dataset, and the reference optimizer.

The reference keeps ``nn.Embedding`` in the model and trains it in ONE torch optimizer with the
dense weights (AdamW on those, torch Adagrad on the table), so that clipping, accumulation and
the learning-rate schedule cover both, as they cover the offloaded table. Adagrad starts its
accumulator at 0.1 and AdamW's eps is 1e-6: with a zero accumulator and clipping every step the
comparison is chaotic (a one-ulp change of the clip norm moves the reference itself by 0.1).
"""

from __future__ import annotations

import os

import numpy as np
import torch

import embedpipe

from .conftest import tiny_bert_config

VOCAB, SEQ, PAD = 1000, 12, 0
TABLE_LR, DENSE_LR = 0.05, 1e-3
ADAGRAD = dict(lr=TABLE_LR, initial_accumulator_value=0.1)


def samples(n: int, seed: int = 0) -> list[dict]:
    """``n`` right-padded samples of Zipf-distributed ids (a few ids in every batch), labelled."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = np.minimum(rng.zipf(1.3, SEQ), VOCAB - 1).astype(np.int64)
        length = int(rng.integers(SEQ // 2, SEQ + 1))
        mask = (np.arange(SEQ) < length).astype(np.int64)
        ids[length:] = PAD
        out.append(
            {
                "input_ids": torch.from_numpy(ids),
                "attention_mask": torch.from_numpy(mask),
                "labels": torch.tensor(int(ids[0]) % 2),
            }
        )
    return out


def bert(seed: int = 0, dropout: float = 0.1) -> torch.nn.Module:
    """A tiny BertForSequenceClassification; with dropout, both runs must draw the same random
    numbers in the same order too."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_bert_config(
        VOCAB, pad_token_id=PAD, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout
    )
    return BertForSequenceClassification(config)


class Combined(torch.optim.Optimizer):
    """Several torch optimizers stepped as one, with their param groups as this one's, so a
    scheduler built on it sets the learning rate of every group. The settings are copied to the
    inner groups at each step: ``load_state_dict`` (which Accelerate calls) replaces the dicts."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.param_groups = [dict(g) for o in optimizers for g in o.param_groups]

    def step(self, closure=None):
        loss = None if closure is None else closure()
        inner = [g for o in self.optimizers for g in o.param_groups]
        for mine, theirs in zip(self.param_groups, inner, strict=True):
            theirs.update({k: v for k, v in mine.items() if k != "params"})
        for optimizer in self.optimizers:
            optimizer.step()
        return loss


def with_adagrad_table(dense: torch.optim.Optimizer, embedding: torch.Tensor) -> Combined:
    """``dense`` (which must not hold ``embedding``) and torch Adagrad on ``embedding``."""
    return Combined(dense, torch.optim.Adagrad([embedding], **ADAGRAD))


def offloaded(model: torch.nn.Module, path, cache_rows: int = 50) -> embedpipe.EmbeddingPipe:
    """``model``'s word embeddings offloaded to ``path``, behind a pipe training them with
    embedpipe's Adagrad (the same settings as the reference's)."""
    table = embedpipe.hf.offload(model, path, chunk_rows=64)
    return embedpipe.EmbeddingPipe(
        table,
        cache_rows=cache_rows,
        optimizer=embedpipe.optim.Adagrad(**ADAGRAD),
        owner=os.environ.get("PIPE_OWNER", "thread"),  # the torchrun runs: "process" too
    )


def dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if "word_embeddings" not in k}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def train_briefly(tmp_path, dataset, steps: int) -> int:
    """``steps`` steps of embedpipe.hf.Trainer (batches of 4) on a fresh tiny BERT offloaded to
    ``tmp_path``; returns the table's step after them."""
    from transformers import TrainingArguments

    model = bert()
    with offloaded(model, tmp_path / "brief.zarr") as pipe:
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            max_steps=steps,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        embedpipe.hf.Trainer(model=model, args=args, train_dataset=dataset, pipe=pipe).train()
        pipe.flush()
        return pipe.table.step


def embedded_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """The model's loss on a pipe's batch: its ``inputs_embeds``, attention mask and labels."""
    fields = ("inputs_embeds", "attention_mask", "labels")
    return model(**{k: batch[k] for k in fields}).loss


def train_table(model, pipe: embedpipe.EmbeddingPipe, n: int, after=None) -> None:
    """``n`` of :func:`samples` in batches of 4 through ``pipe``, the table stepped alone
    (``pipe.step()``); ``after(step)`` after each step."""
    for step, batch in enumerate(pipe.loader(samples(n), batch_size=4), 1):
        embedded_loss(model, batch).backward()
        pipe.step()
        pipe.parameter.grad = None
        if after is not None:
            after(step)
