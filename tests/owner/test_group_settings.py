"""The settings of the torch optimizer group that steps the table (NOTE [ A group's settings the
table cannot take ] in embedpipe/owner/groupsettings.py): exact, or raised before any step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import embedpipe

from ..pipe.test_patterns import Toy, loss, samples

ROOT = Path(__file__).resolve().parents[2]

ROW = {
    "sgd": lambda: embedpipe.optim.SGD(lr=0.1),
    "adagrad": lambda: embedpipe.optim.Adagrad(lr=0.1),
}


def one_cycle_sgd(dense, table):
    """SGD without momentum for the table's group; OneCycleLR cycles every group's."""
    sgd = torch.optim.SGD([{"params": dense}, {"params": table, "momentum": 0.0}], lr=0.1)
    torch.optim.lr_scheduler.OneCycleLR(sgd, max_lr=0.1, total_steps=10)
    return sgd


REFUSED = {  # row optimizer, torch optimizer over (dense, table), what the message says
    "sgd-momentum": ("sgd", lambda d, t: torch.optim.SGD(d + t, lr=0.1, momentum=0.9), "momentum=0.9"),
    "sgd-weight-decay": ("sgd", lambda d, t: torch.optim.SGD(d + t, lr=0.1, weight_decay=0.01), "weight_decay=0.01"),
    "adagrad-weight-decay": ("adagrad", lambda d, t: torch.optim.Adagrad(d + t, lr=0.1, weight_decay=0.01), "weight_decay=0.01"),
    "sgd-one-cycle": ("sgd", one_cycle_sgd, "momentum=0.95.*cycle_momentum=False"),
}  # fmt: skip


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_setting_the_table_cannot_take_raises_before_anything_steps(tmp_path, case, owner):
    """Found by a probe: SGD with momentum or weight decay, Adagrad with weight decay, trained the
    dense weights with them and the table without, silently (5e-5 to 7e-3 from nn.Embedding)."""
    row, build, message = REFUSED[case]
    model = Toy()
    table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    with (
        table,
        embedpipe.EmbeddingPipe(table, cache_rows=20, optimizer=ROW[row](), owner=owner) as pipe,
    ):
        optimizer = build(list(model.lin.parameters()), [pipe.parameter])
        before = [p.detach().clone() for p in model.lin.parameters()]
        batch = next(iter(pipe.loader(samples(16), batch_size=4)))
        loss(model, batch, True).backward()
        with pytest.raises(ValueError, match=f"has {message}"):
            optimizer.step()
        assert all(torch.equal(b, p) for b, p in zip(before, model.lin.parameters(), strict=True))
        assert pipe.parameter.grad is not None  # still pending: nothing of the step was taken
        pipe.parameter.grad = None
    assert embedpipe.Table.open(tmp_path / "t.zarr").step == 0


def test_a_group_of_its_own_without_them_trains_as_nn_embedding_in_that_group(tmp_path):
    """SGD with momentum and weight decay for the dense weights, and the table in a group with
    neither: bit for bit nn.Embedding in the same group of the same optimizer. An AdamW shared
    with the table (another kind than the row optimizer: the program's choice) raises nothing."""

    def sgd(dense, embedding):
        return torch.optim.SGD(
            [{"params": dense}, {"params": embedding, "momentum": 0.0, "weight_decay": 0.0}],
            lr=0.1, momentum=0.9, weight_decay=0.01,
        )  # fmt: skip

    reference = Toy()
    ref_opt = sgd(list(reference.lin.parameters()), [reference.emb.weight])
    for batch in torch.utils.data.DataLoader(samples(16), batch_size=4):
        loss(reference, batch, False).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = Toy()
    table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    with table, embedpipe.EmbeddingPipe(table, cache_rows=20, optimizer=ROW["sgd"]()) as pipe:
        optimizer = sgd(list(model.lin.parameters()), [pipe.parameter])
        for batch in pipe.loader(samples(16), batch_size=4, num_workers=2):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
    trained = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.equal(trained, reference.emb.weight.detach())
    assert torch.equal(model.lin.weight, reference.lin.weight)
    model = Toy()
    table = embedpipe.hf.offload(model, tmp_path / "u.zarr", chunk_rows=16)
    with table, embedpipe.EmbeddingPipe(table, cache_rows=20, optimizer=ROW["adagrad"]()) as pipe:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
        loss(model, next(iter(pipe.loader(samples(16), batch_size=4))), True).backward()
        optimizer.step()


def test_the_row_optimizers_own_settings_are_the_tables_whatever_the_groups(tmp_path):
    """eps, betas, lr_decay, initial_accumulator_value: the row optimizer has them, so the table
    takes the row optimizer's, as documented (review: torch's Adagrad reads its initial
    accumulator from its constructor, not the group, and a scheduler may cycle betas)."""
    model = Toy()
    table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    row = embedpipe.optim.Adagrad(lr=0.1, initial_accumulator_value=0.1)
    with table, embedpipe.EmbeddingPipe(table, cache_rows=20, optimizer=row) as pipe:
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, eps=1e-8, lr_decay=0.01)
        loss(model, next(iter(pipe.loader(samples(16), batch_size=4))), True).backward()
        optimizer.step()
    assert embedpipe.Table.open(tmp_path / "t.zarr").step == 1


ZERO = """
import sys, torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
import embedpipe
from tests.pipe.test_patterns import Toy, loss, samples
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}/store", rank=0, world_size=1)
model = Toy()
table = embedpipe.hf.offload(model, sys.argv[1] + "/t.zarr", chunk_rows=16)
with table, embedpipe.EmbeddingPipe(table, cache_rows=20, optimizer=embedpipe.optim.SGD(lr=0.1)) as pipe:
    optimizer = ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
    )
    loss(model, next(iter(pipe.loader(samples(16), batch_size=4))), True).backward()
    try:
        optimizer.step()
    except ValueError as e:
        print(e)
    pipe.parameter.grad = None
dist.destroy_process_group()
"""


def test_a_zero_redundancy_optimizer_is_checked_by_the_optimizer_it_wraps(tmp_path):
    """Found by review: ZeroRedundancyOptimizer's own step takes the table's gradient, and it is
    no SGD, so its SGD's momentum trained the dense weights only (8.7e-3 apart), silently."""
    out = subprocess.run(
        [sys.executable, "-c", ZERO, str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "ZeroRedundancyOptimizer group that steps the embedding table has momentum=0.9" in (
        out.stdout
    ), out.stdout + out.stderr
