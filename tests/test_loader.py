"""The DataLoader stage under the DataLoader's own options: every one keeps exact training exact."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.pipe import EmbeddingPipe

from .helpers import train_offloaded, train_reference, zipf_dataset

DATA = zipf_dataset(96, seed=1)


@pytest.fixture(scope="module")
def reference():
    return train_reference(DATA, "adagrad", lr=0.5)[0]


@pytest.mark.timeout(240)
@pytest.mark.filterwarnings(
    "ignore:.*pin_memory"
)  # no accelerator here: the DataLoader skips pinning
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(num_workers=2, multiprocessing_context="spawn"), id="spawn"),
        pytest.param(
            dict(num_workers=2, persistent_workers=True, prefetch_factor=1), id="persistent"
        ),
        pytest.param(dict(num_workers=2, pin_memory=True), id="pin_memory"),
        pytest.param(dict(num_workers=3, prefetch_factor=6, cache_rows=0), id="deep-prefetch-lazy"),
        pytest.param(dict(num_workers=2, ring_rows=8), id="ring-overflow"),
        pytest.param(dict(num_workers=1, policy="lru"), id="lru"),
        pytest.param(dict(num_workers=8, prefetch_factor=1), id="8-workers"),
    ],
)
def test_dataloader_options_keep_training_exact(tmp_path, reference, options):
    options = {"cache_rows": 50, **options}
    overflow = "ring_rows" in options  # correct, and says how to make room
    with (
        pytest.warns(RuntimeWarning, match="did not fit the workers' ring")
        if overflow
        else (contextlib.nullcontext())
    ):
        table, *_ = train_offloaded(DATA, "adagrad", lr=0.5, path=tmp_path / "t.zarr", **options)
    assert torch.equal(table, reference)


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset: each worker streams its share of the samples."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        yield from self.samples[worker::workers]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_datasets(tmp_path, num_workers):
    model_weight = torch.randn(1000, 8)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", model_weight).close()
    seen = 0
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=30) as pipe:
        for batch in pipe.loader(Stream(DATA), batch_size=4, num_workers=num_workers):
            assert torch.equal(batch["inputs_embeds"], model_weight[batch["input_ids"]])
            seen += len(batch["input_ids"])
    assert seen == len(DATA)


def test_iterable_dataset_out_of_range_id_names_the_stream_position(tmp_path):
    embedpipe.Table.create(tmp_path / "t.zarr", 10, 4).close()
    data = [{"input_ids": torch.tensor([1, 2])}] * 3 + [{"input_ids": torch.tensor([1, 99])}]
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=3) as pipe:
        with pytest.raises(ValueError, match="sample 3's stream, 'input_ids': id 99 at position 1"):
            list(pipe.loader(Stream(data), batch_size=2))


def test_bf16_autocast_trains_like_the_reference_under_autocast(tmp_path):
    # The rows and their update stay float32; autocast only changes the model's matmuls.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = train_reference(DATA[:48], "sgd", lr=0.5)[0]
        table, *_ = train_offloaded(
            DATA[:48], "sgd", lr=0.5, path=tmp_path / "t.zarr", num_workers=2
        )
    assert table.dtype == torch.float32
    assert torch.equal(table, reference)


def test_batch_mapping_and_device_move(tmp_path):
    weight = torch.randn(1000, 8)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight).close()
    with EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=30, optimizer=embedpipe.optim.SGD(lr=1)
    ) as pipe:
        batch = next(iter(pipe.loader(DATA, batch_size=4)))
        # iteration yields the collated fields; inputs_embeds is read by key (batch.py's NOTE)
        assert list(batch) == ["input_ids", "attention_mask", "labels"]
        assert len(batch) == 3 and "inputs_embeds" in batch and "rows" not in batch
        moved = batch.to("cpu")
        embeds = moved["inputs_embeds"]  # (B, L, D) made from the (U, D) rows
        assert embeds.shape == (4, 16, 8) and embeds.requires_grad
        assert torch.equal(embeds.detach(), weight[batch["input_ids"]])
        assert len(batch.unique_ids) == len(np.unique(batch["input_ids"].numpy()))
        again = moved["inputs_embeds"]  # a new graph each read, from the same leaf of rows
        assert again is not embeds and torch.equal(again, embeds)
        assert again.grad_fn.next_functions[0][0].variable is moved.rows
        with torch.no_grad():
            assert not batch.to("cpu")["inputs_embeds"].requires_grad
