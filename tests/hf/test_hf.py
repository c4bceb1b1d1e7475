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
    restore,
    untie,
)
from embedpipe.pipe.rowsource import taken_at

from ..conftest import tiny_bert_config
from ..frameworks import ADAGRAD, with_adagrad_table

transformers = pytest.importorskip("transformers")

V, D = 1000, 32
PREFIX = "embeddings.word_embeddings."  # BertModel's


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
        bos_token_id=1,
        eos_token_id=[2, 3],  # as Llama 3's: a list
    )
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(tie: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=64, tie_word_embeddings=tie
    )
    config.bos_token_id = config.eos_token_id = V - 1
    return transformers.GPT2LMHeadModel(config).eval()


def gemma() -> torch.nn.Module:
    """Gemma's word embedding multiplies its rows by sqrt(hidden) (a buffer) in its forward."""
    torch.manual_seed(0)
    config = transformers.GemmaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return untie(transformers.GemmaForCausalLM(config)).eval()


def xglm() -> torch.nn.Module:
    """XGLM's (as MBart's, M2M100's...) multiplies them by a float, sqrt(d_model)."""
    torch.manual_seed(0)
    config = transformers.XGLMConfig(
        vocab_size=V,
        d_model=D,
        num_layers=2,
        attention_heads=2,
        ffn_dim=64,
        scale_embedding=True,
        max_position_embeddings=64,
        pad_token_id=1,
    )
    return untie(transformers.XGLMForCausalLM(config)).eval()


def bart_config(**overrides):
    """A tiny BART (transformers 5: its encoder and decoder embeddings are ``shared``)."""
    return transformers.BartConfig(
        vocab_size=V, d_model=D, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_position_embeddings=64, **overrides,
    )  # fmt: skip


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
    state = model.state_dict()  # no rows: the table's step (rowsource.py) in their place
    assert [k for k in state if "word_embeddings" in k] == [f"{PREFIX}_extra_state"]
    assert taken_at(state, PREFIX) == 0
    table.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda: bert("BertModel"),
        lambda: bert("BertForSequenceClassification", num_labels=3),
        llama,
        gpt2,
        gemma,
        xglm,
    ],
    ids=[
        "BertModel",
        "BertForSequenceClassification",
        "LlamaForCausalLM",
        "GPT2LMHeadModel",
        "GemmaForCausalLM",
        "XGLMForCausalLM",
    ],
)
def test_inputs_embeds_after_offload_equal_input_ids_before(tmp_path, make):
    model = make()
    ids, mask = batch()
    weight = model.get_input_embeddings().weight.detach().clone()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask)[0]
        offload(model, tmp_path / "vocab.zarr").close()
        # inputs_embeds: (B, L, D), the rows the loader would gather, as the pipe finishes them
        got = model(
            inputs_embeds=model.get_input_embeddings().finish(weight[ids], None, lambda: ids),
            attention_mask=mask,
        )
    assert torch.equal(got[0], expected)


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


def test_a_hand_written_model_with_a_tied_head_is_refused_too(tmp_path):
    """A model with get_input_embeddings but no get_output_embeddings (found by a probe: an
    AttributeError came out of the check, not the refusal)."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(V, D)
            self.head = torch.nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight

        def get_input_embeddings(self):
            return self.emb

        def set_input_embeddings(self, module):
            self.emb = module

        def forward(self, inputs_embeds):
            return self.head(inputs_embeds)

    model = Tied()
    path = tmp_path / "vocab.zarr"
    with pytest.raises(TiedWeightsError, match=r"emb\.weight is tied to head\.weight.*own copy"):
        offload(model, path)
    assert not path.exists() and isinstance(model.emb, torch.nn.Embedding)


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


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("make", [gemma, xglm], ids=["Gemma", "XGLM"])
def test_a_word_embedding_that_scales_its_rows_trains_and_restores_as_it_was(tmp_path, make, owner):
    """Gemma's and XGLM's embedding multiply the rows by embed_scale in their forward, which a
    model given inputs_embeds skips: the pipe's inputs_embeds carry the scale, so the model, its
    gradient and the table train bit for bit as with the embedding in the model."""
    generator = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(2, V, (16, 8), generator=generator)
    ]
    reference = make().train()
    weight = reference.get_input_embeddings().weight
    optimizer = with_adagrad_table(
        torch.optim.AdamW([p for p in reference.parameters() if p is not weight], lr=1e-3), weight
    )
    for batch_ in torch.utils.data.DataLoader(data, batch_size=4):
        reference(input_ids=batch_["input_ids"], labels=batch_["labels"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    model = make().train()
    scaled = type(model.get_input_embeddings())
    table = offload(model, tmp_path / "vocab.zarr", chunk_rows=64)
    adagrad = embedpipe.optim.Adagrad(**ADAGRAD)
    with embedpipe.EmbeddingPipe(table, cache_rows=50, optimizer=adagrad, owner=owner) as pipe:
        dense = [p for p in model.parameters() if p is not pipe.parameter]
        optimizer = torch.optim.AdamW(
            [{"params": dense}, {"params": [pipe.parameter], "lr": ADAGRAD["lr"]}], lr=1e-3
        )
        for batch_ in pipe.loader(data, batch_size=4, num_workers=2):
            model(inputs_embeds=batch_["inputs_embeds"], labels=batch_["labels"]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert torch.equal(pipe.table.to_tensor(), weight)
        state, expected = model.state_dict(), reference.state_dict()
        assert set(state) - set(expected) == {"model.embed_tokens._extra_state"}
        assert taken_at(state, "model.embed_tokens.") == len(data) // 4
        assert set(expected) - set(state) == {"model.embed_tokens.weight"}
        assert all(torch.equal(v, expected[k]) for k, v in state.items())
        restore(model, pipe)
    assert type(model.get_input_embeddings()) is scaled  # with its scale: generate() works
    ids, mask = batch()
    with torch.no_grad():
        got = model.eval()(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(got, reference.eval()(input_ids=ids, attention_mask=mask).logits)


class DroppedOut(torch.nn.Embedding):
    """A word embedding with dropout in its forward: inputs_embeds would skip it."""

    def forward(self, ids):
        return torch.nn.functional.dropout(super().forward(ids), 0.1, self.training)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda m: setattr(m.get_input_embeddings(), "max_norm", 1.0), "max_norm"),
        (lambda m: setattr(m.get_input_embeddings(), "scale_grad_by_freq", True), "max_norm"),
        (
            lambda m: setattr(m.get_input_embeddings(), "__class__", DroppedOut),
            "other than the rows",
        ),
        (
            lambda m: (
                setattr(m.get_input_embeddings(), "embed_scale", 2.0)
                or setattr(m.get_input_embeddings(), "__class__", DroppedOut)
            ),  # a scale, and something else too
            r"other than the rows it looks up times its embed_scale \(2\)",
        ),
    ],
    ids=["max_norm", "scale_grad_by_freq", "dropout", "scale-and-dropout"],
)
def test_an_embedding_doing_more_than_a_lookup_is_refused_before_anything_is_written(
    tmp_path, change, match
):
    model = bert().eval()  # eval: offload checks the training mode's output too
    change(model)
    embeddings = model.get_input_embeddings()
    path = tmp_path / "vocab.zarr"
    rng = torch.get_rng_state()
    with pytest.raises(errors.InvalidRowsError, match=match):
        offload(model, path)
    assert not path.exists() and model.get_input_embeddings() is embeddings
    assert not embeddings.training  # its mode as it was
    assert torch.equal(torch.get_rng_state(), rng)  # the check drew nothing from the program's


@pytest.mark.parametrize("trains", [False, True], ids=["frozen", "training"])
@pytest.mark.parametrize("by_hand", [False, True], ids=["replacing", "by-hand"])
def test_a_model_rebuilt_on_an_existing_table_keeps_the_scale(tmp_path, by_hand, trains):
    """A new process builds the model again and puts a placeholder for the existing table in
    place of its fresh embedding: ``replacing`` takes the scale from it, one built by hand takes
    the one the table recorded; frozen pipes scale too."""
    model = gemma()
    ids, mask = batch()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    path = str(tmp_path / "vocab.zarr")
    offload(model, path).close()
    rebuilt = gemma()
    rebuilt.set_input_embeddings(
        OffloadedEmbedding(V, D, path, padding_idx=0)
        if by_hand
        else OffloadedEmbedding.replacing(rebuilt.get_input_embeddings(), path)
    )
    optimizer = embedpipe.optim.Adagrad(**ADAGRAD) if trains else None
    with embedpipe.EmbeddingPipe(path, cache_rows=50, optimizer=optimizer) as pipe:
        loaded = next(iter(pipe.loader([{"input_ids": i} for i in ids], batch_size=len(ids))))
        with torch.no_grad():
            got = rebuilt(inputs_embeds=loaded["inputs_embeds"], attention_mask=mask).logits
        assert torch.equal(got, expected)
        wrong = OffloadedEmbedding(V, D, path, embed_scale=2.0)  # noqa: F841 (alive: in the way)
        with pytest.raises(EmbeddingsOffloadedError, match="disagree on the scale"):
            loaded["inputs_embeds"]
    if by_hand:
        with pytest.raises(EmbeddingsOffloadedError, match="built by hand"):
            restore(rebuilt, path)  # a plain nn.Embedding would drop the scale


def test_a_scaled_table_converts_to_what_the_models_embedding_returned(tmp_path):
    """The table records the scale: ``embedpipe convert``, in a process with no model, writes
    the rows times it, as the model's own embedding returns them."""
    model = gemma()
    ids, _ = batch()
    with torch.no_grad():
        expected = model.get_input_embeddings()(ids)
    offload(model, tmp_path / "vocab.zarr").close()
    del model
    gc.collect()  # no placeholder left in this process: the table's record is what counts
    np.save(tmp_path / "shard.npy", ids.numpy())
    out = tmp_path / "shard.emb.zarr"
    embedpipe.convert(tmp_path / "vocab.zarr", tmp_path / "shard.npy", out, workers=0)
    shard = embedpipe.ConvertedShard(out)
    got = torch.stack([shard[i]["inputs_embeds"] for i in range(len(shard))])
    assert torch.equal(got, expected)


def classifier(name: str) -> torch.nn.Module:
    """A tiny ``name`` model from its config (pad id 1, as RoBERTa's), in eval mode."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_attention_heads=2)
    configs = {
        "RobertaForSequenceClassification": lambda: transformers.RobertaConfig(
            **sizes, num_hidden_layers=2, max_position_embeddings=64
        ),
        "RobertaForMultipleChoice": lambda: transformers.RobertaConfig(
            **sizes, num_hidden_layers=2, max_position_embeddings=64
        ),
        "XLMRobertaForMaskedLM": lambda: transformers.XLMRobertaConfig(
            **sizes, num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False
        ),
        "MPNetForSequenceClassification": lambda: transformers.MPNetConfig(
            **sizes, num_hidden_layers=2, max_position_embeddings=64
        ),
        "LlamaForSequenceClassification": lambda: transformers.LlamaConfig(
            **sizes, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=64
        ),
        "GPT2ForSequenceClassification": lambda: transformers.GPT2Config(
            vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=64
        ),
    }
    config = configs[name]()
    config.pad_token_id = 1
    return getattr(transformers, name)(config).eval()


def padded(where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of ids 2..V-1; row 1 padded with id 1 on the ``where`` side (or inside it)."""
    ids = torch.randint(2, V, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    span = {"left": slice(0, 3), "right": slice(6, 9), "inside": slice(3, 5)}[where]
    ids[1, span], mask[1, span] = 1, 0
    return ids, mask


def pipe_embeds(tmp_path, model, ids, mask, **pipe_options):
    """The model offloaded; its output on the pipe's inputs_embeds for ``ids``."""
    table = offload(model, tmp_path / "vocab.zarr")
    with embedpipe.EmbeddingPipe(table, cache_rows=50, **pipe_options) as pipe:
        samples = [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask)]
        loaded = next(iter(pipe.loader(samples, batch_size=len(samples))))
        with torch.no_grad():
            return model(inputs_embeds=loaded["inputs_embeds"], attention_mask=mask)[0]


@pytest.mark.parametrize("where", ["left", "inside"])
@pytest.mark.parametrize(
    "name",
    ["RobertaForSequenceClassification", "XLMRobertaForMaskedLM", "MPNetForSequenceClassification"],
)
def test_positions_numbered_from_the_ids_are_numbered_from_the_gathered_ids(tmp_path, name, where):
    """RoBERTa-like embeddings give padding no position and number the real tokens after it,
    from input_ids; given inputs_embeds they would number every position. The pipe's
    inputs_embeds carry their ids and the embedding block is given them."""
    model = classifier(name)
    ids, mask = padded(where)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask)[0]
    assert torch.equal(pipe_embeds(tmp_path, model, ids, mask), expected)


@pytest.mark.parametrize("where", ["left", "inside"])
def test_positions_of_a_multiple_choice_batch_are_numbered_from_its_ids(tmp_path, where):
    """RobertaForMultipleChoice views its (B, C, L) inputs_embeds as (B * C, L, D) before the
    embedding block: the view carries no ids of its own, and its base's are used."""
    model = classifier("RobertaForMultipleChoice")
    ids, mask = padded(where)
    ids, mask = ids[None], mask[None]  # one question, three choices
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(pipe_embeds(tmp_path, model, ids, mask), expected)


@pytest.mark.parametrize(
    "name", ["LlamaForSequenceClassification", "GPT2ForSequenceClassification"]
)
def test_a_classifier_pooling_the_last_real_token_raises_on_right_padding(tmp_path, name):
    """Given inputs_embeds, transformers pools the last position, padding in a right-padded row:
    raised, naming the row and the remedy; left padding pools the same token as input_ids."""
    model = classifier(name)
    ids, mask = padded("left")
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(pipe_embeds(tmp_path / "left", model, ids, mask), expected)

    model = classifier(name)
    ids, mask = padded("right")
    with pytest.raises(EmbeddingsOffloadedError, match=r"rows \[1\].*padding_side = 'left'"):
        pipe_embeds(tmp_path / "right", model, ids, mask)
    # inputs_embeds remade by the loop carry no ids: the attention mask tells
    with pytest.raises(EmbeddingsOffloadedError, match="attention mask ends in padding"):
        model(inputs_embeds=torch.zeros(3, 9, D), attention_mask=mask)


def marian() -> torch.nn.Module:
    """Marian multiplies the looked-up rows by embed_scale in its encoder's forward."""
    torch.manual_seed(0)
    sizes = dict(encoder_layers=1, decoder_layers=1, encoder_attention_heads=2)
    config = transformers.MarianConfig(
        vocab_size=V, d_model=D, **sizes, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, scale_embedding=True, pad_token_id=1, decoder_start_token_id=1,
        max_position_embeddings=64,
    )  # fmt: skip
    return untie(transformers.MarianMTModel(config)).eval()


def falcon_h1() -> torch.nn.Module:
    """FalconH1 multiplies them by embedding_multiplier in its model's forward."""
    torch.manual_seed(0)
    config = transformers.FalconH1Config(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, mamba_d_ssm=32,
        mamba_n_heads=2, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8,
        embedding_multiplier=3.0, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    return transformers.FalconH1ForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("make", "part"),
    [(marian, lambda m: m.get_encoder()), (falcon_h1, lambda m: m)],
    ids=["Marian", "FalconH1"],
)
def test_a_model_that_scales_the_looked_up_rows_itself_gets_them_scaled(tmp_path, make, part):
    """The scale is in the model's forward, on the lookup only, not in the embedding module:
    offload finds it by running the model both ways, and the batches carry it."""
    model = make()
    ids, mask = batch()
    with torch.no_grad():
        expected = part(model)(input_ids=ids, attention_mask=mask)[0]
    got = pipe_embeds_through(tmp_path, model, part(model), ids, mask)
    assert torch.equal(got, expected)


def pipe_embeds_through(tmp_path, model, part, ids, mask):
    table = offload(model, tmp_path / "vocab.zarr")
    with embedpipe.EmbeddingPipe(table, cache_rows=50) as pipe:
        samples = [{"input_ids": i} for i in ids]
        loaded = next(iter(pipe.loader(samples, batch_size=len(samples))))
        with torch.no_grad():
            return part(inputs_embeds=loaded["inputs_embeds"], attention_mask=mask)[0]


def test_a_model_reading_its_embedding_weight_given_inputs_embeds_is_refused(tmp_path):
    """Gemma 4's per-layer inputs read the embedding's weight whatever the model is given."""
    torch.manual_seed(0)
    config = transformers.Gemma4TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Gemma4ForCausalLM(config)
    embeddings, path = model.get_input_embeddings(), tmp_path / "vocab.zarr"
    with pytest.raises(errors.InvalidRowsError, match="reads its word embeddings even when given"):
        offload(model, path)
    assert not path.exists() and model.get_input_embeddings() is embeddings
    assert model.training  # its mode as it was
    assert not embedpipe.pipe.placeholder.offloaded_embeddings(str(path))


def test_the_scale_is_found_whatever_the_weights_values(tmp_path):
    """The embedding module is tried on rows of its own, not its weight's: zero rows (or rows
    not initialised) cannot hide its scale."""
    model = gemma()
    with torch.no_grad():
        model.get_input_embeddings().weight[:32] = 0
    offload(model, tmp_path / "vocab.zarr").close()
    assert model.get_input_embeddings().scale_value == pytest.approx(D**0.5)


class Adapted(torch.nn.Module):
    """An adapter around the embedding, as PEFT's: the weight is its base layer's."""

    def __init__(self, base: torch.nn.Embedding) -> None:
        super().__init__()
        self.base_layer = base

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, ids):
        return self.base_layer(ids)


def test_an_embedding_inside_an_adapter_is_refused_and_a_frozen_one_restores_frozen(tmp_path):
    model = bert()
    model.set_input_embeddings(Adapted(model.get_input_embeddings()))
    with pytest.raises(errors.InvalidRowsError, match="no weight parameter of its own"):
        offload(model, tmp_path / "adapted.zarr")
    assert not (tmp_path / "adapted.zarr").exists()

    model = bert()
    model.get_input_embeddings().requires_grad_(False)
    with offload(model, tmp_path / "vocab.zarr") as table:
        placeholder = model.get_input_embeddings()
        assert all(m is not placeholder._template for m in model.modules())
        restore(model, table)
    assert not model.get_input_embeddings().weight.requires_grad  # frozen, as it was


def test_models_on_one_table_that_want_different_dtypes_raise(tmp_path):
    first, second = bert(), bert()
    path = str(tmp_path / "vocab.zarr")
    offload(first, path).close()
    second.set_input_embeddings(OffloadedEmbedding.replacing(second.get_input_embeddings(), path))
    second.half()
    with embedpipe.EmbeddingPipe(path, cache_rows=50) as pipe:
        loaded = next(iter(pipe.loader([{"input_ids": torch.tensor([2, 3])}], batch_size=1)))
        with pytest.raises(EmbeddingsOffloadedError, match="different dtypes"):
            loaded["inputs_embeds"]


def test_a_float64_scale_is_recorded_exactly(tmp_path):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the scale buffer is made in float64
    try:
        model = gemma()
    finally:
        torch.set_default_dtype(default)
    ids, _ = batch()
    with torch.no_grad():
        expected = model.get_input_embeddings()(ids)
    offload(model, tmp_path / "vocab.zarr").close()
    del model
    gc.collect()
    np.save(tmp_path / "shard.npy", ids.numpy())
    out = tmp_path / "shard.emb.zarr"
    embedpipe.convert(tmp_path / "vocab.zarr", tmp_path / "shard.npy", out, workers=0)
    shard = embedpipe.ConvertedShard(out)
    assert torch.equal(torch.stack([shard[i]["inputs_embeds"] for i in range(3)]), expected)


def test_a_model_whose_encoder_has_an_embedding_of_its_own_is_refused(tmp_path):
    """BART with tie_word_embeddings=False: set_input_embeddings would replace the encoder's own
    embedding too, and the encoder would read the shared table's rows instead, without an error."""
    torch.manual_seed(0)
    config = bart_config(tie_word_embeddings=False)
    model = transformers.BartModel(config)
    assert model.encoder.embed_tokens is not model.shared
    with pytest.raises(errors.InvalidRowsError, match="also replaces encoder.embed_tokens"):
        offload(model, tmp_path / "vocab.zarr")
    assert not (tmp_path / "vocab.zarr").exists() and model.encoder.embed_tokens is not model.shared


def test_a_model_that_pads_to_its_attention_window_is_probed_at_that_length(tmp_path):
    """Longformer pads its input to a multiple of attention_window (512) by embedding padding
    ids: a 4-token probe would read the offloaded embedding; one of 512 does not."""
    torch.manual_seed(0)
    config = transformers.LongformerConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=600,
    )  # fmt: skip
    model = transformers.LongformerModel(config).eval()
    offload(model, tmp_path / "vocab.zarr").close()
    assert isinstance(model.get_input_embeddings(), OffloadedEmbedding)


def longformer_config(**overrides):
    return transformers.LongformerConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, attention_window=4, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, sep_token_id=2, **overrides,
    )  # fmt: skip


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.LongformerForQuestionAnswering(longformer_config()),
        lambda: transformers.LongformerForMultipleChoice(longformer_config()),
        lambda: transformers.SplinterForQuestionAnswering(
            tiny_bert_config(V, pad_token_id=0, question_token_id=104, model_type="splinter")
        ),
    ],
    ids=["Longformer-QA", "Longformer-multiple-choice", "Splinter-QA"],
)
def test_a_head_that_looks_for_a_special_id_is_refused(tmp_path, make):
    """Longformer's question answering and multiple choice put global attention on the tokens
    before the first separator they find in input_ids; Splinter's pools the question token.
    Given inputs_embeds they do neither: the probe's second row, with the config's special
    ids, finds it (the first, of real tokens only, computes the same both ways)."""
    torch.manual_seed(0)
    model = make().eval()
    with pytest.raises(errors.InvalidRowsError, match="special id it looks for"):
        offload(model, tmp_path / "t.zarr")
    assert not (tmp_path / "t.zarr").exists()


def test_a_model_that_embeds_padding_ids_itself_says_why(tmp_path):
    """Longformer pads a batch to a multiple of its attention window by embedding pad ids, even
    when given inputs_embeds: the error says so, not only to pass inputs_embeds."""
    torch.manual_seed(0)
    model = transformers.LongformerModel(longformer_config()).eval()
    with offload(model, tmp_path / "t.zarr") as table:
        with embedpipe.EmbeddingPipe(table, cache_rows=V) as pipe:
            data = [{"input_ids": torch.arange(3, 9)} for _ in range(2)]  # 6: not a multiple
            batch = next(iter(pipe.loader(data, batch_size=2)))
            with pytest.raises(errors.EmbeddingsOffloadedError, match="attention window"):
                model(inputs_embeds=batch["inputs_embeds"])


def test_the_probe_leaves_the_models_attributes_as_they_were(tmp_path):
    """BigBird switches to full attention for good (replacing its attention modules) when
    given an input as short as the probe's: offload puts them back, so block-sparse attention
    stays what the model computes, as it did before offload."""
    torch.manual_seed(0)
    config = transformers.BigBirdConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, attention_type="block_sparse",
        block_size=2, num_random_blocks=1, pad_token_id=0,
    )  # fmt: skip
    model = transformers.BigBirdModel(config).eval()
    attention = [m for n, m in model.named_modules() if n.endswith("attention.self")]
    offload(model, tmp_path / "t.zarr").close()
    assert model.attention_type == "block_sparse"
    assert [m for n, m in model.named_modules() if n.endswith("attention.self")] == attention


def plus_one(module, args, out):
    """A hook that changes the rows (as NEFTune's noise does), without drawing."""
    return out + 1.0


@pytest.mark.parametrize("resumed", [False, True], ids=["offloaded", "rebuilt-with-replacing"])
@pytest.mark.parametrize(
    ("make", "part"),
    [(marian, lambda m: m.get_encoder()), (falcon_h1, lambda m: m)],
    ids=["Marian", "FalconH1"],
)
def test_hooks_see_the_rows_before_a_scale_the_model_applies(tmp_path, make, part, resumed):
    """Marian and FalconH1 multiply embed_tokens(ids) by their scale in their own forward: a
    hook on the embedding sees the unscaled rows, and the scale applies to what it returns.
    A model rebuilt on the table (``replacing``: its embedding knows no scale) takes where the
    scale goes from the table."""
    reference = make()
    reference.get_input_embeddings().register_forward_hook(plus_one)
    ids, mask = batch()
    with torch.no_grad():
        expected = part(reference)(input_ids=ids, attention_mask=mask)[0]
    model = make()
    path = str(tmp_path / "vocab.zarr")
    offload(model, path).close()
    if resumed:
        model = make()
        model.set_input_embeddings(OffloadedEmbedding.replacing(model.get_input_embeddings(), path))
    model.get_input_embeddings().register_forward_hook(plus_one)
    with embedpipe.EmbeddingPipe(path, cache_rows=50) as pipe:
        loaded = next(iter(pipe.loader([{"input_ids": i} for i in ids], batch_size=len(ids))))
        with torch.no_grad():
            got = part(model)(inputs_embeds=loaded["inputs_embeds"], attention_mask=mask)[0]
    assert torch.equal(got, expected)


def test_hooks_see_a_multiple_choice_batch_as_the_model_flattens_it(tmp_path):
    """BertForMultipleChoice views its (B, C, L) ids as (B * C, L) before the embedding, so
    NEFTune's hook (whose noise scales with the output's shape) sees (B * C, L, D) rows: the
    pipe's batch is (B, C, L), and the hooks get it flattened the same way."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    def noisy(model):
        model.train()
        embeddings = model.get_input_embeddings()
        embeddings.neftune_noise_alpha = 5.0
        embeddings.register_forward_hook(neftune_post_forward_hook)

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (4, 3, 9), generator=generator)
    reference = bert("BertForMultipleChoice", hidden_dropout_prob=0.0)
    noisy(reference)
    torch.manual_seed(1)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    model = bert("BertForMultipleChoice", hidden_dropout_prob=0.0)
    offload(model, tmp_path / "vocab.zarr").close()
    noisy(model)
    with embedpipe.EmbeddingPipe(tmp_path / "vocab.zarr", cache_rows=50) as pipe:
        loaded = next(iter(pipe.loader([{"input_ids": i} for i in ids], batch_size=len(ids))))
        torch.manual_seed(1)
        with torch.no_grad():
            got = model(inputs_embeds=loaded["inputs_embeds"]).logits
    assert torch.equal(got, expected)


def test_hooks_on_an_alias_of_the_word_embedding_are_refused(tmp_path):
    """BART (transformers 5): get_input_embeddings() is `shared`, and the encoder calls
    `encoder.embed_tokens`, another module over the same weight. offload puts the placeholder
    in both places and runs the hooks of the first only: hooks on the second are refused."""
    torch.manual_seed(0)
    config = bart_config()
    model = transformers.BartModel(config)
    model.encoder.embed_tokens.register_forward_hook(plus_one)
    with pytest.raises(errors.InvalidRowsError, match="hooks are registered on encoder.embed_"):
        offload(model, tmp_path / "vocab.zarr")
    assert not (tmp_path / "vocab.zarr").exists()
