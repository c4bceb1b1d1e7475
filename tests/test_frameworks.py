"""Plain loops, Accelerate and Lightning against the same loop with nn.Embedding: the same table.

Every run clips with a norm small enough to clip every step, so the table's gradient must be in
the one global norm; most accumulate over 2 batches and fetch one batch ahead (Accelerate's
DataLoaderShard and Lightning on a dataset without ``__len__`` do), so the rows must be final
when the model reads them, not when ``next()`` returned the batch.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.nn.utils import clip_grad_norm_

import embedpipe

from .frameworks import (
    DENSE_LR,
    TABLE_LR,
    bert,
    dense_state,
    offloaded,
    samples,
    with_adagrad_table,
)
from .helpers import Stream, slow

pytest.importorskip("transformers")

CLIP = 0.05


def dense_parameters(model):
    return [p for n, p in model.named_parameters() if "word_embeddings" not in n]


def warmup(optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def batches_one_ahead(loader):
    """What a prefetching framework does: the next batch is fetched before this one trains."""
    iterator = iter(loader)
    ahead = next(iterator, None)
    while ahead is not None:
        batch, ahead = ahead, next(iterator, None)
        yield batch


def plain_loop(model, optimizer, batches, *, inputs, accumulate=2, schedule=True):
    """The loop people write: accumulate, clip the model's parameters, step, schedule."""
    scheduler = warmup(optimizer) if schedule else None
    for i, batch in enumerate(batches):
        out = model(**inputs(batch), labels=batch["labels"])
        (out.loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()


def reference_inputs(batch):
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def offloaded_inputs(batch):
    return {"inputs_embeds": batch["inputs_embeds"], "attention_mask": batch["attention_mask"]}


def reference_run(data, batch_size=4, model=None, wrap=lambda model: model, **loop):
    """The plain loop on ``model`` (run as ``wrap(model)``) with nn.Embedding: (table, model)."""
    model = bert() if model is None else model
    optimizer = with_adagrad_table(
        torch.optim.AdamW(dense_parameters(model), lr=DENSE_LR, eps=1e-6),
        model.get_input_embeddings().weight,
    )
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size)
    plain_loop(wrap(model), optimizer, loader, inputs=reference_inputs, **loop)
    return model.get_input_embeddings().weight.detach(), model


@pytest.fixture(scope="module")
def data():
    return samples(32)


@pytest.fixture(scope="module")
def reference(data):
    return reference_run(data)


@pytest.mark.parametrize("ahead", [False, True], ids=["next-then-train", "one-ahead"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_plain_loop_with_its_own_table_group_is_exact(tmp_path, data, reference, ahead, workers):
    model = bert()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        loader = pipe.loader(data, batch_size=4, num_workers=workers)
        batches = batches_one_ahead(loader) if ahead else loader
        plain_loop(model, table_group_optimizer(model, pipe), batches, inputs=offloaded_inputs)
    same_as_reference(tmp_path, model, reference)


def table_group_optimizer(model, pipe) -> torch.optim.Optimizer:
    """AdamW on the dense weights, and the table's parameter in a group of its own."""
    return torch.optim.AdamW(
        [{"params": dense_parameters(model)}, {"params": [pipe.parameter], "lr": TABLE_LR}],
        lr=DENSE_LR,
        eps=1e-6,
    )


def same_as_reference(tmp_path, model, reference) -> None:
    """The table at ``tmp_path / "t.zarr"`` and ``model``'s dense weights, bit for bit."""
    table = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.equal(table, reference[0])
    assert dense_state(model).keys() == dense_state(reference[1]).keys()
    assert all(torch.equal(v, dense_state(reference[1])[k]) for k, v in dense_state(model).items())


def checkpointed(reentrant: bool):
    """A tiny BERT whose layers run their forward again in backward (activation checkpointing,
    dropout's random state restored)."""
    model = bert()
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.25
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": reentrant})
    return model


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_trains_as_with_nn_embedding(tmp_path, data, reentrant):
    reference = reference_run(data, model=checkpointed(reentrant))
    model = checkpointed(reentrant)
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        loader = pipe.loader(data, batch_size=4, num_workers=2)
        plain_loop(model, table_group_optimizer(model, pipe), loader, inputs=offloaded_inputs)
    same_as_reference(tmp_path, model, reference)


@pytest.mark.parametrize("backend", ["aot_eager", slow("inductor")])
def test_a_compiled_model_trains_as_with_nn_embedding(tmp_path, data, backend):
    """torch.compile traces the forward and the backward around the pipe's rows (aot_eager: the
    autograd graph inductor would get; inductor: generated C++ kernels, as users run it)."""
    if backend == "inductor" and shutil.which("g++") is None:
        pytest.skip("inductor on CPU needs a C++ compiler (g++)")

    def compiled(model):
        return torch.compile(model, backend=backend)

    reference = reference_run(data, wrap=compiled)
    model = bert()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        loader = pipe.loader(data, batch_size=4, num_workers=2)
        optimizer = table_group_optimizer(model, pipe)
        plain_loop(compiled(model), optimizer, loader, inputs=offloaded_inputs)
    same_as_reference(tmp_path, model, reference)


def test_adamw_over_model_parameters_trains_the_table_at_its_own_rate(tmp_path, data):
    # No scheduler: the table's group is shared with the dense weights, the factor is 1.
    expected, _ = reference_run(data, schedule=False)
    model = bert()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        optimizer = torch.optim.AdamW(model.parameters(), lr=DENSE_LR, eps=1e-6)
        assert any(p is pipe.parameter for p in model.parameters())
        plain_loop(
            model,
            optimizer,
            pipe.loader(data, batch_size=4),
            inputs=offloaded_inputs,
            schedule=False,
        )
        assert not optimizer.state.get(pipe.parameter)  # AdamW never saw a gradient of it
    assert torch.equal(embedpipe.Table.open(tmp_path / "t.zarr").to_tensor(), expected)


def test_clipping_without_the_table_would_differ(tmp_path, data, reference):
    """The test above can fail: clipping only the dense weights trains another table."""
    model = bert()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        optimizer = table_group_optimizer(model, pipe)
        scheduler = warmup(optimizer)
        for i, batch in enumerate(pipe.loader(data, batch_size=4)):
            (model(**offloaded_inputs(batch), labels=batch["labels"]).loss / 2).backward()
            if i % 2:
                clip_grad_norm_(dense_parameters(model), CLIP)
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
    table = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert float((table - reference[0]).abs().max()) > 1e-3


def test_zero_grad_drops_the_tables_gradient_as_it_drops_any(tmp_path, data):
    model = bert()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        optimizer = torch.optim.AdamW(model.parameters())
        batch = next(iter(pipe.loader(data, batch_size=4)))
        model(**offloaded_inputs(batch), labels=batch["labels"]).loss.backward()
        assert pipe.parameter.grad is not None
        optimizer.zero_grad()
        assert pipe.parameter.grad is None
        assert not pipe.step()  # nothing pending
    assert embedpipe.Table.open(tmp_path / "t.zarr").step == 0


def test_a_pipe_in_a_process_group_of_two_raises_naming_what_works(tmp_path, monkeypatch):
    embedpipe.Table.create(tmp_path / "t.zarr", 50, 4).close()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(embedpipe.errors.DistributedNotSupportedError, match="rank 1 of 2"):
        embedpipe.EmbeddingPipe(
            tmp_path / "t.zarr", cache_rows=10, optimizer=embedpipe.optim.SGD(lr=1)
        )
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=10) as frozen:  # reads are fine
        assert frozen.optimizer is None
    embedpipe.Table.open(tmp_path / "t.zarr", "r+").close()  # nothing left locked


def test_padding_comes_from_the_offloaded_model_by_default(tmp_path, data):
    model = bert()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        assert pipe.padding_idx == 0
        ragged = [{"input_ids": list(range(1, 1 + n)), "labels": n % 2} for n in (3, 5, 4)]
        batch = next(iter(pipe.loader(ragged, batch_size=3)))
        assert batch["input_ids"].tolist()[0] == [1, 2, 3, 0, 0]
        assert batch["attention_mask"].tolist()[0] == [1, 1, 1, 0, 0]
        assert batch["inputs_embeds"].shape == (3, 5, 32)


# ------------------------------------------------------------------------------------ Accelerate
def accelerate_run(model, optimizer, loader, inputs, *, save_at=None, resume=None):
    """An Accelerate loop: accumulate 2, clip when gradients sync, schedule; ``save_at`` saves
    the state after that many batches; ``resume`` loads one and skips the batches it had seen."""
    accelerate = pytest.importorskip("accelerate")
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    pipe = getattr(loader, "pipe", None)
    if pipe is not None:  # the table goes with the rest of the state
        accelerator.register_save_state_pre_hook(
            lambda models, weights, folder: pipe.save_checkpoint(os.path.join(folder, "table"))
        )
        accelerator.register_load_state_pre_hook(
            lambda models, folder: pipe.load_checkpoint(os.path.join(folder, "table"))
        )
    scheduler = warmup(optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    assert isinstance(loader, accelerate.data_loader.DataLoaderShard)  # prepared, not passed by
    batches = loader
    if resume is not None:
        accelerator.load_state(resume[0])
        batches = accelerator.skip_first_batches(loader, resume[1])
    for i, batch in enumerate(batches):
        with accelerator.accumulate(model):
            accelerator.backward(model(**inputs(batch), labels=batch["labels"]).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if save_at is not None and i + 1 == save_at:
            accelerator.save_state(save_at and str(pipe.table.path) + ".state")
    return model


def test_accelerate_prepares_the_loader_and_trains_the_same_table(tmp_path):
    data = samples(36)  # 9 batches: groups of 2, 2, 2, 2, 1
    reference = bert(dropout=0.0)
    dense = torch.optim.AdamW(dense_parameters(reference), lr=DENSE_LR, eps=1e-6)
    optimizer = with_adagrad_table(dense, reference.get_input_embeddings().weight)
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    accelerate_run(reference, optimizer, loader, reference_inputs)
    expected = reference.get_input_embeddings().weight.detach()

    runs = {}
    for name, resume in (("whole", None), ("resumed", 4)):
        model = bert(dropout=0.0)
        with offloaded(model, tmp_path / f"{name}.zarr") as pipe:
            optimizer = table_group_optimizer(model, pipe)
            loader = pipe.loader(data, batch_size=4, num_workers=2)
            state = (str(tmp_path / "whole.zarr") + ".state", resume) if resume else None
            model = accelerate_run(
                model,
                optimizer,
                loader,
                offloaded_inputs,
                save_at=4 if name == "whole" else None,
                resume=state,
            )
        runs[name] = (embedpipe.Table.open(tmp_path / f"{name}.zarr").to_tensor(), model)
    assert torch.equal(runs["whole"][0], expected)
    assert all(
        torch.equal(v, dense_state(reference)[k]) for k, v in dense_state(runs["whole"][1]).items()
    )
    assert torch.equal(runs["resumed"][0], expected)  # load_state + skip_first_batches


@pytest.mark.parametrize("split", [False, True])  # split_batches: a slice of each batch
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["huggingface", "shuffled", "torch", "map-style"])
def test_accelerate_gives_each_process_the_samples_it_gives_without_embedpipe(
    tmp_path, kind, workers, split
):
    """Accelerate's ``prepare`` over 2 processes (``dispatch_batches=False``) splits a dataset by
    its type: a Hugging Face stream into file shards, another iterable into slices of groups of
    batches, a map-style one by its batch sampler; with ``split_batches`` each process takes a
    slice of every batch. Each process's batches through the pipe's loader are those of a
    DataLoader over the same dataset, and their embeddings its rows."""
    accelerate = pytest.importorskip("accelerate")
    data = samples(40)
    if kind in ("huggingface", "shuffled"):
        datasets = pytest.importorskip("datasets")
        rows = [{k: v.tolist() for k, v in sample.items()} for sample in data]

        def dataset():
            stream = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=4)
            stream = stream.shuffle(seed=0, buffer_size=8) if kind == "shuffled" else stream
            return stream.with_format("torch")
    else:

        def dataset():
            return Stream(data) if kind == "torch" else data

    def batches(loader, process):
        prepared = accelerate.data_loader.prepare_data_loader(
            loader,
            num_processes=2,
            process_index=process,
            split_batches=split,
            dispatch_batches=False,
            put_on_device=False,
        )
        return list(prepared)

    model = bert()
    weight = model.get_input_embeddings().weight.detach().clone()
    collate = embedpipe.collate.PadCollator(0, "input_ids")
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        shares = []
        for process in (0, 1):
            loader = torch.utils.data.DataLoader(
                dataset(), batch_size=4, num_workers=workers, collate_fn=collate
            )
            expected = [b["input_ids"] for b in batches(loader, process)]
            loader = pipe.loader(dataset(), batch_size=4, num_workers=workers)
            got = batches(loader, process)
            assert [b["input_ids"].tolist() for b in got] == [e.tolist() for e in expected]
            for batch in got:
                assert torch.equal(batch["inputs_embeds"], weight[batch["input_ids"]])
            shares.append(expected)
        assert shares[0] and shares[1] and not torch.equal(shares[0][0], shares[1][0])


# ------------------------------------------------------------------------------------ Lightning
class Unsized(torch.utils.data.IterableDataset):
    """A dataset without ``__len__``: Lightning then fetches one batch ahead."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


def lightning_module(model, inputs, make_optimizer=None, make_loader=None):
    """A LightningModule over ``model``: it trains on the loss (``make_optimizer`` and a warmup),
    logs it in validation, and predicts the logits; ``make_loader()`` in its ``val_dataloader``
    and ``predict_dataloader`` hooks, if given."""
    lightning = pytest.importorskip("lightning")

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        if make_loader is not None:

            def val_dataloader(self):
                return make_loader()

            def predict_dataloader(self):
                return make_loader()

        def training_step(self, batch, index):
            return self.model(**inputs(batch), labels=batch["labels"]).loss

        def validation_step(self, batch, index):
            self.log("loss", self.model(**inputs(batch), labels=batch["labels"]).loss)

        def predict_step(self, batch, index):
            return self.model(**inputs(batch)).logits

        def configure_optimizers(self):
            optimizer = make_optimizer(self.model)
            schedule = {"scheduler": warmup(optimizer), "interval": "step"}
            return {"optimizer": optimizer, "lr_scheduler": schedule}

    return Module()


def lightning_fit(
    model,
    make_optimizer,
    loader,
    inputs,
    *,
    callbacks=(),
    epochs=2,
    ckpt=None,
    root,
    validation=None,
    **options,
):
    lightning = pytest.importorskip("lightning")
    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(
        dirpath=root, every_n_epochs=1, save_top_k=-1
    )
    trainer = lightning.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        gradient_clip_val=CLIP,
        accumulate_grad_batches=2,
        callbacks=[*callbacks, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        **{"devices": 1, **options},
    )
    module = lightning_module(model, inputs, make_optimizer)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=validation, ckpt_path=ckpt)
    return trainer


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_validates_and_predicts_as_with_nn_embedding(tmp_path, workers, hook):
    """Lightning evaluates under torch.inference_mode() (the batches' ids then have no version
    counter, in the workers it forks too) and remakes a loader to predict (an index wrapper
    around its batch sampler), from its arguments where a ``*_dataloader`` hook made it: the
    same loss and logits, bit for bit, as nn.Embedding's."""
    lightning = pytest.importorskip("lightning")
    data = samples(20)
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    options["enable_model_summary"] = False

    def evaluate(model, make_loader, inputs):
        trainer = lightning.Trainer(default_root_dir=tmp_path, **options)
        module = lightning_module(model, inputs, make_loader=make_loader if hook else None)
        given = {} if hook else {"dataloaders": make_loader()}
        loss = trainer.validate(module, verbose=False, **given)[0]["loss"]
        given = {} if hook else {"dataloaders": make_loader()}
        return loss, torch.cat(trainer.predict(module, **given))

    reference = bert(dropout=0.0).eval()
    expected = evaluate(
        reference,
        lambda: torch.utils.data.DataLoader(data, batch_size=4, num_workers=workers),
        reference_inputs,
    )
    model = bert(dropout=0.0).eval()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        got = evaluate(
            model,
            lambda: pipe.loader(data, batch_size=4, num_workers=workers),
            offloaded_inputs,
        )
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1]) and len(got[1]) == len(data)


def test_lightning_validates_every_epoch_while_the_table_trains_as_with_nn_embedding(tmp_path):
    """fit with a shuffled training loader and a validation loader, both the pipe's, 2 workers:
    its sanity check, then a validation each epoch under inference mode, between steps. The
    last validation loss, the table and the dense weights as nn.Embedding's, bit for bit."""
    data, held_out = samples(24), samples(12, seed=1)

    def reference_optimizer(model):
        dense = torch.optim.AdamW(dense_parameters(model), lr=DENSE_LR, eps=1e-6)
        return with_adagrad_table(dense, model.get_input_embeddings().weight)

    def fit(model, optimizer, make_loader, inputs, **options):
        torch.manual_seed(1)  # the training loader's shuffle
        loader = make_loader(data, batch_size=4, shuffle=True, num_workers=2)
        validation = make_loader(held_out, batch_size=4, num_workers=2)
        trainer = lightning_fit(
            model, optimizer, loader, inputs, root=tmp_path, validation=validation, **options
        )
        return float(trainer.callback_metrics["loss"])

    reference = bert(dropout=0.0)
    expected = fit(reference, reference_optimizer, torch.utils.data.DataLoader, reference_inputs)
    model = bert(dropout=0.0)
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        from embedpipe.lightning import PipeCallback

        def optimizer(m):
            groups = [{"params": dense_parameters(m)}, {"params": [pipe.parameter], "lr": TABLE_LR}]
            return torch.optim.AdamW(groups, lr=DENSE_LR, eps=1e-6)

        got = fit(model, optimizer, pipe.loader, offloaded_inputs, callbacks=[PipeCallback(pipe)])
    assert got == expected
    trained = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.equal(trained, reference.get_input_embeddings().weight.detach())
    assert all(torch.equal(v, dense_state(reference)[k]) for k, v in dense_state(model).items())


@pytest.mark.parametrize("policy", ["auto", "lru"])  # lru: the plain BatchSampler, no Foresight
def test_lightning_remakes_the_pipes_loader_as_it_remakes_a_dataloader(tmp_path, policy):
    """Lightning remakes a loader to predict (an index wrapper around its batch sampler) and,
    under DDP, to put its DistributedSampler in it; one loader passed in may be remade several
    times (predict, then fit). Each rank's batches through the pipe's loader, remade twice, are
    those of a DataLoader remade so, shuffled or not, batched or not, and Lightning sees the
    same shuffling; the loader is still the pipe's."""
    pytest.importorskip("lightning")
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader

    data = samples(20)
    table = embedpipe.hf.offload(bert(), tmp_path / "t.zarr", chunk_rows=64)
    with embedpipe.EmbeddingPipe(table, cache_rows=50, policy=policy) as pipe:
        for options in (dict(batch_size=4, shuffle=False), dict(batch_size=4, shuffle=True)):
            for rank in (0, 1):

                def remade(loader, rank=rank, shuffle=options["shuffle"]):
                    _update_dataloader(loader, loader.sampler, RunningStage.PREDICTING)
                    assert _is_dataloader_shuffled(loader) == shuffle
                    sampler = torch.utils.data.DistributedSampler(
                        data, num_replicas=2, rank=rank, shuffle=shuffle, seed=3
                    )
                    return _update_dataloader(loader, sampler)

                plain = remade(torch.utils.data.DataLoader(data, **options))
                piped = remade(pipe.loader(data, num_workers=2, **options))
                assert type(piped).__name__ == "PipeLoader"
                expected = [b["input_ids"] for b in plain]
                got = [b["input_ids"] for b in piped]
                assert len(got) == len(expected) == 3
                assert all(torch.equal(a, b) for a, b in zip(got, expected))
        unbatched = _update_dataloader(pipe.loader(data, batch_size=None), None)
        assert [b["input_ids"].tolist() for b in unbatched] == [
            s["input_ids"].tolist() for s in data
        ]


def test_lightning_predicts_through_the_pipes_loader_over_an_iterable(tmp_path):
    """Remade to predict, a loader over an iterable dataset gets no sampler (Lightning passes
    none): the same predictions as over a DataLoader."""
    lightning = pytest.importorskip("lightning")
    data = samples(12)
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)

    def predict(model, loader, inputs):
        trainer = lightning.Trainer(
            default_root_dir=tmp_path, enable_model_summary=False, **options
        )
        return torch.cat(trainer.predict(lightning_module(model, inputs), dataloaders=loader))

    expected = predict(
        bert(dropout=0.0).eval(),
        torch.utils.data.DataLoader(Stream(data), batch_size=4),
        reference_inputs,
    )
    model = bert(dropout=0.0).eval()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        got = predict(model, pipe.loader(Stream(data), batch_size=4), offloaded_inputs)
    assert torch.equal(got, expected)


def test_lightning_clips_accumulates_prefetches_and_checkpoints_the_table(tmp_path):
    lightning = pytest.importorskip("lightning")
    from embedpipe.lightning import PipeCallback

    data = Unsized(samples(36))
    reference = bert(dropout=0.0)

    def reference_optimizer(model):
        dense = torch.optim.AdamW(dense_parameters(model), lr=DENSE_LR, eps=1e-6)
        return with_adagrad_table(dense, model.get_input_embeddings().weight)

    loader = torch.utils.data.DataLoader(data, batch_size=4)
    lightning_fit(reference, reference_optimizer, loader, reference_inputs, root=tmp_path / "ref")
    expected = reference.get_input_embeddings().weight.detach()

    def run(name, **options):
        model = bert(dropout=0.0)
        with offloaded(model, tmp_path / f"{name}.zarr") as pipe:

            def optimizer(m):
                groups = [
                    {"params": dense_parameters(m)},
                    {"params": [pipe.parameter], "lr": TABLE_LR},
                ]
                return torch.optim.AdamW(groups, lr=DENSE_LR, eps=1e-6)

            loader = pipe.loader(data, batch_size=4)  # an iterable: workers would each yield all
            callback = PipeCallback(pipe)
            trainer = lightning_fit(
                model, optimizer, loader, offloaded_inputs, callbacks=[callback], **options
            )
        metrics.update(trainer.callback_metrics)
        return embedpipe.Table.open(tmp_path / f"{name}.zarr").to_tensor(), model

    metrics = {}
    whole, model = run("whole", root=tmp_path / "whole")
    assert torch.equal(whole, expected)
    assert 0 <= float(metrics["embedpipe/hit_rate"]) <= 1  # the pipe's figures in Lightning's log
    assert all(torch.equal(v, dense_state(reference)[k]) for k, v in dense_state(model).items())

    first_epoch = next((tmp_path / "whole").glob("epoch=0*.ckpt"))
    resumed, _ = run("resumed", root=tmp_path / "resumed", ckpt=str(first_epoch))
    assert torch.equal(resumed, whole)
    assert lightning.__version__  # the package the test ran with


def test_lightning_refuses_weights_only_checkpoints_which_would_hold_no_table(tmp_path):
    """``ModelCheckpoint(save_weights_only=True)``: Lightning leaves the callbacks out of such
    checkpoints, with them the table's snapshot ``PipeCallback`` keeps in each: refused before
    the first batch, rather than checkpoints that silently hold no word embeddings."""
    lightning = pytest.importorskip("lightning")
    from embedpipe.lightning import PipeCallback

    model = bert(dropout=0.0)
    with offloaded(model, tmp_path / "t.zarr") as pipe:

        def optimizer(m):
            groups = [{"params": dense_parameters(m)}, {"params": [pipe.parameter]}]
            return torch.optim.AdamW(groups, lr=DENSE_LR, eps=1e-6)

        weights_only = lightning.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path / "steps", save_weights_only=True, every_n_train_steps=1
        )
        callbacks = [PipeCallback(pipe), weights_only]
        loader = pipe.loader(samples(8), batch_size=4)
        with pytest.raises(ValueError, match="save_weights_only=True"):
            lightning_fit(
                model, optimizer, loader, offloaded_inputs, callbacks=callbacks, root=tmp_path
            )
        assert pipe._owner.submitted == 0
        evaluating = lightning.Trainer(callbacks=callbacks, logger=False)  # writes no checkpoint
        callbacks[0].setup(
            evaluating, lightning_module(model, offloaded_inputs, optimizer), "validate"
        )


def test_lightning_validates_a_checkpoint_with_its_table_and_refuses_one_without(tmp_path):
    """``validate(ckpt_path=...)`` loads the module's weights of that checkpoint: with
    ``PipeCallback`` the table's snapshot comes back too; without it the table stays where
    training left it, and the first batch raises (NOTE [ A state dict keeps the table's step ])
    instead of validating the old weights with the new rows."""
    lightning = pytest.importorskip("lightning")
    from embedpipe.lightning import PipeCallback

    data = samples(16)  # 4 batches an epoch, 2 steps (accumulate_grad_batches=2)
    model = bert(dropout=0.0)
    with offloaded(model, tmp_path / "t.zarr") as pipe:

        def optimizer(m):
            groups = [{"params": dense_parameters(m)}, {"params": [pipe.parameter]}]
            return torch.optim.AdamW(groups, lr=DENSE_LR, eps=1e-6)

        loader = pipe.loader(data, batch_size=4)
        callbacks = [PipeCallback(pipe)]
        trainer = lightning_fit(
            model, optimizer, loader, offloaded_inputs, callbacks=callbacks, root=tmp_path
        )
        first_epoch = str(next(tmp_path.glob("epoch=0*.ckpt")))
        module, options = trainer.lightning_module, dict(accelerator="cpu", devices=1)
        options.update(logger=False, enable_progress_bar=False, enable_model_summary=False)
        with pytest.raises(embedpipe.errors.EmbeddingsOffloadedError, match="taken 2 steps"):
            lightning.Trainer(**options).validate(module, loader, ckpt_path=first_epoch)
        lightning.Trainer(callbacks=[PipeCallback(pipe)], **options).validate(
            module, loader, ckpt_path=first_epoch
        )
        assert pipe._owner.submitted == 2  # the table of that checkpoint
