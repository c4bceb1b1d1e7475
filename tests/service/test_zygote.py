"""Owner processes forked by the training process's zygote (``service/zygote.py``): one zygote
for every owner process of a training process, holding none of their descriptors, ending with
the training process; an owner's exit status as a child's would be."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import embedpipe
from embedpipe.errors import OwnerDiedError
from embedpipe.pipe import EmbeddingPipe
from embedpipe.service import zygote

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


@pytest.fixture
def own_zygote(monkeypatch):
    """A zygote of the test's own, started by its first pipe (which then takes a second or so),
    closed at its end; the suite's goes on after."""
    monkeypatch.setattr(zygote, "_zygote", None)
    yield
    if zygote._zygote is not None:
        zygote._zygote.close()


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


def test_a_killed_zygote_takes_its_owners_with_it_and_the_next_pipe_starts_another(
    tmp_path, own_zygote
):
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
    owner.wait(30)  # it ends by itself, re-parented (else TimeoutExpired)
    assert not psutil.pid_exists(owner.pid) or psutil.Process(owner.pid).status() == "zombie"
    with pytest.raises(OwnerDiedError, match="step 2"):
        train(pipe, steps=2)
    pipe.close()
    with sgd_pipe(path) as again:
        assert again.table.step == 2
        assert np.array_equal(again.table.read(np.arange(1000)), at_2)
        assert psutil.Process(again._owner.process.pid).parent().pid != zygote.pid
        train(again, steps=1)


def test_a_ctrl_c_while_the_zygote_starts_leaves_the_next_owner_in_step(tmp_path, own_zygote):
    """SIGINT while the first pipe waits for its owner: KeyboardInterrupt, the table released;
    the next pipe talks to the owner forked for it (the answer to the interrupted request is
    not taken for its own), and waiting for its exit inside a wait of the zygote's (a collection
    that closes an unclosed pipe) does not hang."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8).close()
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        sgd_pipe(path)
        time.sleep(10)  # not reached: the Ctrl-C comes while the zygote starts
    timer.join()
    with sgd_pipe(path) as pipe:
        owner = pipe._owner.process
        assert owner.pid == pipe._owner.owner_pid  # the process that opened the table
        with zygote._zygote.state, pytest.raises(subprocess.TimeoutExpired):
            owner.wait(0.2)  # a wait inside a wait (a collection closing an unclosed pipe)
        train(pipe)
    assert owner.wait(5) == 0
    assert embedpipe.Table.open(path).step == 3


def test_descriptors_past_1024_do_not_stop_an_owner_from_starting(tmp_path, own_zygote):
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} descriptors a process")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    gc.collect()  # pidfds and sockets of earlier tests closed now, not in the middle
    held = [os.open(os.devnull, os.O_RDONLY)]
    while held[-1] < 1100:  # every number below taken: the pipe's are above 1024
        held.append(os.open(os.devnull, os.O_RDONLY))
    try:
        path = tmp_path / "t.zarr"
        embedpipe.Table.create(path, 1000, 8).close()
        with sgd_pipe(path) as pipe:
            assert pipe._owner.channel.fileno() > 1024
            train(pipe)
        assert pipe._owner.process.wait(5) == 0
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_without_pidfds_owner_processes_start_as_new_interpreters(tmp_path, monkeypatch):
    """Linux before 5.3, or a seccomp profile that blocks pidfd_open: no zygote."""
    monkeypatch.setattr(zygote, "_available", False)
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8).close()
    with sgd_pipe(path) as pipe:
        assert isinstance(pipe._owner.process, subprocess.Popen)
        assert psutil.Process(pipe._owner.process.pid).ppid() == os.getpid()
        train(pipe)
    assert embedpipe.Table.open(path).step == 3


def test_a_zygote_given_up_on_keeps_its_owners_running(tmp_path, own_zygote):
    """The thread that receives a zygote's answers ended (an error there): the next pipe starts
    a new zygote; the old one takes no more requests, its owner trains and closes as before, and
    it ends once that owner has."""
    a, b = tmp_path / "a.zarr", tmp_path / "b.zarr"
    for path in (a, b):
        embedpipe.Table.create(path, 1000, 8).close()
    first = sgd_pipe(a)
    train(first, steps=1)
    old = zygote._zygote
    with old.state:
        old.gone = True
    with sgd_pipe(b) as second:
        assert zygote._zygote is not old
        train(second)
    train(first, steps=2)
    first.close()
    assert embedpipe.Table.open(a).step == 3 and embedpipe.Table.open(b).step == 3
    assert old.process.wait(5) == 0
