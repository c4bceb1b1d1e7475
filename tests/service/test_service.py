"""The owner in a process of its own (``EmbeddingPipe(..., owner="process")``): the same table as
``nn.Embedding`` bit for bit, the same checkpoints, errors that reach the program, and processes
that end with each other."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest.mock import Mock

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.errors import (
    NonFiniteGradientError,
    OwnerDiedError,
    TableExistsError,
    TableLockedError,
)
from embedpipe.pipe import EmbeddingPipe
from embedpipe.service.channel import NO_REPLY, Channel, ChannelClosed
from embedpipe.service.job import Job, RankServer

from ..helpers import slow, tiny_model, train_offloaded, train_reference, zipf_dataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data():
    return zipf_dataset(64)


@pytest.mark.parametrize(
    ("optimizer", "workers", "cache_rows"),
    [
        ("adagrad", 2, 50),
        slow("sgd", 0, 50),
        slow("adagrad", 0, 1000),
        slow("sgd", 2, 0),
        slow("adam", 2, 50),
    ],
)
def test_an_owner_process_trains_the_table_nn_embedding_trains(
    tmp_path, data, optimizer, workers, cache_rows
):
    """The table and the optimizer state of the owner process are the in-process owner's, and
    with SGD and Adagrad nn.Embedding's, bit for bit, whatever the workers and the cache."""
    ref, _, ref_state = train_reference(data, optimizer, 0.5)
    got, _, stats, table = train_offloaded(
        data, optimizer, 0.5, tmp_path / "t.zarr", num_workers=workers, cache_rows=cache_rows,
        owner="process",
    )  # fmt: skip
    if optimizer == "adam":  # SparseAdam sums a sparse gradient in its own order
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    else:
        assert torch.equal(got, ref), (got - ref).abs().max()
    if optimizer == "adagrad":
        assert torch.equal(torch.from_numpy(table.read(np.arange(1000), "sum")), ref_state["sum"])
    assert stats["batches"] == 8 and stats["steps"] == 8
    assert table.step == 8
    if workers and 0 < cache_rows < 1000:  # the lookahead: batches after the first read ahead
        assert stats["read_ahead"] > 0, stats  # (NOTE [ A hand-off read ahead ] in reads.py)


def test_a_ring_slot_overwritten_before_the_reply_is_read_again_whole(tmp_path, data, monkeypatch):
    """The training process copies a batch's rows out of the ring after the owner's reply, only
    those the reply does not send (``RemoteOwner.claim``); a slot overwritten by then (a worker
    come round to it: an order the DataLoader does not promise) has every row read again, so
    training stays nn.Embedding's, bit for bit."""
    from embedpipe.cache.ring import BatchRing

    read_except, overwritten = BatchRing.read_except, []

    def late(self, slot, tag, out, positions):
        if len(overwritten) < 3 and len(positions) < len(out):  # rows to take from the slot
            self._tags[slot] = tag + 2
            overwritten.append(slot)
        return read_except(self, slot, tag, out, positions)

    monkeypatch.setattr(BatchRing, "read_except", late)
    ref, _, ref_state = train_reference(data, "adagrad", 0.5)
    got, _, _, table = train_offloaded(
        data, "adagrad", 0.5, tmp_path / "t.zarr", num_workers=2, cache_rows=1000, owner="process"
    )  # (the whole table cached: no misses left to the owner, which it would send)
    assert len(overwritten) == 3
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert torch.equal(torch.from_numpy(table.read(np.arange(1000), "sum")), ref_state["sum"])


def test_checkpoints_snapshots_and_reads_go_through_the_owner_process(tmp_path, data):
    """checkpoint(), save_checkpoint(), load_checkpoint(), table.read() during training, stats()
    after close(), and the table's own handle afterwards: as with an owner thread."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8, seed=1).close()
    with embedpipe.Table.open(path, "r+") as table:
        with EmbeddingPipe(
            table, cache_rows=30, optimizer=embedpipe.optim.Adagrad(lr=0.5), owner="process"
        ) as pipe:
            loader = pipe.loader(data, batch_size=8, num_workers=2)
            saved = None
            for n, batch in enumerate(loader):
                (batch["inputs_embeds"] ** 2).sum().backward()
                pipe.step()
                if n == 3:
                    assert pipe.checkpoint().step == 4
                    pipe.save_checkpoint(tmp_path / "at-4")
                    saved = table.read(np.arange(1000))  # the rows as of step 4, through a flush
            with pytest.raises(TableExistsError):  # raised in the owner process, raised here
                pipe.save_checkpoint(tmp_path / "at-4")
            with pytest.raises(TableLockedError, match=f"pid {os.getpid()}"):
                embedpipe.Table.open(path, "r+")  # lent to the owner process, held all along
            assert pipe.checkpoint().step == table.step == 8
            pipe.load_checkpoint(tmp_path / "at-4")
            assert table.step == 4  # (found by a probe: it said 8 until the pipe closed)
            assert np.array_equal(table.read(np.arange(1000)), saved)
        assert pipe.stats()["steps"] == 8 - 4  # counted since the pipe opened, after the load
        assert table.step == 4  # this handle took the lock back and sees the owner's commit
        table.update_metadata(note="mine again")  # it writes again
    assert embedpipe.Table.open(path).metadata["note"] == "mine again"


@pytest.mark.slow
def test_errors_of_the_step_are_raised_in_the_training_process(tmp_path, data):
    embedpipe.Table.create(tmp_path / "t.zarr", 1000, 8).close()
    with EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=30, optimizer=embedpipe.optim.SGD(lr=0.1), owner="process"
    ) as pipe:
        batch = next(iter(pipe.loader(data, batch_size=8)))
        (batch["inputs_embeds"] * float("nan")).sum().backward()
        with pytest.raises(NonFiniteGradientError, match="step 1"):
            pipe.step()
        with pytest.warns(RuntimeWarning, match="never taken by an optimizer step"):
            pipe.close()
    assert embedpipe.Table.open(tmp_path / "t.zarr").step == 0


@pytest.mark.parametrize("handle", [slow("path"), "table"])
def test_a_dead_owner_process_is_raised_within_seconds_naming_the_checkpoint(
    tmp_path, data, handle
):
    """SIGKILL of the owner process: the next call raises, naming it and the checkpoint; a
    Ctrl-C (SIGINT to it, or to the terminal's process group) does not stop it. A Table the
    program lent its lock is taken back to the checkpoint, not left with the dead owner's
    rows."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8).close()
    table = embedpipe.Table.open(path, "r+") if handle == "table" else path
    pipe = EmbeddingPipe(
        table, cache_rows=30, optimizer=embedpipe.optim.SGD(lr=0.1), owner="process"
    )
    owner = pipe._owner.process.pid
    assert os.getpgid(owner) != os.getpgrp()  # not in the terminal's process group
    loader = pipe.loader(data, batch_size=8, num_workers=2)
    began, at_2 = None, None
    with pytest.raises(OwnerDiedError, match=r"killed by SIGKILL.*step 2") as raised:
        for n, batch in enumerate(loader):
            batch["inputs_embeds"].sum().backward()
            pipe.step()
            if n == 0:
                os.kill(owner, signal.SIGINT)  # ignored: the training process takes Ctrl-C
            if n == 1:
                pipe.checkpoint()
                at_2 = embedpipe.Table.open(path).read(np.arange(1000))
            if n == 4:
                pipe.flush()  # steps 3-5 in the live arrays, not committed
                os.kill(owner, signal.SIGKILL)
                began = time.monotonic()
    assert time.monotonic() - began < 10
    assert str(owner) in str(raised.value)
    pipe.close()  # closed already: nothing to do, nothing raised
    if handle == "table":
        assert table.step == 2 and np.array_equal(table.read(np.arange(1000)), at_2)
        table.close()
    reopened = embedpipe.Table.open(path, "r+")  # and the lock is free
    assert reopened.step == 2 and np.array_equal(reopened.read(np.arange(1000)), at_2)


def test_an_owner_process_dead_between_epochs_is_raised_as_its_death(tmp_path, data):
    """The owner process dies between two epochs: the next epoch's start (its lookahead stream,
    handed to the owner) raises OwnerDiedError, not an error of the stream's own cleanup."""
    embedpipe.Table.create(tmp_path / "t.zarr", 1000, 8).close()
    pipe = EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=30, optimizer=embedpipe.optim.SGD(lr=0.1), owner="process"
    )
    assert pipe._owner.looks_ahead  # the default policy reads the loader's order ahead
    loader = pipe.loader(data, batch_size=8, num_workers=2)
    for batch in loader:
        batch["inputs_embeds"].sum().backward()
        pipe.step()
    os.kill(pipe._owner.process.pid, signal.SIGKILL)
    with pytest.raises(OwnerDiedError, match="killed by SIGKILL"):
        for batch in loader:
            batch["inputs_embeds"]
    pipe.close()


@pytest.mark.slow
def test_a_killed_trainer_takes_its_owner_process_with_it(tmp_path):
    """kill -9 of the training process: its owner process ends within seconds, without a
    commit, and the table reopens at its last checkpoint."""
    psutil = pytest.importorskip("psutil", reason="psutil lists the job's processes")
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 500, 8).close()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.orphan_run", str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "ORPHAN_RUN_OWNER": "process"},
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("pids"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) >= 5, pids  # the trainer, its zygote, its owner process, 2 workers
        os.kill(pids[0], signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = pids[1:]
        while alive and time.monotonic() < deadline:
            alive = [
                p
                for p in alive
                if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
            ]
            time.sleep(0.1)
        assert not alive, f"processes of the killed job still alive after 10 s: {alive}"
        assert embedpipe.Table.open(path, "r+").step == 0
    finally:
        for p in pids if "pids" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        process.stdout.close()


def test_an_unknown_owner_is_refused(tmp_path):
    embedpipe.Table.create(tmp_path / "t.zarr", 10, 4).close()
    with pytest.raises(ValueError, match="owner must be one of"):
        EmbeddingPipe(tmp_path / "t.zarr", cache_rows=0, owner="elsewhere")


@pytest.mark.slow
def test_the_training_process_holds_no_cache_and_reads_no_table_file(tmp_path):
    """A 1 GiB table, trained in a fresh process with a cache of 1% and of 50%: the training
    process has none of the cache's pages resident, its other memory is the same (with the owner
    in threads it is about 240 MB larger), it opens, holds and maps none of the table's files while
    it trains (with the owner in threads: 1370 files), and after the page cache is dropped it reads
    next to nothing from disk (its owner process and workers do the reads)."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 350_000, 768, init="zeros", chunk_rows=512).close()  # 1.07 GB
    measured, named = {}, []
    for fraction in (0.01, 0.5):
        out = subprocess.run(
            [sys.executable, "-m", "tests.service.resident_run", str(path), str(fraction)],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        measured[fraction] = [int(x) for x in out.stdout.split()]
        named.append(out.stderr.strip().splitlines()[-1])
    (rss_small, cache_small, read_small, owner_small, files_small), (
        rss_large, cache_large, read_large, _, files_large,
    ) = measured.values()  # fmt: skip
    # the 50% cache's block is 537 MB; this process maps it (to hand it to its workers) and
    # reads none of it
    assert cache_small == 0 and cache_large == 0, measured
    # the same within a few MB after malloc_trim (measured: 1 MB apart)
    assert abs(rss_large - rss_small) < 32 << 20, measured
    assert files_small == files_large == 0, named
    if read_small >= 0:  # the page cache could be dropped (root)
        # Measured: 0 bytes, in each run (each reaped foresight child's reads are left out). The
        # count takes in every file, and a module or a shared library's page first touched under
        # load reads as a chunk would (a CI run measured 4.4 MB once): the table's files are
        # named above, and this bounds what reads could pass by the names.
        assert 0 <= read_small < 16 << 20 and 0 <= read_large < 16 << 20, (measured, named)
        assert owner_small > 0, measured  # the 1% cache's misses were read, elsewhere


def test_a_signal_in_the_middle_of_a_request_never_puts_the_replies_out_of_step(
    tmp_path, data, monkeypatch
):
    """Ctrl-C while the training process waits for a reply leaves that reply in the socket:
    the next request must not take it for its own (the rows of one batch given to another).
    Interrupted before the reply's first byte, the pipe goes on exactly; interrupted in the
    middle of a message, the pipe stops its owner process and says so."""
    ref, _, _ = train_reference(data, "sgd", 0.5)
    model = tiny_model()
    weight = model.bert.embeddings.word_embeddings.weight.detach().clone()
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=64).close()
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if "word_emb" not in n], 0.05)
    with EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.5), owner="process"
    ) as pipe:
        channel = pipe._owner.channel
        receive = channel.receive
        for n, batch in enumerate(pipe.loader(data, batch_size=8, num_workers=2)):
            out = model(inputs_embeds=batch["inputs_embeds"], attention_mask=batch["attention_mask"],
                        labels=batch["labels"])  # fmt: skip
            out.loss.backward()
            dense.step()
            dense.zero_grad()
            pipe.step()
            if n == 3:  # a signal while stats() waits for its reply: before its first byte
                with monkeypatch.context() as m:
                    m.setattr(channel, "receive", Mock(side_effect=KeyboardInterrupt))
                    with pytest.raises(KeyboardInterrupt):
                        pipe.stats()
                assert channel.receive == receive
    assert torch.equal(embedpipe.Table.open(tmp_path / "t.zarr").to_tensor(), ref)

    pipe = EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.5), owner="process"
    )
    channel = pipe._owner.channel
    channel.broken = "interrupted while it received a message"  # as _into would leave it
    with pytest.raises(OwnerDiedError, match="interrupted while it received"):
        pipe.stats()
    pipe.close()
    assert embedpipe.Table.open(tmp_path / "t.zarr", "r+").step == 8  # the lock is free


def test_two_threads_claiming_through_one_owner_process_get_their_own_rows(tmp_path, monkeypatch):
    # A claim's rows come back in the transfer block, which the next reply overwrites: each
    # thread must copy its rows out before another thread's request is answered (a pause where
    # the rows are taken out of the block makes the two threads interleave there).
    import threading

    from embedpipe.service import transfer

    take_reply = transfer.Transfer.take_reply

    def slow_take(self, n, *rest):
        rows = take_reply(self, n, *rest)
        time.sleep(0.02)
        return rows

    monkeypatch.setattr(transfer.Transfer, "take_reply", slow_take)
    V, D = 40, 4
    weight = torch.arange(V, dtype=torch.float32)[:, None].expand(V, D).contiguous()
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=8).close()
    wrong, claimed = [], []
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=10, owner="process") as pipe:

        def claim(lo: int, hi: int) -> None:
            data = [{"input_ids": torch.arange(lo, hi)} for _ in range(10)]
            for batch in pipe.loader(data, batch_size=1):
                rows = batch["inputs_embeds"][0, :, 0]
                claimed.append(lo)
                if not torch.equal(rows, batch["input_ids"][0].float()):
                    wrong.append(lo)

        threads = [threading.Thread(target=claim, args=r) for r in ((0, 20), (20, 40))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert len(claimed) == 20 and wrong == []


def test_a_request_sent_without_waiting_never_gets_a_reply(tmp_path):
    """Found by review: with a step's error kept for the next request (a full disk), the owner
    replied to the next no-reply message (rank 0's header, a loader's draw) with it, so the
    request after read that reply for its own and every later one the reply before it."""
    mine, theirs = socket.socketpair()
    server = RankServer(Channel(mine), Job(2), 0)
    server.later = OSError(28, "No space left on device")

    def serve() -> None:
        with contextlib.suppress(ChannelClosed):  # (the test's end)
            server.run()

    threading.Thread(target=serve, daemon=True).start()
    client = Channel(theirs)
    for op in sorted(NO_REPLY - {"submit"}):  # (a submit needs an owner to step)
        client.send({"op": op, "after": 0, "headers": 1, "step": 0, "source": 0, "number": 0})
    client.send({"op": "stats", "after": 0})
    answer, _, _ = client.receive()
    assert isinstance(answer["error"], OSError) and answer["error"].errno == 28, answer
    theirs.settimeout(1.0)
    with pytest.raises(TimeoutError):  # the one reply: to the request
        client.receive()
    theirs.close()
