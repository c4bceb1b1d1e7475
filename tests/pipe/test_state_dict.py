"""A model's state dict keeps the table's step, and loading one taken at another step raises
unless the table's snapshot of that step is loaded too (NOTE [ A state dict keeps the table's
step ] in ``embedpipe/pipe/placeholder.py``).

The pattern: an early stop that goes back to its best weights, ``model.load_state_dict(best)``.
With ``nn.Embedding`` the word embeddings go back too. With the rows in the table they stayed
where training left them: before, the model paired the best dense weights with the last rows,
and ``save_pretrained`` saved that, with no error.
"""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

import embedpipe
import embedpipe.hf
from embedpipe.pipe.rowsource import encoded, taken_at

from ..frameworks import ADAGRAD, bert, embedded_loss, samples, train_table

pytest.importorskip("transformers", reason="an optional extra")

BEST, STEPS = 3, 6
PREFIX = "bert.embeddings.word_embeddings."


def reference(batches: list[dict]) -> torch.Tensor:
    """nn.Embedding + torch Adagrad: the best state (weights and the optimizer's) taken at step
    BEST, loaded back after STEPS, then two more steps."""
    model = bert(dropout=0.0)
    optimizer = torch.optim.Adagrad([model.get_input_embeddings().weight], **ADAGRAD)
    for n, batch in enumerate(batches, 1):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if n == BEST:
            best = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        if n == STEPS:
            model.load_state_dict(best[0])
            optimizer.load_state_dict(best[1])
    return model.get_input_embeddings().weight.detach()


@pytest.fixture
def trained(tmp_path, request):
    """An offloaded BERT whose pipe trained the table STEPS steps; its state dict at step BEST,
    and the table's snapshot then."""
    model = bert(dropout=0.0)
    embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=64).close()
    pipe = embedpipe.EmbeddingPipe(
        tmp_path / "t.zarr",
        cache_rows=50,
        optimizer=embedpipe.optim.Adagrad(**ADAGRAD),
        owner=getattr(request, "param", "thread"),
    )
    batches = iter(pipe.loader(samples(4 * (STEPS + 2)), batch_size=4))
    for n in range(1, STEPS + 1):
        embedded_loss(model, next(batches)).backward()
        pipe.step()
        pipe.parameter.grad = None
        if n == BEST:
            best = copy.deepcopy(model.state_dict())
            pipe.save_checkpoint(tmp_path / "best.zarr")
    yield model, pipe, batches, best
    pipe.close()


@pytest.mark.parametrize("trained", ["thread", "process"], indirect=True)
def test_a_state_dict_of_another_step_raises_at_the_next_read_save_and_restore(tmp_path, trained):
    model, pipe, batches, best = trained
    assert taken_at(best, PREFIX, pop=False) == BEST
    model.load_state_dict(best)  # the dense weights of step 3; the table has taken 6 steps
    batch = next(batches)
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps.*taken 6"):
        batch["inputs_embeds"]
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="snapshot of step 3"):
        model.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="snapshot of step 3"):
        embedpipe.hf.restore(model, pipe)


def test_the_best_state_with_the_tables_snapshot_trains_on_as_nn_embedding(tmp_path, trained):
    model, pipe, batches, best = trained
    model.load_state_dict(best)
    pipe.load_checkpoint(tmp_path / "best.zarr")  # the table, its Adagrad state and step 3
    for batch in batches:  # two more steps
        embedded_loss(model, batch).backward()
        pipe.step()
        pipe.parameter.grad = None
    data = samples(4 * (STEPS + 2))
    stacked = [
        {k: torch.stack([s[k] for s in data[i : i + 4]]) for k in data[0]}
        for i in range(0, len(data), 4)
    ]
    expected = reference(stacked)
    model.save_pretrained(tmp_path / "saved")
    saved = type(model).from_pretrained(tmp_path / "saved").get_input_embeddings().weight
    assert torch.equal(saved, expected)


def test_a_state_dict_of_this_step_or_without_a_step_is_not_refused(trained):
    model, pipe, batches, best = trained
    model.load_state_dict(model.state_dict())  # taken and loaded at step 6
    embedded_loss(model, next(batches)).backward()
    pipe.step()
    del best[PREFIX + "_extra_state"]  # as an older state dict
    model.load_state_dict(best)
    next(batches)["inputs_embeds"]  # not checked


def test_an_evaluation_through_a_frozen_pipe_checks_the_state_dict_too(tmp_path, trained):
    model, pipe, _, best = trained
    pipe.close()
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=50) as frozen:
        assert taken_at(model.state_dict(), PREFIX) == STEPS  # the table's step, frozen too
        model.load_state_dict(best)
        batch = next(iter(frozen.loader(samples(4), batch_size=4)))
        with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps.*taken 6"):
            batch["inputs_embeds"]


def test_a_state_dict_given_to_save_pretrained_is_checked_and_its_step_left_out(tmp_path, trained):
    model, _, _, best = trained
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps"):
        model.save_pretrained(tmp_path / "stale", state_dict=best)
    model.save_pretrained(tmp_path / "now", state_dict=model.state_dict())
    _, info = type(model).from_pretrained(tmp_path / "now", output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]


def test_a_partial_load_after_a_stale_one_leaves_it_checked(trained):
    model, _, batches, best = trained
    model.load_state_dict(best)
    head = {k: v for k, v in model.state_dict().items() if k.startswith("classifier")}
    model.load_state_dict(head, strict=False)  # no step in it: the stale one stays recorded
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps"):
        next(batches)["inputs_embeds"]


def test_the_step_survives_a_cast_of_the_state_dict_to_a_half_precision():
    for dtype in (torch.bfloat16, torch.float16):
        assert taken_at({"e._extra_state": encoded(70_001).to(dtype)}, "e.") == 70_001


def test_torchs_distributed_checkpoint_reads_and_loads_the_state_dict(trained):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model, _, batches, best = trained
    assert taken_at(get_model_state_dict(model), PREFIX) == STEPS
    set_model_state_dict(model, best)  # stale: raises at the read, as load_state_dict does
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps"):
        next(batches)["inputs_embeds"]


def test_an_older_model_on_the_table_left_with_a_stale_state_dict_is_not_checked(tmp_path):
    """A notebook cell run again: the first run's model, kept alive by a traceback, holds a
    stale load; the new run offloads a new model over the same path and trains."""
    first = bert(dropout=0.0)
    table = embedpipe.hf.offload(first, tmp_path / "t.zarr")
    with embedpipe.EmbeddingPipe(
        table, cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.1)
    ) as pipe:
        train_table(first, pipe, 4)
        state = first.state_dict()
        train_table(first, pipe, 4)
        first.load_state_dict(state)  # taken at step 1; the table is at step 2
    table.close()
    second = bert(dropout=0.0)
    table = embedpipe.hf.offload(second, tmp_path / "t.zarr", overwrite=True)
    with embedpipe.EmbeddingPipe(
        table, cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.1)
    ) as pipe:
        train_table(second, pipe, 8)
    assert first is not None


def test_a_frozen_evaluation_of_the_matching_snapshot_leaves_the_training_table_checked(
    tmp_path, trained
):
    """The best weights evaluated on the best table's copy: right. Training on with the best
    weights and the last table's rows is not, and still raises."""
    model, _, batches, best = trained
    model.load_state_dict(best)
    with embedpipe.EmbeddingPipe(tmp_path / "best.zarr", cache_rows=50) as snapshot:
        snapshot.attach(model)
        next(iter(snapshot.loader(samples(4), batch_size=4)))["inputs_embeds"]
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps.*taken 6"):
        next(batches)["inputs_embeds"]


def test_a_frozen_pipe_on_an_older_step_changes_neither_what_is_saved_nor_the_step(
    tmp_path, trained
):
    model, pipe, _, _ = trained
    pipe.close()  # the table committed at step 6
    trained_rows = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    older_table = embedpipe.Table.open(tmp_path / "t.zarr", step=BEST)
    with embedpipe.EmbeddingPipe(older_table, cache_rows=50) as older:
        next(iter(older.loader(samples(4), batch_size=4)))["inputs_embeds"]
        assert taken_at(model.state_dict(), PREFIX) == STEPS
        model.save_pretrained(tmp_path / "saved")
    saved = type(model).from_pretrained(tmp_path / "saved").get_input_embeddings().weight
    assert torch.equal(saved, trained_rows)


def test_rows_given_with_a_state_dict_are_not_checked_against_the_table(tmp_path, trained):
    model, _, _, best = trained
    with embedpipe.Table.open(tmp_path / "best.zarr") as snapshot:
        best[PREFIX + "weight"] = snapshot.to_tensor()  # the best weights, word embeddings too
    model.save_pretrained(tmp_path / "saved", state_dict=best)
    saved = type(model).from_pretrained(tmp_path / "saved").get_input_embeddings().weight
    assert torch.equal(saved, best[PREFIX + "weight"])


def test_a_save_on_the_matching_snapshot_leaves_the_record_for_training(tmp_path, trained):
    model, pipe, _, best = trained
    pipe.close()  # the table at step 6
    model.load_state_dict(best)
    with embedpipe.EmbeddingPipe(tmp_path / "best.zarr", cache_rows=50) as snapshot:
        snapshot.attach(model)
        next(iter(snapshot.loader(samples(4), batch_size=4)))["inputs_embeds"]
        model.save_pretrained(tmp_path / "saved")  # the best weights with the best rows: right
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps"):
        with embedpipe.EmbeddingPipe(
            tmp_path / "t.zarr", cache_rows=50, optimizer=embedpipe.optim.Adagrad(**ADAGRAD)
        ) as again:  # training on from the last table's rows: not
            next(iter(again.loader(samples(4), batch_size=4)))["inputs_embeds"]


def test_restored_from_the_matching_snapshot_leaves_the_record(tmp_path, trained):
    model, _, batches, best = trained
    model.load_state_dict(best)
    with embedpipe.hf.restored(model, tmp_path / "best.zarr"):
        pass
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 3 steps"):
        next(batches)["inputs_embeds"]


def test_a_state_dict_taken_after_a_load_holds_the_loaded_step(trained):
    model, _, _, best = trained
    model.load_state_dict(best)  # not yet checked: the weights are step 3's
    assert taken_at(model.state_dict(), PREFIX) == BEST


def test_a_model_pickled_whole_keeps_the_tables_step(tmp_path, trained):
    """``torch.save(model)`` holds no rows, and the model it loads reads the table as it is
    then: the table's step goes with it, checked as a state dict's (a model of step 6 saved at
    step 7 raises; one of the table's step saves its rows)."""
    model, pipe, batches, _ = trained
    pickled = io.BytesIO()
    torch.save(model, pickled)  # at step 6
    embedded_loss(model, next(batches)).backward()
    pipe.step()
    pipe.parameter.grad = None
    pickled.seek(0)
    stale = torch.load(pickled, weights_only=False)
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 6 steps.*taken 7"):
        stale.save_pretrained(tmp_path / "stale")
    with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="taken 6 steps.*taken 7"):
        next(batches)["inputs_embeds"]  # the batch cannot tell which model will read it
    del stale
    gc.collect()
    pickled = io.BytesIO()
    torch.save(model, pickled)
    pickled.seek(0)
    torch.load(pickled, weights_only=False).save_pretrained(tmp_path / "saved")
    saved = type(model).from_pretrained(tmp_path / "saved").get_input_embeddings().weight
    assert torch.equal(saved.detach(), pipe.table.to_tensor())
