"""The DataLoader stage under the DataLoader's own options: every one keeps exact training exact."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import textwrap
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.ids import unique_inverse
from embedpipe.pipe import EmbeddingPipe
from embedpipe.worker.looked_up import LookedUp

from ..helpers import Stream, small_table, train_offloaded, train_reference, zipf_dataset

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
        pytest.param(
            dict(num_workers=2, multiprocessing_context="spawn"), id="spawn", marks=pytest.mark.slow
        ),
        pytest.param(
            dict(num_workers=2, persistent_workers=True, prefetch_factor=1), id="persistent"
        ),
        pytest.param(dict(num_workers=2, pin_memory=True), id="pin_memory"),
        pytest.param(dict(num_workers=3, prefetch_factor=6, cache_rows=0), id="deep-prefetch-lazy"),
        pytest.param(dict(num_workers=2, ring_rows=8), id="ring-overflow"),
        pytest.param(dict(num_workers=1, policy="lru"), id="lru"),
        pytest.param(
            dict(num_workers=8, prefetch_factor=1), id="8-workers", marks=pytest.mark.slow
        ),
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


class EpochStream(Stream):
    """A stream that reshuffles by its epoch (as a Hugging Face streaming dataset's buffer does),
    with a length and a setting the loop changes."""

    def __init__(self, samples):
        super().__init__(samples)
        self.epoch, self.max_length = 0, 99
        self.num_rows = len(samples)  # as a datasets.Dataset has, as the pipe's table has

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.samples)

    def __iter__(self):
        order = torch.randperm(
            len(self.samples), generator=torch.Generator().manual_seed(self.epoch)
        )
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for i in order[worker::workers].tolist():
            yield {"input_ids": self.samples[i]["input_ids"][: self.max_length]}


def subset(samples):
    return torch.utils.data.Subset(samples, range(len(samples)))


@pytest.mark.parametrize("dataset", [EpochStream, list, subset])
def test_the_loaders_dataset_is_the_users_as_frameworks_reach_it(tmp_path, dataset):
    """loader.dataset is the user's iterable dataset, or wraps the user's map-style one (its
    ids are checked by index): either way Accelerate's set_epoch (Trainer calls it every epoch)
    and a loop that sets an attribute reach the user's, and len() is the DataLoader's."""
    embedpipe.Table.create(tmp_path / "t.zarr", 1000, 4).close()
    data = dataset(DATA)
    plain = torch.utils.data.DataLoader(data, batch_size=4, collate_fn=lambda b: b)
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=30) as pipe:
        loader = pipe.loader(data, batch_size=4, num_workers=2)
        assert len(loader) == len(plain)
        if dataset is list:
            assert loader.dataset.index(DATA[0]) == 0  # the list's own method
            return
        if dataset is subset:
            assert loader.dataset.dataset is DATA and loader.dataset.indices == data.indices
            return
        assert loader.dataset.num_rows == len(DATA)  # not the table's 1000 rows
        firsts = []
        for epoch in range(2):
            if hasattr(loader.dataset, "set_epoch"):  # as accelerate.DataLoaderShard does
                loader.dataset.set_epoch(epoch)
            loader.dataset.max_length = 3 + epoch
            batches = list(loader)
            firsts.append(batches[0]["input_ids"])
            assert {b["input_ids"].shape[1] for b in batches} == {3 + epoch}
        assert data.epoch == 1 and data.max_length == 4
        assert not torch.equal(firsts[0][:, :3], firsts[1][:, :3])  # reshuffled


@pytest.mark.parametrize(
    "workers, where",
    [
        (0, "1 of a batch collated in the training process"),
        (2, "1 of a batch collated by worker 1"),
    ],
)
def test_iterable_dataset_out_of_range_id_names_the_stream_position(tmp_path, workers, where):
    embedpipe.Table.create(tmp_path / "t.zarr", 10, 4).close()
    data = [{"input_ids": torch.tensor([1, 2])}] * 3 + [{"input_ids": torch.tensor([1, 99])}]
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=3) as pipe:
        loader = pipe.loader(Stream(data), batch_size=2, num_workers=workers)
        assert type(loader.dataset) is Stream  # as it is: frameworks split it by its type
        with pytest.raises(ValueError, match=f"sample {where}, 'input_ids': id 99 at position 1"):
            list(loader)


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


@pytest.mark.parametrize("num_rows", [50, 100_000])  # marked in a table-sized array; sorted
@pytest.mark.parametrize("shape", [(4, 16), (64,), (0,)])
def test_unique_ids_and_inverse_are_numpys(num_rows, shape):
    ids = np.random.default_rng(0).integers(0, num_rows, shape)
    unique_ids, inverse = unique_inverse(ids, num_rows)
    expected, expected_inverse = np.unique(ids, return_inverse=True)
    assert np.array_equal(unique_ids, expected) and unique_ids.dtype == np.int64
    assert np.array_equal(inverse, expected_inverse.reshape(shape)) and inverse.shape == shape
    assert np.array_equal(unique_ids[inverse], ids)


def test_fields_travel_from_a_worker_as_bytes_and_arrive_as_tensors():
    ids = torch.arange(32 * 128).reshape(32, 128)
    fields = {
        "input_ids": ids,
        "mask": torch.ones(32, 128, dtype=torch.bool),
        "scores": torch.randn(8, 3).to(torch.bfloat16),
        "columns": ids[:, :4].t(),  # a view, not contiguous
        "grad": torch.zeros(2, requires_grad=True),  # keeps torch's own way
        "nested": [{"labels": torch.tensor([1, -100])}, "text"],
    }
    item = LookedUp(fields, np.arange(3), np.zeros((32, 128), np.int64), 0, 2, None, 1, 2, 1)
    sent = ForkingPickler.dumps(item)  # as the DataLoader's queue pickles a worker's batch
    assert len(sent) > ids.nbytes  # the ids' bytes are in the pickle, not in shared memory
    received = pickle.loads(sent)
    assert received.unique_ids.tolist() == [0, 1, 2] and received.slot == 0 and received.misses == 1
    for key in ("input_ids", "mask", "scores", "columns", "grad"):
        assert torch.equal(received.fields[key], fields[key]), key
        assert received.fields[key].dtype == fields[key].dtype, key
    assert received.fields["grad"].requires_grad
    assert torch.equal(received.fields["nested"][0]["labels"], torch.tensor([1, -100]))
    assert received.fields["nested"][1] == "text"


class Batched(torch.utils.data.Dataset):
    """A dataset with its own ``__getitems__``, which the DataLoader calls for a batch."""

    def __init__(self, samples):
        self.samples = samples
        self.batches = 0

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        raise AssertionError("the DataLoader fetches whole batches through __getitems__")

    def __getitems__(self, indices):
        self.batches += 1
        return [self.samples[i] for i in indices]


def test_a_datasets_getitems_is_used_and_a_bad_sample_is_named(tmp_path):
    embedpipe.Table.create(tmp_path / "t.zarr", 10, 4).close()
    good = [{"input_ids": torch.tensor([1, 2], dtype=torch.int32)} for _ in range(5)]
    bad = [*good[:3], {"input_ids": torch.tensor([1, 99])}, *good[3:]]
    # lookahead=0: the lookahead reader fetches samples through __getitems__ too
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=3, lookahead=0) as pipe:
        data = Batched(good)
        assert len(list(pipe.loader(data, batch_size=2))) == 3 and data.batches == 3
        with pytest.raises(ValueError, match="sample 3, 'input_ids': id 99 at position 1"):
            list(pipe.loader(Batched(bad), batch_size=2))


@pytest.mark.parametrize(
    ("collate", "message"),
    [
        (lambda s: (torch.stack([x["input_ids"] for x in s]),), "got a tuple; give the loader a"),
        (lambda s: {"ids": torch.stack([x["input_ids"] for x in s])}, r"keys: \['ids'\]"),
    ],
    ids=["tuple", "other-key"],
)
def test_a_collate_without_the_ids_under_their_key_says_what_to_change(tmp_path, collate, message):
    embedpipe.Table.create(tmp_path / "t.zarr", 10, 4).close()
    data = [{"input_ids": torch.tensor([1, 2])} for _ in range(4)]
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=3) as pipe:
        with pytest.raises(TypeError, match=message):
            next(iter(pipe.loader(data, batch_size=2, collate_fn=collate)))


class _SaysItsInit(torch.utils.data.Dataset):
    """Samples that carry what the worker's ``worker_init_fn`` left in the environment."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.tensor([i, 7]), "init": int(os.environ.get("_INIT_SAW", -1))}


def _init(worker_id: int) -> None:
    os.environ["_INIT_SAW"] = str(worker_id)


@pytest.mark.parametrize("user_init", [None, _init])
def test_the_loaders_worker_init_fn_stays_the_programs(tmp_path, user_init):
    """embedpipe's watch of the training process wraps ``worker_init_fn`` only while the workers
    start: the loader's attribute stays what the program set (Lightning seeds the workers of a
    loader whose ``worker_init_fn`` is None, and would not if it found embedpipe's there), and
    the program's own still runs in each worker."""
    path = small_table(tmp_path)
    with EmbeddingPipe(path, cache_rows=10) as pipe:
        loader = pipe.loader(_SaysItsInit(), batch_size=2, num_workers=2, worker_init_fn=user_init)
        assert loader.worker_init_fn is user_init
        seen = {int(v) for batch in loader for v in batch["init"]}
        assert loader.worker_init_fn is user_init
    assert seen == ({-1} if user_init is None else {0, 1})


def test_an_epoch_left_unfinished_at_exit_closes_quietly(tmp_path):
    # A script that ends with an epoch's iterator alive: the interpreter clears the modules'
    # names before it closes that generator, whose cleanup must need none of them (it printed
    # "Exception ignored ... TypeError: isinstance() arg 2 must be a type").
    script = textwrap.dedent(
        f"""
        import torch
        import embedpipe
        import embedpipe.pipe.loader as loader_module  # kept by __main__: cleared later

        embedpipe.Table.create({str(tmp_path / "t.zarr")!r}, 300, 8).close()
        data = [{{"input_ids": torch.randint(0, 300, (16,))}} for _ in range(48)]
        pipe = embedpipe.EmbeddingPipe(
            {str(tmp_path / "t.zarr")!r}, cache_rows=300, optimizer=embedpipe.optim.SGD(lr=0.1)
        )
        it = iter(pipe.loader(data, batch_size=4))
        for _ in range(3):
            batch = next(it)
            batch["inputs_embeds"].sum().backward()
            pipe.step()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
