"""Parity of embedpipe.optim with torch's optimizers on nn.Embedding, and hyperparameter checks.

Each test trains two copies of one table on the same batches of duplicated (Zipf-like) ids:

- the reference: ``nn.Embedding`` stepped by ``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam``;
- embedpipe's way: a plain tensor table, a leaf of the batch's unique rows, the gradient summed
  per id by the dense backward of ``F.embedding(inverse, leaf)``, ``opt.update`` on the gathered
  rows and state, and a scatter back.

With ``lookup="unique"`` the reference looks up ``unique_ids`` through its sparse embedding and
expands with ``inverse``, so torch's optimizer sees the same per-id gradient: everything is
bitwise equal. With ``lookup="ids"`` it looks up the raw ids, and torch sums the duplicates in
another order (see the module docstring of embedpipe.optim): equal to rounding only.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from embedpipe import optim

V, D, B, L = 200, 16, 8, 16
STEPS = 30

# (ours, reference factory); large learning rates so that any difference in the op order shows.
CASES = {
    "sgd": (optim.SGD(lr=0.5), lambda p: torch.optim.SGD(p, lr=0.5)),
    "adagrad": (optim.Adagrad(lr=0.5), lambda p: torch.optim.Adagrad(p, lr=0.5)),
    "adagrad-decay": (
        optim.Adagrad(lr=0.5, lr_decay=0.1, initial_accumulator_value=0.3, eps=1e-3),
        lambda p: torch.optim.Adagrad(
            p, lr=0.5, lr_decay=0.1, initial_accumulator_value=0.3, eps=1e-3
        ),
    ),
    "adam": (optim.Adam(lr=0.1), lambda p: torch.optim.SparseAdam(p, lr=0.1)),
    "adam-betas": (
        optim.Adam(lr=0.1, betas=(0.5, 0.9), eps=1e-3),
        lambda p: torch.optim.SparseAdam(p, lr=0.1, betas=(0.5, 0.9), eps=1e-3),
    ),
}

# torch.optim.Adagrad builds sparse tensors without opting in or out of invariant checks.
pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")


def batch_loss(out, keep, head, targets, w):
    """A loss nonlinear in out (B, L, D): a linear head + cross entropy, plus a random linear term."""
    out = out * keep[..., None]  # ids whose gradient must be zero
    logits = (out @ head).flatten(0, 1)  # (B * L, 10)
    return F.cross_entropy(logits, targets.flatten(), reduction="sum") + (out * w).sum()


@dataclass
class Run:
    start: torch.Tensor  # (V, D) the table before training
    table: torch.Tensor  # (V, D) embedpipe's table after training
    state: dict[str, torch.Tensor]  # name -> (V, D)
    ref_weight: torch.Tensor  # (V, D) the reference embedding's weight after training
    ref_state: dict  # torch's optimizer state for that weight


def train(
    name, *, lookup="unique", sparse=True, dtype=torch.float32, steps=STEPS, zero_grad_ids=()
) -> Run:
    """Train both copies for ``steps`` steps on the same batches.

    Ids in ``zero_grad_ids`` are in every batch but get an all-zero gradient from step 2 on.
    """
    opt, make_reference = CASES[name]
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, D, generator=g, dtype=dtype)
    head = torch.randn(D, 10, generator=g, dtype=dtype) / 4
    emb = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=sparse)
    reference = make_reference(emb.parameters())
    table = weight.clone()
    state = {k: torch.full((V, D), v, dtype=dtype) for k, v in opt.state_init().items()}
    zero_grad_ids = torch.tensor(zero_grad_ids, dtype=torch.long)

    for step in range(1, steps + 1):
        ids = (torch.rand(B, L, generator=g) ** 3 * V).long()  # id 0 is ~17% of the batch
        ids[0, : len(zero_grad_ids)] = zero_grad_ids
        targets = torch.randint(0, 10, (B, L), generator=g)
        w = torch.randn(B, L, D, generator=g, dtype=dtype)
        keep = ~torch.isin(ids, zero_grad_ids) if step > 1 else torch.ones_like(ids, dtype=bool)
        loss_of = functools.partial(batch_loss, keep=keep, head=head, targets=targets, w=w)

        unique_ids, inverse = torch.unique(ids, return_inverse=True)
        reference.zero_grad()
        out = F.embedding(inverse, emb(unique_ids)) if lookup == "unique" else emb(ids)
        loss_of(out).backward()
        reference.step()

        leaf = table[unique_ids].clone().requires_grad_()  # (U, D)
        loss_of(F.embedding(inverse, leaf)).backward()
        rows = leaf.detach().clone()
        state_rows = {k: s[unique_ids] for k, s in state.items()}
        opt.update(rows, leaf.grad, state_rows, step)
        table[unique_ids] = rows
        for k, s in state.items():
            s[unique_ids] = state_rows[k]
    ref_state = reference.state[emb.weight]
    return Run(weight, table, state, emb.weight.detach(), ref_state)


#: Which torch path each case matches bit for bit: SparseAdam needs a sparse gradient, embedpipe's
#: Adagrad repeats the dense single-tensor branch (fused addcmul_/addcdiv_).
SPARSE_REFERENCE = {
    "sgd": False,
    "adagrad": False,
    "adagrad-decay": False,
    "adam": True,
    "adam-betas": True,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_bitwise_parity_given_the_same_per_id_gradient(name, dtype):
    run = train(name, dtype=dtype, sparse=SPARSE_REFERENCE[name])
    assert not torch.equal(run.table, run.start)
    assert torch.equal(run.table, run.ref_weight)
    assert set(run.state) == set(run.ref_state) - {"step"}  # torch's state names are ours
    for k, s in run.state.items():
        assert torch.equal(s, run.ref_state[k]), k
    if run.state:  # SGD keeps none
        assert int(run.ref_state["step"]) == STEPS  # one counter for the whole table, not per row


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adagrad-decay"])
def test_bitwise_with_a_dense_embedding_looked_up_with_duplicate_ids(name):
    # nn.Embedding's dense backward sums repeated ids in occurrence order, as embedpipe's does.
    run = train(name, lookup="ids", sparse=False)
    assert torch.equal(run.table, run.ref_weight)
    for k, s in run.state.items():
        assert torch.equal(s, run.ref_state[k]), k


@pytest.mark.parametrize("name", list(CASES))
def test_parity_with_sparse_duplicate_lookups_is_within_rounding(name):
    # Torch sums duplicate ids of a sparse gradient in another order (SGD: one add per
    # occurrence). Measured max abs diff of the tables over 30 steps: 1.9e-5 sgd, about 5e-7
    # adagrad and adam, on rows up to ~13; state (values up to ~1e3) within 2e-4.
    run = train(name, lookup="ids")
    torch.testing.assert_close(run.table, run.ref_weight, rtol=1e-5, atol=1e-4)
    for k, s in run.state.items():
        torch.testing.assert_close(s, run.ref_state[k], rtol=1e-5, atol=1e-4)


ZERO_GRAD_IDS = (0, 3, 150)


def test_adam_decays_the_moments_of_rows_present_with_a_zero_gradient():
    run = train("adam", zero_grad_ids=ZERO_GRAD_IDS)
    assert torch.equal(run.table, run.ref_weight)
    assert torch.equal(run.state["exp_avg"], run.ref_state["exp_avg"])
    # Their only gradient came at step 1, yet every later step decayed exp_avg and moved them.
    first = train("adam", zero_grad_ids=ZERO_GRAD_IDS, steps=1)
    idx = torch.tensor(ZERO_GRAD_IDS)
    beta1 = optim.Adam().betas[0]
    torch.testing.assert_close(
        run.state["exp_avg"][idx], first.state["exp_avg"][idx] * beta1 ** (STEPS - 1)
    )
    assert (run.table[idx] != first.table[idx]).all()


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_rows_present_with_a_zero_gradient_stay_put_under_sgd_and_adagrad(name):
    run = train(name, zero_grad_ids=ZERO_GRAD_IDS, sparse=False)
    assert torch.equal(run.table, run.ref_weight)
    idx = torch.tensor(ZERO_GRAD_IDS)
    assert torch.equal(run.table[idx], train(name, zero_grad_ids=ZERO_GRAD_IDS, steps=1).table[idx])


@pytest.mark.parametrize("name", list(CASES))
def test_config_round_trips_through_json(name):
    opt = CASES[name][0]
    config = json.loads(json.dumps(opt.config()))
    assert config == opt.config()
    assert config["name"] == opt.name
    assert optim.from_config(config) == opt


def test_defaults_are_torchs():
    p = [torch.zeros(2, 2, requires_grad=True)]
    adagrad = torch.optim.Adagrad(p).defaults
    assert optim.Adagrad().config() == {
        "name": "adagrad",
        **{k: adagrad[k] for k in ("lr", "lr_decay", "initial_accumulator_value", "eps")},
    }
    adam = torch.optim.SparseAdam(p).defaults
    assert optim.Adam() == optim.Adam(lr=adam["lr"], betas=adam["betas"], eps=adam["eps"])
    assert optim.SGD(lr=0.1).config() == {"name": "sgd", "lr": 0.1}
    assert optim.SGD(0.1).state_init() == {}
    assert optim.Adagrad(initial_accumulator_value=0.5).state_init() == {"sum": 0.5}
    assert list(optim.Adam().state_init()) == ["exp_avg", "exp_avg_sq"]


def test_frozen():
    with pytest.raises(AttributeError):
        optim.SGD(lr=0.1).lr = 0.2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("make", "shown"),
    [
        (lambda: optim.SGD(lr=-0.1), "-0.1"),
        (lambda: optim.SGD(lr=float("nan")), "nan"),
        (lambda: optim.SGD(lr=float("inf")), "inf"),
        (lambda: optim.Adagrad(lr=-1.0), "-1.0"),
        (lambda: optim.Adagrad(lr_decay=-0.5), "-0.5"),
        (lambda: optim.Adagrad(initial_accumulator_value=-2.0), "-2.0"),
        (lambda: optim.Adagrad(eps=0.0), "0.0"),
        (lambda: optim.Adam(lr=-3.0), "-3.0"),
        (lambda: optim.Adam(betas=(1.0, 0.999)), "1.0"),
        (lambda: optim.Adam(betas=(0.9, -0.25)), "-0.25"),
        (lambda: optim.Adam(betas=(0.9,)), "(0.9,)"),
        (lambda: optim.Adam(eps=-1e-8), "-1e-08"),
    ],
)
def test_bad_hyperparameters_name_the_value_and_the_range(make, shown):
    with pytest.raises(ValueError, match="must be") as excinfo:
        make()
    assert shown in str(excinfo.value)


def test_from_config_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="'rmsprop'"):
        optim.from_config({"name": "rmsprop", "lr": 0.1})
    with pytest.raises(ValueError, match="momentum"):
        optim.from_config({"name": "sgd", "lr": 0.1, "momentum": 0.9})
