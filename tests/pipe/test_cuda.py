"""On a CUDA device: batches moved with ``batch.to("cuda")`` train the table that ``nn.Embedding`` on
the same device trains with the matching torch optimizer.

Skipped where torch sees no CUDA device (CI has none); docs/gpu.md gives the last run on a GPU.
The gradient of the rows is summed on the device by the same kernel as ``nn.Embedding``'s
backward, in the same order, and the model trains there; the table's step is taken in CPU memory.
So the reference is ``nn.Embedding`` on CUDA whose torch optimizer steps a CPU copy of the weight:
the two must agree bit for bit. Against torch's optimizer stepping on the GPU, SGD agrees bit for
bit (asserted; seen on an H200); Adagrad's square root and division round differently on the GPU
in a few elements a step (at most 6e-8 there), which training then amplifies: the test prints how
far the tables end apart.
"""

from __future__ import annotations

import pytest
import torch

import embedpipe
from embedpipe.pipe import EmbeddingPipe

from ..helpers import (
    PARITY,
    REFERENCE_OPTIMIZERS,
    dense_optimizer,
    same_dense_params,
    tiny_model,
    train_offloaded,
    train_reference,
    zipf_dataset,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS, BATCH = 24, 8


@pytest.fixture(scope="module")
def data():
    return zipf_dataset(STEPS * BATCH)


def test_frozen_lookups_on_cuda_equal_the_models_own_bit_for_bit(tmp_path):
    model = tiny_model().cuda()
    weight = model.bert.embeddings.word_embeddings.weight.detach().cpu()
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=64).close()
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=50) as pipe, torch.no_grad():
        loader = pipe.loader(
            zipf_dataset(32, seed=3, padded=True), batch_size=8, num_workers=2, pin_memory=True
        )
        for batch in loader:
            batch = batch.to("cuda", non_blocking=True)
            assert batch["inputs_embeds"].device.type == "cuda"
            mask = batch["attention_mask"]
            expected = model(input_ids=batch["input_ids"], attention_mask=mask).logits
            got = model(inputs_embeds=batch["inputs_embeds"], attention_mask=mask).logits
            assert torch.equal(got, expected)


def reference_stepped_on_the_cpu(data, optimizer: str, lr: float):
    """``nn.Embedding`` in the model on CUDA, its gradient stepped by the torch optimizer on a copy
    of the weight in CPU memory (where embedpipe steps the table), copied back after each step."""
    model = tiny_model().cuda()
    emb = model.bert.embeddings.word_embeddings
    table = emb.weight.detach().cpu().clone().requires_grad_()
    table_optimizer = REFERENCE_OPTIMIZERS[optimizer]([table], lr)
    dense = dense_optimizer(model)
    for start in range(0, len(data), BATCH):
        batch = torch.utils.data.default_collate(data[start : start + BATCH])
        batch = {k: v.cuda() for k, v in batch.items()}
        model(**batch).loss.backward()
        dense.step()
        dense.zero_grad()
        table.grad = emb.weight.grad.cpu()
        table_optimizer.step()
        table_optimizer.zero_grad()
        emb.weight.grad = None
        with torch.no_grad():
            emb.weight.copy_(table)
    return table.detach(), model


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_on_cuda_equals_nn_embedding_on_cuda_stepped_on_the_cpu(tmp_path, data, optimizer):
    reference, ref_model = reference_stepped_on_the_cpu(data, optimizer, lr=0.5)
    on_cuda, _, _ = train_reference(data, optimizer, lr=0.5, device="cuda")
    table, model, stats, _ = train_offloaded(
        data,
        optimizer,
        lr=0.5,
        path=tmp_path / "t.zarr",
        **PARITY,
        pin_memory=True,
        device="cuda",
    )
    assert stats["steps"] == STEPS and stats["evictions"] > 0
    difference = (table - on_cuda).abs()
    print(
        f"\n{optimizer} on {torch.cuda.get_device_name()}: against torch's step on the GPU, "
        f"{int((difference > 0).sum())} of {difference.numel()} table elements differ "
        f"(max {difference.max().item():.3g})"
    )
    assert torch.equal(table, reference)
    assert same_dense_params(model, ref_model)
    if optimizer == "sgd":  # w - lr * g rounds alike on both
        assert torch.equal(table, on_cuda)
