"""The offloaded embedding: the module that stands where a model's ``nn.Embedding`` was.

:class:`OffloadedEmbedding` holds no rows; a training pipe's gradient parameter is its one
parameter, so an optimizer and ``clip_grad_norm_`` over ``model.parameters()`` reach the table.
Every one made in this process is registered by its table's path: a pipe on that table adopts
them (``EmbeddingPipe.attach``) and asks them for the dtype ``inputs_embeds`` should have.
``embedpipe.hf.offload`` makes one; ``embedpipe.lightning`` and DDP see it through
:func:`ignore_in_ddp`.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import EmbeddingsOffloadedError

#: The offloaded embedding modules of this process, by table path, oldest first: a pipe on that
#: table adopts the newest one's gradient parameter and attaches it to all of them.
_OFFLOADED: dict[str, list[weakref.ref[OffloadedEmbedding]]] = {}


@functools.lru_cache(maxsize=64)
def _resolved(path: str) -> str:
    """The registry's key for ``path``; cached: a batch asks for its table's modules at every
    read (their dtype), and ``realpath`` makes a system call per part of the path."""
    return os.path.realpath(path)


def offloaded_embeddings(path: str) -> list[OffloadedEmbedding]:
    """The modules offloaded to the table at ``path`` in this process and still alive, newest
    first (a notebook cell run again offloads a new model over the same path)."""
    refs = _OFFLOADED.get(_resolved(path), [])
    refs[:] = [r for r in refs if r() is not None]
    return [m for m in (r() for r in reversed(refs)) if m is not None]


class OffloadedEmbedding(nn.Module):
    """Stands where a model's ``nn.Embedding`` was; holds no rows.

    Keeps ``num_embeddings``, ``embedding_dim``, ``padding_idx`` and the table's ``path``, plus
    the ``dtype`` and ``device`` the model expects ``inputs_embeds`` in (they follow
    ``model.to(...)``). :func:`offload` puts one in a model; a model rebuilt in a new process
    (to resume training on a table that exists) takes one by hand:
    ``model.set_input_embeddings(OffloadedEmbedding(V, D, path, padding_idx=...))``, made before
    the pipe, which then attaches its parameter to it. Calling it, reading ``.weight`` or
    ``copy.deepcopy`` (an EMA, a best-model copy) raises :class:`EmbeddingsOffloadedError`.

    Its one parameter, ``rows``, is a training pipe's :attr:`~embedpipe.EmbeddingPipe.parameter`:
    the table's pending gradient, in the model where the embedding weight was, so clipping
    ``model.parameters()`` counts it. :func:`offload` makes it, and a pipe on the table adopts it,
    so an optimizer built before or after the pipe holds it. It holds no data (a view of one
    zero), is left out of ``state_dict()`` and does not follow ``model.to(...)``: it lives where
    the gradient does.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        path: str,
        *,
        padding_idx: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.path, self.padding_idx = path, padding_idx
        self.dtype, self.device = dtype, torch.device(device)
        self.register_parameter("rows", None)
        # a pipe made on the table from now on finds it (and attaches its parameter to it)
        _OFFLOADED.setdefault(_resolved(path), []).append(weakref.ref(self))

    def attach(self, parameter: nn.Parameter) -> None:
        """Hold a pipe's gradient parameter as ``rows`` (replacing an earlier pipe's)."""
        self.rows = parameter

    @contextmanager
    def _without_rows(self) -> Iterator[None]:
        rows = self._parameters.pop("rows", None)
        try:
            yield
        finally:
            self._parameters["rows"] = rows

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        with self._without_rows():
            super()._save_to_state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        if getattr(self, "_skip_weight", False):  # a checkpoint's copy of the table's rows
            state_dict.pop(prefix + "weight", None)
        with self._without_rows():
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _error(self) -> EmbeddingsOffloadedError:
        return EmbeddingsOffloadedError(
            f"the word embeddings of this model live in {self.path}; call the model with "
            "inputs_embeds=batch['inputs_embeds'] from embedpipe's loader, not input_ids"
        )

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise self._error()

    def __getattr__(self, name: str) -> Any:
        if name == "weight":  # resize_token_embeddings, a weight tied by hand, an init pass
            raise EmbeddingsOffloadedError(
                f"the word embeddings of this model live in {self.path}, not in the model: "
                "its embedding module holds no .weight (call the model with "
                "inputs_embeds=batch['inputs_embeds']; resize the vocabulary before "
                "embedpipe.hf.offload; freeze the table with "
                "model.get_input_embeddings().requires_grad_(False); or put the rows back with "
                "embedpipe.hf.restore(model, pipe))"
            )
        return super().__getattr__(name)

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadedEmbedding:
        # A copy would read the same live table, not a snapshot of it: an EMA (AveragedModel)
        # would never average the embeddings, a best-model copy or a frozen teacher would see
        # the rows as they go on training. Refused, not copied: it cannot be made exact.
        raise EmbeddingsOffloadedError(
            f"cannot copy a model whose word embeddings live in {self.path}: the copy would "
            "read the same table as it trains, not a snapshot of it (an EMA or AveragedModel "
            "would not average the embeddings; a best-model copy or a frozen teacher would "
            "see the rows change). Copy the model before embedpipe.hf.offload (the copy keeps "
            "its own nn.Embedding), or snapshot the table with pipe.checkpoint()"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> OffloadedEmbedding:
        # model.to(device) / .half() reach us here: follow them on an empty tensor (no memory)
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        self.dtype, self.device = probe.dtype, probe.device
        with self._without_rows():
            return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, path={self.path!r}, dtype={self.dtype}"
        )


def ignore_in_ddp(model: nn.Module, placeholder: OffloadedEmbedding) -> None:
    """Tell ``DistributedDataParallel`` to leave the table's gradient parameter alone: its
    shape changes with every batch and its gradient is averaged by the pipe itself."""
    name = next((n for n, m in model.named_modules() if m is placeholder), None)
    if name is None:
        return
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    model._ddp_params_and_buffers_to_ignore = sorted(ignored | {f"{name}.rows" if name else "rows"})
