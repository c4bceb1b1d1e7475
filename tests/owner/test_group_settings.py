"""The settings of the torch optimizer group that steps the table (NOTE [ A group's settings the
table cannot take ] in embedpipe/owner/groupsettings.py): exact, or raised before any step."""

from __future__ import annotations

import pytest
import torch

import embedpipe

from ..pipe.test_patterns import Toy, loss, samples

ROW = {
    "sgd": lambda: embedpipe.optim.SGD(lr=0.1),
    "adagrad": lambda: embedpipe.optim.Adagrad(lr=0.1),
    "adam": lambda: embedpipe.optim.Adam(lr=0.1),
}
REFUSED = {  # row optimizer, torch optimizer over (dense, table), the setting named
    "sgd-momentum": ("sgd", lambda d, t: torch.optim.SGD(d + t, lr=0.1, momentum=0.9), "momentum"),
    "sgd-weight-decay": ("sgd", lambda d, t: torch.optim.SGD(d + t, lr=0.1, weight_decay=0.01), "weight_decay"),
    "adagrad-weight-decay": ("adagrad", lambda d, t: torch.optim.Adagrad(d + t, lr=0.1, weight_decay=0.01), "weight_decay"),
    "adagrad-eps": ("adagrad", lambda d, t: torch.optim.Adagrad(d + t, lr=0.1, eps=1e-8), "eps"),
    "adagrad-lr-decay": ("adagrad", lambda d, t: torch.optim.Adagrad(d + t, lr=0.1, lr_decay=0.1), "lr_decay"),
    "sparse-adam-betas": ("adam", lambda d, t: torch.optim.SparseAdam(t, lr=0.1, betas=(0.8, 0.99)), "betas"),
}  # fmt: skip


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_setting_the_table_cannot_take_raises_before_anything_steps(tmp_path, case, owner):
    """Found by a probe: SGD with momentum or weight decay, Adagrad with weight decay, trained the
    dense weights with them and the table without, silently (5e-5 to 7e-3 from nn.Embedding)."""
    row, build, setting = REFUSED[case]
    model = Toy()
    table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    with (
        table,
        embedpipe.EmbeddingPipe(table, cache_rows=20, optimizer=ROW[row](), owner=owner) as pipe,
    ):
        dense = [] if row == "adam" else list(model.lin.parameters())
        optimizer = build(dense, [pipe.parameter])
        before = [p.detach().clone() for p in model.lin.parameters()]
        batch = next(iter(pipe.loader(samples(16), batch_size=4)))
        loss(model, batch, True).backward()
        with pytest.raises(ValueError, match=f"has {setting}="):
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
