"""The table's gradient as a Parameter: accumulated as .grad, taken by any optimizer's step at
the right learning rate, dropped by zero_grad, and loud where a pattern cannot be exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe import EmbeddingPipe

from ..helpers import adagrad_reference, small_samples, small_table

# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.

LR = 0.5


def pipe_on(tmp_path, **options) -> EmbeddingPipe:
    return EmbeddingPipe(
        small_table(tmp_path), cache_rows=10, optimizer=embedpipe.optim.Adagrad(lr=LR), **options
    )


def squares(batch) -> torch.Tensor:
    return (batch["inputs_embeds"] ** 2).sum()


def test_backward_passes_accumulate_like_grad_then_one_step(tmp_path):
    data = small_samples(6)
    with pipe_on(tmp_path) as pipe:
        batches = list(pipe.loader(data, batch_size=2))
        for batch in batches:
            squares(batch).backward()
        assert pipe.stats()["steps"] == 0  # backward alone steps nothing
        ids = sorted({int(i) for s in data for i in s["input_ids"]})
        assert pipe.parameter.grad.shape == (len(ids), 4)
        assert pipe.step()
    weight = np.arange(400, dtype=np.float32).reshape(100, 4) / 100
    embedding = torch.nn.Embedding(100, 4, _weight=torch.from_numpy(weight.copy()))
    optimizer = torch.optim.Adagrad(embedding.parameters(), lr=LR)
    for batch in batches:
        (embedding(batch["input_ids"]) ** 2).sum().backward()  # .grad sums the three
    optimizer.step()
    table = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.equal(table, embedding.weight.detach())


def test_a_second_backward_through_one_batch_accumulates_as_torch_does(tmp_path):
    data = small_samples(2)
    with pipe_on(tmp_path) as pipe:
        batch = next(iter(pipe.loader(data, batch_size=2)))
        loss = squares(batch)
        loss.backward(retain_graph=True)
        loss.backward()
        pipe.step()
    weight = np.arange(400, dtype=np.float32).reshape(100, 4) / 100
    expected, _ = adagrad_reference(weight, [batch["input_ids"], batch["input_ids"]], 2, lr=LR)
    twice = torch.nn.Embedding(100, 4, _weight=torch.from_numpy(weight.copy()))
    optimizer = torch.optim.Adagrad(twice.parameters(), lr=LR)
    loss = (twice(batch["input_ids"]) ** 2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    optimizer.step()
    assert torch.equal(embedpipe.Table.open(tmp_path / "t.zarr").to_tensor(), twice.weight.detach())
    assert not torch.equal(twice.weight.detach(), expected)  # two steps would differ


def test_a_scheduler_on_a_shared_group_scales_the_tables_rate(tmp_path):
    data = small_samples(2)
    with pipe_on(tmp_path, owner="thread") as pipe:
        dense = torch.nn.Parameter(torch.zeros(3))
        optimizer = torch.optim.SGD([dense, pipe.parameter], lr=0.1)
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.25)
        seen = []
        pipe._owner.writeback._apply = lambda ids, grad, step, lr, f=pipe._owner.apply: (
            seen.append(lr),
            f(ids, grad, step, lr),
        )
        squares(next(iter(pipe.loader(data, batch_size=2)))).backward()
        optimizer.step()
        pipe.flush()
    assert seen == [pytest.approx(LR * 0.25)]


def test_a_group_of_its_own_sets_the_tables_rate(tmp_path):
    with pipe_on(tmp_path) as pipe:
        optimizer = torch.optim.SGD([{"params": [pipe.parameter], "lr": 0.0}], lr=1.0)
        squares(next(iter(pipe.loader(small_samples(2), batch_size=2)))).backward()
        optimizer.step()
        pipe.flush()
        assert pipe.stats()["steps"] == 1
    table = embedpipe.Table.open(tmp_path / "t.zarr")
    assert torch.equal(table.to_tensor(), torch.arange(400.0).reshape(100, 4) / 100)  # lr 0


def test_an_optimizer_without_the_table_stepped_first_leaves_it_to_the_one_with_it(tmp_path):
    with pipe_on(tmp_path) as pipe:
        other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        holder = torch.optim.SGD([pipe.parameter], lr=0.1)
        loader = pipe.loader(small_samples(4), batch_size=2)
        squares(next(iter(loader))).backward()
        other.step()  # does not hold the table: takes nothing
        assert pipe.parameter.grad is not None
        holder.step()
        other.step()  # takes nothing either after the holder's step
        pipe.flush()
        assert pipe.stats()["steps"] == 1 and pipe.parameter.grad is not None  # as torch's
        holder.zero_grad()
        assert pipe.parameter.grad is None


def test_a_closure_step_takes_the_gradient_the_closure_made(tmp_path):
    with pipe_on(tmp_path) as pipe:
        optimizer = torch.optim.SGD([pipe.parameter], lr=LR)
        batch = next(iter(pipe.loader(small_samples(2), batch_size=2)))

        def closure():
            loss = squares(batch)
            loss.backward()
            return loss

        optimizer.step(closure)
        pipe.flush()
        assert pipe.stats()["steps"] == 1

        class Twice(torch.optim.SGD):  # a line search: the closure runs more than once
            def step(self, closure=None):
                closure()
                return closure()

        twice = Twice([pipe.parameter], lr=LR)
        twice.load_state_dict(optimizer.state_dict())  # (a new one would raise, unloaded)
        with pytest.raises(RuntimeError, match="called its closure twice"):
            twice.step(closure)
        with pytest.raises(RuntimeError, match="LBFGS"):
            torch.optim.LBFGS([pipe.parameter]).step(closure)


@pytest.mark.slow
def test_gradients_that_pile_up_with_no_step_warn_and_close_drops_them(tmp_path):
    pipe = pipe_on(tmp_path)
    loader = pipe.loader(small_samples(2), batch_size=2)
    with pytest.warns(RuntimeWarning, match="no optimizer has stepped"):
        for _ in range(embedpipe.owner.gradient.PILE_UP_WARNING):
            squares(next(iter(loader))).backward()
    with pytest.warns(RuntimeWarning, match="never taken by an optimizer step"):
        pipe.close()
    assert embedpipe.Table.open(tmp_path / "t.zarr").step == 0


def test_a_non_finite_gradient_is_refused_at_the_step_and_nothing_is_applied(tmp_path):
    with pipe_on(tmp_path) as pipe:
        optimizer = torch.optim.SGD([pipe.parameter], lr=LR)
        batch = next(iter(pipe.loader(small_samples(2), batch_size=2)))
        (batch["inputs_embeds"].sum() * float("inf")).backward()
        with pytest.raises(embedpipe.errors.NonFiniteGradientError, match="id 0"):
            optimizer.step()
        assert pipe.stats()["steps"] == 0
        optimizer.zero_grad()
    assert embedpipe.Table.open(tmp_path / "t.zarr").step == 0


def test_reads_of_the_table_under_a_live_pipe_see_its_steps(tmp_path):
    embedpipe.Table.create(tmp_path / "z.zarr", 50, 4, init="zeros").close()
    with EmbeddingPipe(
        tmp_path / "z.zarr", cache_rows=50, optimizer=embedpipe.optim.SGD(lr=1.0)
    ) as pipe:
        batch = next(iter(pipe.loader([{"input_ids": torch.tensor([3, 4])}], batch_size=1)))
        batch["inputs_embeds"].sum().backward()
        pipe.step()  # queued; the rows are in the cache, not yet in the files
        assert pipe.table.read([3]).tolist() == [[-1.0] * 4]
        assert pipe.table.to_tensor()[4].tolist() == [-1.0] * 4


def test_lookups_in_the_training_process_do_not_flush_the_pipe(tmp_path, monkeypatch):
    # num_workers=0 reads misses through the owner's own Table: not through its flushing read()
    embedpipe.Table.create(tmp_path / "z.zarr", 500, 4).close()
    with EmbeddingPipe(
        tmp_path / "z.zarr", cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1.0)
    ) as pipe:
        flushes = []
        monkeypatch.setattr(pipe._owner, "flush", lambda: flushes.append(1))
        data = [{"input_ids": torch.tensor([i, i + 100])} for i in range(8)]
        for batch in pipe.loader(data, batch_size=1):
            batch["inputs_embeds"].sum().backward()
            pipe.step()
        assert pipe.stats()["misses"] > 0 and flushes == []


def test_an_optimizer_built_after_offload_and_before_the_pipe_holds_the_table(tmp_path):
    from ..frameworks import bert

    model = bert()
    table = embedpipe.hf.offload(model, tmp_path / "m.zarr")
    optimizer = torch.optim.AdamW(model.parameters())  # the order the old docs taught
    with table, EmbeddingPipe(table, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1)) as pipe:
        assert any(p is pipe.parameter for g in optimizer.param_groups for p in g["params"])
        assert any(p is pipe.parameter for p in model.parameters())


def test_zero_grad_without_set_to_none_drops_rows_as_a_sparse_gradient_does(tmp_path):
    # SparseAdam decays the moments of every row present in the gradient; a sparse gradient
    # zeroed in place has no rows left, so zeroed rows must not be stepped.
    weight = np.arange(400, dtype=np.float32).reshape(100, 4) / 100
    reference = torch.nn.Embedding(100, 4, sparse=True, _weight=torch.from_numpy(weight.copy()))
    torch_adam = torch.optim.SparseAdam(reference.parameters(), lr=0.1)
    first, second = torch.tensor([[1, 2]]), torch.tensor([[3, 4]])
    with EmbeddingPipe(
        small_table(tmp_path), cache_rows=10, optimizer=embedpipe.optim.Adam(lr=0.1)
    ) as pipe:
        holder = torch.optim.SGD([pipe.parameter], lr=0.1)
        loader = iter(
            pipe.loader([{"input_ids": first[0]}, {"input_ids": second[0]}], batch_size=1)
        )
        for ids, optimizer in ((first, torch_adam), (second, torch_adam)):
            (reference(ids) ** 2).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        for batch in loader:
            squares(batch).backward()
            holder.step()
            holder.zero_grad(set_to_none=False)
        squares(next(iter(pipe.loader([{"input_ids": second[0]}], batch_size=1)))).backward()
        holder.zero_grad(set_to_none=False)  # zeroed, then stepped: no row moves
        torch_adam.step()
        holder.step()
    table = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.allclose(table, reference.weight.detach(), rtol=0, atol=1e-6)
