"""EmbeddingPipe end to end: a tiny BERT trained with its table offloaded equals nn.Embedding training."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.pipe import EmbeddingPipe

from ..helpers import (
    PARITY,
    VOCAB,
    same_dense_params,
    tiny_model,
    train_offloaded,
    train_reference,
    zipf_dataset,
)

STEPS = 24
BATCH = 8


@pytest.fixture(scope="module")
def data():
    return zipf_dataset(STEPS * BATCH)


def test_frozen_pipe_outputs_equal_input_ids_bit_for_bit(tmp_path, data):
    model = tiny_model()
    weight = model.bert.embeddings.word_embeddings.weight.detach()
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=64).close()
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=50) as pipe, torch.no_grad():
        for batch in pipe.loader(
            zipf_dataset(32, seed=3, padded=True), batch_size=8, num_workers=2
        ):
            expected = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
            got = model(
                inputs_embeds=batch["inputs_embeds"], attention_mask=batch["attention_mask"]
            ).logits
            assert torch.equal(got, expected)
            assert not batch["inputs_embeds"].requires_grad


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_equals_nn_embedding_bit_for_bit(tmp_path, data, optimizer):
    reference, ref_model, _ = train_reference(data, optimizer, lr=0.5)
    table, model, stats, _ = train_offloaded(
        data,
        optimizer,
        lr=0.5,
        path=tmp_path / "t.zarr",
        **PARITY,
    )
    assert stats["steps"] == STEPS and stats["evictions"] > 0 and stats["refreshed"] > 0
    assert stats["cleaned_ahead"] > 0  # dirty rows written back ahead of their eviction
    assert (table - reference).abs().max().item() <= 1e-6
    assert torch.equal(table, reference)
    assert same_dense_params(model, ref_model)


def test_adam_equals_sparse_adam_within_tolerance(tmp_path, data):
    reference, _, _ = train_reference(data, "adam", lr=0.1)
    table, _, _, _ = train_offloaded(
        data,
        "adam",
        lr=0.1,
        path=tmp_path / "t.zarr",
        **PARITY,
    )
    # SparseAdam sums repeated ids in coalesce()'s order, embedpipe in occurrence order: rounding only.
    torch.testing.assert_close(table, reference, rtol=1e-5, atol=1e-5)
    assert (table - reference).abs().max().item() > 0 or torch.equal(table, reference)


@pytest.mark.slow
def test_exact_mode_is_identical_across_workers_and_cache_sizes(tmp_path, data):
    results = {}
    for num_workers in (0, 2, 4):
        for cache_rows in (0, VOCAB // 20, VOCAB):
            table, _, stats, _ = train_offloaded(
                data,
                "adagrad",
                lr=0.5,
                path=tmp_path / f"t{num_workers}_{cache_rows}.zarr",
                cache_rows=cache_rows,
                num_workers=num_workers,
            )
            results[num_workers, cache_rows] = table
            assert stats["steps"] == STEPS
    first = results[0, 0]
    for key, table in results.items():
        assert torch.equal(table, first), key


def test_optimizer_state_is_saved_next_to_the_rows(tmp_path, data):
    _, _, reference_state = train_reference(data, "adagrad", lr=0.5)
    _, _, _, table = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", cache_rows=30
    )
    assert table.state_names == ["sum"]
    assert table.step == STEPS and table.metadata["optimizer"]["name"] == "adagrad"
    state = torch.from_numpy(table.read(np.arange(VOCAB), "sum"))
    assert torch.equal(state, reference_state["sum"])  # torch's accumulator, bit for bit


def test_padded_batches_and_padding_idx(tmp_path):
    data = zipf_dataset(64, seed=5, padded=True)
    table, _, _, _ = train_offloaded(
        data, "sgd", lr=0.5, path=tmp_path / "t.zarr", padding_idx=0, num_workers=2
    )
    original = tiny_model().bert.embeddings.word_embeddings.weight.detach()
    assert torch.equal(table[0], original[0])  # looked up in every batch, never updated
    assert not torch.equal(table[1], original[1])


def test_gradient_accumulation_sums_batches_into_one_step(tmp_path, data):
    # Reference: torch with grads summed over 2 batches of 4 is one step per 8 samples...
    reference, _, _ = train_reference(data, "sgd", lr=0.5, batch_size=4, accumulate=2)
    table, _, stats, _ = train_offloaded(
        data,
        "sgd",
        lr=0.5,
        path=tmp_path / "t.zarr",
        batch_size=4,
        accumulate=2,
        num_workers=2,
    )
    assert stats["steps"] == len(data) // 8
    assert torch.equal(table, reference)  # the same sums in the same order


def test_grad_accumulation_is_gone_with_a_message_naming_the_replacement(tmp_path):
    embedpipe.Table.create(tmp_path / "t.zarr", 50, 4).close()
    with pytest.raises(TypeError, match="accumulate_grad_batches or accelerator.accumulate"):
        EmbeddingPipe(tmp_path / "t.zarr", cache_rows=10, grad_accumulation=2)


def test_a_checkpoint_inside_an_accumulation_group_does_not_change_training(tmp_path):
    data = [{"input_ids": torch.tensor([i % 7, 3])} for i in range(8)]
    results = []
    for checkpoint in (False, True):
        path = tmp_path / f"c{checkpoint}.zarr"
        embedpipe.Table.create(path, 50, 4).close()
        with EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1)) as pipe:
            for k, batch in enumerate(pipe.loader(data, batch_size=2)):
                (batch["inputs_embeds"] ** 2).sum().backward()
                if checkpoint and k == 1:
                    pipe.checkpoint()
                    assert pipe.stats()["steps"] == 0  # half a group is not a step
                    assert embedpipe.Table.open(path).step == 0
            pipe.step()  # the four backward passes, summed
        assert pipe.stats()["steps"] == 1
        results.append(embedpipe.Table.open(path).to_tensor())
    assert torch.equal(results[0], results[1])


def test_batch_sampler_passes_through(tmp_path):
    weight = torch.randn(50, 4)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight).close()
    data = [{"input_ids": torch.tensor([i])} for i in range(10)]
    sampler = torch.utils.data.BatchSampler(range(10), batch_size=5, drop_last=False)
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=5) as pipe:
        batches = list(pipe.loader(data, batch_sampler=sampler))
    assert [len(b["input_ids"]) for b in batches] == [5, 5]
    assert torch.equal(batches[1]["inputs_embeds"], weight[5:10][:, None])


def test_a_hand_off_that_takes_a_step_before_its_rows_are_written_trains_bit_for_bit(
    tmp_path, data, monkeypatch
):
    # Every step's table write waits, so every hand-off comes while the last step's rows are
    # computed and not yet written: it must take them from the step (NOTE [ A hand-off waits
    # for the step's rows, not its writes ]), and wait for nothing more.
    from embedpipe.cache.rowcache import RowCache
    from embedpipe.owner.computed import Computed

    write_uncached, find = RowCache.write_uncached, Computed.find
    taken = []

    def slow_write(self, update, before):
        time.sleep(0.05)
        write_uncached(self, update, before)

    def counted_find(self, ids):
        changed, where = find(self, ids)
        taken.append(int(changed.sum()))
        return changed, where

    monkeypatch.setattr(RowCache, "write_uncached", slow_write)
    monkeypatch.setattr(Computed, "find", counted_find)
    reference, ref_model, _ = train_reference(data, "adagrad", lr=0.5)
    table, model, _, _ = train_offloaded(
        data,
        "adagrad",
        lr=0.5,
        path=tmp_path / "t.zarr",
        cache_rows=VOCAB // 20,
        num_workers=2,
        owner="thread",
    )
    assert len(taken) >= STEPS // 2 and sum(taken) > 0  # most hand-offs took rows of a step
    assert torch.equal(table, reference)
    assert same_dense_params(model, ref_model)
