"""Memory: a table many times larger than the cache trains without any process growing with it.

1 GiB on disk, a 5 MB cache, Zipf-distributed ids, SGD training with two workers. Over the run the
workers read tens of thousands of rows from disk; if the pages they read stayed in the process, or
anything kept per batch, the main process or a worker would grow by far more than the budget:
cache + ring + 12 bytes per table row (+ 8 MiB for the allocator).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import embedpipe
from embedpipe.pipe import EmbeddingPipe

ROWS, DIM = 1 << 20, 256  # 1 GiB of float32
CACHE_ROWS = 5 * 2**20 // (DIM * 4)  # 5 MiB
BATCHES, WARMUP = 200, 20
SLACK = (
    8 * 2**20
)  # allocator arenas, the DataLoader's queues (measured growth: 10-16 MiB owner, 4-6 MiB workers)


class ZipfTokens(torch.utils.data.Dataset):
    """Sentences of Zipf-distributed ids spread over the whole table."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.permutation = rng.permutation(ROWS)
        self.ids = (rng.zipf(1.1, (n, 128)) - 1) % ROWS  # a heavy tail: many distinct rows

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.from_numpy(self.permutation[self.ids[i]])}


def memory(loader) -> tuple[int, list[int]]:
    """RSS of this process, and for each worker the larger of its RSS and its unique memory (USS).

    The workers' RSS counts the pages of the table files they have mapped, which two workers
    share (so USS alone would not see them) and which the kernel maps a large folio at a time.
    """
    pids = [w.pid for w in loader._iterator._workers]  # persistent workers
    workers = [psutil.Process(pid).memory_full_info() for pid in pids]
    return psutil.Process().memory_info().rss, [max(w.rss, w.uss) for w in workers]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_neither_owner_nor_workers_grow_with_the_table(tmp_path):
    # Large chunks: every chunk file stays open in the readers (fewer than MAX_OPEN_CHUNKS); what
    # they read must not pile up in their memory.
    embedpipe.Table.create(tmp_path / "big.zarr", ROWS, DIM, chunk_rows=4096).close()
    pipe = EmbeddingPipe(
        tmp_path / "big.zarr", cache_rows=CACHE_ROWS, optimizer=embedpipe.optim.SGD(lr=0.1)
    )
    loader = pipe.loader(
        ZipfTokens(BATCHES * 8), batch_size=8, num_workers=2, persistent_workers=True
    )
    with pipe:
        for k, batch in enumerate(loader):
            batch["inputs_embeds"].mean().backward()
            pipe.step()
            if k == 0:  # the workers are up and have read their first batches
                _, workers_start = memory(loader)
            if k == WARMUP:  # the owner's allocator and lazy imports have settled
                owner_start, _ = memory(loader)
                read_start = pipe.stats()["rows_read"]
        owner_end, workers_end = memory(loader)
        stats = pipe.stats()
    ring = loader.ring.nbytes
    budget = (
        CACHE_ROWS * DIM * 4 + ring + 12 * ROWS + SLACK
    )  # 12 B/row: slot_of, last_updated, LFU uses
    rows_read = stats["rows_read"] - read_start
    # Each random row read maps a 4 KiB page: kept, the pages alone would blow the budget.
    assert rows_read * 4096 > 2 * budget, rows_read
    assert stats["evictions"] > 0 and stats["rows_written"] > 0
    assert owner_end - owner_start < budget, (owner_end - owner_start) / 2**20
    assert len(workers_start) == len(workers_end) == 2
    for start, end in zip(workers_start, workers_end):
        assert end - start < budget, (end - start) / 2**20


def test_a_cache_that_will_not_fit_as_it_fills_warns_before_it_does(tmp_path, monkeypatch):
    """NOTE [ A cache that fills past the memory ] (cache/budget.py): the room left is checked
    while the cache fills, not only when the pipe is made (a real pipe, its real shared cache;
    only the room the kernel reports is made small, after the pipe was made with room enough)."""
    from embedpipe.cache import budget

    embedpipe.Table.create(tmp_path / "t.zarr", 20_000, 64).close()
    data = [{"input_ids": torch.arange(i * 128, (i + 1) * 128) % 20_000} for i in range(64)]
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=10_000, owner="thread") as pipe:
        cache = pipe._owner.cache
        before = cache.unfilled_bytes()
        assert before > 10_000 * 64 * 4 // 2  # made: most of the rows' pages not taken yet
        room = {"bytes": 10 * before}
        monkeypatch.setattr(budget, "available_memory", lambda: room["bytes"])
        loader = pipe.loader(data, batch_size=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # room enough: no warning
            batches = iter(loader)
            for _ in range(8):
                next(batches)["inputs_embeds"]
        filled = cache.unfilled_bytes()
        assert filled < before  # the kernel counts the pages the admissions took
        room["bytes"] = filled // 2  # the workers and the model took the rest
        with pytest.warns(budget.MemoryBudgetWarning) as caught:
            for _ in range(8):
                next(batches)["inputs_embeds"]
        message = str(caught[0].message)
        assert "the cache of 10,000 rows is filling" in message and "cache_rows" in message
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            for batch in batches:
                batch["inputs_embeds"]


def test_a_cache_that_takes_no_more_pages_is_not_looked_at_again(tmp_path, monkeypatch):
    """The look at the room left (11 file reads) runs every 8 batches only while the cache takes
    pages: batches whose rows are all cached (a whole table, the same ids) take none, so after
    the first look there is none, until a batch brings new rows."""
    from embedpipe.cache import budget

    embedpipe.Table.create(tmp_path / "t.zarr", 20_000, 64).close()
    same = [{"input_ids": torch.arange(128)} for _ in range(40)]
    fresh = [{"input_ids": torch.arange(i * 128, (i + 1) * 128)} for i in range(1, 9)]
    looks = []  # the owner's looks: each compares what the cache will take with the room left
    monkeypatch.setattr(budget, "warn_if_fill_will_not_fit", lambda *a: looks.append(a) or True)
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=20_000, owner="thread") as pipe:
        for batch in pipe.loader(same, batch_size=1):
            batch["inputs_embeds"]
        assert len(looks) == 1  # at batch 8; batches 16, 24, 32 and 40 took no pages
        for batch in pipe.loader(fresh, batch_size=1):
            batch["inputs_embeds"]
        assert len(looks) == 2  # batch 48: the new rows took pages


def test_a_new_training_cache_has_its_optimizer_state_still_to_fill(tmp_path):
    """What a cache will still take counts its optimizer state by the share of its rows still
    untouched, not by the share of the whole shared block (whose per-table-row index is
    written when it is made: a table 100x the cache)."""
    embedpipe.Table.create(tmp_path / "t.zarr", 100_000, 64).close()
    adagrad = embedpipe.optim.Adagrad(lr=0.1)
    with EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=1_000, optimizer=adagrad, owner="thread"
    ) as pipe:
        cache = pipe._owner.cache
        state = sum(array.nbytes for array in cache.state.values())
        expected = cache.shared.rows.nbytes + cache.shared.version.nbytes + state
        assert state == cache.shared.rows.nbytes  # Adagrad: one sum a row
        assert 0.95 * expected <= cache.unfilled_bytes() <= expected


FILLING_IN_AN_OWNER_PROCESS = """
import warnings, torch, embedpipe
from embedpipe.pipe import EmbeddingPipe
data = [{"input_ids": torch.arange(i * 128, (i + 1) * 128) % 20_000} for i in range(32)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with EmbeddingPipe(PATH, cache_rows=10_000, owner="process") as pipe:
        for batch in pipe.loader(data, batch_size=2):
            batch["inputs_embeds"]
filling = [w for w in caught if "is filling" in str(w.message)]
print(len(filling), filling[0].category.__name__ if filling else None)
"""


def test_a_filling_cache_warns_from_an_owner_process_too(tmp_path):
    """The owner process's warning reaches the training process, as a MemoryBudgetWarning. Both
    processes see a memory of 1 byte, through a ``sitecustomize`` the owner's interpreter (a
    fresh one, which inherits the environment) loads too."""
    embedpipe.Table.create(tmp_path / "t.zarr", 20_000, 64).close()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import embedpipe.cache.budget as budget\nbudget.available_memory = lambda: 1\n"
    )
    root = Path(__file__).resolve().parents[2]
    code = FILLING_IN_AN_OWNER_PROCESS.replace("PATH", repr(str(tmp_path / "t.zarr")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(root)])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "MemoryBudgetWarning"]


@pytest.mark.parametrize("optimizer", [None, embedpipe.optim.SGD(lr=0.1)])
@pytest.mark.parametrize("fits", [True, False])
def test_a_frozen_auto_pipe_whose_table_fits_in_memory_is_lfu_in_a_thread(
    tmp_path, monkeypatch, fits, optimizer
):
    # NOTE [ A frozen table that fits in memory ]: its misses come from the page cache, where
    # looking ahead costs more than the reads it saves. A training pipe looks ahead regardless.
    from embedpipe.cache import budget
    from embedpipe.service.client import RemoteOwner

    monkeypatch.setattr(budget, "stays_in_page_cache", lambda nbytes: fits)
    embedpipe.Table.create(tmp_path / "t.zarr", 200, 4).close()
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.2, size=(40, 16)), 200) - 1
    data = [{"input_ids": torch.from_numpy(row)} for row in ids]
    read = {}
    for policy in ("auto", "lfu"):
        pipe = EmbeddingPipe(tmp_path / "t.zarr", cache_rows=20, policy=policy, optimizer=optimizer)
        with pipe:
            if policy == "auto":
                looks_ahead = optimizer is not None or not fits
                assert pipe._owner.looks_ahead == looks_ahead
                assert isinstance(pipe._owner, RemoteOwner) == looks_ahead  # else a thread
            for batch in pipe.loader(data, batch_size=4):
                if optimizer is not None:
                    batch["inputs_embeds"].sum().backward()
                    pipe.step()
            read[policy] = pipe.stats()["rows_read"]
    if optimizer is None and fits:
        assert read["auto"] == read["lfu"]


def test_a_frozen_pipe_not_looking_ahead_owns_in_a_thread_and_a_compressed_table_looks_ahead(
    tmp_path, monkeypatch
):
    # a compressed chunk is decoded whole at each read: its misses are no page-cache copies
    from embedpipe.cache import budget
    from embedpipe.service.client import RemoteOwner

    monkeypatch.setattr(budget, "stays_in_page_cache", lambda nbytes: True)
    embedpipe.Table.create(tmp_path / "raw.zarr", 200, 4).close()
    embedpipe.Table.create(tmp_path / "zstd.zarr", 200, 4, compressor="zstd").close()
    with EmbeddingPipe(tmp_path / "raw.zarr", cache_rows=20, policy="lfu") as pipe:
        assert not isinstance(pipe._owner, RemoteOwner)
    with EmbeddingPipe(tmp_path / "zstd.zarr", cache_rows=20) as pipe:
        assert pipe._owner.looks_ahead and isinstance(pipe._owner, RemoteOwner)


class RandomCrops(torch.utils.data.Dataset):
    """Each sample a random crop of a random length: the randomness a real dataset has."""

    def __init__(self, n: int, num_rows: int) -> None:
        self.n, self.num_rows = n, num_rows

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        length = int(torch.randint(4, 24, ()))
        ids = torch.minimum(torch.from_numpy(np.random.zipf(1.2, length)), torch.tensor(1000))
        return {"input_ids": (ids - 1) % self.num_rows}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_frozen_pipe_whose_table_fits_reads_its_checkpoint_through_a_window(
    tmp_path, monkeypatch, workers
):
    # NOTE [ A frozen table that fits in memory ]: its lookups map the checkpoint's chunk files
    # read-only (store/mapped.py): no preadv in the processes that look up (the workers inherit
    # the count), and the rows are the table's. A frozen pipe on a table open for writing reads
    # the live arrays, which are never read so.
    import multiprocessing

    from embedpipe.cache import budget

    monkeypatch.setattr(budget, "stays_in_page_cache", lambda nbytes: True)
    embedpipe.Table.create(tmp_path / "t.zarr", 3000, 8, chunk_rows=128).close()
    with embedpipe.Table.open(tmp_path / "t.zarr", "r+") as table:
        weight = table.to_tensor()
    preads = multiprocessing.get_context("fork").Value("i", 0)
    preadv = os.preadv

    def counted(*args):
        with preads.get_lock():
            preads.value += 1
        return preadv(*args)

    monkeypatch.setattr(os, "preadv", counted)
    data = RandomCrops(64, 3000)
    for source, maps in (
        (tmp_path / "t.zarr", True),
        (embedpipe.Table.open(tmp_path / "t.zarr", "r+"), False),
    ):
        preads.value = 0
        with EmbeddingPipe(source, cache_rows=200, policy="lfu", padding_idx=0) as pipe:
            loader = pipe.loader(data, batch_size=8, num_workers=workers)
            for _ in range(2):
                for batch in loader:
                    torch.testing.assert_close(
                        batch["inputs_embeds"], weight[batch["input_ids"]], rtol=0, atol=0
                    )
            assert pipe.stats()["rows_read"] > 0
        assert (preads.value == 0) == maps, preads.value
        if not maps:
            source.close()
