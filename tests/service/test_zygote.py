"""Owner processes forked by the training process's zygote (``service/zygote.py``): one zygote
for every owner process of a training process, holding none of their descriptors, ending with
the training process; an owner's exit status as a child's would be."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import embedpipe
from embedpipe.errors import OwnerDiedError
from embedpipe.pipe import EmbeddingPipe

from ..helpers import zipf_dataset

psutil = pytest.importorskip("psutil", reason="psutil tells a process's parent and children")


def sgd_pipe(path, **options) -> EmbeddingPipe:
    return EmbeddingPipe(
        path, cache_rows=30, optimizer=embedpipe.optim.SGD(lr=0.1), owner="process", **options
    )


def train(pipe: EmbeddingPipe, steps: int = 3) -> None:
    for n, batch in enumerate(pipe.loader(zipf_dataset(8 * steps, vocab=1000), batch_size=8)):
        batch["inputs_embeds"].sum().backward()
        pipe.step()
        if n + 1 == steps:
            break


def test_owner_processes_are_forks_of_one_zygote_that_keeps_no_descriptor_of_theirs(tmp_path):
    """Two pipes, one after the other and two at once: every owner process is a child of the
    same zygote, itself a child of this process; the zygote holds none of the tables' files
    (the writer lock's open file stays the training process's and its owner's), and a closed
    pipe's owner exits with status 0, as a child of this process would."""
    paths = [tmp_path / f"{name}.zarr" for name in "abc"]
    for path in paths:
        embedpipe.Table.create(path, 1000, 8).close()
    owners = []
    with sgd_pipe(paths[0]) as pipe:
        train(pipe)
        owners.append(pipe._owner.process)
    with sgd_pipe(paths[1]) as first, sgd_pipe(paths[2]) as second:
        train(first)
        train(second)
        owners += [first._owner.process, second._owner.process]
        zygote = psutil.Process(owners[1].pid).parent()
        assert zygote.parent().pid == os.getpid()
        assert {psutil.Process(o.pid).ppid() for o in owners[1:]} == {zygote.pid}
        held = [
            os.readlink(f"/proc/{zygote.pid}/fd/{fd}")
            for fd in os.listdir(f"/proc/{zygote.pid}/fd")
        ]
        assert not [f for f in held if str(tmp_path) in f], held
        assert {os.readlink(f"/proc/{o.pid}/exe") for o in owners[1:]} == {
            os.path.realpath(sys.executable)
        }
    assert [o.wait(5) for o in owners] == [0, 0, 0]
    for path in paths:  # each committed its steps, and the lock is free
        table = embedpipe.Table.open(path, "r+")
        assert table.step == 3
        table.close()


def test_a_killed_zygote_takes_its_owners_with_it_and_the_next_pipe_starts_another(tmp_path):
    """SIGKILL of the zygote: its owner processes end (re-parented), the training process
    raises naming the checkpoint, and the next pipe forks its owner from a new zygote."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8).close()
    pipe = sgd_pipe(path)
    train(pipe, steps=2)
    pipe.checkpoint()
    at_2 = embedpipe.Table.open(path).read(np.arange(1000))
    owner = pipe._owner.process
    zygote = psutil.Process(owner.pid).parent()
    zygote.kill()
    assert owner.wait(5) is not None  # ended within seconds
    with pytest.raises(OwnerDiedError, match="step 2"):
        train(pipe, steps=2)
    pipe.close()
    with sgd_pipe(path) as again:
        assert again.table.step == 2
        assert np.array_equal(again.table.read(np.arange(1000)), at_2)
        assert psutil.Process(again._owner.process.pid).parent().pid != zygote.pid
        train(again, steps=1)
