"""Hugging Face: move a model's input word embeddings into a :class:`~embedpipe.Table`, and
train it with ``transformers.Trainer``.

::

    table = embedpipe.hf.offload(model, "vocab.zarr")   # weight -> zarr, bit for bit
    model(inputs_embeds=batch["inputs_embeds"], attention_mask=batch["attention_mask"])

- ``offloading.py``: :func:`offload` (refuses a model whose input embeddings are tied to its
  output layer: :func:`untie` gives the output layer its own copy first), :func:`restore` (the
  trained table back into the model, for ``save_pretrained``), :func:`embedding_bytes` (the
  accelerator memory the table costs while it lives in the model). Works with any
  ``transformers.PreTrainedModel``, duck-typed: transformers is imported only by the caller.
- ``probe.py``: ``offload``'s check that the model computes the same from ``inputs_embeds`` as
  from ``input_ids`` (and the scale some models put on the looked-up rows);
- ``saving.py``: ``save_pretrained`` on an offloaded model writes the table's rows into the
  folder as the word embeddings (NOTE [ save_pretrained on an offloaded model ]);
- ``trainer.py``: :class:`Trainer`, a ``transformers.Trainer`` that trains through a pipe
  (imported when first asked for: it imports transformers).

The module that stands where the embedding was, :class:`OffloadedEmbedding`, belongs to the pipe
(``embedpipe/pipe/placeholder.py``). See ``docs/huggingface.md`` and ``docs/integrations.md``.
"""

from __future__ import annotations

from typing import Any

from ..errors import EmbeddingsOffloadedError
from ..pipe.placeholder import ON_MADE, OffloadedEmbedding
from .offloading import (
    TiedWeightsError,
    embedding_bytes,
    offload,
    restore,
    restored,
    skipping_word_embeddings,
    untie,
)
from .saving import keep_word_embeddings

# a model offloaded from now on saves its word embeddings with save_pretrained (hf/saving.py)
if keep_word_embeddings not in ON_MADE:
    ON_MADE.append(keep_word_embeddings)
keep_word_embeddings()

__all__ = [
    "EmbeddingsOffloadedError",
    "OffloadedEmbedding",
    "TiedWeightsError",
    "Trainer",
    "embedding_bytes",
    "offload",
    "restore",
    "restored",
    "skipping_word_embeddings",
    "untie",
]


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # imports transformers: only when asked for
        from .trainer import Trainer

        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
