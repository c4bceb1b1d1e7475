"""The shard a service serves (``service/shard.py``): before a job trains it, a later shard's
files are those of the last checkpoint, and its chunks of the state arrays are as the first
shard's service left the table's metadata (NOTE [ Shard services ])."""

from __future__ import annotations

import os

import numpy as np
import pytest

import embedpipe
from embedpipe.service.shard import ServedShard, check


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 256, 4, chunk_rows=64).close()  # shard 1/2: rows 128-256
    table = embedpipe.Table.open(path, "r+")
    yield table
    table._modified = False
    table.close()


def later_shards_handle(table):
    return embedpipe.Table._reader(table.path, table.path, "r+")


def test_a_later_shard_takes_its_rows_back_and_fills_arrays_added_since_afresh(table):
    shard = ServedShard(table, 1, 2)
    assert shard.rows == (128, 256) and not shard.locks
    ids = np.array([10, 200])
    before = table.read(ids)
    table.write(ids, np.ones((2, 4), np.float32))  # a dropped job's rows, both shards
    table._add_state("sum", 0.0)  # the first shard's service prepares the next job's table
    table.write(np.array([130]), np.full((1, 4), 7.0, np.float32), "sum")  # a late write
    mine = later_shards_handle(table)
    shard.settle(mine, {"sum": 0.0})
    assert (mine.read(ids)[1] == before[1]).all()  # its row: the checkpoint's
    assert (mine.read(ids)[0] == 1).all()  # the first shard's: not its to take back
    assert (mine.read(np.arange(128, 256), "sum") == 0).all()  # filled afresh


def test_a_later_shard_removes_its_chunks_of_an_array_the_table_dropped(table):
    table._add_state("sum", 0.0)  # a job's array, never committed; the job dies
    ServedShard(table, 0, 2).settle(table, {})  # the first shard's drop: its files, metadata
    assert "sum" not in table.state_names
    ServedShard(table, 1, 2).settle(later_shards_handle(table), {})
    state = os.path.join(table.path, "state", "sum")
    assert not os.path.exists(state), os.listdir(state)


def test_a_job_of_another_shape_is_refused_naming_both(table):
    with pytest.raises(ValueError, match=r"rows 0 to 128 \(shard 0/2\), and this job's machine "
                       r"trains rows 128 to 256: each machine's ranks need"):  # fmt: skip
        check(ServedShard(table, 0, 2), (128, 256), "unix:/x.sock", table.path)
    check(ServedShard(table, 1, 2), [128, 256], "unix:/x.sock", table.path)
    check(None, None, "unix:/x.sock", table.path)
