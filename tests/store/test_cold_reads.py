"""RawRows.read with the page cache dropped (rows sent to the disk in one pass, then waited for)
gives exactly what the general zarr API and the one-row-at-a-time path give: duplicates, rows
across chunks, the first and last row, a chunk replaced or copied on write while open, more
chunks than a reader keeps open, and readers forked into real DataLoader workers."""

from __future__ import annotations

import glob
import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import embedpipe
from embedpipe.store import rowstore
from embedpipe.store.layout import WEIGHT
from embedpipe.store.rowstore import RawRows, ZarrRows
from embedpipe.tools.benchmark import cgroup

ROWS, DIM, CHUNK = 5000, 24, 256  # rows of 96 bytes: some straddle two pages


@pytest.fixture
def weight() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((ROWS, DIM), dtype=np.float32)


@pytest.fixture
def path(tmp_path, weight) -> str:
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=CHUNK).close()
    return str(tmp_path / "t.zarr")


def reader(path: str) -> RawRows:
    """A reader of the live arrays (the files a pipe writes), as DataLoader workers have."""
    rows = embedpipe.Table._reader(path, path)._array(WEIGHT)
    assert type(rows) is RawRows
    return rows


def drop_page_cache(rows: RawRows) -> None:
    """Write back and drop the table's pages from the OS page cache (only this table's files)."""
    cgroup.drop_page_cache(glob.glob(os.path.join(rows.root, "c", "*", "0")))


def random_ids(seed: int, n: int = 1200) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, ROWS, n)
    ids[:50] = ids[50:100]  # duplicates
    return np.concatenate([[0, ROWS - 1, 0, CHUNK - 1, CHUNK, ROWS - 1], ids])


def test_cold_reads_equal_zarr_and_the_serial_path(path, weight):
    rows = reader(path)
    reference = ZarrRows(rows.array)
    for seed in range(3):
        ids = random_ids(seed)
        # posix_fadvise(DONTNEED) is advice: about one run in ten on this 6.18 kernel, it left
        # every page of the files cached, and no row had to wait. Each read is checked; the
        # disk must have been read (the second pass run) in one of three tries.
        for _ in range(3):
            drop_page_cache(rows)
            waited = rows.rows_waited
            cold = rows.read(ids)
            np.testing.assert_array_equal(cold, weight[ids])
            np.testing.assert_array_equal(cold, reference.read(ids))
            if rows.rows_waited > waited:
                break
        assert rows.rows_waited > waited  # the disk was read: the second pass ran
        np.testing.assert_array_equal(rows.read(ids), cold)  # warm
    serial = reader(path)
    serial._nowait = False  # every row read and waited for in turn (no RWF_NOWAIT)
    drop_page_cache(serial)
    ids = random_ids(7)
    np.testing.assert_array_equal(serial.read(ids), weight[ids])
    assert serial.rows_waited == len(ids)


def test_read_chunk_and_empty_reads(path, weight):
    rows = reader(path)
    drop_page_cache(rows)
    last = (ROWS - 1) // CHUNK
    np.testing.assert_array_equal(rows.read_chunk(last), weight[last * CHUNK :])
    np.testing.assert_array_equal(rows.read_chunk(1), weight[CHUNK : 2 * CHUNK])
    assert rows.read(np.array([], dtype=np.int64)).shape == (0, DIM)


def test_a_chunk_replaced_or_copied_while_open_reads_new_rows(path, weight):
    rows = reader(path)
    ids = random_ids(3)
    rows.read(ids)  # every chunk now open in this reader
    writer = embedpipe.Table.open(path, mode="r+")
    live = writer._array(WEIGHT)
    new_chunk = -weight[CHUNK : 2 * CHUNK]
    live.write_chunk(1, new_chunk)  # a new file renamed over the open one
    checkpoint_link = os.path.join(live.root, "c", "2", "0.link")
    os.link(live._path(2), checkpoint_link)  # as a checkpoint shares it: copy on write
    live.write(np.array([2 * CHUNK + 5]), np.full((1, DIM), 7, dtype=np.float32))
    expected = weight.copy()
    expected[CHUNK : 2 * CHUNK] = new_chunk
    expected[2 * CHUNK + 5] = 7
    for drop in (False, True):
        if drop:
            drop_page_cache(rows)
        np.testing.assert_array_equal(rows.read(ids), expected[ids])
    shared = np.fromfile(checkpoint_link, dtype=np.float32).reshape(CHUNK, DIM)
    np.testing.assert_array_equal(shared, weight[2 * CHUNK : 3 * CHUNK])  # unchanged
    os.unlink(checkpoint_link)
    writer.close()


def test_more_chunks_than_a_reader_keeps_open(path, weight, monkeypatch):
    monkeypatch.setattr(rowstore, "MAX_OPEN_CHUNKS", 3)  # a batch touches all 20 chunks
    rows = reader(path)
    for seed in range(2):
        ids = random_ids(seed)
        drop_page_cache(rows)
        np.testing.assert_array_equal(rows.read(ids), weight[ids])
    assert len(rows._files) == 3


class ReadsRows(Dataset):
    """Each item reads 300 random rows through one reader made (and used) before the fork."""

    def __init__(self, rows: RawRows) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = random_ids(100 + i, 300)
        drop_page_cache(self.rows)
        return torch.from_numpy(ids), torch.from_numpy(self.rows.read(ids))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_readers_in_dataloader_workers(path, weight, context):
    rows = reader(path)
    rows.read(random_ids(0))  # files open in the parent, inherited by forked workers
    loader = DataLoader(
        ReadsRows(rows), batch_size=None, num_workers=2, multiprocessing_context=context
    )
    seen = 0
    for ids, got in loader:
        np.testing.assert_array_equal(got.numpy(), weight[ids.numpy()])
        seen += 1
    assert seen == 16
    np.testing.assert_array_equal(rows.read(random_ids(5)), weight[random_ids(5)])  # parent


def test_a_pickled_reader_reopens_its_files(path, weight):
    rows = reader(path)
    rows.read(random_ids(0))
    copy = pickle.loads(pickle.dumps(rows))
    assert not copy._files
    np.testing.assert_array_equal(copy.read(random_ids(1)), weight[random_ids(1)])
