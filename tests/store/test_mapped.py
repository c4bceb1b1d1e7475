"""Rows written through mapped chunk files (the owner process's writes, NOTE [ Mapped row writes ]):
they land where ``pwrite`` would put them and nowhere else, every reader sees them, a checkpoint
never changes, and a full disk is an ``OSError``, never a ``SIGBUS``."""

from __future__ import annotations

import os
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


def test_rows_written_through_mappings_are_what_every_reader_reads(tmp_path, weight):
    path = tmp_path / "t.zarr"
    ids = np.array([3, 40, 41, 300, 511])
    rows = np.arange(len(ids) * D, dtype=np.float32).reshape(-1, D)
    with mapped_table(path, weight) as table:
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
        got = table.read([1, 2, 40, 41, 100])
    expected = weight[[1, 2, 40, 41, 100]].copy()
    expected[:2], expected[2] = 3.0, 1.0
    np.testing.assert_array_equal(got, expected)


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
