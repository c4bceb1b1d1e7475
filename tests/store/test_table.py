"""Table: create/open/read/write, state and metadata, the writer lock, and every bad input."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
import torch
import zarr

import embedpipe
from embedpipe import errors
from embedpipe.store.layout import INIT_BLOCK_ROWS, default_chunk_rows
from embedpipe.store.rowstore import RawRows, ZarrRows


def test_from_tensor_round_trips_bits(tmp_path, weight):
    t = embedpipe.Table.from_tensor(tmp_path / "a.zarr", torch.from_numpy(weight), chunk_rows=100)
    assert (t.num_rows, t.dim, t.dtype) == (1000, 16, np.dtype("float32"))
    assert torch.equal(t.to_tensor(), torch.from_numpy(weight))
    t.close()


def test_read_returns_rows_in_order_of_ids_with_duplicates(table, weight):
    ids = np.array([999, 3, 3, 0, 512, 3, 64, 63])
    np.testing.assert_array_equal(table.read(ids), weight[ids])
    np.testing.assert_array_equal(
        table.read(torch.tensor([[5, 6], [7, 5]])), weight[[[5, 6], [7, 5]]]
    )
    assert table.read([]).shape == (0, 16)


def test_random_reads_match_zarr_api(table, weight):
    ids = np.random.default_rng(1).integers(0, 1000, 5000)
    np.testing.assert_array_equal(table.read(ids), weight[ids])
    z = zarr.open_array(os.path.join(table.path, "weight"), mode="r")
    np.testing.assert_array_equal(z[:], weight)


def test_readers_see_committed_checkpoints_only(table, weight):
    reader = embedpipe.Table.open(table.path)
    reader.read(np.arange(1000))  # maps every chunk
    ids = np.array([999, 0, 70, 64])
    rows = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    table.write(ids, rows)
    expected = weight.copy()
    expected[ids] = rows
    np.testing.assert_array_equal(embedpipe.Table.open(table.path).to_tensor(), weight)
    table.checkpoint()
    np.testing.assert_array_equal(embedpipe.Table.open(table.path).to_tensor(), expected)
    np.testing.assert_array_equal(reader.read(np.arange(1000)), weight)  # its checkpoint, whole
    np.testing.assert_array_equal(zarr.open_array(os.path.join(table.path, "weight"))[:], expected)


def test_edge_chunk_is_stored_at_full_chunk_size(table):
    # 1000 rows in 64-row chunks: chunk 15 holds rows 960..999 in a 64-row file, as zarr does.
    assert os.path.getsize(os.path.join(table.path, "weight", "c", "15", "0")) == 64 * 16 * 4
    table.write([999], np.ones((1, 16), np.float32))
    assert os.path.getsize(os.path.join(table.path, "weight", "c", "15", "0")) == 64 * 16 * 4


@pytest.mark.parametrize("compressor", ["zstd", "blosc"])
def test_compressed_tables_use_the_zarr_path_and_agree(tmp_path, weight, compressor):
    t = embedpipe.Table.from_tensor(
        tmp_path / "c.zarr", weight, chunk_rows=64, compressor=compressor
    )
    assert type(t._array("weight")) is ZarrRows
    ids = np.array([5, 900, 5, 64])
    np.testing.assert_array_equal(t.read(ids), weight[ids])
    t.write([900], np.zeros((1, 16), np.float32))
    assert not t.read([900]).any()
    t.close()


def test_uncompressed_tables_use_raw_chunks(table):
    assert type(table._array("weight")) is RawRows


def test_create_normal_is_seeded_and_independent_of_chunking(tmp_path):
    rows = INIT_BLOCK_ROWS + 10
    a = embedpipe.Table.create(tmp_path / "a.zarr", rows, 8, seed=3, chunk_rows=100)
    b = embedpipe.Table.create(tmp_path / "b.zarr", rows, 8, seed=3, chunk_rows=4096)
    c = embedpipe.Table.create(tmp_path / "c.zarr", rows, 8, seed=4)
    wa = a.to_tensor()
    assert torch.equal(wa, b.to_tensor()) and not torch.equal(wa, c.to_tensor())
    assert abs(float(wa.std()) - 1.0) < 0.05 and abs(float(wa.mean())) < 0.05
    d = embedpipe.Table.create(tmp_path / "d.zarr", 100, 8, std=0.02)
    assert abs(float(d.to_tensor().std()) - 0.02) < 0.005
    z = embedpipe.Table.create(tmp_path / "z.zarr", 100, 8, init="zeros")
    assert not z.to_tensor().any()


def test_default_chunking_is_about_1_mib_of_whole_rows():
    assert default_chunk_rows(30522, 768) == 256  # 768 KiB
    assert default_chunk_rows(250_000, 128) == 2048
    assert default_chunk_rows(10, 128) == 10


def test_state_arrays_share_the_row_index(table):
    table.add_state("sum", fill=0.5)
    assert table.state_names == ["sum"]
    np.testing.assert_array_equal(table.read([3, 999], "sum"), np.full((2, 16), 0.5, np.float32))
    table.write([3], np.full((1, 16), 2.0, np.float32), "sum")
    table.checkpoint()
    reopened = embedpipe.Table.open(table.path)
    assert reopened.state_names == ["sum"]
    assert reopened.read([3], "sum")[0, 0] == 2.0 and reopened.read([4], "sum")[0, 0] == 0.5
    with pytest.raises(KeyError, match="exp_avg"):
        table.read([0], "exp_avg")


def test_metadata_persists(table):
    table.update_metadata(step=7, optimizer={"name": "adagrad", "lr": 0.1})
    assert embedpipe.Table.open(table.path).metadata["step"] == 0  # not committed yet
    table.close()  # commits
    meta = embedpipe.Table.open(table.path).metadata
    assert meta["step"] == 7 and meta["optimizer"] == {"name": "adagrad", "lr": 0.1}
    assert meta["format_version"] == 2


def test_pickled_table_reopens_read_only(table, weight):
    import pickle

    clone = pickle.loads(pickle.dumps(table))
    assert clone.mode == "r"
    np.testing.assert_array_equal(clone.read([1, 2]), weight[[1, 2]])


# ----------------------------------------------------------------------------- the writer lock
def _try_open_for_writing(path, queue):
    try:
        embedpipe.Table.open(path, "r+")
        queue.put("opened")
    except errors.TableLockedError as e:
        queue.put(str(e))


@pytest.mark.slow
def test_second_writer_in_another_process_is_refused_naming_the_holder(table):
    queue = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_try_open_for_writing, args=(table.path, queue))
    p.start()
    message = queue.get(timeout=60)
    p.join(timeout=60)
    assert f"pid {os.getpid()}" in message and table.path in message


def test_second_writer_in_this_process_is_refused_and_close_releases(table):
    with pytest.raises(errors.TableLockedError, match=f"pid {os.getpid()}"):
        embedpipe.Table.open(table.path, "r+")
    embedpipe.Table.open(table.path, "r").read([0])  # readers need no lock
    table.close()
    with embedpipe.Table.open(table.path, "r+") as again:
        again.write([0], np.zeros((1, 16), np.float32))


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [-1, 1000, 10**12])
def test_out_of_range_id_names_the_id_and_position(table, bad):
    with pytest.raises(
        errors.IdOutOfRangeError, match=rf"id {bad} at position 2 .* 1000 rows"
    ) as e:
        table.read([0, 1, bad, 3])
    assert isinstance(e.value, ValueError)


def test_out_of_range_write_writes_nothing(table, weight):
    with pytest.raises(ValueError, match="id 1000 at position 1"):
        table.write([5, 1000], np.zeros((2, 16), np.float32))
    np.testing.assert_array_equal(table.read([5]), weight[[5]])


@pytest.mark.parametrize("ids", [[1.0, 2.0], np.array([0.5]), torch.tensor([1.0]), [True, False]])
def test_float_or_bool_ids_are_refused_naming_the_dtype(table, ids):
    with pytest.raises(errors.InvalidIdsError, match="must be integers, got dtype") as e:
        table.read(ids)
    assert isinstance(e.value, (ValueError, TypeError))


def test_ragged_ids_are_refused(table):
    with pytest.raises(errors.InvalidIdsError, match="ragged"):
        table.read([[1, 2], [3]])


def test_duplicate_ids_in_write_are_refused_naming_the_id(table, weight):
    with pytest.raises(errors.InvalidIdsError, match="id 7 repeats"):
        table.write([7, 8, 7], np.zeros((3, 16), np.float32))
    np.testing.assert_array_equal(table.read([7, 8]), weight[[7, 8]])


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (np.zeros((2, 15), np.float32), r"shape \(2, 16\) .* got \(2, 15\)"),
        (np.zeros((3, 16), np.float32), r"shape \(2, 16\) .* got \(3, 16\)"),
        (np.zeros((2, 16), np.float64), "dtype float32, got float64"),
        (np.zeros((2, 16), np.int32), "dtype float32, got int32"),
    ],
)
def test_rows_of_wrong_shape_or_dtype_are_refused_before_writing(table, weight, rows, match):
    with pytest.raises(errors.InvalidRowsError, match=match):
        table.write([1, 2], rows)
    np.testing.assert_array_equal(table.read([1, 2]), weight[[1, 2]])


def test_write_to_a_read_only_table_is_refused(table):
    reader = embedpipe.Table.open(table.path, "r")
    with pytest.raises(errors.ReadOnlyTableError, match="mode='r\\+'") as e:
        reader.write([0], np.zeros((1, 16), np.float32))
    assert isinstance(e.value, PermissionError)


def test_missing_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no table at .*nothing.zarr"):
        embedpipe.Table.open(tmp_path / "nothing.zarr")


def test_paths_that_are_not_tables_are_refused(tmp_path):
    (tmp_path / "file.txt").write_text("hello")
    with pytest.raises(errors.TableFormatError, match="file.txt is a file"):
        embedpipe.Table.open(tmp_path / "file.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.TableFormatError, match="empty is not an embedpipe table"):
        embedpipe.Table.open(tmp_path / "empty")
    zarr.open_group(tmp_path / "plain.zarr", mode="w")
    with pytest.raises(errors.TableFormatError, match="without embedpipe metadata"):
        embedpipe.Table.open(tmp_path / "plain.zarr")


def test_create_refuses_an_existing_path_unless_overwrite(table, tmp_path):
    with pytest.raises(errors.TableExistsError, match="t.zarr already exists"):
        embedpipe.Table.create(table.path, 10, 4)
    with pytest.raises(errors.TableLockedError):  # overwrite never deletes a table being written
        embedpipe.Table.create(table.path, 10, 4, overwrite=True)
    table.close()
    with embedpipe.Table.create(table.path, 10, 4, overwrite=True) as t:
        assert (t.num_rows, t.dim) == (10, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_rows=0, dim=4), "num_rows must be a positive integer, got 0"),
        (dict(num_rows=10, dim=-2), "dim must be a positive integer, got -2"),
        (dict(num_rows=10, dim=4, dtype="int8"), "dtype must be one of .* got 'int8'"),
        (dict(num_rows=10, dim=4, compressor="gzip"), "compressor must be one of .* got 'gzip'"),
        (dict(num_rows=10, dim=4, init="xavier"), "init must be .* got 'xavier'"),
        (dict(num_rows=10, dim=4, std=float("nan")), "std must be a finite number"),
    ],
)
def test_bad_create_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        embedpipe.Table.create(tmp_path / "x.zarr", **kwargs)
    assert not (tmp_path / "x.zarr").exists()


def test_bfloat16_and_wrong_rank_tensors_are_refused(tmp_path):
    with pytest.raises(errors.InvalidRowsError, match="bfloat16 .* weight.float()"):
        embedpipe.Table.from_tensor(tmp_path / "b.zarr", torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(errors.InvalidRowsError, match=r"2-D .* got shape \(4,\)"):
        embedpipe.Table.from_tensor(tmp_path / "b.zarr", np.zeros(4, np.float32))
    assert not (tmp_path / "b.zarr").exists()


def test_from_tensor_with_its_arguments_swapped_says_so(tmp_path):
    with pytest.raises(TypeError, match=r"the path comes first; got a Tensor of shape \(4, 2\)"):
        embedpipe.Table.from_tensor(torch.zeros(4, 2), tmp_path / "t.zarr")
    assert not (tmp_path / "t.zarr").exists()
