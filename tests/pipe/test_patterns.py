"""Patterns users write around the loop, each exact against nn.Embedding or loud.

A toy model (mean of tanh(embeddings), then a linear layer) keeps these fast; the framework
tests train a real BERT.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import embedpipe
from embedpipe.errors import TableOwnedError
from embedpipe.owner.freshstate import STEPPED
from embedpipe.owner.gradient import BUILT_LR

V, D = 60, 8
# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.

ADAGRAD = dict(lr=0.05, initial_accumulator_value=0.1)


class Toy(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, 2)

    def get_input_embeddings(self):
        return self.emb

    def set_input_embeddings(self, module):
        self.emb = module

    def forward(self, input_ids=None, inputs_embeds=None):
        x = self.emb(input_ids) if inputs_embeds is None else inputs_embeds
        return self.lin(torch.tanh(x).mean(1))


def samples(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(1.3, (n, 6)), V - 1).astype(np.int64)
    return [
        {"input_ids": torch.from_numpy(i), "labels": torch.tensor(k % 2)} for k, i in enumerate(ids)
    ]


def loss(model, batch, offloaded: bool) -> torch.Tensor:
    x = (
        {"inputs_embeds": batch["inputs_embeds"]}
        if offloaded
        else {"input_ids": batch["input_ids"]}
    )
    return nn.functional.cross_entropy(model(**x), batch["labels"])


def reference_optimizer(model):
    dense = torch.optim.AdamW(model.lin.parameters(), lr=1e-2)
    adagrad = torch.optim.Adagrad([model.emb.weight], **ADAGRAD)
    return dense, adagrad


def step_both(dense, adagrad) -> None:
    """The reference's step: its dense optimizer and torch Adagrad on the embedding."""
    for optimizer in (dense, adagrad):
        optimizer.step()
        optimizer.zero_grad()


def one_optimizer(model, pipe) -> torch.optim.Optimizer:
    """AdamW on the dense weights, with the table's parameter in a group at Adagrad's rate."""
    return torch.optim.AdamW(
        [{"params": model.lin.parameters()}, {"params": [pipe.parameter], "lr": ADAGRAD["lr"]}],
        lr=1e-2,
    )


def offloaded(tmp_path, model, name="t.zarr", **options):
    table = embedpipe.hf.offload(model, tmp_path / name, chunk_rows=16)
    return embedpipe.EmbeddingPipe(
        table, cache_rows=20, optimizer=embedpipe.optim.Adagrad(**ADAGRAD), **options
    )


def offloaded_table(tmp_path, name="t.zarr"):
    """A training pipe on the table already at ``tmp_path / name``."""
    return embedpipe.EmbeddingPipe(
        str(tmp_path / name),
        cache_rows=20,
        optimizer=embedpipe.optim.Adagrad(**ADAGRAD),
    )


def table(pipe) -> torch.Tensor:
    return pipe.table.to_tensor()


def freeze_the_weight(model) -> None:
    model.emb.weight.requires_grad = False


def freeze_the_module(model) -> None:
    for parameter in model.get_input_embeddings().parameters():
        parameter.requires_grad = False


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (freeze_the_weight, None),  # frozen first (fine-tuning), offloaded later: stays frozen
        (freeze_the_module, None),
        (None, freeze_the_module),  # after offload, before the pipe: the parameter offload made
        (None, "pipe"),  # after the pipe, as one freezes an nn.Embedding
    ],
    ids=["weight-then-offload", "module-then-offload", "offload-then-module", "pipe-then-module"],
)
def test_frozen_word_embeddings_stay_frozen_and_the_rest_trains_as_with_nn_embedding(
    tmp_path, before, after
):
    reference = Toy()
    reference.emb.requires_grad_(False)
    dense = torch.optim.AdamW(reference.lin.parameters(), lr=1e-2)
    for batch in torch.utils.data.DataLoader(samples(8), batch_size=4):
        loss(reference, batch, False).backward()
        dense.step()
        dense.zero_grad()

    model = Toy()
    before and before(model)
    table_ = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    after not in (None, "pipe") and after(model)
    with embedpipe.EmbeddingPipe(
        table_, cache_rows=20, optimizer=embedpipe.optim.Adagrad(**ADAGRAD)
    ) as pipe:
        if after == "pipe":
            model.get_input_embeddings().requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for batch in pipe.loader(samples(8), batch_size=4):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(table(pipe), reference.emb.weight)
    assert torch.equal(model.lin.weight, reference.lin.weight)


def test_a_batch_held_across_load_checkpoint_gets_the_loaded_rows(tmp_path):
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        held = next(iter(pipe.loader(samples(4), batch_size=4)))
        for k, batch in enumerate(pipe.loader(samples(24), batch_size=4)):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
            if k == 1:
                pipe.save_checkpoint(tmp_path / "snap")
        with torch.no_grad():
            held["inputs_embeds"]  # made final at step 6
        pipe.load_checkpoint(tmp_path / "snap")  # back to step 2: step numbers go back too
        with torch.no_grad():
            assert torch.equal(held["inputs_embeds"], table(pipe)[held["input_ids"]])


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_load_in_the_middle_of_an_accumulation_group_keeps_the_gradient_as_torch_does(
    tmp_path, owner
):
    """Found by a probe (Accelerate's load_state in the running process): torch's
    load_state_dict leaves .grad as it is, so the next step applies the whole group's gradient
    to the loaded weights; the table's load dropped its pending gradient, and its step took the
    part after the load only (2.7e-4 from nn.Embedding, silently)."""
    reference = Toy()
    ref_opts = reference_optimizer(reference)
    model = Toy()
    with offloaded(tmp_path, model, owner=owner) as pipe:
        optimizer = one_optimizer(model, pipe)
        runs = [
            (reference, False, ref_opts, torch.utils.data.DataLoader(samples(16), batch_size=2)),
            (model, True, (optimizer,), pipe.loader(samples(16), batch_size=2)),
        ]
        for net, offloaded_, opts, loader in runs:
            saved = None
            for k, batch in enumerate(loader):
                loss(net, batch, offloaded_).backward()
                if k == 6:  # mid-group: back to the state saved at step 2, .grad kept
                    net.load_state_dict(saved[0])
                    for opt, state in zip(opts, saved[1], strict=True):
                        opt.load_state_dict(state)
                    if offloaded_:
                        pipe.load_checkpoint(tmp_path / "step-2")
                if k % 2 == 1:
                    for opt in opts:
                        opt.step()
                        opt.zero_grad()
                if k == 3:
                    saved = (
                        copy.deepcopy(net.state_dict()),
                        [copy.deepcopy(o.state_dict()) for o in opts],
                    )
                    if offloaded_:
                        pipe.save_checkpoint(tmp_path / "step-2")
    assert torch.equal(table(pipe), reference.emb.weight.detach())
    assert torch.equal(model.lin.weight, reference.lin.weight)


def trained(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def gradient_by_autograd_grad(model, value):
    params = trained(model)
    for p, g in zip(params, torch.autograd.grad(value, params, allow_unused=True), strict=True):
        p.grad = g


@pytest.mark.parametrize(
    ("take", "warns"),
    [
        (gradient_by_autograd_grad, True),
        (lambda m, v: v.backward(inputs=trained(m)), True),
        (None, False),
        (lambda m, v: v.backward(), False),
    ],
    ids=["autograd-grad", "backward-inputs", "no-backward", "backward"],
)
def test_a_gradient_taken_for_the_models_parameters_says_the_table_got_none(tmp_path, take, warns):
    """Found by a probe: the table's gradient flows through the batch's rows, not through
    pipe.parameter; a gradient taken for model.parameters() gave the table none, where
    nn.Embedding's weight gets its own, and the table never stepped, silently. Frozen on
    purpose, a batch skipped with no backward at all (review), or a plain backward, it says
    nothing."""
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = one_optimizer(model, pipe)
        for frozen in (False, True):
            pipe.parameter.requires_grad_(not frozen)
            batch = next(iter(pipe.loader(samples(4), batch_size=4)))
            value = loss(model, batch, True)
            if take is not None:
                take(model, value)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer.step()
            said = [w for w in caught if "no gradient reached" in str(w.message)]
            assert len(said) == (1 if warns and not frozen else 0), said
            assert all(w.filename == __file__ for w in said)  # the program's step
            optimizer.zero_grad()
        pipe.flush()
        assert pipe.stats()["steps"] == (1 if take is not None and not warns else 0)


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_gradient_put_in_place_of_the_tables_says_so_and_trains_as_the_last_rows(tmp_path, owner):
    """Found by a probe (multi-task gradient surgery): a .grad saved after one batch's backward
    and put back after another's trained the second batch's rows with the first's gradient,
    silently; the pipe knows the rows of the tensor it made only. Changed in place, exact and
    quiet; replaced by one made from it (p.grad * 0.5), exact, and it says so once (review:
    refusing it refused valid loops)."""
    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    model = Toy()
    with offloaded(tmp_path, model, owner=owner) as pipe:
        optimizer = one_optimizer(model, pipe)
        runs = [
            (
                reference,
                False,
                (dense, adagrad),
                torch.utils.data.DataLoader(samples(8), batch_size=4),
            ),
            (model, True, (optimizer,), pipe.loader(samples(8), batch_size=4)),
        ]
        for net, offloaded_, opts, loader in runs:
            for k, batch in enumerate(loader):
                loss(net, batch, offloaded_).backward()
                for p in net.parameters():
                    if k == 0:
                        p.grad.mul_(0.5)
                    else:
                        p.grad = p.grad * 0.5
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for opt in opts:
                        opt.step()
                        opt.zero_grad()
                said = [w for w in caught if "replaced by a tensor" in str(w.message)]
                assert len(said) == (1 if offloaded_ and k == 1 else 0), said
                assert all(w.filename == __file__ for w in said)  # the program's step
        assert torch.equal(table(pipe), reference.emb.weight.detach())


@pytest.mark.parametrize("rule", ["plateau", "by hand"])
def test_a_learning_rate_changed_without_a_scheduler_base_reaches_the_table(tmp_path, rule):
    def run(model, optimizer, batches, offloaded):
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        for batch in batches:
            loss(model, batch, offloaded).backward()
            optimizer.step()
            optimizer.zero_grad()
            if rule == "plateau":
                plateau.step(1.0)  # never improves: halves the rate every step
            else:
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5

    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    data = samples(16)

    class Shared(torch.optim.Optimizer):
        """AdamW on the dense part and Adagrad on the table, scaled by one group's lr factor:
        what the table's rate in a group shared with dense weights is."""

        def __init__(self):
            params = [*reference.lin.parameters(), reference.emb.weight]
            super().__init__([{"params": params}], {"lr": 1e-2})

        def step(self, closure=None):
            factor = self.param_groups[0]["lr"] / 1e-2
            dense.param_groups[0]["lr"] = 1e-2 * factor
            adagrad.param_groups[0]["lr"] = ADAGRAD["lr"] * factor
            dense.step()
            adagrad.step()

    run(reference, Shared(), torch.utils.data.DataLoader(data, batch_size=4), False)
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # one shared group
        run(model, optimizer, pipe.loader(data, batch_size=4), True)
        assert torch.allclose(table(pipe), reference.emb.weight.detach(), rtol=0, atol=1e-7)


def test_an_optimizer_without_the_table_never_takes_its_gradient_and_says_so_once(tmp_path):
    model = Toy()
    with offloaded(tmp_path, model, owner="thread") as pipe:
        dense = torch.optim.AdamW(model.lin.parameters(), lr=1e-2)  # not pipe.parameter
        batches = iter(pipe.loader(samples(12), batch_size=4))
        loss(model, next(batches), True).backward()
        dense.step()
        assert pipe._owner.writeback.submitted == 0 and pipe.parameter.grad is not None
        with pytest.warns(RuntimeWarning, match="none that holds it did"):
            loss(model, next(batches), True).backward()
        pipe.step()  # the remedy: the table steps at the row optimizer's rate
        assert pipe._owner.writeback.submitted == 1
        loss(model, next(batches), True).backward()
        dense.step()  # once is enough: no second warning at the next backward
        pipe.step()


def test_an_optimizer_built_before_offload_raises_at_its_step(tmp_path):
    model = Toy()
    stale = torch.optim.AdamW(model.parameters(), lr=1e-2)  # holds the V x D weight
    with offloaded(tmp_path, model) as pipe:
        loss(model, next(iter(pipe.loader(samples(4), batch_size=4))), True).backward()
        with pytest.raises(RuntimeError, match="built before offload"):
            stale.step()


def two_tables(tmp_path, order: str, step_b: bool, owner: str = "thread"):
    """Two tables, each in its own torch Adagrad, one loss: a pipe each, against two
    nn.Embedding. ``order``: which optimizer steps first; ``step_b``: B's optimizer steps (else
    B is a frozen stage whose optimizer never steps)."""
    data = samples(16)
    torch.manual_seed(3)
    ref_a, ref_b = nn.Embedding(V, D), nn.Embedding(V, D)
    weights = ref_a.weight.detach().clone(), ref_b.weight.detach().clone()
    opt_a = torch.optim.Adagrad(ref_a.parameters(), **ADAGRAD)
    opt_b = torch.optim.Adagrad(ref_b.parameters(), **ADAGRAD)

    def steps(a, b):
        first, second = (a, b) if order == "a first" else (b, a)
        for opt in (first, second):
            if opt is a or step_b:
                opt.step()
            opt.zero_grad()

    for batch in torch.utils.data.DataLoader(data, batch_size=4):
        (ref_a(batch["input_ids"]).sum() + (ref_b(batch["input_ids"]) ** 2).sum()).backward()
        steps(opt_a, opt_b)
    pipes = [
        embedpipe.EmbeddingPipe(
            embedpipe.Table.from_tensor(tmp_path / f"{n}.zarr", w, chunk_rows=16),
            cache_rows=20,
            optimizer=embedpipe.optim.Adagrad(**ADAGRAD),
            owner=owner,
        )
        for n, w in zip("ab", weights)
    ]
    with pipes[0] as a, pipes[1] as b:
        pa = torch.optim.Adagrad([a.parameter], **ADAGRAD)
        pb = torch.optim.Adagrad([b.parameter], **ADAGRAD)
        for batch in a.loader(data, batch_size=4):
            (batch["inputs_embeds"].sum() + (b_embeds(b, batch) ** 2).sum()).backward()
            steps(pa, pb)
        return (table(a), table(b)), (ref_a.weight.detach(), ref_b.weight.detach()), weights


def b_embeds(pipe, batch) -> torch.Tensor:
    """The second table's rows for the first loader's batch, through a one-batch loader."""
    one = [{"input_ids": ids} for ids in batch["input_ids"]]
    return next(iter(pipe.loader(one, batch_size=len(one))))["inputs_embeds"]


@pytest.mark.parametrize(
    ("order", "owner"), [("a first", "thread"), ("b first", "thread"), ("b first", "process")]
)
def test_two_tables_in_two_optimizers_each_step_with_their_own(tmp_path, order, owner):
    got, expected, _ = two_tables(tmp_path, order, step_b=True, owner=owner)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_table_whose_optimizer_never_steps_stays_as_it_was(tmp_path, owner):
    got, expected, before = two_tables(tmp_path, "a first", step_b=False, owner=owner)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], before[1])


def test_a_hand_written_warmup_in_a_shared_group_scales_the_table_as_built(tmp_path):
    """AdamW(model.parameters(), lr=0.1) with the loop setting the rate (0.01 -> 0.1 over 10
    steps) before each step: the table's rate is Adagrad's times lr / 0.1, as nn.Embedding in
    a matching optimizer gets it."""
    data = samples(40)

    def warmup(optimizer, k):
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (k + 1) / 10)

    reference = Toy()
    dense = torch.optim.AdamW(reference.lin.parameters(), lr=0.1)
    adagrad = torch.optim.Adagrad([reference.emb.weight], **ADAGRAD)
    for k, batch in enumerate(torch.utils.data.DataLoader(data, batch_size=4)):
        warmup(dense, k)
        adagrad.param_groups[0]["lr"] = ADAGRAD["lr"] * dense.param_groups[0]["lr"] / 0.1
        loss(reference, batch, False).backward()
        step_both(dense, adagrad)
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # one group, shared
        for k, batch in enumerate(pipe.loader(data, batch_size=4)):
            warmup(optimizer, k)
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.allclose(table(pipe), reference.emb.weight.detach(), rtol=0, atol=1e-7)
        assert "initial_lr" not in optimizer.param_groups[0]  # embedpipe wrote nothing there


def test_an_optimizer_built_mid_run_at_another_rate_than_its_default_is_warned_about(tmp_path):
    """A second phase's AdamW(model.parameters()), built after the pipe's first batch, is first
    seen at its step: at its default rate that is its built rate; at another (a warmup begun by
    hand, or a group built with a rate of its own) embedpipe cannot tell, and warns. (Row SGD:
    a new optimizer on a table Adagrad stepped raises, test below.)"""
    model = Toy()
    table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    with embedpipe.EmbeddingPipe(
        table, cache_rows=20, optimizer=embedpipe.optim.SGD(lr=0.1)
    ) as pipe:
        for phase in ("default", "changed"):
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # one group, shared
            batch = next(iter(pipe.loader(samples(4), batch_size=4)))
            if phase == "changed":
                optimizer.param_groups[0]["lr"] = 0.01
            loss(model, batch, True).backward()
            if phase == "default":
                optimizer.step()
            else:
                with pytest.warns(RuntimeWarning, match="first seen by embedpipe at this step"):
                    optimizer.step()
            assert optimizer.param_groups[0][BUILT_LR] == optimizer.param_groups[0]["lr"]
            optimizer.zero_grad()


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_rate_set_before_the_first_batch_is_warned_about_and_initial_lr_says_it(tmp_path, owner):
    """NOTE [ A rate changed before embedpipe saw it ] (owner/builtrate.py). Found by a probe: a
    resumed run setting its decayed rate (0.1 * 0.5**3) before the loop, in a fresh optimizer
    whose one group is shared, had that rate taken for the built one and trained the table 8x
    too fast, silently. It is warned about; with group['initial_lr'] = 0.1 the table's rate is
    Adagrad's times 0.125, as nn.Embedding in a matching optimizer gets it."""
    data = samples(16)
    reference = Toy()
    dense = torch.optim.AdamW(reference.lin.parameters(), lr=0.0125)
    adagrad = torch.optim.Adagrad([reference.emb.weight], **{**ADAGRAD, "lr": ADAGRAD["lr"] / 8})
    for batch in torch.utils.data.DataLoader(data, batch_size=4):
        loss(reference, batch, False).backward()
        step_both(dense, adagrad)
    for said in (False, True):
        model = Toy()
        with offloaded(tmp_path, model, f"t{int(said)}.zarr", owner=owner) as pipe:
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # one group, shared
            optimizer.param_groups[0]["lr"] = 0.0125  # the decay of the steps before the resume
            if said:
                optimizer.param_groups[0]["initial_lr"] = 0.1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for batch in pipe.loader(data, batch_size=4):
                    loss(model, batch, True).backward()
                    optimizer.step()
                    optimizer.zero_grad()
            rates = [w for w in caught if "first seen by embedpipe at the pipe's first" in str(w)]
            assert len(rates) == (0 if said else 1), [str(w.message) for w in caught]
            if said:
                assert torch.allclose(table(pipe), reference.emb.weight.detach(), rtol=0, atol=1e-7)
            else:
                assert rates[0].filename == __file__  # the program's loop


@pytest.mark.parametrize(
    "second", ["new", "new-frozen-first", "new-adagrad", "loaded", "loaded-unmarked", "sgd"]
)
@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_new_optimizer_on_a_table_its_row_optimizer_stepped_raises(tmp_path, second, owner):
    """Found by a red-team probe: a second phase's new AdamW trained on from the table's Adagrad
    sums, where a new torch Adagrad starts afresh (8.99e-6 apart after 4 steps), silently. One
    loaded from the first's state_dict goes on, exact. A new SGD without momentum raises too
    (found by a red-team probe: Lightning's configure_optimizers at a second fit, 4.2e-8 after
    2 steps), unless made before the table stepped in this process (it keeps no state: a resume
    by hand builds it anew, as test_a_model_rebuilt_to_resume...)."""
    data = samples(16)
    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    for k in range(0, 16, 4):
        batch = {key: torch.stack([s[key] for s in data[k : k + 4]]) for key in data[0]}
        loss(reference, batch, False).backward()
        step_both(dense, adagrad)
    model = Toy()
    with offloaded(tmp_path, model, owner=owner) as pipe:
        optimizer = one_optimizer(model, pipe)
        for k, batch in enumerate(pipe.loader(data, batch_size=4)):
            if k == 2:
                state, optimizer = optimizer.state_dict(), one_optimizer(model, pipe)
                if second.startswith("loaded"):  # unmarked: saved by an earlier embedpipe
                    for group in state["param_groups"] if second != "loaded" else ():
                        group.pop(STEPPED, None)
                    optimizer.load_state_dict(state)
                elif second == "sgd":
                    optimizer = torch.optim.SGD([pipe.parameter], lr=ADAGRAD["lr"])
                elif second == "new-adagrad":  # (its state made at step 0 when built: review)
                    optimizer = torch.optim.Adagrad(model.parameters(), **ADAGRAD)
            # (review: a first step of the dense weights alone made it look loaded)
            pipe.parameter.requires_grad_(not (k == 2 and second == "new-frozen-first"))
            loss(model, batch, True).backward()
            if (k == 2 and second in ("new", "new-adagrad", "sgd")) or (
                k == 3 and second == "new-frozen-first"
            ):
                with pytest.raises(RuntimeError, match="keeps the state of 2 step"):
                    optimizer.step()
                return
            optimizer.step()
            optimizer.zero_grad()
        assert pipe.stats()["steps"] == 4
        if second.startswith("loaded"):
            assert torch.equal(table(pipe), reference.emb.weight.detach())


@pytest.mark.parametrize("loaded", [False, True])
def test_a_new_sgd_through_a_new_pipe_on_a_table_stepped_in_this_process(tmp_path, loaded):
    """Found by review: the steps of this process were counted by pipe, so a function that makes
    its own pipe for each run (a second fit) built a new SGD that trained on from the table's
    Adagrad sums, silently. It raises; after a snapshot loaded into the table it goes on."""
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        pipe.save_checkpoint(tmp_path / "start")
        two_steps(model, pipe, samples(8))
    pipe.table.close()
    with offloaded_table(tmp_path) as pipe:
        if loaded:
            pipe.load_checkpoint(tmp_path / "start")
            pipe.checkpoint()  # (the table's row state: afresh, as the snapshot's)
        sgd = torch.optim.SGD([pipe.parameter], lr=ADAGRAD["lr"])
        loss(model, next(iter(pipe.loader(samples(4), batch_size=4))), True).backward()
        with contextlib.nullcontext() if loaded else pytest.raises(RuntimeError, match="SGD"):
            sgd.step()


def two_steps(model, pipe, data, optimizer=None) -> torch.optim.Optimizer:
    optimizer = optimizer or one_optimizer(model, pipe)
    for batch in pipe.loader(data, batch_size=4):
        loss(model, batch, True).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


@pytest.mark.parametrize("case", ["load-stepped", "load-fresh", "other-row-optimizer"])
def test_what_a_new_optimizer_meets_after_a_load_or_a_row_optimizer_changed(tmp_path, case):
    """Found by review: a load_checkpoint left the count of remembered steps as before the load
    (a snapshot of 2 Adagrad steps loaded into a fresh table then trained silently from its
    sums with a new optimizer; a step-0 snapshot raised), and a table SGD stepped raised for a
    row Adagrad, whose state starts fresh there."""
    model, data = Toy(), samples(8)
    if case == "other-row-optimizer":
        embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16).close()
        sgd = embedpipe.optim.SGD(lr=0.05)
        with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=20, optimizer=sgd) as pipe:
            two_steps(model, pipe, data)
        with offloaded_table(tmp_path) as pipe:
            two_steps(model, pipe, data)  # a new AdamW, a row Adagrad: both start fresh
            assert pipe.stats()["steps"] == 2
        return
    if case == "load-stepped":
        with offloaded(tmp_path, model) as pipe:
            two_steps(model, pipe, data)
            pipe.save_checkpoint(tmp_path / "stepped")
        other = Toy()
        with offloaded(tmp_path, other, "other.zarr") as pipe:  # step 0, no step taken
            pipe.load_checkpoint(tmp_path / "stepped")  # its sums of 2 steps: a new one raises
            with pytest.raises(RuntimeError, match="keeps the state of 2 step"):
                two_steps(other, pipe, data)
        return
    with offloaded(tmp_path, model) as pipe:
        pipe.save_checkpoint(tmp_path / "fresh")
        two_steps(model, pipe, data)
        pipe.load_checkpoint(tmp_path / "fresh")  # step 0: a new optimizer starts with it
        two_steps(model, pipe, data)


def test_offloading_again_over_the_same_path_trains_the_new_model(tmp_path):
    first = Toy()
    embedpipe.hf.offload(first, tmp_path / "t.zarr", chunk_rows=16).close()
    second = Toy()
    table = embedpipe.hf.offload(second, tmp_path / "t.zarr", chunk_rows=16, overwrite=True)
    optimizer = torch.optim.AdamW(second.parameters())  # built before the pipe
    with (
        table,
        embedpipe.EmbeddingPipe(table, cache_rows=5, optimizer=embedpipe.optim.SGD(lr=1)) as pipe,
    ):
        assert any(p is pipe.parameter for p in second.parameters())
        assert any(p is pipe.parameter for g in optimizer.param_groups for p in g["params"])
        # the first model's rows are not in the table made anew (a notebook cell run again):
        # restoring it, or saving it (save_pretrained reads the same way), raises
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="made anew"):
            embedpipe.hf.restore(first, pipe)
        embedpipe.hf.restore(second, pipe)
    with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="made anew"):
        embedpipe.hf.restore(first, tmp_path / "t.zarr")


class Padded(Toy):
    def __init__(self, padding_idx) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx)


@pytest.mark.parametrize("padding_idx", [3, V - 1, -1])
def test_a_padding_row_past_the_first_rows_trains_as_nn_embeddings(tmp_path, padding_idx):
    """An embedding padding with a late row (the last, as many LLM vocabularies do; -1 is the
    last) is offloaded, and its padding row gets no gradient, as nn.Embedding's."""
    data = samples(16)
    for sample in data:
        sample["input_ids"][-2:] = padding_idx % V
    reference = Padded(padding_idx)
    dense, adagrad = reference_optimizer(reference)
    for batch in torch.utils.data.DataLoader(data, batch_size=4):
        loss(reference, batch, False).backward()
        step_both(dense, adagrad)
    model = Padded(padding_idx)
    with offloaded(tmp_path, model) as pipe:
        assert pipe.padding_idx == padding_idx % V
        optimizer = one_optimizer(model, pipe)
        for batch in pipe.loader(data, batch_size=4):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(table(pipe), reference.emb.weight.detach())


@pytest.mark.parametrize("case", ["pipe without", "model without"])
def test_a_pipe_and_a_model_padding_with_other_rows_raise(tmp_path, case):
    """The pipe's padding_idx (the table's record) and the model's embedding's must agree: a
    pipe made with padding_idx=None for a model padding with row 0, or a table recording row 0
    (an import of a folder whose config names a pad token) for a model whose embedding has none
    (T5's), would train another row than nn.Embedding, silently."""
    model = Padded(0 if case == "pipe without" else None)
    path = str(tmp_path / "t.zarr")
    embedpipe.hf.offload(model, path, chunk_rows=16).close()
    if case == "model without":
        with embedpipe.Table.open(path, "r+") as opened:
            opened.update_metadata(padding_idx=0)
            opened.checkpoint()
    padding = dict(padding_idx=None) if case == "pipe without" else {}
    optimizer = embedpipe.optim.Adagrad(**ADAGRAD)
    with embedpipe.EmbeddingPipe(path, cache_rows=20, optimizer=optimizer, **padding) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="padding_idx="):
            loss(model, batch, True)


def test_a_model_rebuilt_on_its_table_is_checked_against_a_table_made_anew(tmp_path):
    """A model rebuilt to resume (its placeholder built by hand, ``replacing``) takes the id of
    the table the pipe that trains it reads; one made anew at that path later holds no rows of
    it: restoring it from there raises."""
    embedpipe.hf.offload(Toy(), tmp_path / "t.zarr", chunk_rows=16).close()
    rebuilt = Toy()
    placeholder = embedpipe.hf.OffloadedEmbedding.replacing(rebuilt.emb, str(tmp_path / "t.zarr"))
    rebuilt.set_input_embeddings(placeholder)
    with offloaded_table(tmp_path) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        loss(rebuilt, batch, True).backward()
        pipe.step()
    embedpipe.hf.offload(Toy(1), tmp_path / "t.zarr", chunk_rows=16, overwrite=True).close()
    with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="made anew"):
        embedpipe.hf.restore(rebuilt, tmp_path / "t.zarr")


def test_an_evaluation_through_a_copy_attached_leaves_the_model_its_table(tmp_path):
    """Mid-training, the model evaluated through a frozen pipe on a copy of its rows (a table of
    their own: another id), attached: training on and restoring read the training table."""
    model, data = Toy(), samples(16)

    def train(pipe, optimizer, batches):
        for batch in pipe.loader(batches, batch_size=4):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()

    with offloaded(tmp_path, model) as pipe:
        optimizer = one_optimizer(model, pipe)
        train(pipe, optimizer, data[:8])
        embedpipe.Table.from_tensor(tmp_path / "copy.zarr", table(pipe), chunk_rows=16).close()
        with embedpipe.EmbeddingPipe(tmp_path / "copy.zarr", cache_rows=20) as frozen:
            frozen.attach(model)
            with torch.no_grad():
                for batch in frozen.loader(data[8:], batch_size=4):
                    loss(model, batch, True)
        train(pipe, optimizer, data[8:])
        embedpipe.hf.restore(model, pipe)
        assert torch.equal(model.emb.weight.detach(), table(pipe))


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("made", ["on-its-table", "by-path", "by-path-before", "on-it-before"])
def test_a_frozen_pipe_on_the_table_another_pipe_trains_here_raises(tmp_path, made, owner):
    """Found by a red-team probe: an evaluation through a second, frozen pipe on the table that
    a pipe of the same process trains read its files without the rows the trainer's cache held
    (on the trainer's Table object: 15-20 of 160 rows an earlier step's), or, opened by path, its
    last checkpoint (all 160 stale, however many steps since), with no error. Made before the
    trainer, it raises at its first batch, and after the trainer closed too (it reads the
    checkpoint it opened, or the trainer's Table object; review found a check of the table's
    step that let the latter read stale rows), even a trainer that took no step (loud, not
    silent); one made after the trainer closed reads the rows trained."""
    model, data = Toy(), samples(16)
    frozen = None
    if made.endswith("before"):
        on = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
        if made == "by-path-before":
            on.close()
            on = tmp_path / "t.zarr"
        frozen = embedpipe.EmbeddingPipe(on, cache_rows=20)
        pipe = embedpipe.EmbeddingPipe(
            on, cache_rows=20, optimizer=embedpipe.optim.Adagrad(**ADAGRAD), owner=owner
        )
    else:
        pipe = offloaded(tmp_path, model, owner=owner)
    with pipe:
        optimizer = one_optimizer(model, pipe)
        for batch in pipe.loader(data, batch_size=4):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
        with pytest.raises(TableOwnedError, match=r"pipe.loader\(eval_dataset\)"):
            if frozen is None:
                on = pipe.table if made == "on-its-table" else pipe.table.path
                frozen = embedpipe.EmbeddingPipe(on, cache_rows=20)
            with torch.no_grad():
                next(iter(frozen.loader(data, batch_size=4)))["inputs_embeds"]
        trained = table(pipe)
    if frozen is not None:  # made before: it reads the checkpoint it opened, stale still
        with frozen, pytest.raises(TableOwnedError, match="trained the table since"):
            next(iter(frozen.loader(data, batch_size=4)))["inputs_embeds"]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=20) as frozen:
        batch = next(iter(frozen.loader(data, batch_size=4)))
        assert torch.equal(batch["inputs_embeds"], trained[batch["input_ids"]])


def test_two_forward_passes_over_one_batch_add_up_as_with_nn_embedding(tmp_path):
    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    data = samples(8)
    for batch in torch.utils.data.DataLoader(data, batch_size=4):
        (loss(reference, batch, False) + loss(reference, batch, False)).backward()
        loss(reference, batch, False).backward()  # a second graph over the same batch
        step_both(dense, adagrad)
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = one_optimizer(model, pipe)
        for batch in pipe.loader(data, batch_size=4):
            (loss(model, batch, True) + loss(model, batch, True)).backward()
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(table(pipe), reference.emb.weight.detach())


def test_the_compact_rows_train_a_custom_embedding_layer(tmp_path):
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        before = table(pipe)
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        embeds = nn.functional.embedding(batch.inverse, batch.rows)  # the compact form
        nn.functional.cross_entropy(model(inputs_embeds=embeds), batch["labels"]).backward()
        assert pipe.step()
        assert not torch.equal(table(pipe), before)


def test_copying_a_batch_field_by_field_never_reads_the_rows_early(tmp_path):
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        copied = {k: v for k, v in batch.items()}  # what a prefetcher does
        assert set(copied) == {"input_ids", "labels"} and "inputs_embeds" in batch
        assert batch._leaf is None  # nothing was read


def test_rows_refreshed_under_inference_mode_can_be_trained_on(tmp_path):
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = iter(pipe.loader(samples(8), batch_size=4))
        first, ahead = next(batches), next(batches)
        loss(model, first, True).backward()
        optimizer.step()
        with torch.inference_mode():
            model(inputs_embeds=ahead["inputs_embeds"])  # refreshed in inference mode
        loss(model, ahead, True).backward()
        optimizer.step()


def test_hf_trainer_trains_on_an_iterable_dataset(tmp_path):
    pytest.importorskip("transformers")
    from ..frameworks import samples as bert_samples
    from ..frameworks import train_briefly

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(bert_samples(16))

    assert train_briefly(tmp_path, Stream(), steps=3) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ids_edited_in_place_train_as_nn_embedding_trains_the_edited_ids(tmp_path, num_workers):
    """Masking in the loop: 15% of the ids become id 1 ([MASK]) after the batch is handed out;
    the table trains as nn.Embedding fed the masked ids (the [MASK] row included)."""
    data = samples(32)
    masks = [torch.rand(4, 6, generator=torch.Generator().manual_seed(k)) < 0.15 for k in range(8)]

    def run(model, optimizers, batches, offloaded_):
        for k, batch in enumerate(batches):
            if offloaded_ and k % 2:
                batch = batch.to("cpu")  # an edit after a move is seen too
            batch["input_ids"][masks[k]] = 1
            loss(model, batch, offloaded_).backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()

    reference = Toy()
    run(
        reference,
        reference_optimizer(reference),
        torch.utils.data.DataLoader(data, batch_size=4),
        False,
    )
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        dense = torch.optim.AdamW(model.lin.parameters(), lr=1e-2)
        adagrad = torch.optim.Adagrad([pipe.parameter], **ADAGRAD)
        run(model, [dense, adagrad], pipe.loader(data, batch_size=4, num_workers=num_workers), True)
        assert pipe.stats()["relookups"] > 0
        assert torch.equal(table(pipe), reference.emb.weight.detach())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_ids_made_and_edited_under_inference_mode_embed_the_edited_ids(tmp_path, num_workers):
    """Under torch.inference_mode() (Lightning's validation) the batch's ids are inference
    tensors, in the workers forked then too, with no version counter: an edit in place is
    found by their values, and the embeddings are the edited ids' rows."""
    data = samples(16)
    weight = Toy().emb.weight.detach().clone()
    with offloaded(tmp_path, Toy()) as pipe, torch.inference_mode():
        for k, batch in enumerate(pipe.loader(data, batch_size=4, num_workers=num_workers)):
            assert batch["input_ids"].is_inference()
            if k % 2:
                batch["input_ids"][:, 0] = 1
            assert torch.equal(batch["inputs_embeds"], weight[batch["input_ids"]])
        assert pipe.stats()["relookups"] == 2


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_a_model_cast_after_offload_gets_inputs_embeds_in_its_dtype(tmp_path, dtype):
    """...and a batch read to train says, once, that the table trains in its own dtype (found by
    a probe: model.to(torch.bfloat16) after offload trained the table 3.2e-4 away from an
    nn.Embedding cast with the model, silently). Read without a gradient or in eval mode, it
    says nothing."""
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        model.to(dtype)
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                assert batch["inputs_embeds"].dtype == dtype
            model.eval()  # an evaluation that reads the batch before its no_grad (HF's, review)
            batch = next(iter(pipe.loader(samples(4), batch_size=4)))
            assert batch["inputs_embeds"].dtype == dtype
            model.train()
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        with pytest.warns(RuntimeWarning, match=f"inputs_embeds in {dtype} .*trains in float32"):
            assert batch["inputs_embeds"].dtype == dtype
        loss(model, batch, True).float().backward()  # the gradient reaches the float32 table
        assert pipe.parameter.grad.dtype == torch.float32 and pipe.parameter.grad.any()
        pipe.step()


def test_restore_after_the_pipe_closed_reads_the_committed_table(tmp_path):
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in pipe.loader(samples(8), batch_size=4):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
    trained = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    with embedpipe.hf.restored(model, pipe):  # what Trainer.save_model does after the with block
        assert torch.equal(model.get_input_embeddings().weight, trained)


def _train_by_hand(model, pipe, batches) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # holds pipe.parameter
    for batch in batches:
        loss(model, batch, True).backward()
        optimizer.step()
        optimizer.zero_grad()


def _resume_by_hand(folder: str) -> None:
    """The resumed half, in a new process: a fresh model, its dense weights as saved."""
    rebuilt = Toy()
    rebuilt.lin.load_state_dict(torch.load(f"{folder}/lin.pt"))
    rebuilt.set_input_embeddings(embedpipe.hf.OffloadedEmbedding(V, D, f"{folder}/resumed.zarr"))
    with embedpipe.EmbeddingPipe(
        f"{folder}/resumed.zarr", cache_rows=20, optimizer=embedpipe.optim.Adagrad(**ADAGRAD)
    ) as pipe:
        assert any(p is pipe.parameter for p in rebuilt.parameters())
        _train_by_hand(rebuilt, pipe, pipe.loader(samples(16)[8:], batch_size=4))
    torch.save(rebuilt.lin.state_dict(), f"{folder}/lin.pt")


def test_a_model_rebuilt_to_resume_takes_an_offloaded_embedding_by_hand(tmp_path):
    """A plain loop resumed in a new process: the model is built again (with an nn.Embedding),
    an OffloadedEmbedding takes the embedding's place on the existing table, and the pipe and
    an SGD built after it (anew: it keeps no state) train on exactly as one uninterrupted run.
    (In the same process, that SGD raises: NOTE [ A new optimizer and the table's state ].)"""
    data = samples(16)
    straight = Toy()
    with offloaded(tmp_path, straight, "straight.zarr") as pipe:
        _train_by_hand(straight, pipe, pipe.loader(data, batch_size=4))
    pipe.table.close()
    first = Toy()
    with offloaded(tmp_path, first, "resumed.zarr") as pipe:
        _train_by_hand(first, pipe, pipe.loader(data[:8], batch_size=4))
    pipe.table.close()
    torch.save(first.lin.state_dict(), tmp_path / "lin.pt")
    resumed = multiprocessing.get_context("spawn").Process(
        target=_resume_by_hand, args=(str(tmp_path),)
    )
    resumed.start()
    resumed.join(timeout=120)
    assert resumed.exitcode == 0
    expected = embedpipe.Table.open(tmp_path / "straight.zarr").to_tensor()
    assert torch.equal(embedpipe.Table.open(tmp_path / "resumed.zarr").to_tensor(), expected)
    assert torch.equal(torch.load(tmp_path / "lin.pt")["weight"], straight.lin.weight)


def test_a_resumed_optimizer_scales_the_table_from_the_rate_it_was_built_with(tmp_path):
    """ReduceLROnPlateau halving a shared group's rate, the optimizer saved and loaded in the
    middle: the table's rate keeps following the first run's built rate (it travels in the
    optimizer's state_dict), as one uninterrupted run."""

    def run(name, split):
        model = Toy()
        with offloaded(tmp_path, model, name) as pipe:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
            for k, batch in enumerate(pipe.loader(samples(24), batch_size=4)):
                if k == split:  # "a new process": a new optimizer, its state loaded
                    state = optimizer.state_dict()
                    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                    optimizer.load_state_dict(state)
                    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
                        optimizer, factor=0.5, patience=0
                    )
                    plateau.step(1.0)
                loss(model, batch, True).backward()
                optimizer.step()
                optimizer.zero_grad()
                plateau.step(1.0)  # never improves: halves the rate every step
            out = table(pipe)
        pipe.table.close()
        return out

    assert torch.equal(run("straight.zarr", None), run("resumed.zarr", 3))


CLIP = 0.1  # below most steps' gradient norm (0.18-0.42 here): the clip scales them


def scaled_steps(
    model, batches, optimizers, offloaded: bool, inf_at: int
) -> tuple[list[float], list[float]]:
    """A GradScaler loop (float32 on CPU: a power-of-two scale is exact), clipping after the
    unscale; batch ``inf_at``'s loss is inf, so the scaler skips that step. The scales seen,
    and the gradient norms before the clip."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales, norms = [], []
    for k, batch in enumerate(batches):
        out = loss(model, batch, offloaded) * (float("inf") if k == inf_at else 1.0)
        scaler.scale(out).backward()
        for optimizer in optimizers:
            scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        for optimizer in optimizers:
            optimizer.zero_grad()
    return scales, norms


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_grad_scaler_unscales_the_table_and_skips_its_step_on_inf(tmp_path, owner):
    """torch.amp.GradScaler with clipping, one step skipped for an inf loss: the table and the
    dense weights as nn.Embedding's under the same loop (the skipped step's gradient is dropped,
    not applied later, and the table's gradient is unscaled before the clip sees it)."""
    data = samples(24)
    reference = Toy()
    expected = scaled_steps(
        reference, torch.utils.data.DataLoader(data, batch_size=4), reference_optimizer(reference),
        offloaded=False, inf_at=2,
    )  # fmt: skip
    model = Toy()
    with offloaded(tmp_path, model, owner=owner) as pipe:
        optimizer = one_optimizer(model, pipe)
        got = scaled_steps(
            model, pipe.loader(data, batch_size=4, num_workers=2), [optimizer], True, inf_at=2
        )
        (scales, norms), (expected_scales, expected_norms) = got, expected
        assert scales == expected_scales and scales[2] < scales[1]  # the inf seen in both runs
        assert np.array_equal(norms, expected_norms, equal_nan=True)  # the skipped step's: nan
        assert sum(n > CLIP for n in norms) >= 3  # the clip scaled those steps, in both runs
        pipe.flush()
        assert pipe.stats()["steps"] == 5  # six batches, one skipped
        assert torch.equal(table(pipe), reference.emb.weight.detach())
        assert torch.equal(model.lin.weight, reference.lin.weight)


@pytest.mark.parametrize("unscale", [False, True], ids=["scaled", "unscaled-first"])
def test_a_grad_scaler_with_a_fused_optimizer_unscales_and_skips_the_table_too(tmp_path, unscale):
    """A fused optimizer unscales its gradients in its own step and skips the step on an inf
    (GradScaler calls it all the same, with grad_scale and found_inf set): the table's step
    does the same, bit for bit with nn.Embedding under the same loop."""
    data = samples(24)

    def run(model, batches, optimizers, offloaded: bool) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for k, batch in enumerate(batches):
            out = loss(model, batch, offloaded) * (float("inf") if k == 2 else 1.0)
            scaler.scale(out).backward()
            for optimizer in optimizers:
                if unscale:
                    scaler.unscale_(optimizer)
                scaler.step(optimizer)
            scaler.update()
            for optimizer in optimizers:
                optimizer.zero_grad()

    reference = Toy()
    dense = torch.optim.AdamW(reference.lin.parameters(), lr=1e-2, fused=True)
    adagrad = torch.optim.Adagrad([reference.emb.weight], **ADAGRAD)
    run(reference, torch.utils.data.DataLoader(data, batch_size=4), [dense, adagrad], False)
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        groups = [{"params": model.lin.parameters()}, {"params": [pipe.parameter], "lr": 0.05}]
        optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
        run(model, pipe.loader(data, batch_size=4), [optimizer], True)
        pipe.flush()
        assert pipe.stats()["steps"] == 5  # six batches, one skipped
        assert pipe.parameter not in optimizer.state  # .grad hidden from it, the skip's too
        assert torch.equal(table(pipe), reference.emb.weight.detach())
        assert torch.equal(model.lin.weight, reference.lin.weight)


def loop_as_written(pattern: str, model, embedding, batches, optimizers, offloaded: bool) -> None:
    """Loops that leave ``.grad`` to torch's rules: never zeroed, zeroed every other step,
    stepped twice, zeroed in place while the embedding is frozen (the steps still count)."""
    for k, batch in enumerate(batches):
        if pattern == "frozen-zeroed":
            embedding.requires_grad_(k not in (2, 3))
        loss(model, batch, offloaded).backward()
        for optimizer in optimizers:
            optimizer.step()
            if pattern == "stepped-twice":
                optimizer.step()
        for optimizer in optimizers:
            if pattern == "never-zeroed" or (pattern == "zeroed-every-other" and k % 2 == 0):
                continue
            optimizer.zero_grad(set_to_none=pattern != "frozen-zeroed")


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize(
    "pattern", ["never-zeroed", "zeroed-every-other", "stepped-twice", "frozen-zeroed", "maximize"]
)
def test_a_step_leaves_the_gradient_as_torch_does(tmp_path, pattern, owner):
    """torch steps whatever .grad holds and leaves it there: a gradient never zeroed adds up,
    a second step applies it again, one zeroed in place still counts a step (Adagrad's
    lr_decay counts it) and moves no row; maximize ascends. The table, bit for bit."""
    data, rows = samples(24), dict(ADAGRAD, lr_decay=0.5)
    maximize = pattern == "maximize"
    reference = Toy()
    dense = torch.optim.AdamW(reference.lin.parameters(), lr=1e-2, maximize=maximize)
    adagrad = torch.optim.Adagrad([reference.emb.weight], **rows, maximize=maximize)
    batches = torch.utils.data.DataLoader(data, batch_size=4)
    loop_as_written(pattern, reference, reference.emb.weight, batches, [dense, adagrad], False)
    model = Toy()
    table_ = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    row_optimizer = embedpipe.optim.Adagrad(**rows)
    with embedpipe.EmbeddingPipe(
        table_, cache_rows=20, optimizer=row_optimizer, owner=owner
    ) as pipe:
        groups = [{"params": model.lin.parameters()}, {"params": [pipe.parameter], "lr": 0.05}]
        optimizer = torch.optim.AdamW(groups, lr=1e-2, maximize=maximize)
        batches = pipe.loader(data, batch_size=4)
        loop_as_written(pattern, model, pipe.parameter, batches, [optimizer], True)
        assert torch.equal(table(pipe), reference.emb.weight.detach())
        assert torch.equal(model.lin.weight, reference.lin.weight)


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_clip_grad_value_clamps_the_tables_gradient_as_nn_embeddings(tmp_path, owner):
    """clip_grad_value_ over model.parameters() clamps the table's pending gradient in place,
    as it clamps nn.Embedding's .grad: the same table, bit for bit."""
    data = samples(16)
    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    for batch in torch.utils.data.DataLoader(data, batch_size=4):
        (loss(reference, batch, False) * 50).backward()
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
        step_both(dense, adagrad)
    model = Toy()
    with offloaded(tmp_path, model, owner=owner) as pipe:
        optimizer = one_optimizer(model, pipe)
        for batch in pipe.loader(data, batch_size=4, num_workers=2):
            (loss(model, batch, True) * 50).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(table(pipe), reference.emb.weight.detach())
        assert torch.equal(model.lin.weight, reference.lin.weight)


def other_samples(n: int) -> list[dict]:
    rng = np.random.default_rng(5)
    ids = np.minimum(rng.zipf(1.5, (n, 6)), V - 1).astype(np.int64)
    return [
        {"input_ids": torch.from_numpy(i), "labels": torch.tensor(k % 3 % 2)}
        for k, i in enumerate(ids)
    ]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("owner", ["thread", "process"])
def test_two_loaders_taking_turns_train_as_two_dataloaders(tmp_path, owner, workers):
    """Multi-task training: two shuffled loaders over two datasets, zipped, a step a batch
    from each in turn (each loader's epoch foreseen by the pipe, or not): the batches and the
    table as two plain DataLoaders feeding nn.Embedding. (``zip`` makes both iterators before
    the first batch: NOTE [ An epoch begins at iter() ].)"""
    first, second = samples(24), other_samples(24)
    options = dict(batch_size=4, shuffle=True, num_workers=workers)
    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    expected = []
    torch.manual_seed(3)
    plain = torch.utils.data.DataLoader
    for pair in zip(plain(first, **options), plain(second, **options)):
        for batch in pair:
            expected.append(batch["input_ids"])
            loss(reference, batch, False).backward()
            step_both(dense, adagrad)
    model = Toy()
    with offloaded(tmp_path, model, owner=owner) as pipe:
        optimizer = one_optimizer(model, pipe)
        got = []
        torch.manual_seed(3)
        for pair in zip(pipe.loader(first, **options), pipe.loader(second, **options)):
            for batch in pair:
                got.append(batch["input_ids"].clone())
                loss(model, batch, True).backward()
                optimizer.step()
                optimizer.zero_grad()
        assert len(got) == len(expected) == 12
        assert all(torch.equal(g, e) for g, e in zip(got, expected))
        assert torch.equal(table(pipe), reference.emb.weight.detach())


@pytest.mark.parametrize(
    "options",
    [dict(num_workers=0), dict(num_workers=2), dict(num_workers=2, persistent_workers=True)],
    ids=["0-workers", "2-workers", "persistent"],
)
def test_an_epoch_begins_at_iter_as_a_dataloaders(tmp_path, options):
    """``iter(loader)`` makes torch's iterator at once (its seed; with workers, the sampler's
    order): a draw between ``iter()`` and the first ``next()``, and two live iterators of one
    loader, give a DataLoader's batches. ``len()`` of the iterator is a DataLoader's."""
    data, options = samples(24), dict(batch_size=4, shuffle=True, **options)

    def batches(make):
        torch.manual_seed(7)
        loader = make(data, **options)
        first = iter(loader)
        torch.rand(1)  # a dropout, a noise, a second loader's iterator
        got = [next(first)["input_ids"].clone() for _ in range(2)]
        for _ in range(2):  # two epochs of two live iterators (zip): the second resets the first
            got += [b["input_ids"].clone() for pair in zip(loader, loader) for b in pair]
        return got, len(iter(loader))

    expected, length = batches(torch.utils.data.DataLoader)
    with offloaded(tmp_path, Toy()) as pipe:
        got, pipe_length = batches(pipe.loader)
    assert pipe_length == length == 6
    assert len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.parametrize("unfrozen", [False, True], ids=["trained", "unfrozen-later"])
def test_a_penalty_on_the_parameters_values_raises_and_trains_without_the_table(tmp_path, unfrozen):
    """A weight penalty over ``model.parameters()`` reads ``pipe.parameter``, which holds no rows
    (nn.Embedding's weight would add the whole table to it): its backward raises, and nothing
    reaches the table, also for a table frozen when the pipe was made and unfrozen since. The
    same penalty without it trains as nn.Embedding's with the penalty on the dense weights
    alone."""
    data = samples(16)
    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    for batch in torch.utils.data.DataLoader(data, batch_size=4):
        penalty = sum(p.pow(2).sum() for p in reference.lin.parameters())
        (loss(reference, batch, False) + 1e-2 * penalty).backward()
        step_both(dense, adagrad)
    model = Toy()
    path = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=16)
    if unfrozen:
        freeze_the_module(model)
    adagrad = embedpipe.optim.Adagrad(**ADAGRAD)
    with embedpipe.EmbeddingPipe(path, cache_rows=20, optimizer=adagrad) as pipe:
        if unfrozen:  # gradual unfreezing
            model.get_input_embeddings().requires_grad_(True)
        optimizer = one_optimizer(model, pipe)
        before = table(pipe)
        batches = iter(pipe.loader(data[:8] + data, batch_size=4))
        penalty = lambda: sum(p.pow(2).sum() for p in model.parameters())  # noqa: E731
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="p is not pipe.param"):
            (loss(model, next(batches), True) + 1e-2 * penalty()).backward()
        optimizer.zero_grad()
        # made before the forward, the penalty's backward runs after the rows' (which set the
        # parameter's shape): torch raises there, at the shape its saved value has changed to
        early = penalty()
        with pytest.raises(RuntimeError, match="size of tensor"):
            (loss(model, next(batches), True) + 1e-2 * early).backward()
        optimizer.zero_grad()
        assert pipe._owner.submitted == 0 and torch.equal(table(pipe), before)
        for batch in batches:
            penalty = sum(p.pow(2).sum() for p in model.parameters() if p is not pipe.parameter)
            (loss(model, batch, True) + 1e-2 * penalty).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(table(pipe), reference.emb.weight.detach())
        assert torch.equal(model.lin.weight, reference.lin.weight)


def test_a_table_trained_by_one_row_optimizer_refuses_another(tmp_path):
    """Adam would go on from the table's step (its bias correction) and from Adagrad's state,
    where a fresh torch optimizer starts from step 1: reopening the table, or loading its
    snapshot, with another row optimizer is refused before anything is written."""
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = one_optimizer(model, pipe)
        for batch in pipe.loader(samples(8), batch_size=4):
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
        pipe.save_checkpoint(tmp_path / "snapshot")
        trained = table(pipe)
    pipe.table.close()  # offload's handle
    adam = embedpipe.optim.Adam(lr=0.01)
    with pytest.raises(ValueError, match="trained by adagrad up to step 2"):
        embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=20, optimizer=adam)
    embedpipe.Table.from_tensor(tmp_path / "other.zarr", trained, chunk_rows=16).close()
    with embedpipe.EmbeddingPipe(tmp_path / "other.zarr", cache_rows=20, optimizer=adam) as pipe:
        with pytest.raises(ValueError, match="trained by adagrad up to step 2"):
            pipe.load_checkpoint(tmp_path / "snapshot")
        assert pipe.table.step == 0 and torch.equal(table(pipe), trained)
    adagrad = embedpipe.optim.Adagrad(**ADAGRAD)  # the same kind, as before
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=20, optimizer=adagrad) as pipe:
        assert pipe.table.step == 2 and torch.equal(table(pipe), trained)


def test_training_on_through_the_pipe_after_restore_raises(tmp_path):
    """``restore(model, pipe)`` mid-training puts the rows of then in the model: training on
    through the pipe would leave its nn.Embedding behind the table, and a save would write
    the old rows. A batch read for the model in training mode with grad enabled raises; an
    evaluation (eval mode: Trainer reads the batch before its no_grad) does not, nor does
    training once the placeholder is put back (as ``restored`` does)."""
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        optimizer = one_optimizer(model, pipe)
        batches = iter(pipe.loader(samples(20), batch_size=4))
        loss(model, next(batches), True).backward()
        optimizer.step()
        optimizer.zero_grad()
        placeholder = model.get_input_embeddings()
        embedpipe.hf.restore(model, pipe)
        rows = model.emb.weight.detach().clone()
        model.eval()
        loss(model, next(batches), True)
        model.train()
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="restore put the"):
            loss(model, next(batches), True)
        assert torch.equal(table(pipe), rows)
        model.set_input_embeddings(placeholder)
        loss(model, next(batches), True).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert not torch.equal(table(pipe), rows)


def test_a_copy_of_an_offloaded_model_is_refused_and_one_made_before_offload_trains_apart(
    tmp_path,
):
    """An EMA (AveragedModel), a best-model snapshot or a frozen teacher deep-copies the model:
    a copy of the offloaded one would read the live table, never a snapshot, so it raises."""
    import copy

    from torch.optim.swa_utils import AveragedModel

    model = Toy()
    teacher = copy.deepcopy(model)  # before offload: a copy with its own nn.Embedding
    with offloaded(tmp_path, model) as pipe:
        for make_copy in (copy.deepcopy, AveragedModel):
            with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError) as info:
                make_copy(model)
            message = str(info.value)
            assert str(tmp_path / "t.zarr") in message and "before embedpipe.hf.offload" in message
        optimizer = one_optimizer(model, pipe)
        for batch in pipe.loader(samples(16), batch_size=4):
            loss(model, batch, offloaded=True).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert not torch.equal(table(pipe), teacher.emb.weight.detach())
    assert torch.equal(teacher.emb.weight, Toy().emb.weight)  # the teacher's rows never moved
    assert isinstance(model.get_input_embeddings(), embedpipe.hf.OffloadedEmbedding)


def noise(module, args, output):
    """NEFTune's hook, in short: noise from torch's generator, in training mode only."""
    return output + torch.rand_like(output) * 0.1 if module.training else output


@pytest.mark.parametrize("registered", ["before offload", "after offload"])
def test_hooks_on_the_word_embedding_run_on_the_batches_rows(tmp_path, registered):
    """A forward hook on model.get_input_embeddings() (NEFTune, enable_input_require_grads) runs
    on each batch's inputs_embeds, with the batch's ids, as nn.Embedding's call runs it; the
    handle taken before offload still removes it."""
    seen = {True: [], False: []}

    def hook_all(model, offloaded):
        embedding, log = model.get_input_embeddings(), seen[offloaded]
        a = embedding.register_forward_hook(noise)
        embedding.register_forward_hook(
            lambda m, args, kwargs, out: log.append(args[0].clone()), with_kwargs=True
        )
        embedding.register_forward_pre_hook(
            lambda m, args, kwargs: (args, kwargs), with_kwargs=True
        )
        embedding.register_forward_pre_hook(lambda m, args: (args[0].clamp(0, V - 1),))  # equal
        embedding.register_forward_hook(lambda m, args, out: log.append("first"), prepend=True)
        embedding.register_forward_hook(lambda m, args, out: log.append("always"), always_call=True)
        return (a,)

    reference = Toy()
    dense, adagrad = reference_optimizer(reference)
    handles = hook_all(reference, False)
    batches = list(torch.utils.data.DataLoader(samples(16), batch_size=4))
    for n, batch in enumerate(batches):
        if n == 2:
            handles[0].remove()
        loss(reference, batch, False).backward()
        step_both(dense, adagrad)

    model = Toy()
    handles = hook_all(model, True) if registered == "before offload" else None
    with offloaded(tmp_path, model) as pipe:
        handles = handles or hook_all(model, True)
        optimizer = one_optimizer(model, pipe)
        for n, batch in enumerate(pipe.loader(samples(16), batch_size=4)):
            if n == 2:
                handles[0].remove()
            loss(model, batch, True).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(table(pipe), reference.emb.weight)
    assert torch.equal(model.lin.weight, reference.lin.weight)
    assert len(seen[True]) == 12 and [type(x) for x in seen[True]] == [type(x) for x in seen[False]]
    assert all(x == y if isinstance(x, str) else torch.equal(x, y) for x, y in zip(*seen.values()))


def test_hooks_that_cannot_run_on_the_batches_rows_raise(tmp_path):
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        embedding = model.get_input_embeddings()
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        handle = embedding.register_forward_pre_hook(lambda m, args: (args[0] % 3,))
        with pytest.raises(
            embedpipe.errors.EmbeddingsOffloadedError, match="changes the module's input"
        ):
            batch["inputs_embeds"]
        handle.remove()
        handle = embedding.register_full_backward_hook(lambda m, gin, gout: None)
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="backward hook"):
            batch["inputs_embeds"]
        handle.remove()
        embedding.register_forward_pre_hook(lambda m, args: None)  # changes nothing: runs
        assert torch.equal(batch["inputs_embeds"], table(pipe)[batch["input_ids"]])
        # a second model on the table (alive): which one reads the batch is unknown
        other = embedpipe.hf.OffloadedEmbedding.replacing(Toy().emb, str(tmp_path / "t.zarr"))
        with pytest.raises(
            embedpipe.errors.EmbeddingsOffloadedError, match="cannot tell which model"
        ):
            batch["inputs_embeds"]
        del other


@pytest.mark.parametrize("reads", ["one read a pass", "one read for both"])
def test_two_forward_passes_run_the_hooks_twice(tmp_path, reads):
    """R-Drop, SimCSE: two forward passes on one batch. nn.Embedding runs its hooks at each (two
    noises): so does the pipe, whether the loop reads batch['inputs_embeds'] for each pass or
    gives one read to both (the second pass runs them anew on the read's rows)."""

    def two_passes(model, inputs):
        first, second = model(**inputs()), model(**inputs())
        return nn.functional.mse_loss(first, second) + first.square().mean()

    reference = Toy()
    reference.emb.register_forward_hook(noise)
    dense, adagrad = reference_optimizer(reference)
    for batch in torch.utils.data.DataLoader(samples(12), batch_size=4):
        two_passes(reference, lambda b=batch: {"input_ids": b["input_ids"]}).backward()
        step_both(dense, adagrad)

    model = Toy()
    model.emb.register_forward_hook(noise)
    with offloaded(tmp_path, model) as pipe:
        optimizer = one_optimizer(model, pipe)
        for batch in pipe.loader(samples(12), batch_size=4):
            read = batch["inputs_embeds"] if reads == "one read for both" else None
            embeds = (
                (lambda r=read: r) if read is not None else (lambda b=batch: b["inputs_embeds"])
            )
            two_passes(model, lambda e=embeds: {"inputs_embeds": e()}).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(table(pipe), reference.emb.weight)
        assert torch.equal(model.lin.weight, reference.lin.weight)


def test_a_checkpoint_recomputing_the_forward_sees_the_first_passes_rows(tmp_path):
    """A non-reentrant activation checkpoint around the model recomputes its forward in the
    backward pass, with torch's generator put back: the hooks' noise is the first pass's, as
    nn.Embedding's would be."""
    checkpointed = lambda model, **inputs: torch.utils.checkpoint.checkpoint(  # noqa: E731
        model, use_reentrant=False, **inputs
    )
    reference = Toy()
    reference.emb.register_forward_hook(noise)
    batch = next(iter(torch.utils.data.DataLoader(samples(4), batch_size=4)))
    torch.manual_seed(3)
    checkpointed(reference, input_ids=batch["input_ids"]).square().sum().backward()
    model = Toy()
    model.emb.register_forward_hook(noise)
    with offloaded(tmp_path, model) as pipe:
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        torch.manual_seed(3)
        checkpointed(model, inputs_embeds=batch["inputs_embeds"]).square().sum().backward()
        assert torch.equal(model.lin.weight.grad, reference.lin.weight.grad)


def test_what_the_hooks_did_not_see_is_refused(tmp_path):
    """A slice or a concatenation of a read: the hooks ran on other rows than the model is
    given (NEFTune's noise depends on the shape). Unless every hook gives the same rows
    wherever it runs (transformers' enable_input_require_grads)."""
    model = Toy()
    with offloaded(tmp_path, model) as pipe:
        handle = model.get_input_embeddings().register_forward_hook(noise)
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        read = batch["inputs_embeds"]
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="a part of a read"):
            model(inputs_embeds=read[:, :-1])
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="not a read of"):
            model(inputs_embeds=torch.cat([read, read]))
        handle.remove()

        def make_inputs_require_grads(module, args, output):  # as transformers names it
            output.requires_grad_(True)

        model.get_input_embeddings().register_forward_hook(make_inputs_require_grads)
        read = batch["inputs_embeds"]
        model(inputs_embeds=read[:2]) + model(inputs_embeds=torch.cat([read, read]))[:2]


def test_a_model_put_in_eval_mode_before_offload_stays_there(tmp_path):
    """The placeholder takes the replaced module's mode: a hook that reads it (NEFTune adds
    noise in training only) sees the model's."""
    model = Toy().eval()
    with offloaded(tmp_path, model):
        assert not model.get_input_embeddings().training


def test_a_pipe_on_a_copy_of_the_table_runs_the_models_hooks(tmp_path):
    """A model offloaded to one path, trained on a copy elsewhere (a local disk): attach makes
    the copy's batches the model's (its dtype, scale and hooks)."""
    import shutil

    model = Toy()
    embedpipe.hf.offload(model, tmp_path / "a.zarr", chunk_rows=16).close()
    shutil.copytree(tmp_path / "a.zarr", tmp_path / "b.zarr")
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: out * 0)
    with embedpipe.EmbeddingPipe(tmp_path / "b.zarr", cache_rows=20) as pipe:
        pipe.attach(model)
        batch = next(iter(pipe.loader(samples(4), batch_size=4)))
        assert not batch["inputs_embeds"].any()


def test_restore_gives_the_hooks_back(tmp_path):
    model = Toy()
    calls = []
    model.emb.register_forward_hook(lambda m, args, out: calls.append(1))
    with offloaded(tmp_path, model) as pipe:
        model.get_input_embeddings().register_forward_hook(lambda m, args, out: calls.append(2))
        embedpipe.hf.restore(model, pipe)
    model(input_ids=torch.tensor([[1, 2]]))
    assert calls == [1, 2]
    # a placeholder built by hand (a model rebuilt to resume) restores as an nn.Embedding
    model.set_input_embeddings(embedpipe.hf.OffloadedEmbedding(V, D, str(tmp_path / "t.zarr")))
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: calls.append(3))
    embedpipe.hf.restore(model, tmp_path / "t.zarr")
    model(input_ids=torch.tensor([[1, 2]]))
    assert calls == [1, 2, 3]
