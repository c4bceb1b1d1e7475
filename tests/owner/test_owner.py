"""One owner per table, and a pipe's lifecycle: claimed, closed (again after a failure), or
dropped and collected, which still commits its steps and releases the table."""

from __future__ import annotations

import errno
import gc
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe import errors
from embedpipe.pipe import EmbeddingPipe

from ..helpers import SMALL_D as D
from ..helpers import SMALL_V as V
from ..helpers import adagrad_reference, small_table
from ..helpers import small_samples as samples

# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.


@pytest.fixture
def path(tmp_path):
    return small_table(tmp_path)


def train(pipe, n_batches: int) -> None:
    for batch in pipe.loader(samples(2 * n_batches), batch_size=2):
        (-batch["inputs_embeds"]).sum().backward()
        pipe.step()


def sgd() -> embedpipe.optim.SGD:
    return embedpipe.optim.SGD(lr=1.0)


def test_a_second_pipe_on_one_table_object_is_refused_naming_the_first(path):
    table = embedpipe.Table.open(path, "r+")  # as a notebook cell re-run does
    first = EmbeddingPipe(table, cache_rows=10, optimizer=sgd())
    train(first, 4)
    with pytest.raises(errors.TableOwnedError, match=r"EmbeddingPipe made at .*test_owner\.py:\d+"):
        EmbeddingPipe(table, cache_rows=10, optimizer=sgd())
    first.close()
    with EmbeddingPipe(table, cache_rows=10, optimizer=sgd()) as second:  # now it may
        train(second, 4)
    table.close()
    assert embedpipe.Table.open(path).step == 8  # both runs' steps, none lost


def test_table_close_and_writes_under_a_live_pipe_are_refused(path):
    table = embedpipe.Table.open(path, "r+")
    pipe = EmbeddingPipe(table, cache_rows=10, optimizer=sgd())
    train(pipe, 3)
    for attempt in (
        table.close,
        lambda: table.write([1], np.zeros((1, D), np.float32)),
        lambda: table.update_metadata(step=99),
        lambda: table.add_state("m", 0.0),
        table.checkpoint,
    ):
        with pytest.raises(errors.TableOwnedError, match="EmbeddingPipe made at"):
            attempt()
    pipe.close()  # the pipe still owns a working table: its rows reach disk
    table.close()
    reopened = embedpipe.Table.open(path)
    assert reopened.step == 3 and not np.array_equal(reopened.read([0]), np.zeros((1, D)))


def test_close_can_be_called_again_after_a_failed_commit(path, monkeypatch):
    from embedpipe.store import checkpoints

    commit = checkpoints.commit
    failures = []

    def full_disk_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")
        return commit(*args, **kwargs)

    pipe = EmbeddingPipe(path, owner="thread", cache_rows=10, optimizer=sgd())
    train(pipe, 5)
    monkeypatch.setattr(checkpoints, "commit", full_disk_once)
    with pytest.raises(OSError, match=rf"{path}.* step 5.*No space left") as raised:
        pipe.close()
    assert raised.value.errno == errno.ENOSPC
    assert embedpipe.Table.open(path).step == 0  # the last checkpoint, whole
    pipe.close()  # space freed: the retry commits
    assert embedpipe.Table.open(path).step == 5
    embedpipe.Table.open(path, "r+").close()  # and the table is released


def test_a_dropped_pipe_is_collected_commits_its_steps_and_releases_the_table(path):
    pipe = EmbeddingPipe(path, cache_rows=10, optimizer=sgd())
    loader = pipe.loader(samples(6), batch_size=2)
    for batch in loader:
        (-batch["inputs_embeds"]).sum().backward()
        pipe.step()
    alive = weakref.ref(pipe)
    with pytest.warns(ResourceWarning, match="was not closed"):
        del pipe, loader, batch
        gc.collect()
    assert alive() is None
    embedpipe.Table.open(path, "r+").close()  # not locked any more
    reopened = embedpipe.Table.open(path)
    assert reopened.step == 3 and reopened.read([7])[0, 0] > 7 * D / 100  # row 7 trained


@pytest.mark.slow
@pytest.mark.parametrize("compressor", ["none", "zstd"])  # zstd writes through zarr's executor
def test_a_pipe_alive_at_interpreter_exit_commits_its_steps(tmp_path, compressor):
    path = small_table(tmp_path, compressor)
    script = textwrap.dedent(
        f"""
        import torch, embedpipe
        pipe = embedpipe.EmbeddingPipe({str(path)!r}, cache_rows=10,
                                       optimizer=embedpipe.optim.SGD(lr=1.0))
        data = [{{"input_ids": torch.tensor([i % {V}, 7])}} for i in range(8)]
        for batch in pipe.loader(data, batch_size=2, num_workers=2):
            (-batch["inputs_embeds"]).sum().backward()
            pipe.step()
        # no close(): the interpreter exits with the pipe alive
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "default::ResourceWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ResourceWarning" in result.stderr and "was not closed" in result.stderr
    assert embedpipe.Table.open(path).step == 4


def test_writes_through_a_read_only_pipe_table_need_no_claim(path):
    with EmbeddingPipe(path, cache_rows=10) as frozen, EmbeddingPipe(path, cache_rows=5) as again:
        next(iter(frozen.loader(samples(2), batch_size=2)))
        next(iter(again.loader(samples(2), batch_size=2)))


# ----------------------------------------------------------------------------- forked workers
def test_workers_that_exit_each_epoch_commit_nothing(path):
    """A DataLoader worker is a forked copy of the owner: when it exits (each epoch, without
    persistent_workers) it must not close its copy of the pipe, nor commit anything."""
    weight = embedpipe.Table.open(path).to_tensor().numpy()
    data = samples(40)
    with EmbeddingPipe(path, cache_rows=20, optimizer=embedpipe.optim.Adagrad(lr=0.5)) as pipe:
        loader = pipe.loader(data, batch_size=4, num_workers=1)
        for _ in range(3):
            for batch in loader:
                (batch["inputs_embeds"] ** 2).sum().backward()
                pipe.step()
            time.sleep(0.5)  # this epoch's worker has exited
            assert [c.step for c in pipe.table.checkpoints] == [0]  # nothing committed by it
    table = embedpipe.Table.open(path)
    assert [c.step for c in table.checkpoints] == [0, 30]
    batches = [torch.stack([s["input_ids"] for s in data[i : i + 4]]) for i in range(0, 40, 4)]
    expected, total = adagrad_reference(weight, batches * 3, 30)
    assert torch.equal(table.to_tensor(), expected)
    assert torch.equal(torch.from_numpy(table.read(np.arange(V), "sum")), total)


@pytest.mark.slow
def test_a_trainer_killed_after_its_workers_exited_reopens_at_its_real_checkpoint(path):
    weight = embedpipe.Table.open(path).to_tensor()
    script = textwrap.dedent(
        f"""
        import os, signal, time, torch, embedpipe
        pipe = embedpipe.EmbeddingPipe({str(path)!r}, cache_rows=20,
                                       optimizer=embedpipe.optim.Adagrad(lr=0.5))
        data = [{{"input_ids": torch.tensor([i % {V}, 7])}} for i in range(40)]
        for batch in pipe.loader(data, batch_size=4, num_workers=1):
            (batch["inputs_embeds"] ** 2).sum().backward()
            pipe.step()
        time.sleep(0.5)  # the worker exits
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    subprocess.run([sys.executable, "-c", script], timeout=120)
    table = embedpipe.Table.open(path)
    assert table.step == 0 and [c.step for c in table.checkpoints] == [0]
    assert torch.equal(table.to_tensor(), weight)


def test_steps_that_change_no_row_are_committed_too(path):
    data = samples(8) + [{"input_ids": torch.zeros(3, dtype=torch.int64)}] * 4
    with EmbeddingPipe(
        path, cache_rows=20, optimizer=embedpipe.optim.Adam(lr=0.1), padding_idx=0
    ) as pipe:
        for k, batch in enumerate(pipe.loader(data, batch_size=4)):
            (batch["inputs_embeds"] ** 2).sum().backward()
            pipe.step()
            if k == 1:
                pipe.checkpoint()  # step 2; step 3 only has the padding id: no row changes
    assert embedpipe.Table.open(path).step == 3  # Adam's bias correction counts it
