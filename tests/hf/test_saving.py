"""hf: ``save_pretrained`` on an offloaded model writes the trained word embeddings, so
``from_pretrained`` gives back the model as trained (NOTE [ save_pretrained on an offloaded
model ] in ``embedpipe/hf/saving.py``). Before, the folder had no word embeddings and
``from_pretrained`` initialised them afresh, with one MISSING line in its report."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import embedpipe
import embedpipe.hf

from ..frameworks import ADAGRAD, bert, offloaded, samples, train_table
from .test_hf import V, bart_config

transformers = pytest.importorskip("transformers", reason="an optional extra")

KEY = "bert.embeddings.word_embeddings.weight"
SAVE_AT = 3


def batches(n: int = 6) -> list[dict]:
    data = samples(4 * n)
    return [
        {k: torch.stack([s[k] for s in data[i : i + 4]]) for k in data[0]}
        for i in range(0, len(data), 4)
    ]


def train_reference() -> tuple[torch.Tensor, torch.Tensor]:
    """The word embeddings after SAVE_AT steps and at the end, trained with nn.Embedding."""
    model = bert(dropout=0.0)
    weight = model.get_input_embeddings().weight
    optimizer = torch.optim.Adagrad([weight], **ADAGRAD)
    rows = []
    for n, batch in enumerate(batches(), 1):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if n == SAVE_AT:
            rows.append(weight.detach().clone())
    return rows[0], weight.detach().clone()


def pipe_on(path, owner: str = "thread") -> embedpipe.EmbeddingPipe:
    return embedpipe.EmbeddingPipe(
        path, cache_rows=50, optimizer=embedpipe.optim.Adagrad(**ADAGRAD), owner=owner
    )


def word_embeddings(folder, cls=transformers.BertForSequenceClassification, **kwargs):
    return cls.from_pretrained(folder, **kwargs).get_input_embeddings().weight.detach()


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_save_pretrained_mid_training_and_after_writes_the_trained_rows(tmp_path, owner):
    mid, final = train_reference()
    model = bert(dropout=0.0)
    embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=64).close()

    def save(n: int) -> None:
        if n == SAVE_AT:
            model.save_pretrained(tmp_path / "mid")

    with pipe_on(tmp_path / "t.zarr", owner) as pipe:
        train_table(model, pipe, 24, save)
        model.save_pretrained(tmp_path / "open")
    model.save_pretrained(tmp_path / "closed")  # the table as committed at close
    assert torch.equal(word_embeddings(tmp_path / "mid"), mid)
    assert torch.equal(word_embeddings(tmp_path / "open"), final)
    assert torch.equal(word_embeddings(tmp_path / "closed"), final)
    # saving mid-training changed nothing in the training itself
    assert torch.equal(embedpipe.Table.open(tmp_path / "t.zarr").to_tensor(), final)


def test_a_sharded_save_with_a_variant_and_a_sub_model_load_the_rows(tmp_path):
    model = bert()
    weight = model.get_input_embeddings().weight.detach().clone()
    embedpipe.hf.offload(model, tmp_path / "t.zarr").close()
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB", variant="v1")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.v1.json").read_text())
    assert index["weight_map"][KEY] == "model-embedpipe-word-embeddings.v1.safetensors"
    assert torch.equal(word_embeddings(tmp_path / "sharded", variant="v1"), weight)
    model.bert.save_pretrained(tmp_path / "encoder")  # the rows under the sub-model's key
    assert torch.equal(word_embeddings(tmp_path / "encoder", transformers.BertModel), weight)


def test_a_model_rebuilt_on_the_table_by_hand_saves_the_rows_its_pipe_trained(tmp_path):
    model = bert(dropout=0.0)
    initial = model.get_input_embeddings().weight.detach().clone()
    embedpipe.hf.offload(model, tmp_path / "t.zarr").close()
    rebuilt = bert(seed=1, dropout=0.0)  # a new process resuming: other initial weights
    embedding = embedpipe.hf.OffloadedEmbedding.replacing(
        rebuilt.get_input_embeddings(), str(tmp_path / "t.zarr")
    )
    rebuilt.set_input_embeddings(embedding)
    with pipe_on(tmp_path / "t.zarr") as pipe:  # adopts the module: no attach
        train_table(rebuilt, pipe, 8)
        rebuilt.save_pretrained(tmp_path / "saved")
        trained = pipe.table.to_tensor()
    assert torch.equal(word_embeddings(tmp_path / "saved"), trained)
    assert not torch.equal(trained, initial)  # it trained


def test_push_to_hub_from_save_pretrained_is_refused_before_anything_is_written(tmp_path):
    model = bert()
    with offloaded(model, tmp_path / "t.zarr"):
        with pytest.raises(embedpipe.hf.EmbeddingsOffloadedError, match="push_to_hub"):
            model.save_pretrained(tmp_path / "out", push_to_hub=True)
    assert not (tmp_path / "out").exists()


def test_a_model_not_offloaded_saves_as_transformers_saves_it(tmp_path):
    model = bert()
    model.save_pretrained(tmp_path / "plain")
    assert torch.equal(word_embeddings(tmp_path / "plain"), model.get_input_embeddings().weight)


def test_a_model_attached_to_a_pipe_on_a_copy_saves_the_copys_rows(tmp_path):
    model = bert(dropout=0.0)
    embedpipe.hf.offload(model, tmp_path / "t.zarr").close()
    with pipe_on(tmp_path / "t.zarr") as pipe:
        pipe.save_checkpoint(tmp_path / "copy.zarr")
    with pipe_on(tmp_path / "copy.zarr") as pipe:
        pipe.attach(model)
        train_table(model, pipe, 8)
        model.save_pretrained(tmp_path / "saved")
        trained = pipe.table.to_tensor()
    del pipe
    gc.collect()
    model.save_pretrained(tmp_path / "after")  # the pipe is gone: its table as committed
    assert torch.equal(word_embeddings(tmp_path / "saved"), trained)
    assert torch.equal(word_embeddings(tmp_path / "after"), trained)
    assert not torch.equal(trained, embedpipe.Table.open(tmp_path / "t.zarr").to_tensor())


def test_a_model_offloaded_by_hand_after_the_pipe_saves_the_rows_it_trained(tmp_path):
    model = bert(dropout=0.0)
    embedpipe.hf.offload(model, tmp_path / "t.zarr").close()
    with pipe_on(tmp_path / "t.zarr") as pipe:
        rebuilt = bert(seed=1, dropout=0.0)  # made after the pipe: never attached to it
        rebuilt.set_input_embeddings(
            embedpipe.hf.OffloadedEmbedding.replacing(
                rebuilt.get_input_embeddings(), str(tmp_path / "t.zarr")
            )
        )
        train_table(rebuilt, pipe, 8)
        rebuilt.save_pretrained(tmp_path / "saved")
        trained = pipe.table.to_tensor()
    assert torch.equal(word_embeddings(tmp_path / "saved"), trained)


@pytest.mark.parametrize("second", ["20KB", "50GB"])  # sharded again, or whole
def test_a_save_over_an_earlier_sharded_one_holds_the_new_rows(tmp_path, second):
    model = bert(dropout=0.0)
    embedpipe.hf.offload(model, tmp_path / "t.zarr").close()
    with pipe_on(tmp_path / "t.zarr") as pipe:
        model.save_pretrained(tmp_path / "saved", max_shard_size="20KB")
        train_table(model, pipe, 8)
        model.save_pretrained(tmp_path / "saved", max_shard_size=second)
        trained = pipe.table.to_tensor()
    assert torch.equal(word_embeddings(tmp_path / "saved"), trained)


def test_an_encoder_decoder_untied_and_offloaded_loads_its_encoder_and_decoder_rows(tmp_path):
    """BART's encoder and decoder embeddings are its ``shared`` one; after ``untie``,
    transformers saves ``shared`` alone and gives the two others fresh rows at load (see
    docs/huggingface.md, Tying). Offloaded, the rows are saved under all three names."""
    torch.manual_seed(0)
    config = bart_config()
    model = embedpipe.hf.untie(transformers.BartForConditionalGeneration(config)).eval()
    ids = torch.randint(4, V, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids, decoder_input_ids=ids).logits
    embedpipe.hf.offload(model, tmp_path / "t.zarr").close()
    model.save_pretrained(tmp_path / "saved")
    reloaded = type(model).from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids, decoder_input_ids=ids).logits, expected)


def test_rows_given_in_the_state_dict_are_saved_as_given(tmp_path):
    model = bert()
    given = model.state_dict()
    embedpipe.hf.offload(model, tmp_path / "t.zarr").close()
    given[KEY] = torch.zeros_like(given[KEY])
    model.save_pretrained(tmp_path / "given", state_dict=given)
    assert not word_embeddings(tmp_path / "given").any()
