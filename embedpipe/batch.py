"""EmbeddedBatch: what the training loop receives from ``pipe.loader(...)``.

A read-only mapping of the user's collated fields plus ``"inputs_embeds"``. The (B, L, D)
embeddings are made where they are used, on the batch's device, from the unique rows::

    rows: (U, D) leaf, requires grad  --F.embedding(inverse: (B, L))-->  inputs_embeds: (B, L, D)

Embedding's backward sums the gradient of repeated ids, so the hook on ``rows`` receives the
(U, D) gradient of the unique ids, already deduplicated on the device, and hands it to the pipe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

INPUTS_EMBEDS = "inputs_embeds"

#: Called with (unique_ids (U,) CPU int64, grad (U, D) on the device) when backward reaches the rows.
GradSink = Callable[[torch.Tensor, torch.Tensor], None]


def _move(value: Any, device: torch.device | str, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return {k: _move(v, device, non_blocking) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_move(v, device, non_blocking) for v in value)
    return value


class _GradHook:
    """Hands the rows' gradient to the pipe, once. Holds no reference to the batch or the graph:
    a hook that did (a bound method of the batch) would make a reference cycle through the
    autograd graph, and every batch's (B, L, D) tensors would wait for the cyclic collector."""

    def __init__(self, unique_ids: torch.Tensor, sink: GradSink) -> None:
        self.unique_ids = unique_ids
        self.sink = sink
        self.sent = False

    def __call__(self, grad: torch.Tensor) -> None:
        if self.sent:
            raise RuntimeError(
                "a second backward pass reached this batch's embeddings; embedpipe applies one "
                "optimizer step per backward: sum the losses and call backward once per batch"
            )
        self.sent = True
        self.sink(self.unique_ids, grad)


class EmbeddedBatch(Mapping[str, Any]):
    """The collated fields plus ``inputs_embeds``; ``.to(device)`` moves the (U, D) rows, not (B, L, D).

    Attributes ``unique_ids`` (U,), ``inverse`` (shaped like the ids) and ``rows`` (U, D) are
    there for code that wants the compact form (e.g. a custom embedding layer).
    """

    def __init__(
        self,
        fields: Mapping[str, Any],
        unique_ids: torch.Tensor,
        inverse: torch.Tensor,
        rows: torch.Tensor,
        grad_sink: GradSink | None,
    ) -> None:
        if INPUTS_EMBEDS in fields:
            raise KeyError(f"the collated batch already has a field {INPUTS_EMBEDS!r}; rename it")
        self.fields = fields
        self.unique_ids = unique_ids
        self.inverse = inverse
        self.rows = rows
        self.grad_sink = grad_sink
        self._embeds: torch.Tensor | None = None

    def __getitem__(self, key: str) -> Any:
        if key != INPUTS_EMBEDS:
            return self.fields[key]
        if self._embeds is not None:
            return self._embeds
        if self.grad_sink is None or not torch.is_grad_enabled():
            return F.embedding(self.inverse, self.rows)  # not kept: a later read may train
        rows = self.rows.detach().requires_grad_()
        rows.register_hook(_GradHook(self.unique_ids, self.grad_sink))
        self._embeds = F.embedding(self.inverse, rows)  # (U, D) -> (B, L, D)
        return self._embeds

    def __iter__(self) -> Iterator[str]:
        yield from self.fields
        yield INPUTS_EMBEDS

    def __len__(self) -> int:
        return len(self.fields) + 1

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EmbeddedBatch:
        """The batch on ``device``; ``inputs_embeds`` is then made there."""
        return EmbeddedBatch(
            _move(self.fields, device, non_blocking),
            self.unique_ids,
            self.inverse.to(device, non_blocking=non_blocking),
            self.rows.to(device, non_blocking=non_blocking),
            self.grad_sink,
        )

    def __repr__(self) -> str:
        return f"EmbeddedBatch(keys={list(self)}, unique_ids={len(self.unique_ids)}, device={self.rows.device})"
