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

import pytest
import torch

import embedpipe
import embedpipe.hf

from ..frameworks import ADAGRAD, bert, samples

pytest.importorskip("transformers", reason="an optional extra")

BEST, STEPS = 3, 6


def loss(model, batch) -> torch.Tensor:
    fields = ("inputs_embeds", "attention_mask", "labels")
    return model(**{k: batch[k] for k in fields}).loss


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
    table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=64)
    pipe = embedpipe.EmbeddingPipe(
        table,
        cache_rows=50,
        optimizer=embedpipe.optim.Adagrad(**ADAGRAD),
        owner=getattr(request, "param", "thread"),
    )
    batches = iter(pipe.loader(samples(4 * (STEPS + 2)), batch_size=4))
    for n in range(1, STEPS + 1):
        loss(model, next(batches)).backward()
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
    assert int(best["bert.embeddings.word_embeddings.embedpipe_step"]) == BEST
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
        loss(model, batch).backward()
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
    loss(model, next(batches)).backward()
    pipe.step()
    del best["bert.embeddings.word_embeddings.embedpipe_step"]  # as an older state dict
    model.load_state_dict(best)
    next(batches)["inputs_embeds"]  # not checked


def test_a_frozen_tables_state_dict_has_no_step(tmp_path):
    model = bert()
    table = embedpipe.hf.offload(model, tmp_path / "t.zarr")
    with embedpipe.EmbeddingPipe(table, cache_rows=50):
        assert not any(k.endswith("embedpipe_step") for k in model.state_dict())
