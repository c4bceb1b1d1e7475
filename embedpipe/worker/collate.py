"""The loader's default collate: ``default_collate``, plus padding for token lists of uneven length.

Hugging Face ``datasets`` yield each sample's tokens as a Python list, one length per sample::

    {"input_ids": [101, 7, 9, 102], "attention_mask": [1, 1, 1, 1], "label": 1}

``default_collate`` cannot stack those. :class:`PadCollator` pads every list-like field to the
longest in the batch (on the right, as Hugging Face tokenizers do) and stacks it: the ids with
the pad id (the model's ``padding_idx``, recorded by ``embedpipe.hf.offload``, or a tokenizer's
``pad_token_id``), ``labels`` with -100 (ignored by the loss), anything else with 0; and adds an
``attention_mask`` when the batch has none. Every other field goes through ``default_collate``.
With ``hf_labels=True`` (``embedpipe.hf.Trainer`` sets it), a ``label`` or ``label_ids`` field
is renamed ``labels``, as Hugging Face's own collators do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

#: What each field is padded with, besides the ids; -100 is what torch's cross entropy ignores.
PAD_VALUES = {"labels": -100}


class PadCollator:
    """Collate samples, padding list-like fields of uneven length (see the module doc).

    ``pad_id`` pads the ids under ``ids_key``; ``tokenizer`` (anything with ``pad_token_id``)
    gives it instead. A batch whose ids need padding with no pad id known raises ``ValueError``.
    """

    def __init__(
        self,
        pad_id: int | None = None,
        ids_key: str = "input_ids",
        *,
        tokenizer: Any = None,
        hf_labels: bool = False,
    ) -> None:
        if tokenizer is not None:
            pad_id = getattr(tokenizer, "pad_token_id", None)
            if pad_id is None:
                raise ValueError(f"{type(tokenizer).__name__} has no pad_token_id; set one first")
        self.pad_id = pad_id
        self.ids_key = ids_key
        self.hf_labels = hf_labels

    def __call__(self, samples: list[Any]) -> Any:
        if not samples or not all(isinstance(s, Mapping) for s in samples):
            return default_collate(samples)
        batch: dict[str, Any] = {}
        padded_ids: torch.Tensor | None = None
        for field in samples[0]:
            values = [s[field] for s in samples]
            key = "labels" if self.hf_labels and field in ("label", "label_ids") else field
            if _same_shape_tensors(values):  # nothing to pad: one copy, not one per sample
                batch[key] = torch.stack(values)
                continue
            if not all(_is_sequence(v) for v in values):
                batch[key] = default_collate(values)
                continue
            rows = [torch.as_tensor(v) for v in values]
            length = max(len(r) for r in rows)
            if all(len(r) == length and r.dtype == rows[0].dtype for r in rows):
                batch[key] = torch.stack(rows)
                continue
            pad = self._pad_id(rows, length) if key == self.ids_key else PAD_VALUES.get(key, 0)
            stacked = rows[0].new_full((len(rows), length), pad)
            for i, r in enumerate(rows):
                stacked[i, : len(r)] = r
            batch[key] = stacked
            if key == self.ids_key and any(len(r) < length for r in rows):
                padded_ids = torch.zeros(len(rows), length, dtype=torch.int64)
                for i, r in enumerate(rows):
                    padded_ids[i, : len(r)] = 1
        if padded_ids is not None and "attention_mask" not in batch:
            batch["attention_mask"] = padded_ids
        return batch

    def _pad_id(self, rows: list[torch.Tensor], length: int) -> int:
        if self.pad_id is None and any(len(r) < length for r in rows):
            lengths = sorted({len(r) for r in rows})
            raise ValueError(
                f"the samples' {self.ids_key!r} have different lengths ({lengths[0]} to "
                f"{lengths[-1]}) and no pad id is known: give the pipe padding_idx= (offload() "
                "records the model's), or pass collate_fn=embedpipe.worker.collate.PadCollator("
                "tokenizer=...) or your own collate_fn"
            )
        return 0 if self.pad_id is None else self.pad_id

    def __repr__(self) -> str:
        return f"PadCollator(pad_id={self.pad_id}, ids_key={self.ids_key!r})"


def _same_shape_tensors(values: list[Any]) -> bool:
    """1-D tensors of one shape and dtype (the common case, checked cheaply)."""
    first = values[0]
    if not isinstance(first, torch.Tensor) or first.dim() != 1:
        return False
    shape, dtype = first.shape, first.dtype
    return all(
        isinstance(v, torch.Tensor) and v.shape == shape and v.dtype == dtype for v in values
    )


def _is_sequence(value: Any) -> bool:
    """A 1-D run of numbers: a list or tuple of them, a 1-D tensor or array."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 1
    return (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and all(isinstance(x, (int, float, np.integer, np.floating)) for x in value)
    )
