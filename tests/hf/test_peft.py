"""PEFT's LoRA on an offloaded BERT: the adapters train as on nn.Embedding's, bit for bit.

The recipe people run: LoRA on the attention, the base model frozen (the table with it),
gradient checkpointing, reentrant (transformers 4's default; many recipes still ask for it).
PEFT then hooks the input embedding (``enable_input_require_grads``) so that the first
checkpointed layer backpropagates into its adapters; the model is given inputs_embeds and never
calls that module, so the pipe runs the hook (NOTE [ Hooks on the offloaded embedding ]).
Without it no adapter in a checkpointed layer trained, and torch only warned.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import embedpipe

from ..conftest import tiny_bert_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="an optional extra (the test extra installs it)")

V = 1000


def lora_bert(checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(tiny_bert_config(V, num_labels=2))
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.2x
        (enable or model.gradient_checkpointing_enable)({"use_reentrant": True})
    return model


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    config = peft.LoraConfig(
        task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' rename of the checkpointing
        return peft.get_peft_model(model, config)


def samples() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(5, V, (12,), generator=generator),
            "attention_mask": torch.ones(12, dtype=torch.long),
            "labels": torch.tensor(i % 2),
        }
        for i in range(32)
    ]


def train(model, batches, offloaded: bool) -> None:
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in batches:
        embeds = {"inputs_embeds": batch["inputs_embeds"]} if offloaded else {}
        ids = {} if offloaded else {"input_ids": batch["input_ids"]}
        out = model(**embeds, **ids, attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def trained(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
@pytest.mark.parametrize("order", ["offload, then LoRA", "LoRA, then offload"])
def test_lora_adapters_train_as_on_nn_embedding(tmp_path, order, checkpointing):
    reference = with_lora(lora_bert(checkpointing))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # use_cache with checkpointing
        train(reference, torch.utils.data.DataLoader(samples(), batch_size=8), offloaded=False)

    model = lora_bert(checkpointing)
    weight = model.get_input_embeddings().weight.detach().clone()
    if order == "offload, then LoRA":
        table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=64)
        model = with_lora(model)
    else:
        model = with_lora(model)
        table = embedpipe.hf.offload(model, tmp_path / "t.zarr", chunk_rows=64)
    # a pipe that could train the table (PEFT froze it) and one that cannot: the same
    optimizer = embedpipe.optim.Adagrad(lr=0.05) if order.startswith("offload") else None
    with embedpipe.EmbeddingPipe(table, cache_rows=100, optimizer=optimizer) as pipe:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # "None of the inputs have requires_grad"
            warnings.filterwarnings("ignore", "`use_cache=True`")
            train(model, pipe.loader(samples(), batch_size=8), offloaded=True)
        assert torch.equal(pipe.table.to_tensor(), weight)  # frozen with the base model
    expected, got = trained(reference), trained(model)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
