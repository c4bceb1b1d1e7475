"""Checkpoints of a table: what a reader, a crash and a reopen see; keep and step; snapshots;
zarr readers; durability (fsync, short writes, a full disk); damaged chunk files."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch
import zarr

import embedpipe
from embedpipe import errors
from embedpipe.pipe import EmbeddingPipe
from embedpipe.store import checkpoints

from ..helpers import adagrad_reference

V, D = 200, 8


# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.


@pytest.fixture
def weight() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((V, D), dtype=np.float32)


@pytest.fixture
def path(tmp_path, weight):
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=16).close()
    return tmp_path / "t.zarr"


def batches(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": torch.from_numpy((rng.zipf(1.3, 6) - 1) % V)} for _ in range(n)]


def reference(weight: np.ndarray, data: list[dict], steps: int):
    """nn.Embedding + torch Adagrad, one step per sample (as ``train`` does): table and sum."""
    return adagrad_reference(weight, [s["input_ids"][None] for s in data], steps)


def train(pipe, data: list[dict], checkpoint_every: int | None = None) -> None:
    for k, batch in enumerate(pipe.loader(data, batch_size=1), start=1):
        (batch["inputs_embeds"] ** 2).sum().backward()
        pipe.step()
        if checkpoint_every and k % checkpoint_every == 0:
            pipe.checkpoint()


def adagrad_pipe(path, **options) -> EmbeddingPipe:
    return EmbeddingPipe(path, cache_rows=20, optimizer=embedpipe.optim.Adagrad(lr=0.5), **options)


def writer_once_free(path, seconds: float = 10.0) -> embedpipe.Table:
    """The table opened for writing once the crashed script's owner process, which holds the
    lock, has ended: it ends within a fraction of a second of the script (it looks for its
    parent every 0.2 s), so a writer opened at once could find the lock held still (seen in
    CI on a loaded host, 1 run in 3)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return embedpipe.Table.open(path, "r+")
        except errors.TableLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def assert_table(table, expected) -> None:
    rows, total = expected
    assert torch.equal(table.to_tensor(), rows)
    assert torch.equal(torch.from_numpy(table.read(np.arange(V), "sum")), total)


# ----------------------------------------------------------------------------- what is seen
@pytest.mark.slow
def test_a_crash_reopens_exactly_at_the_last_checkpoint(path, weight):
    script = textwrap.dedent(
        f"""
        import os, numpy as np, torch, embedpipe
        rng = np.random.default_rng(0)
        data = [{{"input_ids": torch.from_numpy((rng.zipf(1.3, 6) - 1) % {V})}} for _ in range(12)]
        pipe = embedpipe.EmbeddingPipe({str(path)!r}, cache_rows=20,
                                       optimizer=embedpipe.optim.Adagrad(lr=0.5))
        for k, batch in enumerate(pipe.loader(data, batch_size=1), start=1):
            (batch["inputs_embeds"] ** 2).sum().backward()
            pipe.step()
            if k == 8:
                pipe.checkpoint()
            if k == 12:
                pipe.flush()  # steps 9-12 are in the table's files, not committed
                os._exit(0)   # a crash
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    expected = reference(weight, batches(12), 8)
    assert_table(embedpipe.Table.open(path), expected)  # a reader: the checkpoint
    with writer_once_free(path) as table:  # a writer: recovered to it
        assert table.step == 8
        assert_table(table, expected)
    live = zarr.open_array(os.path.join(path, "weight"), mode="r")[:]
    np.testing.assert_array_equal(live, expected[0].numpy())  # zarr too, after the recovery


def test_a_reader_opened_during_training_sees_one_checkpoint_throughout(path, weight):
    data = batches(10)
    with adagrad_pipe(path) as pipe:
        train(pipe, data[:4])
        pipe.checkpoint()
        reader = embedpipe.Table.open(path)
        train(pipe, data[4:10], checkpoint_every=2)  # 3 more: keep=3 would prune step 4...
        assert reader.step == 4 and 4 in [c.step for c in reader.checkpoints]  # ...but it is open
        assert_table(reader, reference(weight, data, 4))
        reader.close()
        pipe.checkpoint()
    assert 4 not in [c.step for c in embedpipe.Table.open(path).checkpoints]  # gone once closed
    assert_table(embedpipe.Table.open(path), reference(weight, data, 10))


def test_keep_and_older_steps(path, weight):
    data = batches(8)
    with adagrad_pipe(path, keep=2) as pipe:
        train(pipe, data, checkpoint_every=2)
    table = embedpipe.Table.open(path)
    assert [c.step for c in table.checkpoints] == [6, 8]  # close() found nothing new to commit
    assert_table(embedpipe.Table.open(path, step=6), reference(weight, data, 6))
    with pytest.raises(
        errors.TableNotFoundError, match=r"no checkpoint at step 4; it has steps \[6, 8\]"
    ):
        embedpipe.Table.open(path, step=4)


def test_opening_to_write_at_an_older_step_takes_the_table_back_to_it(path, weight):
    data = batches(6)
    with adagrad_pipe(path, keep=5) as pipe:
        train(pipe, data, checkpoint_every=3)
    with embedpipe.Table.open(path, "r+", step=3) as table:
        assert table.step == 3
        assert_table(table, reference(weight, data, 3))
    assert [c.step for c in embedpipe.Table.open(path).checkpoints][-2:] == [6, 3]  # 6 is kept
    with adagrad_pipe(path) as pipe:  # and training goes on from step 3, exactly
        train(pipe, data[3:])
    assert_table(embedpipe.Table.open(path), reference(weight, data, 6))


def test_zarr_and_tensorstore_read_the_last_checkpoint_without_warnings(path, weight):
    data = batches(5)
    with adagrad_pipe(path) as pipe:
        train(pipe, data)
    expected = reference(weight, data, 5)[0].numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(path, mode="r")
        members = dict(group.members(max_depth=None))
        np.testing.assert_array_equal(group["weight"][:], expected)
    assert {"weight", "state", "state/sum", "checkpoints"} <= set(members)
    tensorstore = pytest.importorskip("tensorstore")
    store = tensorstore.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(path, "weight")}}
    ).result()
    np.testing.assert_array_equal(store.read().result(), expected)


# ----------------------------------------------------------------------------- snapshots
@pytest.mark.parametrize("where", ["same filesystem", "another filesystem"])
def test_save_and_load_checkpoint_round_trip_and_training_goes_on_exactly(
    tmp_path, path, weight, where
):
    if where == "another filesystem":
        if os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("/dev/shm is on the same filesystem here")
        folder = f"/dev/shm/embedpipe-test-{os.getpid()}"
        shutil.rmtree(folder, ignore_errors=True)
    else:
        folder = str(tmp_path / "snapshot")
    data = batches(9)
    try:
        with adagrad_pipe(path, keep=10) as pipe:
            train(pipe, data[:3])
            pipe.save_checkpoint(folder)
            train(pipe, data[3:6])  # a detour the load throws away
            pipe.load_checkpoint(folder)
            train(pipe, data[3:9])
        assert_table(embedpipe.Table.open(path), reference(weight, data, 9))
        snapshot = embedpipe.Table.open(folder)
        assert snapshot.step == 3
        assert_table(snapshot, reference(weight, data, 3))
        chunk = os.path.join("weight", "c", "0", "0")
        saved = os.stat(os.path.join(snapshot.checkpoints[-1].path, chunk))
        source = embedpipe.Table.open(path, step=3).checkpoints  # the table's checkpoint at 3
        original = os.stat(os.path.join(next(c.path for c in source if c.step == 3), chunk))
        linked = (saved.st_dev, saved.st_ino) == (original.st_dev, original.st_ino)
        assert linked == (where == "same filesystem")
        with adagrad_pipe(folder) as pipe:  # a snapshot is a table of its own
            train(pipe, data[3:9])
        assert_table(embedpipe.Table.open(folder), reference(weight, data, 9))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_load_checkpoint_refuses_a_table_of_another_shape(tmp_path, path):
    embedpipe.Table.create(tmp_path / "other.zarr", V + 1, D).close()
    with adagrad_pipe(path) as pipe, pytest.raises(ValueError, match=r"201 x 8 .* load a snapshot"):
        pipe.load_checkpoint(tmp_path / "other.zarr")


# ----------------------------------------------------------------------------- durability
def test_a_commit_makes_data_and_folders_durable_before_its_rename(path, monkeypatch):
    events = []
    fsync, rename = os.fsync, os.rename

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_rename(src, dst, **kw):
        events.append(("rename", str(dst)))
        rename(src, dst, **kw)

    with embedpipe.Table.open(path, "r+") as table:
        table.write([3], np.ones((1, D), np.float32))
        monkeypatch.setattr(os, "fsync", recording_fsync)
        monkeypatch.setattr(os, "rename", recording_rename)
        checkpoint = table.checkpoint()
    commit = next(
        i for i, (kind, p) in enumerate(events) if kind == "rename" and p == checkpoint.path
    )
    before = {p for kind, p in events[:commit] if kind == "fsync"}
    after = {p for kind, p in events[commit:] if kind == "fsync"}
    assert os.path.join(path, "weight", "c", "0", "0") in before  # the row written
    assert any(p.startswith(os.path.join(path, "checkpoints", ".tmp-")) for p in before)
    assert os.path.join(path, "checkpoints") in after  # the rename itself


def test_short_writes_are_continued(path, weight, monkeypatch):
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: pwrite(fd, bytes(data)[:5], offset))
    rows = np.arange(3 * D, dtype=np.float32).reshape(3, D)
    with embedpipe.Table.open(path, "r+") as table:
        table.write([1, 50, 199], rows)
    np.testing.assert_array_equal(embedpipe.Table.open(path).read([1, 50, 199]), rows)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB filesystem of its own (tmpfs; needs root)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("owner", ["thread", "process"])  # the process writes through mappings
def test_a_full_disk_raises_naming_table_and_step_and_the_last_checkpoint_survives(
    small_disk, owner
):
    # 4096 x 64 float32 = 1 MiB of weights + 1 MiB of Adagrad state on a 3 MiB disk: the first
    # checkpoint fits, then copy-on-write of the chunks that training touches runs out of space.
    rows, dim = 4096, 64
    weight = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
    path = small_disk / "t.zarr"
    embedpipe.Table.from_tensor(path, weight, chunk_rows=256).close()
    rng = np.random.default_rng(1)
    data = [{"input_ids": torch.from_numpy(rng.integers(0, rows, 64))} for _ in range(40)]
    pipe = EmbeddingPipe(path, cache_rows=0, optimizer=embedpipe.optim.Adagrad(lr=0.5), owner=owner)
    committed = 0
    with pytest.raises(OSError) as raised:
        for k, batch in enumerate(pipe.loader(data, batch_size=1), start=1):
            (batch["inputs_embeds"] ** 2).sum().backward()
            pipe.step()
            if k % 2 == 0:
                committed = pipe.checkpoint().step
    assert raised.value.errno == errno.ENOSPC
    message = str(raised.value)
    assert str(path) in message and "step" in message and "last checkpoint" in message
    with pytest.raises(OSError):
        pipe.close()  # still full: the error again, and close() may be retried
    pipe._owner.table._abandon()  # let go of the lock without committing, as a crash would
    table = embedpipe.Table.open(path)
    assert table.step == committed
    expected = reference(weight, data, committed)[0]
    assert torch.equal(table.to_tensor(), expected)  # the checkpoint, bit-equal


# ----------------------------------------------------------------------------- damage
def test_a_missing_or_truncated_chunk_raises_naming_the_chunk_and_its_rows(path):
    checkpoint = embedpipe.Table.open(path).checkpoints[-1].path
    os.unlink(os.path.join(checkpoint, "weight", "c", "3", "0"))
    with pytest.raises(errors.CorruptTableError, match=r"chunk 3 \(rows 48\.\.63\) .* is missing"):
        embedpipe.Table.open(path).read([50])
    embedpipe.Table.open(path).read([47, 64])  # the other chunks still read
    chunk = os.path.join(checkpoint, "weight", "c", "4", "0")
    os.truncate(chunk, 100)
    with pytest.raises(OSError, match=r"chunk 4 \(rows 64\.\.79\) .* has 100 bytes, not 512"):
        embedpipe.Table.open(path).read([70])


def test_a_damaged_compressed_chunk_raises_naming_it(tmp_path, weight):
    path = tmp_path / "z.zarr"
    embedpipe.Table.from_tensor(path, weight, chunk_rows=16, compressor="zstd").close()
    checkpoint = embedpipe.Table.open(path).checkpoints[-1].path
    with open(os.path.join(checkpoint, "weight", "c", "2", "0"), "r+b") as f:
        f.write(b"garbage!")
    with pytest.raises(
        errors.CorruptTableError, match=r"chunk 2 \(rows 32\.\.47\) .* cannot be decoded"
    ):
        embedpipe.Table.open(path).read([40])


def test_a_format_1_table_is_read_and_upgraded_when_opened_to_write(path, weight):
    # Format 1: no checkpoints, a writer.lock file, chunks never written have no file.
    shutil.rmtree(os.path.join(path, "checkpoints"))
    os.unlink(os.path.join(path, "weight", "c", "5", "0"))  # reads as zeros in format 1
    with open(os.path.join(path, "writer.lock"), "w") as f:
        f.write("pid 1 on host since then\n")
    with open(os.path.join(path, "zarr.json")) as f:
        meta = json.load(f)
    meta["attributes"]["embedpipe"]["format_version"] = 1
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(meta, f)
    expected = weight.copy()
    expected[80:96] = 0
    np.testing.assert_array_equal(embedpipe.Table.open(path).to_tensor(), expected)
    with embedpipe.Table.open(path, "r+") as table:
        assert table.metadata["format_version"] == 2 and len(table.checkpoints) == 1
    assert not os.path.exists(os.path.join(path, "writer.lock"))
    np.testing.assert_array_equal(embedpipe.Table.open(path).to_tensor(), expected)


def test_a_checkpoint_folder_is_not_opened_as_a_table_of_its_own(path):
    checkpoint = embedpipe.Table.open(path).checkpoints[-1]
    with pytest.raises(
        errors.TableFormatError, match=rf"a checkpoint inside a table.*step={checkpoint.step}"
    ):
        embedpipe.Table.open(checkpoint.path)


def test_a_table_dropped_without_close_keeps_only_what_was_committed(path, weight):
    import gc

    table = embedpipe.Table.open(path, "r+")
    table.write([0], np.zeros((1, D), np.float32))
    with pytest.warns(ResourceWarning, match="not kept"):
        del table
        gc.collect()
    np.testing.assert_array_equal(embedpipe.Table.open(path, "r+").read([0]), weight[[0]])


def test_debris_of_an_interrupted_commit_is_removed_on_open(path):
    with embedpipe.Table.open(path, "r+") as table:
        table.write([1], np.ones((1, D), np.float32))
    folder = os.path.join(path, "checkpoints")
    last = embedpipe.Table.open(path).checkpoints[-1].path
    shutil.copytree(last, os.path.join(folder, ".tmp-000099"))  # a commit cut before its rename
    open(os.path.join(path, "weight", "c", "0", "0.123.tmp"), "w").close()  # a cut copy
    embedpipe.Table.open(path, "r+").close()
    assert sorted(os.listdir(folder)) == sorted(
        ["zarr.json", *(os.path.basename(c.path) for c in checkpoints.checkpoints(str(path)))]
    )
    assert not os.path.exists(os.path.join(path, "weight", "c", "0", "0.123.tmp"))


def test_a_load_checkpoint_that_fails_midway_commits_nothing(tmp_path, path, weight, monkeypatch):
    data = batches(10)
    folder = tmp_path / "snapshot"
    link_or_copy = checkpoints._link_or_copy
    calls = []

    def full_disk_at_the_third_file(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", dst)
        link_or_copy(src, dst)

    with pytest.raises(OSError, match="No space left"), adagrad_pipe(path, owner="thread") as pipe:
        train(pipe, data[:2])
        pipe.save_checkpoint(folder)  # step 2, committed
        train(pipe, data[2:5])
        monkeypatch.setattr(checkpoints, "_link_or_copy", full_disk_at_the_third_file)
        pipe.load_checkpoint(folder)  # half restored: nothing of it may be committed
    monkeypatch.undo()
    table = embedpipe.Table.open(path)
    assert table.step == 2  # the last real checkpoint, whole
    assert_table(table, reference(weight, data, 2))
    with embedpipe.Table.open(path, "r+") as again:
        assert_table(again, reference(weight, data, 2))


def test_an_interrupted_format_1_upgrade_is_done_again(path, weight, monkeypatch):
    shutil.rmtree(os.path.join(path, "checkpoints"))
    with open(os.path.join(path, "zarr.json")) as f:
        meta = json.load(f)
    meta["attributes"]["embedpipe"]["format_version"] = 1
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(meta, f)
    commit = checkpoints.commit
    monkeypatch.setattr(
        checkpoints, "commit", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full"))
    )
    with pytest.raises(OSError, match="full"):
        embedpipe.Table.open(path, "r+")
    monkeypatch.setattr(checkpoints, "commit", commit)
    np.testing.assert_array_equal(embedpipe.Table.open(path).to_tensor(), weight)
    with embedpipe.Table.open(path, "r+") as table:
        assert table.metadata["format_version"] == 2
    np.testing.assert_array_equal(embedpipe.Table.open(path).to_tensor(), weight)


def test_copy_on_write_keeps_a_zero_chunk_sparse(tmp_path):
    table = embedpipe.Table.create(tmp_path / "z.zarr", 4096, 64, init="zeros", chunk_rows=4096)
    table.checkpoint()  # the chunk is now shared: the next write copies it
    table.write([5], np.ones((1, 64), np.float32))
    chunk = os.path.join(table.path, "weight", "c", "0", "0")
    assert os.stat(chunk).st_nlink == 1  # a private copy...
    assert os.stat(chunk).st_blocks * 512 < 64 * 1024  # ...of 1 MiB, that took a page or so
    np.testing.assert_array_equal(table.read([4, 5])[:, 0], [0, 1])
    table.close()


def test_nothing_works_in_the_folder_once_the_pipe_is_closed(tmp_path):
    # Pruned checkpoints are deleted in the background; close() waits for that, so the folder
    # can be removed (or overwritten) right after.
    rows, dim = 1 << 15, 256  # 32 MiB: each pruned checkpoint holds chunks to free
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, rows, dim, chunk_rows=1024).close()
    rng = np.random.default_rng(0)
    data = [{"input_ids": torch.from_numpy(rng.integers(0, rows, 512))} for _ in range(6)]
    with EmbeddingPipe(path, cache_rows=0, optimizer=embedpipe.optim.SGD(lr=0.1), keep=1) as pipe:
        for batch in pipe.loader(data, batch_size=1):
            batch["inputs_embeds"].sum().backward()
            pipe.step()
            pipe.checkpoint()
    shutil.rmtree(path)  # no background deletion racing it
    embedpipe.Table.create(path, 10, 4).close()


def test_a_shards_recover_takes_back_its_own_chunks_and_nothing_else(tmp_path):
    """``recover(only=shard_files(...))``: the files of a shard's row chunks go back to the
    checkpoint; another shard's (its service may be writing them) and the metadata stay."""
    path = tmp_path / "t.zarr"
    table = embedpipe.Table.create(path, 256, 4, chunk_rows=64)  # chunks 0-3
    table.close()
    table = embedpipe.Table.open(path, "r+")
    ids = np.array([1, 200])  # chunks 0 and 3
    before = table.read(ids)
    table.write(ids, np.ones((2, 4), np.float32))
    table._update_metadata(note="later")
    table._add_state("sum", 0.0)  # as the first shard's owner prepares the table for a job
    checkpoints.recover(str(path), checkpoints.shard_files((2, 4), others=False))
    assert (path / "state" / "sum" / "c" / "3" / "0").exists()  # not this shard's to remove
    live = embedpipe.Table._reader(str(path), str(path))
    assert (live.read(ids)[0] == 1).all()  # chunk 0 kept
    assert (live.read(ids)[1] == before[1]).all()  # chunk 3 taken back
    assert live.metadata.get("note") == "later"  # not the shard's
    checkpoints.recover(str(path), checkpoints.shard_files((0, 2), others=True))
    live = embedpipe.Table._reader(str(path), str(path))
    assert (live.read(ids) == before).all() and "note" not in live.metadata
    assert not (path / "state" / "sum" / "zarr.json").exists()  # the committer's: removed
    table._modified = False
    table.close()
