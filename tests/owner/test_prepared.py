"""A step's working copy prepared at its batch's hand-off (NOTE [ A step prepared at its batch's
hand-off ] in ``cache/rowcache.py``): each step of the usual loop takes the copy its batch's
hand-off made, any other step falls back to reading, and both train as nn.Embedding + torch
Adagrad do, bit for bit, weights and Adagrad's sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embedpipe

from ..helpers import (
    PARITY,
    VOCAB,
    dense_optimizer,
    initial_table,
    tiny_model,
    train_offloaded,
    train_reference,
    zipf_dataset,
)


def assert_trained_as_the_reference(weight, table, reference) -> None:
    expected, _, state = reference
    assert torch.equal(weight, expected)
    assert torch.equal(torch.from_numpy(table.read(np.arange(VOCAB), "sum")), state["sum"])


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_each_step_takes_the_copy_its_batch_prepared_and_trains_bit_for_bit(
    tmp_path, owner, padded
):
    """Padded: the step lacks the padding row, so it takes a subset of its batch's copy."""
    data = zipf_dataset(8 * 10, seed=3, padded=padded)
    options = {**PARITY, "owner": owner} | ({"padding_idx": 0} if padded else {})
    weight, _, stats, table = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", **options
    )
    assert stats["steps"] == 10 and stats["prepared"] == 10
    assert_trained_as_the_reference(weight, table, train_reference(data, "adagrad", lr=0.5))


def test_a_step_of_two_batches_falls_back_to_their_staged_copies(tmp_path):
    data = zipf_dataset(4 * 16, seed=4)
    weight, _, stats, table = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", batch_size=4, accumulate=2,
        cache_rows=VOCAB // 20,
    )  # fmt: skip
    assert stats["steps"] == 8 and stats["prepared"] < 8 and stats["staged"] > 0
    reference = train_reference(data, "adagrad", lr=0.5, batch_size=4, accumulate=2)
    assert_trained_as_the_reference(weight, table, reference)


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_batches_claimed_ahead_of_several_steps_are_not_prepared_for_them(tmp_path, owner):
    """Every batch is claimed before the first step: each copy is of step 0, so no later step
    takes one as its working copy, and the rows steps changed since are read again."""
    data = zipf_dataset(8 * 6, seed=5)
    path = tmp_path / "t.zarr"
    initial_table(path)
    model = tiny_model()
    dense = dense_optimizer(model)
    optimizer = embedpipe.optim.Adagrad(lr=0.5)
    with embedpipe.EmbeddingPipe(
        path, cache_rows=VOCAB // 20, optimizer=optimizer, owner=owner
    ) as pipe:
        batches = list(pipe.loader(data, batch_size=8))
        for batch in batches:
            model(
                **{k: batch[k] for k in ("inputs_embeds", "attention_mask", "labels")}
            ).loss.backward()
            dense.step()
            dense.zero_grad()
            pipe.step()
    stats = pipe.stats()
    assert stats["steps"] == 6 and stats["prepared"] <= 1
    table = embedpipe.Table.open(path)
    assert_trained_as_the_reference(
        table.to_tensor(), table, train_reference(data, "adagrad", lr=0.5)
    )


def test_bounded_mode_prepares_no_step(tmp_path):
    data = zipf_dataset(8 * 4, seed=6)
    *_, stats, _ = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", consistency="bounded", max_staleness=1
    )
    assert stats["steps"] == 4 and stats["prepared"] == 0
