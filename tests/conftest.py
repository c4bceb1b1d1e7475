"""Shared fixtures: small tables on disk and a tiny BERT built from a config (no downloads)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import embedpipe

# One intra-op thread, here and in every interpreter a test starts: torch's float32 sqrt (in
# Adagrad and Adam) goes through MKL's vector math one chunk a thread, and on this project's
# AVX-512 machines MKL computed the second thread's chunk wrong (about 2e-5 relative) in some
# fresh processes (6 of 20 in one series, 3 of 80 in another; torch 2.13.0+cpu, a 500 x 8
# tensor): a bitwise comparison against nn.Embedding then failed for torch's sake.
# docs/consistency.md, "A deterministic torch on CPU". tests/owner/test_lookahead.py runs a
# pool of 2 threads on purpose (a child forked while it runs).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def weight() -> np.ndarray:
    """A 1000 x 16 float32 table with distinct rows."""
    return np.random.default_rng(0).standard_normal((1000, 16), dtype=np.float32)


@pytest.fixture
def table(tmp_path, weight) -> embedpipe.Table:
    """``weight`` as a table of 64-row chunks, open for writing."""
    t = embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=64)
    yield t
    t.close()


def tiny_bert_config(vocab_size: int = 1000, **overrides):
    from transformers import BertConfig

    options = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    options.update(overrides)
    return BertConfig(**options)


@pytest.fixture
def bert_folder(tmp_path):
    """A tiny BertForMaskedLM saved with save_pretrained (safetensors), and its word embeddings."""
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(tiny_bert_config())
    folder = tmp_path / "bert"
    model.save_pretrained(folder)
    return folder, model.bert.embeddings.word_embeddings.weight.detach().clone()


@pytest.fixture(autouse=True)
def frozen_auto_looks_ahead(monkeypatch):
    """A frozen pipe's ``policy="auto"`` looks ahead in every test, whatever memory this machine
    has free: it is LFU where the table fits in half of it (NOTE [ A frozen table that fits in
    memory ] in ``pipe/defaults.py``), which would make a test's policy the machine's. The tests
    of that choice set it themselves."""
    monkeypatch.setattr(embedpipe.cache.budget, "stays_in_page_cache", lambda nbytes: False)
