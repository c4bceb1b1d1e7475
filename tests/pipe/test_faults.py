"""Faults surface in the training loop as clear errors, never as hangs, and lose nothing applied."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe import errors
from embedpipe.owner.writeback import WritebackError
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


class Crashing(torch.utils.data.Dataset):
    def __init__(self, crash_at: int) -> None:
        self.crash_at = crash_at

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict:
        # a worker dies (out of memory, say); the main process reads samples too, for the
        # lookahead policy's window, and must not be the one killed
        if i == self.crash_at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"input_ids": torch.tensor([i % V])}


@pytest.mark.timeout(120)
def test_a_worker_that_dies_raises_in_the_loop(path):
    with EmbeddingPipe(path, cache_rows=10) as pipe:
        loader = pipe.loader(Crashing(crash_at=13), batch_size=2, num_workers=2)
        # embedpipe's WorkerDiedError, or torch's own when its SIGCHLD handler fires first
        with pytest.raises(
            RuntimeError,
            match=r"worker \(pid \d+\) (died \(killed by SIGKILL: out of memory|is killed by signal)",
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
    delay: float = 0.0  # seconds before the failure

    def update(self, rows, grad, state, step, lr=None):
        if step == self.fail_at:
            time.sleep(self.delay)
            raise OSError(f"disk on fire at step {step}")
        super().update(rows, grad, state, step, lr=lr)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_writeback_error_surfaces_in_the_loop_and_earlier_steps_are_kept(path, num_workers):
    pipe = EmbeddingPipe(path, cache_rows=10, optimizer=FailingSGD(lr=1.0, fail_at=3))
    seen = 0
    with pytest.raises(WritebackError, match="failed at step 3: OSError: disk on fire at step 3"):
        with pipe:
            for batch in pipe.loader(samples(20), batch_size=2, num_workers=num_workers):
                (-batch["inputs_embeds"]).sum().backward()
                pipe.step()
                seen += 1
    assert seen == 3  # the error came with the first batch after step 3, not later, not never
    table = embedpipe.Table.open(path)
    assert table.step == 2  # steps 1 and 2 were written, nothing of step 3 or later
    pipe.close()  # idempotent
    embedpipe.Table.open(path, "r+").close()  # the table was released


def test_non_finite_gradient_raises_and_applies_nothing(path):
    # The check is at the step (pipe.step() or a torch optimizer's), not in backward.
    before = embedpipe.Table.open(path).to_tensor()
    with EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0)) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=2)))
        scale = torch.ones(D)
        scale[2] = float("nan")
        (batch["inputs_embeds"] * scale).sum().backward()
        message = r"non-finite embedding gradient \(nan\) for id \d+ .* step 1"
        with pytest.raises(errors.NonFiniteGradientError, match=message):
            pipe.step()
        assert pipe.stats()["writeback_queue"] == 0
        optimizer = torch.optim.SGD([pipe.parameter], lr=1.0)
        with pytest.raises(errors.NonFiniteGradientError, match=message):
            optimizer.step()
        assert pipe.stats()["writeback_queue"] == 0 and pipe.stats()["steps"] == 0
        optimizer.zero_grad()  # drops it: close() has nothing to warn about
    assert torch.equal(embedpipe.Table.open(path).to_tensor(), before)


def test_non_finite_check_can_be_turned_off(path):
    with EmbeddingPipe(
        path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0), check_finite=False
    ) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=2)))
        (batch["inputs_embeds"] * float("inf")).sum().backward()
        assert pipe.step()
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
        with pytest.raises(errors.TableOwnedError, match="stale rows"):  # (test_patterns.py)
            EmbeddingPipe(path, cache_rows=1)  # a frozen reader here: the last checkpoint's rows
    with EmbeddingPipe(path, cache_rows=1) as frozen:  # once the trainer closed: its rows
        next(iter(frozen.loader(samples(2), batch_size=2)))


def test_a_batch_without_ids_says_what_it_expected(path):
    with (
        EmbeddingPipe(path, cache_rows=1) as pipe,
        pytest.raises(TypeError, match="ids under 'tokens'"),
    ):
        next(iter(pipe.loader(samples(2), batch_size=2, ids_key="tokens")))


def test_close_after_a_writeback_failure_with_a_partial_group_keeps_the_applied_steps(path):
    # Bounded mode, a slow failure at step 2: the loop ends with half of group 3 pending.
    optimizer = FailingSGD(lr=1.0, fail_at=2, delay=0.5)
    pipe = EmbeddingPipe(
        path,
        owner="thread",
        cache_rows=10,
        optimizer=optimizer,
        consistency="bounded",
        max_staleness=5,
    )
    for k, batch in enumerate(pipe.loader(samples(10), batch_size=2)):  # steps 1, 2 and a half
        (-batch["inputs_embeds"]).sum().backward()
        if k % 2:
            pipe.step()
    assert pipe._owner.gradient.pending
    with pytest.raises(WritebackError):
        pipe._owner.writeback.wait()  # the failure is known before close()
    with (
        pytest.warns(RuntimeWarning, match="never taken by an optimizer step"),
        pytest.raises(WritebackError, match="failed at step 2"),
    ):
        pipe.close()
    assert embedpipe.Table.open(path).step == 1  # step 1 written
    embedpipe.Table.open(path, "r+").close()  # and the table released


def test_backward_after_close_is_an_error_not_a_lost_update(path):
    pipe = EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0))
    batch = next(iter(pipe.loader(samples(2), batch_size=2)))
    embeds = batch["inputs_embeds"]
    pipe.close()
    with pytest.raises(RuntimeError, match="closed"):
        embeds.sum().backward()


def test_a_second_backward_on_one_batch_accumulates_as_torch_grad_does(path):
    # Two backward passes through one batch, then one step: torch's accumulated .grad + one step.
    weight = embedpipe.Table.open(path).to_tensor()
    embedding = torch.nn.Embedding(V, D, _weight=weight.clone())
    reference = torch.optim.SGD(embedding.parameters(), lr=1.0)
    with EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0)) as pipe:
        batch = next(iter(pipe.loader(samples(2), batch_size=2)))
        embeds = batch["inputs_embeds"]
        (embeds**2).sum().backward(retain_graph=True)
        (3 * embeds).sum().backward()
        expected = embedding(batch["input_ids"])
        (expected**2).sum().backward(retain_graph=True)
        (3 * expected).sum().backward()
        ids = batch["input_ids"].unique()  # sorted, as the pending gradient's rows are
        assert torch.equal(pipe.parameter.grad, embedding.weight.grad[ids])
        assert pipe.step()
        reference.step()
    table = embedpipe.Table.open(path)
    assert table.step == 1
    assert torch.equal(table.to_tensor(), embedding.weight.detach())


def test_reading_embeds_under_no_grad_first_does_not_disable_training(path):
    with EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0)) as pipe:
        batch = next(iter(pipe.loader(samples(2), batch_size=2)))
        with torch.no_grad():
            batch["inputs_embeds"].norm()
        assert batch["inputs_embeds"].requires_grad


def test_non_finite_gradient_on_the_padding_row_is_ignored_as_nn_embedding_does(path):
    with EmbeddingPipe(
        path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0), padding_idx=7
    ) as pipe:
        batch = next(iter(pipe.loader(samples(2), batch_size=2)))
        embeds = batch["inputs_embeds"]  # every sample holds id 7
        poison = torch.where(batch["input_ids"][..., None] == 7, float("nan"), 1.0)
        (embeds * poison).sum().backward()
        assert pipe.step()  # no NonFiniteGradientError: the padding row has no gradient
    assert pipe.stats()["steps"] == 1
    assert torch.isfinite(embedpipe.Table.open(path).to_tensor()).all()


@pytest.mark.parametrize(
    "optimizer", [embedpipe.optim.Adam(lr=1e-3), embedpipe.optim.Adagrad(lr=1e-3)]
)
def test_float16_tables_update_in_float32(tmp_path, optimizer):
    embedpipe.Table.from_tensor(tmp_path / "h.zarr", np.zeros((10, 4), np.float16)).close()
    data = [{"input_ids": torch.tensor([1, 2])}]
    with EmbeddingPipe(tmp_path / "h.zarr", cache_rows=4, optimizer=optimizer) as pipe:
        for batch in pipe.loader(data * 3, batch_size=1):
            assert batch["inputs_embeds"].dtype == torch.float16
            (batch["inputs_embeds"].float() * torch.tensor([1e-3, 0, 1, -1])).sum().backward()
            pipe.step()
    table = embedpipe.Table.open(tmp_path / "h.zarr").to_tensor()
    assert torch.isfinite(table).all()  # eps 1e-8 and g^2 vanish in float16: NaN/inf before
    assert (table[1, 0] < 0) and (table[1, 3] > 0) and table[0].abs().sum() == 0


def test_unbatched_loading(path):
    with EmbeddingPipe(path, cache_rows=10) as pipe:
        batches = list(pipe.loader(samples(3), batch_size=None))
    assert batches[0]["inputs_embeds"].shape == (3, D)


# ----------------------------------------------------------------------------- interruptions
class _InterruptOncePut:
    """Stands for the writeback queue; its next put raises KeyboardInterrupt, as a Ctrl-C landing
    between the step count and the queue put would."""

    def __init__(self, queue) -> None:
        self.queue, self.armed = queue, True

    def put(self, item) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self.queue.put(item)

    def __getattr__(self, name):
        return getattr(self.queue, name)


@pytest.mark.timeout(60)
def test_a_signal_inside_submit_neither_hangs_nor_loses_the_pipe(path):
    pipe = EmbeddingPipe(path, owner="thread", cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0))
    writeback = getattr(pipe, "_owner", pipe).writeback
    batches = iter(pipe.loader(samples(10), batch_size=2))
    (-next(batches)["inputs_embeds"]).sum().backward()
    pipe.step()  # step 1
    writeback._queue = _InterruptOncePut(writeback._queue)
    (-next(batches)["inputs_embeds"]).sum().backward()
    with pytest.raises(KeyboardInterrupt):
        pipe.step()  # counted, never queued
    assert not pipe._owner.gradient.pending  # lost, as the warning will say: not applied later
    with pytest.warns(RuntimeWarning, match="interrupted before they were queued"):
        batch = next(batches)  # waits for the writeback: must notice, not hang
        embeds = batch["inputs_embeds"]
    (-embeds).sum().backward()
    pipe.step()
    for batch in batches:
        (-batch["inputs_embeds"]).sum().backward()
        pipe.step()
    pipe.close()
    assert embedpipe.Table.open(path).step == 4  # 5 steps taken, the interrupted one not counted


def _raise_at_line(function: str, source: str, after: int):
    """A trace function that raises inside ``function`` (of ``cache/sharedrows.py``) when it is
    about to run the line ``source``, on the ``after``-th time: what a debugger's trace function
    (or a signal handler) can do between any two lines."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            import linecache

            if linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() == source:
                seen[0] += 1
                if seen[0] == after:
                    raise RuntimeError(f"interrupted in {function}")
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(
            "cache/sharedrows.py"  # was rowcache.py, where these no longer are: it never raised
        ):
            return local
        return None

    return tracer


def _train_in_two_parts(path, data, split, tracer=None):
    """Train on data[:split] then data[split:] with 2 workers; with ``tracer`` set during the
    first part, the batch it interrupts is retried in the second part (as a user re-running the
    loop would)."""
    import sys

    with EmbeddingPipe(
        path, cache_rows=12, optimizer=embedpipe.optim.Adagrad(lr=0.5), owner="thread"
    ) as pipe:
        done = 0
        sys.settrace(tracer)
        try:
            for batch in pipe.loader(data[:split], batch_size=4, num_workers=2):
                (batch["inputs_embeds"] ** 2).sum().backward()
                pipe.step()
                done += 4
        except RuntimeError as e:
            assert "interrupted in" in str(e)
            interrupted = True
        else:
            interrupted = False
        finally:
            sys.settrace(None)
        for batch in pipe.loader(data[done:], batch_size=4, num_workers=2):
            (batch["inputs_embeds"] ** 2).sum().backward()
            pipe.step()
    return embedpipe.Table.open(path).to_tensor(), interrupted


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("function", "line"),
    [("put", "self.rows[slots] = rows"), ("clear", "self.slot_id[slots] = -1")],
)
def test_an_exception_inside_a_cache_change_leaves_training_exact(tmp_path, function, line):
    rng = np.random.default_rng(0)
    data = [{"input_ids": torch.from_numpy((rng.zipf(1.3, 6) - 1) % V)} for _ in range(160)]
    weight = np.arange(V * D, dtype=np.float32).reshape(V, D) / 100
    results = []
    for name, tracer in (("plain", None), ("cut", _raise_at_line(function, line, after=3))):
        embedpipe.Table.from_tensor(tmp_path / f"{name}.zarr", weight, chunk_rows=16).close()
        split = 40 if tracer is None else 160
        table, interrupted = _train_in_two_parts(tmp_path / f"{name}.zarr", data, split, tracer)
        assert interrupted == (tracer is not None)  # the cut run was cut
        results.append(table)
    assert torch.equal(results[0], results[1])


def test_a_close_while_another_tables_write_error_is_handled_leaves_its_message(path):
    """Found in a read-through: close() in an except took the error being handled for its
    own, and rewrote another table's write error to say where this table reopens."""
    said = "a step of table /elsewhere.zarr at step 3 failed: No space left on device"
    error = errors.TableWriteError(errno.ENOSPC, f"{said}; the table reopens at its last one")
    pipe = EmbeddingPipe(path, owner="thread", cache_rows=4, optimizer=embedpipe.optim.SGD(lr=1))
    try:
        raise error
    except errors.TableWriteError:
        pipe.close()
    assert error.strerror == f"{said}; the table reopens at its last one"


@pytest.mark.timeout(120)
def test_a_failed_state_write_inside_a_step_never_leaves_half_a_step(path, monkeypatch):
    from embedpipe.store import rowstore

    weight = embedpipe.Table.open(path).to_tensor().numpy()
    data = samples(16)
    batches = [torch.stack([s["input_ids"] for s in data[i : i + 2]]) for i in range(0, 16, 2)]
    write = rowstore.RawRows.write
    calls = []

    def state_write_fails_at_step_5(self, ids, rows):
        if self.root.endswith("sum"):
            calls.append(1)
            if len(calls) == 5:  # the weights of step 5 are written, its state is not
                raise OSError(errno.ENOSPC, "No space left on device", self.root)
        return write(self, ids, rows)

    monkeypatch.setattr(rowstore.RawRows, "write", state_write_fails_at_step_5)
    pipe = EmbeddingPipe(
        path, owner="thread", cache_rows=0, optimizer=embedpipe.optim.Adagrad(lr=0.5)
    )
    with pytest.raises(OSError, match=r"step 5.*No space left on device") as raised:
        with pipe:
            for batch in pipe.loader(data, batch_size=2):
                (batch["inputs_embeds"] ** 2).sum().backward()
                pipe.step()
    assert raised.value.errno == errno.ENOSPC
    assert "the table reopens at step 4" in str(raised.value)  # true when it is shown
    table = embedpipe.Table.open(path)
    expected, expected_sum = adagrad_reference(weight, batches, table.step)
    assert table.step == 4  # steps 1-4 committed, none of step 5
    assert torch.equal(table.to_tensor(), expected)
    assert torch.equal(torch.from_numpy(table.read(np.arange(V), "sum")), expected_sum)


@pytest.mark.timeout(60)
def test_close_gives_up_on_a_writeback_that_hangs(path):
    import threading

    release = threading.Event()

    @dataclass(frozen=True)
    class HangingSGD(embedpipe.optim.SGD):
        def update(self, rows, grad, state, step, lr=None):
            if step == 2:
                release.wait(30)  # a table write that never returns
            super().update(rows, grad, state, step, lr=lr)

    pipe = EmbeddingPipe(
        path,
        owner="thread",
        cache_rows=10,
        optimizer=HangingSGD(lr=1.0),
        consistency="bounded",
        max_staleness=5,
    )
    for batch in pipe.loader(samples(6), batch_size=2):
        (-batch["inputs_embeds"]).sum().backward()
        pipe.step()
    pipe._owner.writeback.stall_seconds = 0.5
    started = time.monotonic()
    with pytest.raises(WritebackError, match="applied nothing for"):
        pipe.close()
    assert time.monotonic() - started < 20
    release.set()
    pipe._owner.writeback._thread.join(10)
    assert embedpipe.Table.open(path).step == 0  # nothing half-written was committed


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_killed_at_random_points_raises_within_bounded_time(path):
    import psutil

    rng = np.random.default_rng(1)
    for _ in range(3):
        with EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1)) as pipe:
            loader = pipe.loader(samples(4000), batch_size=2, num_workers=2)
            others = {c.pid for c in psutil.Process().children()}  # e.g. a resource tracker
            killed_at, kill_at = None, int(rng.integers(5, 40))
            with pytest.raises(RuntimeError, match=r"worker \(pid \d+\)"):
                for k, batch in enumerate(loader):
                    (-batch["inputs_embeds"]).sum().backward()
                    pipe.step()
                    if k == kill_at:
                        workers = [c for c in psutil.Process().children() if c.pid not in others]
                        victim = workers[int(rng.integers(0, 2))]
                        os.kill(victim.pid, signal.SIGKILL)
                        killed_at = time.monotonic()
            assert killed_at is not None and time.monotonic() - killed_at < 30


def test_a_pipe_that_cannot_commit_leaves_the_last_checkpoint_as_it_was(path, monkeypatch):
    # A full disk at step 4's state write, and the undo of its weights fails too: the pipe is
    # broken. Closing it must not commit anything, under any step number.
    from embedpipe.store import rowstore

    weight = embedpipe.Table.open(path).to_tensor()
    write = rowstore.RawRows.write
    calls = []

    def full_from_step_4(self, ids, rows):
        calls.append(self.root)
        if len(calls) >= 8:  # weights and state of steps 1-3 written, then nothing fits
            raise OSError(errno.ENOSPC, "No space left on device", self.root)
        return write(self, ids, rows)

    monkeypatch.setattr(rowstore.RawRows, "write", full_from_step_4)
    pipe = EmbeddingPipe(
        path, owner="thread", cache_rows=0, optimizer=embedpipe.optim.Adagrad(lr=0.5)
    )
    with pytest.raises(OSError):
        for batch in pipe.loader(samples(20), batch_size=2):
            (batch["inputs_embeds"] ** 2).sum().backward()
            pipe.step()
    assert pipe._owner.cache.broken is not None
    with pytest.raises(OSError):
        pipe.close()
    monkeypatch.undo()
    table = embedpipe.Table.open(path)
    assert [c.step for c in table.checkpoints] == [0]
    assert torch.equal(table.to_tensor(), weight)
    embedpipe.Table.open(path, "r+").close()  # released


@pytest.mark.slow
@pytest.mark.parametrize("when", ["training", "starting"])
def test_a_killed_trainer_leaves_no_process_and_no_shared_memory(tmp_path, when):
    """kill -9 of a trainer whose workers have filled the result queue's pipe, or whose
    (spawned) workers are still starting: every process of the job (workers, foresight child)
    is gone within 10 s (NOTE [ Workers die with the training process ]), and with them every
    mapping of the cache and ring."""
    psutil = pytest.importorskip("psutil", reason="psutil lists the job's processes")
    embedpipe.Table.create(tmp_path / "t.zarr", 500, 8).close()
    mode = ["starting"] if when == "starting" else []
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.orphan_run", str(tmp_path / "t.zarr"), *mode],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("pids"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) >= 3, pids  # the trainer and its 2 workers at least
        if when == "training":  # the workers fill the queue while the trainer sleeps in its step
            time.sleep(2)
        else:  # both spawned workers are in worker_init_fn (torch's watch has not begun)
            marks = [tmp_path / f"t.zarr.started-{w}" for w in (0, 1)]
            deadline = time.monotonic() + 60
            while not all(m.exists() for m in marks) and time.monotonic() < deadline:
                time.sleep(0.05)
        os.kill(pids[0], signal.SIGKILL)
        process.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = pids[1:]
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if psutil.pid_exists(p) and _not_zombie(psutil, p)]
            time.sleep(0.1)
        assert not alive, f"processes of the killed job still alive after 10 s: {alive}"
    finally:
        for p in pids if "pids" in locals() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        process.stdout.close()


def _not_zombie(psutil, pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
def test_a_full_disk_while_writing_ahead_clears_once_space_is_freed(path, monkeypatch):
    """The writeback thread writes cold rows ahead of need when idle; a full disk there loses
    nothing and must not stick: once space is freed, checkpoint() and close() work and the
    table is nn.Embedding + Adagrad's (before: checkpoint() failed twice with the same error,
    and close() said the table reopens at step 0 after committing the last step)."""
    from embedpipe.store import rowstore

    weight = embedpipe.Table.open(path).to_tensor().numpy()
    data = samples(32)
    batches = [torch.stack([s["input_ids"] for s in data[i : i + 2]]) for i in range(0, 32, 2)]
    write, full, failed = rowstore.RawRows.write, [False], []

    def full_while_asked(self, ids, rows):
        if full[0]:
            failed.append(len(ids))
            raise OSError(errno.ENOSPC, "No space left on device", self.root)
        return write(self, ids, rows)

    monkeypatch.setattr(rowstore.RawRows, "write", full_while_asked)
    with EmbeddingPipe(
        path, owner="thread", cache_rows=12, optimizer=embedpipe.optim.Adagrad(lr=0.5)
    ) as pipe:
        with pytest.warns(RuntimeWarning, match="ahead of need failed"):
            for n, batch in enumerate(pipe.loader(data, batch_size=2)):
                (batch["inputs_embeds"] ** 2).sum().backward()
                full[0] = 6 <= n < 10  # the disk is full while these steps are applied
                pipe.step()
                deadline = time.monotonic() + 5
                while full[0] and not failed and time.monotonic() < deadline:
                    time.sleep(0.01)  # the thread, idle after the step, tries to write ahead
                pipe._owner.writeback.wait()
                full[0] = False
        assert failed  # a write ahead did fail
        pipe.checkpoint()
    table = embedpipe.Table.open(path)
    expected, expected_sum = adagrad_reference(weight, batches, 16)
    assert table.step == 16
    assert torch.equal(table.to_tensor(), expected)
    assert torch.equal(torch.from_numpy(table.read(np.arange(V), "sum")), expected_sum)
