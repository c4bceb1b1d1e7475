"""hf: offload a model's word embeddings bit for bit, free them, refuse tied or bf16 tables, untie."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe import errors
from embedpipe.hf import (
    EmbeddingsOffloadedError,
    OffloadedEmbedding,
    TiedWeightsError,
    embedding_bytes,
    offload,
    untie,
)

from ..conftest import tiny_bert_config

transformers = pytest.importorskip("transformers")

V, D = 1000, 32


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bert(cls_name: str = "BertModel", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(tiny_bert_config(V, **overrides)).eval()


def llama(tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=64, tie_word_embeddings=tie
    )
    config.bos_token_id = config.eos_token_id = V - 1
    return transformers.GPT2LMHeadModel(config).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row, so the attention mask matters
    return ids, mask


def test_offload_writes_the_weight_bit_for_bit_and_frees_it(tmp_path):
    model = bert()
    weight = model.get_input_embeddings().weight
    original, gone = weight.detach().clone(), weakref.ref(weight)
    before = parameter_bytes(model)
    del weight

    table = offload(model, tmp_path / "vocab.zarr", chunk_rows=64)

    assert (table.num_rows, table.dim, table.dtype) == (V, D, np.dtype("float32"))
    assert np.array_equal(
        table.to_tensor().numpy().view(np.uint32), original.numpy().view(np.uint32)
    )
    assert parameter_bytes(model) == before - V * D * 4
    gc.collect()
    assert gone() is None, "the old embedding Parameter is still referenced somewhere"
    placeholder = model.get_input_embeddings()
    assert isinstance(placeholder, OffloadedEmbedding)
    assert (placeholder.num_embeddings, placeholder.embedding_dim) == (V, D)
    assert (placeholder.padding_idx, placeholder.path) == (0, table.path)
    assert [p.shape for p in placeholder.parameters()] == [(0, D)]  # a pipe's gradient, empty
    assert list(placeholder.buffers()) == []
    assert not any("word_embeddings" in k for k in model.state_dict())
    table.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: bert("BertModel"),
        lambda: bert("BertForSequenceClassification", num_labels=3),
        llama,
        gpt2,
    ],
    ids=["BertModel", "BertForSequenceClassification", "LlamaForCausalLM", "GPT2LMHeadModel"],
)
def test_inputs_embeds_after_offload_equal_input_ids_before(tmp_path, make):
    model = make()
    ids, mask = batch()
    weight = model.get_input_embeddings().weight.detach().clone()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask)[0]
        offload(model, tmp_path / "vocab.zarr").close()
        # inputs_embeds: (B, L, D), the rows the loader would gather
        got = model(inputs_embeds=weight[ids], attention_mask=mask)[0]
    assert torch.equal(got, expected)


def test_offloaded_model_refuses_input_ids_with_the_remedy(tmp_path):
    model = bert()
    table = offload(model, tmp_path / "vocab.zarr")
    ids, mask = batch()
    with pytest.raises(EmbeddingsOffloadedError, match="inputs_embeds") as info:
        model(input_ids=ids, attention_mask=mask)
    assert table.path in str(info.value) and isinstance(info.value, RuntimeError)
    with pytest.raises(EmbeddingsOffloadedError, match="live in"):
        model.get_input_embeddings().weight  # noqa: B018
    with pytest.raises(EmbeddingsOffloadedError, match="resize the vocabulary before"):
        model.resize_token_embeddings(V + 8)  # reads the weight: the message says what to do
    assert not hasattr(model.get_input_embeddings(), "weight")
    with pytest.raises(EmbeddingsOffloadedError, match="already offloaded"):
        offload(model, tmp_path / "again.zarr")
    table.close()


@pytest.mark.parametrize(
    ("make", "input_name", "output_name"),
    [
        (
            lambda: bert("BertForMaskedLM"),
            "bert.embeddings.word_embeddings.weight",
            "cls.predictions.decoder.weight",
        ),
        (lambda: gpt2(tie=True), "transformer.wte.weight", "lm_head.weight"),
    ],
    ids=["BertForMaskedLM", "GPT2LMHeadModel"],
)
def test_tied_model_is_refused_before_anything_is_written(tmp_path, make, input_name, output_name):
    model = make()
    embeddings = model.get_input_embeddings()
    path = tmp_path / "vocab.zarr"
    with pytest.raises(TiedWeightsError) as info:
        offload(model, path)
    message = str(info.value)
    assert input_name in message and output_name in message
    assert "embedpipe.hf.untie(model)" in message and isinstance(info.value, ValueError)
    assert not path.exists()
    assert model.get_input_embeddings() is embeddings  # model untouched
    assert model.get_output_embeddings().weight is embeddings.weight


def test_untie_then_offload_keeps_the_mlm_outputs(tmp_path):
    model = bert("BertForMaskedLM")
    ids, mask = batch()
    weight = model.get_input_embeddings().weight.detach().clone()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits

    assert untie(model) is model
    decoder = model.get_output_embeddings().weight
    assert decoder is not model.get_input_embeddings().weight
    assert decoder.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(decoder, weight)
    assert model.config.tie_word_embeddings is False
    model.tie_weights()  # re-reads the config: must not tie them again
    model.post_init()
    assert model.get_output_embeddings().weight is decoder

    before = parameter_bytes(model)
    offload(model, tmp_path / "vocab.zarr").close()
    assert parameter_bytes(model) == before - V * D * 4
    out = model(inputs_embeds=weight[ids], attention_mask=mask, labels=ids)
    assert torch.equal(out.logits, expected)
    out.loss.backward()
    assert decoder.grad is not None and decoder.grad.shape == (V, D)


def test_bfloat16_model_is_refused_with_the_cast(tmp_path):
    model = bert().to(torch.bfloat16)
    path = tmp_path / "vocab.zarr"
    with pytest.raises(errors.InvalidRowsError, match=r"bfloat16.*\.float\(\)"):
        offload(model, path)
    assert not path.exists()
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    # the remedy works: a float32 table, bit for bit the bf16 values
    expected = model.get_input_embeddings().weight.detach().float()
    model.get_input_embeddings().float()
    with offload(model, path) as table:
        assert torch.equal(table.to_tensor(), expected)


def test_existing_path_is_refused_and_the_model_kept(tmp_path):
    embedpipe.Table.create(tmp_path / "vocab.zarr", 10, 4).close()
    model = bert()
    embeddings = model.get_input_embeddings()
    with pytest.raises(errors.TableExistsError):
        offload(model, tmp_path / "vocab.zarr")
    assert model.get_input_embeddings() is embeddings
    offload(model, tmp_path / "vocab.zarr", overwrite=True).close()
    assert isinstance(model.get_input_embeddings(), OffloadedEmbedding)


def test_placeholder_follows_model_to(tmp_path):
    model = bert()
    offload(model, tmp_path / "vocab.zarr").close()
    model.to(torch.float64)
    assert model.get_input_embeddings().dtype == torch.float64
    assert model.get_input_embeddings().device == torch.device("cpu")


def test_embedding_bytes(tmp_path):
    assert embedding_bytes((30522, 768)) == 30522 * 768 * 16  # BERT-base with Adam
    assert embedding_bytes((V, D), "sgd") == V * D * 4 * 2
    assert embedding_bytes((V, D), "Adagrad") == V * D * 4 * 3
    assert embedding_bytes((V, D), "adamw") == V * D * 4 * 4
    assert embedding_bytes((V, D), None) == V * D * 4
    assert embedding_bytes((V, D), "adam", dtype=torch.float16) == V * D * 2 * 4
    model = bert()
    assert embedding_bytes(model) == V * D * 4 * 4
    assert embedding_bytes(model.get_input_embeddings(), "sgd") == V * D * 4 * 2
    with offload(model, tmp_path / "vocab.zarr") as table:
        assert embedding_bytes(model) == embedding_bytes(table) == V * D * 4 * 4
    with pytest.raises(ValueError, match="optimizer must be one of"):
        embedding_bytes((V, D), "lion")
