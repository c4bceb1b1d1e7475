"""Rows written through mapped chunk files (the owner process's writes, NOTE [ Mapped row writes ]):
they land where ``pwrite`` would put them and nowhere else, every reader sees them, a checkpoint
never changes, and a full disk is an ``OSError``, never a ``SIGBUS``."""

from __future__ import annotations

import errno
import mmap
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.store import mapped

from .test_checkpoints import small_disk  # noqa: F401 (a fixture)

V, D = 512, 32  # chunks of 32 rows: 4 KiB, a page


@pytest.fixture(autouse=True, params=["window", "a mapping a chunk"])
def layout(request, monkeypatch) -> str:
    """Every test twice: with the array mapped into one window, and a mapping a chunk."""
    if request.param == "window" and (not mapped._FLAGS_KNOWN or mmap.PAGESIZE != 4096):
        pytest.skip("the window needs Linux on x86_64 or aarch64, and chunks of whole pages")
    monkeypatch.setattr(mapped, "WINDOW", request.param == "window")
    return request.param


@pytest.fixture
def weight() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((V, D), dtype=np.float32)


def mapped_table(path, weight=None, **create):
    if weight is None:
        table = embedpipe.Table.create(path, V, D, chunk_rows=32, init="zeros", **create)
    else:
        table = embedpipe.Table.from_tensor(path, weight, chunk_rows=32)
    mapped.map_writes(table)
    return table


def chunk_file(path, chunk: int) -> str:
    return os.path.join(str(path), "weight", "c", str(chunk), "0")


def read_chunk(path, chunk: int) -> np.ndarray:
    """The rows in a chunk's file, read as bytes."""
    with open(chunk_file(path, chunk), "rb") as f:
        return np.frombuffer(f.read(), dtype="<f4").reshape(-1, D)


def test_rows_written_through_mappings_are_what_every_reader_reads(tmp_path, weight, layout):
    path = tmp_path / "t.zarr"
    ids = np.array([3, 40, 41, 300, 511])
    rows = np.arange(len(ids) * D, dtype=np.float32).reshape(-1, D)
    with mapped_table(path, weight) as table:
        assert (table._array("weight").mapped._window is not None) == (layout == "window")
        table.write(ids, -rows)  # the files are the checkpoint's too: copied, written by pwrite
        assert not table._array("weight").mapped._maps
        table.write(ids, rows)  # the copies are this table's alone: mapped
        assert sorted(table._array("weight").mapped._maps) == [0, 1, 9, 15]
        expected = weight.copy()
        expected[ids] = rows
        np.testing.assert_array_equal(table.read(np.arange(V)), expected)  # preadv, same file
        np.testing.assert_array_equal(read_chunk(path, 1), expected[32:64])  # the file's bytes
    np.testing.assert_array_equal(embedpipe.Table.open(path).to_tensor().numpy(), expected)


def test_a_checkpoint_never_changes_under_a_mapped_write(tmp_path, weight):
    """After a commit the chunk files are shared with the checkpoint: a write copies them
    first, though they were mapped before the commit."""
    path = tmp_path / "t.zarr"
    with mapped_table(path, weight) as table:
        table.write([5, 100], np.ones((2, D), dtype=np.float32))  # copied
        table.write([5, 100], np.ones((2, D), dtype=np.float32))  # mapped now
        checkpoint = table.checkpoint()
        table.write([5, 100, 101], np.full((3, D), 7.0, dtype=np.float32))
        table.write([6], np.full((1, D), 8.0, dtype=np.float32))  # the copy, mapped again
        live = table.read([5, 6, 100, 101])
    saved = np.concatenate([read_chunk(checkpoint.path, 0), read_chunk(checkpoint.path, 3)])
    expected = np.concatenate([weight[:32], weight[96:128]])
    expected[[5, 32 + 4]] = 1.0
    np.testing.assert_array_equal(saved, expected)
    np.testing.assert_array_equal(live, [[7.0] * D, [8.0] * D, [7.0] * D, [7.0] * D])


def test_a_mapped_chunk_is_looked_at_once_until_this_process_changes_chunk_files(
    tmp_path, weight, layout, monkeypatch
):
    """NOTE [ A chunk checked once until its files change ]: a chunk in the window is looked at
    (a ``stat`` of its path) at its first write, not at every write and read after it; a
    checkpoint's links make every chunk looked at again, so a write after it still copies the
    shared file first. Mapped a chunk (no window), every write looks, as before."""
    path = tmp_path / "t.zarr"
    looked = []
    stat = os.stat
    with mapped_table(path, weight) as table:
        for _ in range(2):  # copied, then mapped
            table.write([1, 40], np.ones((2, D), dtype=np.float32))
        monkeypatch.setattr(os, "stat", lambda p, *a, **k: looked.append(p) or stat(p, *a, **k))
        table.write([2, 41], np.full((2, D), 2.0, dtype=np.float32))
        np.testing.assert_array_equal(table.read([2, 41]), np.full((2, D), 2.0))
        assert (looked == []) == (layout == "window"), looked
        checkpoint = table.checkpoint()
        looked.clear()
        table.write([2, 41], np.full((2, D), 3.0, dtype=np.float32))  # shared: copied first
        assert {chunk_file(path, 0), chunk_file(path, 1)} <= set(map(str, looked)), looked
        for _ in range(2):  # the copies mapped, then written with no look
            table.write([3], np.full((1, D), 4.0, dtype=np.float32))
        live = table.read([2, 3, 41])
    np.testing.assert_array_equal(
        read_chunk(checkpoint.path, 0)[1:4], [[1.0] * D, [2.0] * D, weight[3]]
    )
    np.testing.assert_array_equal(read_chunk(checkpoint.path, 1)[8:10], [[1.0] * D, [2.0] * D])
    np.testing.assert_array_equal(live, [[3.0] * D, [4.0] * D, [3.0] * D])


def test_a_chunk_replaced_whole_is_mapped_again(tmp_path, weight):
    path = tmp_path / "t.zarr"
    with mapped_table(path, weight) as table:
        table.write([1], np.zeros((1, D), dtype=np.float32))  # copied
        table.write([1], np.zeros((1, D), dtype=np.float32))  # chunk 0 mapped
        assert list(table._array("weight").mapped._maps) == [0]
        rows = table._array("weight")
        fresh = np.full((32, D), 3.0, dtype=np.float32)
        rows.write_chunk(0, fresh)  # a new file renamed over the mapped one
        table.write([2], np.full((1, D), 4.0, dtype=np.float32))
        got = table.read(np.arange(32))
    fresh[2] = 4.0
    np.testing.assert_array_equal(got, fresh)


def test_a_read_takes_mapped_rows_from_the_window_and_never_a_replaced_file(
    tmp_path, weight, layout, monkeypatch
):
    """Rows of chunks mapped into the window are read from it, with no system call a row; a
    chunk file replaced since it was mapped is read from the new file."""
    path = tmp_path / "t.zarr"
    reads = []
    preadv = os.preadv
    with mapped_table(path, weight) as table:
        rows = table._array("weight")
        for _ in range(2):  # copied, then mapped
            table.write([1, 40], np.ones((2, D), dtype=np.float32))
        assert sorted(rows.mapped._maps) == [0, 1]
        monkeypatch.setattr(os, "preadv", lambda *a: reads.append(a[2]) or preadv(*a))
        np.testing.assert_array_equal(table.read([41, 40]), [weight[41], np.ones(D)])
        assert (reads == []) == (layout == "window"), reads
        rows.write_chunk(0, np.full((32, D), 3.0, dtype=np.float32))  # a new file over chunk 0's
        ids = [100, 41, 1, 41, 2, 40, 100]  # unsorted, repeated: window, new file, never mapped
        got = table.read(ids)
        whole = table.read([41, 40])  # all from the window
    expected = weight[ids].copy()
    expected[[2, 4]], expected[5] = 3.0, 1.0
    np.testing.assert_array_equal(got, expected)
    for read in (got, whole):
        assert read.dtype == table.dtype, read.dtype


def test_one_write_over_mapped_shared_and_unmapped_chunks(tmp_path, weight):
    """A write whose rows fall in a mapped chunk, a chunk a checkpoint shares and one never
    mapped, in no order: each lands, and the checkpoint keeps its rows."""
    path = tmp_path / "t.zarr"
    with mapped_table(path, weight) as table:
        for _ in range(2):  # copied, then mapped
            table.write([3], np.ones((1, D), dtype=np.float32))
        checkpoint = table.checkpoint()  # every chunk shared now
        for _ in range(2):  # chunk 0 copied, then mapped again
            table.write([3], np.full((1, D), 2.0, dtype=np.float32))
        ids = np.array([170, 4, 300, 3])  # chunk 5 (shared), 0 (mapped), 9 (shared), 0
        rows = np.arange(4 * D, dtype=np.float32).reshape(4, D)
        table.write(ids, rows)
        got = table.read(np.arange(V))
    expected = weight.copy()
    expected[ids] = rows
    np.testing.assert_array_equal(got, expected)
    saved = weight[160:192].copy()
    np.testing.assert_array_equal(read_chunk(checkpoint.path, 5), saved)


def test_an_address_space_refused_leaves_a_mapping_a_chunk(tmp_path, weight, monkeypatch):
    """A window the kernel refuses (a limit on the address space, strict overcommit) is no
    error: the chunks are mapped one by one."""
    real = mmap.mmap

    def refuse(fileno, *args, **kwargs):
        if fileno == -1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fileno, *args, **kwargs)

    monkeypatch.setattr(mapped.mmap, "mmap", refuse)
    path = tmp_path / "t.zarr"
    with mapped_table(path, weight) as table:
        for _ in range(2):
            table.write([3, 100], np.ones((2, D), dtype=np.float32))
        assert table._array("weight").mapped._window is None
        assert sorted(table._array("weight").mapped._maps) == [0, 3]
        np.testing.assert_array_equal(table.read([3, 100]), np.ones((2, D)))


def test_a_chunk_that_fails_to_map_is_not_left_as_mapped(tmp_path, weight, layout, monkeypatch):
    if layout != "window":
        pytest.skip("the window's own mapping call")
    path = tmp_path / "t.zarr"
    with mapped_table(path, weight) as table:
        table.write([3], np.ones((1, D), dtype=np.float32))  # copied
        table.write([3], np.ones((1, D), dtype=np.float32))  # chunk 0 mapped
        rows = table._array("weight")
        rows.write_chunk(0, np.full((32, D), 3.0, dtype=np.float32))  # replaced: to map again

        def fail(part, fd):
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

        monkeypatch.setattr(mapped, "_map_over", fail)
        with pytest.raises(OSError):
            table.write([4], np.ones((1, D), dtype=np.float32))
        assert 0 not in rows.mapped._maps
        np.testing.assert_array_equal(table.read([3, 4]), np.full((2, D), 3.0))  # by preadv
        monkeypatch.undo()
        table.write([4], np.ones((1, D), dtype=np.float32))
        np.testing.assert_array_equal(table.read([3, 4, 5]), [[3.0] * D, [1.0] * D, [3.0] * D])


def test_rows_read_after_a_roll_back_are_the_checkpoint(tmp_path, weight):
    path = tmp_path / "t.zarr"
    with mapped_table(path, weight) as table:
        for value in (1.0, 2.0):
            table.write([3, 100], np.full((2, D), value, dtype=np.float32))
        table.checkpoint()
        for value in (5.0, 6.0):  # copied, then through the mapping
            table.write([3, 4], np.full((2, D), value, dtype=np.float32))
        table._roll_back()
        np.testing.assert_array_equal(table.read([3, 4, 100]), [[2.0] * D, weight[4], [2.0] * D])
        table.write([4], np.full((1, D), 7.0, dtype=np.float32))
        np.testing.assert_array_equal(table.read([3, 4]), [[2.0] * D, [7.0] * D])


def test_a_sparse_chunk_is_allocated_before_it_is_written(tmp_path):
    path = tmp_path / "t.zarr"
    with mapped_table(path) as table:
        file = chunk_file(path, 2)
        assert os.stat(file).st_blocks * 512 < os.stat(file).st_size  # zeros: a sparse file
        table.write([70], np.ones((1, D), dtype=np.float32))
        assert os.stat(file).st_blocks * 512 >= os.stat(file).st_size
        np.testing.assert_array_equal(table.read([69, 70, 71]), np.eye(3, 1, -1).repeat(D, 1))


def test_with_mapped_writes_off_rows_go_by_pwrite(tmp_path, weight):
    path = tmp_path / "t.zarr"
    with embedpipe.Table.from_tensor(path, weight, chunk_rows=32) as table:
        table.write([9], np.ones((1, D), dtype=np.float32))
        assert table._array("weight").mapped is None  # the default, and the owner thread's
        np.testing.assert_array_equal(table.read([9])[0], np.ones(D))


def test_a_full_disk_under_mapped_writes_is_an_oserror_not_a_sigbus(small_disk, layout):  # noqa: F811
    """A 4 MiB table of zeros (sparse files) on a 3 MiB disk, every chunk written through its
    mapping: in a child process, so that a SIGBUS would show as its death by signal."""
    code = textwrap.dedent(
        f"""
        import errno, numpy as np, embedpipe
        from embedpipe.store import mapped
        from embedpipe.store.mapped import map_writes
        mapped.WINDOW = {layout == "window"}
        table = embedpipe.Table.create({str(small_disk / "t.zarr")!r}, 16384, 64,
                                       chunk_rows=256, init="zeros")
        map_writes(table)
        ones = np.ones((16, 64), dtype=np.float32)
        table.write(np.arange(0, 16384, 256), ones.repeat(4, 0))  # copies: sparse, unshared
        try:
            for chunk in range(64):
                table.write(np.arange(chunk * 256 + 16, chunk * 256 + 256, 16), ones[1:])
        except OSError as e:
            print("raised", e.errno == errno.ENOSPC, chunk, len(table._array("weight").mapped._maps))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7: SIGBUS
    _, enospc, chunk, maps = done.stdout.split()
    assert enospc == "True" and 0 < int(chunk) < 64 and int(maps) == int(chunk), done.stdout


def test_the_owner_process_writes_through_mappings_and_trains_as_the_thread(tmp_path, weight):
    """A 2% cache (evictions every batch), Adagrad, a checkpoint midway: the owner process's
    table and state equal the owner thread's, bit for bit."""
    rng = np.random.default_rng(2)
    data = [{"input_ids": torch.from_numpy(rng.zipf(1.3, 24) % V)} for _ in range(48)]
    tables = {}
    for owner in ("thread", "process"):
        path = tmp_path / f"{owner}.zarr"
        embedpipe.Table.from_tensor(path, weight, chunk_rows=32).close()
        pipe = embedpipe.EmbeddingPipe(
            path, cache_rows=10, optimizer=embedpipe.optim.Adagrad(lr=0.1), owner=owner
        )
        with pipe:
            for k, batch in enumerate(pipe.loader(data, batch_size=4)):
                (batch["inputs_embeds"] ** 2).sum().backward()
                pipe.step()
                if k == 5:
                    pipe.checkpoint()
            assert pipe.stats()["rows_written"] > 100
        table = embedpipe.Table.open(path)
        tables[owner] = (table.to_tensor(), table.read(np.arange(V), table.state_names[0]))
    assert torch.equal(tables["thread"][0], tables["process"][0])
    np.testing.assert_array_equal(tables["thread"][1], tables["process"][1])


def test_the_mapped_bytes_are_bounded(tmp_path, weight, monkeypatch):
    monkeypatch.setattr(mapped, "MAPPED_BYTES", 3 * 32 * D * 4)  # three chunks
    path = tmp_path / "t.zarr"
    with embedpipe.Table.from_tensor(path, weight, chunk_rows=32) as table:
        mapped.map_writes(table, mapped.MAPPED_BYTES)
        for _ in range(2):  # copied, then mapped
            table.write(np.arange(0, V, 8), np.ones((V // 8, D), dtype=np.float32))
        assert list(table._array("weight").mapped._maps) == [13, 14, 15]  # the last written


def test_a_checkpoint_read_through_a_window_is_the_checkpoint_whatever_the_writer_does(
    tmp_path, weight, layout, monkeypatch
):
    """NOTE [ A checkpoint read through a window ]: a handle on a checkpoint maps its chunk
    files read-only as it reads them (no system call a row); a writer's rows and commits after
    it never show (the writer copies a shared chunk first); a pickled handle maps anew; a live
    handle is never mapped so."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.from_tensor(path, weight, chunk_rows=32).close()
    reader = embedpipe.Table.open(path)
    assert mapped.map_reads(reader)
    reads = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda *a: reads.append(a[2]) or preadv(*a))
    ids = np.random.default_rng(1).integers(0, V, size=300)  # repeated, in any order
    np.testing.assert_array_equal(reader.read(ids), weight[ids])
    assert (reads == []) == (layout == "window"), len(reads)
    with embedpipe.Table.open(path, "r+") as writer:
        assert not mapped.map_reads(writer)  # the live arrays: a writer changes them
        writer.write(np.arange(0, V, 7), np.full((len(range(0, V, 7)), D), 9.0, np.float32))
        writer.checkpoint()
        writer.write([1, 2], np.full((2, D), 5.0, dtype=np.float32))
    np.testing.assert_array_equal(reader.read(ids), weight[ids])
    clone = pickle.loads(pickle.dumps(reader._array("weight")))
    np.testing.assert_array_equal(clone.read(ids[::-1]), weight[ids[::-1]])
    assert isinstance(clone.mapped, mapped.MappedReads)
    reader.close()


def test_a_damaged_chunk_of_a_checkpoint_read_through_a_window_is_named(tmp_path, weight):
    from embedpipe.errors import CorruptTableError

    path = tmp_path / "t.zarr"
    embedpipe.Table.from_tensor(path, weight, chunk_rows=32).close()
    with embedpipe.Table.open(path) as reader:
        mapped.map_reads(reader)
        np.testing.assert_array_equal(reader.read([1, 40]), weight[[1, 40]])  # chunks 0, 1
        os.truncate(chunk_file(reader.root, 3), 100)  # before its first read: never mapped
        with pytest.raises(CorruptTableError, match=r"chunk 3 \(rows 96\.\.127\)"):
            reader.read([1, 100])


def test_a_reader_of_a_checkpoint_never_sees_the_owners_writes_after_its_commit(tmp_path, weight):
    """The two windows together: the owner's writes go through its window with no look at the
    files (chunks checked once), a commit makes them looked at again, so the write after it
    copies the chunks the new checkpoint shares, and a reader mapping that checkpoint keeps
    reading its rows."""
    path = tmp_path / "t.zarr"
    ids = np.array([1, 40, 100, 300])
    with mapped_table(path, weight) as writer:
        for value in (1.0, 2.0, 3.0):  # copied, mapped, then through the window unlooked
            writer.write(ids, np.full((4, D), value, dtype=np.float32))
        writer.checkpoint()
        with embedpipe.Table.open(path) as reader:  # the checkpoint just committed
            assert mapped.map_reads(reader)
            np.testing.assert_array_equal(reader.read(ids), np.full((4, D), 3.0))
            for value in (4.0, 5.0):  # copied first, then the copies through the window
                writer.write(ids, np.full((4, D), value, dtype=np.float32))
            np.testing.assert_array_equal(reader.read(ids[::-1]), np.full((4, D), 3.0))
            np.testing.assert_array_equal(writer.read(ids), np.full((4, D), 5.0))


def test_a_read_window_refused_or_out_of_mappings_reads_with_preadv(
    tmp_path, weight, layout, monkeypatch
):
    path = tmp_path / "t.zarr"
    embedpipe.Table.from_tensor(path, weight, chunk_rows=32).close()
    ids = np.random.default_rng(2).integers(0, V, size=200)

    refusals = []

    def refused(*args):
        refusals.append(args)
        raise OSError(errno.ENOMEM, "too many mappings")

    for patch in ((mapped, "MAX_READ_CHUNKS", 8), (mapped, "_map_over", refused)):
        with monkeypatch.context() as m:
            m.setattr(*patch)
            with embedpipe.Table.open(path) as reader:
                mapped.map_reads(reader)
                for _ in range(2):  # a chunk refused once is not tried again
                    np.testing.assert_array_equal(reader.read(ids), weight[ids])
                assert not reader._array("weight").mapped._mapped.any()
    assert len(refusals) == (len(np.unique(ids // 32)) if layout == "window" else 0)
