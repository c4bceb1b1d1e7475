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
