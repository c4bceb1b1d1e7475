"""The writeback thread holds a computed step's writes until a hand-off has taken its rows
(NOTE [ A step's writes wait for the hand-off after it ] in ``owner/writeback.py``), and every
other way the loop can go on lets them go: nothing waits for the hold's timeout."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.owner import writeback
from embedpipe.owner.writeback import Writeback
from embedpipe.pipe import EmbeddingPipe

# a hold no test may wait out: each would fail on pytest's timeout instead
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def held(monkeypatch):
    monkeypatch.setattr(writeback, "HOLD_SECONDS", 600.0)


class Steps:
    """An ``apply`` that computes, holds, then "writes" (records the step)."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self.writeback = Writeback(self.apply)

    def apply(self, ids, grad, step, lr) -> None:
        self.writeback.computed_now(step)
        self.writeback.hold(step)
        self.written.append(step)

    def submit(self) -> int:
        return self.writeback.submit(np.arange(2), torch.zeros(2, 1))


def test_a_computed_step_is_written_once_a_hand_off_took_its_rows(held):
    steps = Steps()
    step = steps.submit()
    steps.writeback.wait(computed=True, timeout=10)  # the hand-off's wait: it goes on here
    assert steps.written == [] and steps.writeback.applied == 0
    steps.writeback.handed_off(step)
    steps.writeback.wait(timeout=10)
    assert steps.written == [1]
    steps.writeback.close()


def test_a_thread_waiting_for_applied_steps_lets_a_held_step_write(held):
    steps = Steps()
    steps.submit()
    steps.writeback.wait(timeout=10)  # a checkpoint's or a refresh's wait: no hand-off comes
    assert steps.written == [1]
    steps.writeback.close()


def test_a_step_queued_behind_a_held_one_lets_it_write(held):
    steps = Steps()
    steps.submit()
    steps.writeback.wait(computed=True, timeout=10)
    steps.submit()  # gradient accumulation over a step without a batch between
    steps.writeback.wait(computed=True, timeout=10)
    assert steps.written == [1]  # the second is held in its turn
    steps.writeback.close()
    assert steps.written == [1, 2]


def test_close_writes_a_held_step(held):
    steps = Steps()
    steps.submit()
    steps.writeback.wait(computed=True, timeout=10)
    steps.writeback.close()
    assert steps.written == [1]


def test_without_a_hand_off_a_held_step_writes_after_the_hold(monkeypatch):
    monkeypatch.setattr(writeback, "HOLD_SECONDS", 0.2)
    steps = Steps()
    steps.submit()
    steps.writeback.wait(computed=True, timeout=10)
    # the last step of an epoch, which nothing follows: written on its own after the hold
    for _ in range(200):
        if steps.written:
            break
        time.sleep(0.05)
    assert steps.written == [1] and steps.writeback.applied == 1
    steps.writeback.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_training_with_holds_that_never_time_out_is_bit_equal_to_nn_embedding(
    tmp_path, monkeypatch, held, num_workers
):
    """The owner thread (in this process, where the hold is patched): a loop of hand-offs,
    steps, a checkpoint, a refresh of a batch held across a step, and close; every write went
    through a hand-off, a wait or close, and the table is nn.Embedding's."""
    V, D = 64, 8
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, V, D, seed=0, chunk_rows=8).close()
    weight = embedpipe.Table.open(path).to_tensor()
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, V, (6,), generator=g)} for _ in range(24)]

    emb = torch.nn.Embedding(V, D, _weight=weight.clone())  # torch Adagrad's dense branch
    adagrad = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    for batch in torch.utils.data.DataLoader(data, batch_size=2):
        (emb(batch["input_ids"]) ** 2).sum().backward()
        adagrad.step()
        adagrad.zero_grad()

    pipe = EmbeddingPipe(
        path, cache_rows=10, optimizer=embedpipe.optim.Adagrad(lr=0.1), owner="thread"
    )
    loader = pipe.loader(data, batch_size=2, num_workers=num_workers)
    kept = None
    for i, batch in enumerate(loader):
        (batch["inputs_embeds"] ** 2).sum().backward()
        pipe.step()
        if i == 3:
            pipe.checkpoint()
        if i == 5:
            kept = batch  # read again below, after later steps: a refresh
    kept["inputs_embeds"]
    pipe.close()
    assert torch.equal(embedpipe.Table.open(path).to_tensor(), emb.weight.detach())


def test_an_owners_computed_step_is_written_after_the_next_hand_off_not_before(tmp_path, held):
    """The owner's wiring of the hold: a step's writes wait for the batch after it (not for a
    later step, a waiter or close), and that batch's hand-off lets them go."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 64, 4, seed=0, chunk_rows=8).close()
    data = [{"input_ids": torch.arange(i, i + 8)} for i in range(0, 48, 8)]
    with EmbeddingPipe(
        path, cache_rows=16, optimizer=embedpipe.optim.SGD(lr=1.0), owner="thread"
    ) as pipe:
        written = pipe._owner.writeback
        # (a worker's lookup: with none, the loop's own lookup waits for the step first)
        batches = iter(pipe.loader(data, batch_size=1, num_workers=1))
        next(batches)["inputs_embeds"].sum().backward()
        pipe.step()
        written.wait(computed=True, timeout=10)
        time.sleep(0.2)
        assert written.applied == 0  # computed, held: no hand-off has taken its rows
        next(batches)  # this hand-off takes them
        for _ in range(200):
            if written.applied == 1:
                break
            time.sleep(0.05)
        assert written.applied == 1


def test_rows_a_step_applied_during_a_hand_offs_wait_are_among_those_it_re_read(
    tmp_path, monkeypatch
):
    """Found by review. An owner process sends back only the rows a hand-off re-read (``stale``)
    and the misses it read: the training process keeps its lookup's copy of every other row. A
    step applied between the hand-off's first reads and its wait for the last step (its table
    write slowed here) changes rows that must be among them. Checked where the owner process
    checks, at ``deliver``, with the owner in this process; SGD with lr 1 counts each row's
    updates, so every row handed out is checked against the count too."""
    from embedpipe.cache.rowcache import RowCache
    from embedpipe.owner.owner import Owner

    V, D = 64, 4
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, V, D, init="zeros", chunk_rows=8).close()
    write = RowCache.write_uncached

    def slow_write(self, update, before):
        time.sleep(0.03)
        write(self, update, before)

    monkeypatch.setattr(RowCache, "write_uncached", slow_write)
    final_rows, missed = Owner.final_rows, []

    def checked(self, item, rows, deliver=None):
        looked_up = None if rows is None else rows.copy()

        def check(final, stale, step, tick):
            if looked_up is not None and stale is not None:
                deferred = item.deferred if item.deferred is not None else np.empty(0, np.int64)
                sent = np.union1d(stale, deferred)
                kept = np.setdiff1d(np.arange(len(final)), sent)
                missed.append(int((looked_up[kept] != final[kept]).any(axis=1).sum()))
            if deliver is not None:
                deliver(final, stale, step, tick)

        return final_rows(self, item, rows, check)

    monkeypatch.setattr(Owner, "final_rows", checked)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randperm(V, generator=g)[:24]} for _ in range(40)]
    expected, stale_batches = np.zeros(V), 0
    with EmbeddingPipe(
        path, cache_rows=16, optimizer=embedpipe.optim.SGD(lr=1.0), owner="thread", policy="lru"
    ) as pipe:
        loader = pipe.loader(data, batch_size=1, num_workers=2, prefetch_factor=4)
        for k, batch in enumerate(loader):
            ids = data[k]["input_ids"].numpy()
            embeds = batch["inputs_embeds"][0].detach()
            stale_batches += not torch.equal(embeds[:, 0], torch.from_numpy(expected[ids]).float())
            (-batch["inputs_embeds"]).sum().backward()
            pipe.step()
            expected[ids] += 1
    assert stale_batches == 0
    assert len(missed) == len(data) and sum(missed) == 0, missed
    table = embedpipe.Table.open(path).to_tensor()
    assert torch.equal(table[:, 0], torch.from_numpy(expected).float())
