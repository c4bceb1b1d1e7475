"""Faults surface in the training loop as clear errors, never as hangs, and lose nothing applied."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe import errors
from embedpipe.pipe import EmbeddingPipe
from embedpipe.writeback import WritebackError

V, D = 100, 4


@pytest.fixture
def path(tmp_path):
    weight = np.arange(V * D, dtype=np.float32).reshape(V, D) / 100
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=16).close()
    return tmp_path / "t.zarr"


def samples(n: int, bad: dict[int, int] | None = None) -> list[dict]:
    out = [{"input_ids": torch.tensor([i % V, (3 * i) % V, 7])} for i in range(n)]
    for index, value in (bad or {}).items():
        out[index]["input_ids"] = torch.tensor([1, value, 2])
    return out


class Crashing(torch.utils.data.Dataset):
    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        if i == self.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"input_ids": torch.tensor([i % V])}


@pytest.mark.timeout(120)
def test_a_worker_that_dies_raises_in_the_loop(path):
    with EmbeddingPipe(path, cache_rows=10) as pipe:
        loader = pipe.loader(Crashing(crash_at=13), batch_size=2, num_workers=2)
        with pytest.raises(
            RuntimeError, match=r"DataLoader worker \(pid\(s\)? ?\d+\) .*exited unexpectedly|killed"
        ):
            for _ in loader:
                pass


@pytest.mark.parametrize("num_workers", [0, 2])
def test_out_of_range_id_names_the_id_and_the_sample(path, num_workers):
    data = samples(20, bad={13: V + 5})
    with EmbeddingPipe(path, cache_rows=10) as pipe:
        with pytest.raises(
            ValueError, match=rf"sample 13, 'input_ids': id {V + 5} at position 1 .* {V} rows"
        ):
            for _ in pipe.loader(data, batch_size=4, num_workers=num_workers):
                pass


def test_out_of_range_id_from_a_collate_names_the_batch_position(path):
    def collate(batch):  # a collate that breaks ids after the per-sample check
        return {"input_ids": torch.stack([s["input_ids"] for s in batch]) * 50}

    with (
        EmbeddingPipe(path, cache_rows=10) as pipe,
        pytest.raises(
            errors.IdOutOfRangeError, match=r"batch ids: id \d+ at position \(\d+, \d+\)"
        ),
    ):
        for _ in pipe.loader(samples(8), batch_size=4, collate_fn=collate):
            pass


@dataclass(frozen=True)
class FailingSGD(embedpipe.optim.SGD):
    fail_at: int = 3

    def update(self, rows, grad, state, step):
        if step == self.fail_at:
            raise OSError(f"disk on fire at step {step}")
        super().update(rows, grad, state, step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_writeback_error_surfaces_in_the_loop_and_earlier_steps_are_kept(path, num_workers):
    pipe = EmbeddingPipe(path, cache_rows=10, optimizer=FailingSGD(lr=1.0, fail_at=3))
    seen = 0
    with pytest.raises(WritebackError, match="failed at step 3: OSError: disk on fire at step 3"):
        with pipe:
            for batch in pipe.loader(samples(20), batch_size=2, num_workers=num_workers):
                (-batch["inputs_embeds"]).sum().backward()
                seen += 1
    assert seen == 3  # the error came with the first batch after step 3, not later, not never
    table = embedpipe.Table.open(path)
    assert table.step == 2  # steps 1 and 2 were written, nothing of step 3 or later
    pipe.close()  # idempotent
    embedpipe.Table.open(path, "r+").close()  # the table was released


def test_non_finite_gradient_raises_and_applies_nothing(path):
    before = embedpipe.Table.open(path).to_tensor()
    with EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0)) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=2)))
        scale = torch.ones(D)
        scale[2] = float("nan")
        with pytest.raises(
            errors.NonFiniteGradientError,
            match=r"non-finite embedding gradient \(nan\) for id \d+ .* step 1",
        ):
            (batch["inputs_embeds"] * scale).sum().backward()
        assert pipe.stats()["writeback_queue"] == 0
    assert torch.equal(embedpipe.Table.open(path).to_tensor(), before)


def test_non_finite_check_can_be_turned_off(path):
    with EmbeddingPipe(
        path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0), check_finite=False
    ) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=2)))
        (batch["inputs_embeds"] * float("inf")).sum().backward()
    assert not torch.isfinite(embedpipe.Table.open(path).to_tensor()).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(cache_rows=-1), "cache_rows must be an integer >= 0"),
        (dict(cache_rows=1.5), "cache_rows must be an integer"),
        (dict(cache_rows=10, consistency="eventual"), "consistency must be one of"),
        (dict(cache_rows=10, consistency="bounded"), "needs max_staleness"),
        (dict(cache_rows=10, max_staleness=2), "needs consistency='bounded'"),
        (dict(cache_rows=10, policy="fifo"), "policy must be one of"),
        (dict(cache_rows=10, padding_idx=V), f"padding_idx must be in \\[0, {V}\\)"),
        (dict(cache_rows=10, grad_accumulation=0), "grad_accumulation must be an integer >= 1"),
    ],
)
def test_bad_pipe_options(path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmbeddingPipe(path, **kwargs)
    embedpipe.Table.open(path, "r+").close()  # nothing kept the table locked


def test_a_read_only_table_with_an_optimizer_is_refused(path):
    with pytest.raises(ValueError, match="mode='r\\+'"):
        EmbeddingPipe(embedpipe.Table.open(path), cache_rows=1, optimizer=embedpipe.optim.SGD(lr=1))


def test_a_second_pipe_writing_the_same_table_is_refused(path):
    with EmbeddingPipe(path, cache_rows=1, optimizer=embedpipe.optim.SGD(lr=1)):
        with pytest.raises(errors.TableLockedError, match=f"pid {os.getpid()}"):
            EmbeddingPipe(path, cache_rows=1, optimizer=embedpipe.optim.SGD(lr=1))
        with EmbeddingPipe(path, cache_rows=1) as frozen:  # a frozen reader is fine
            next(iter(frozen.loader(samples(2), batch_size=2)))


def test_a_batch_without_ids_says_what_it_expected(path):
    with (
        EmbeddingPipe(path, cache_rows=1) as pipe,
        pytest.raises(TypeError, match="ids under 'tokens'"),
    ):
        next(iter(pipe.loader(samples(2), batch_size=2, ids_key="tokens")))
