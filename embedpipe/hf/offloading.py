"""Offload a model's input word embeddings into a table, and put them back.

:func:`offload` moves the weight into a :class:`~embedpipe.Table` bit for bit and leaves an
:class:`~embedpipe.pipe.placeholder.OffloadedEmbedding` in its place; :func:`restore` puts an
``nn.Embedding`` with the (trained) rows back, for ``save_pretrained``; :func:`untie` gives a tied
output layer its own copy first; :func:`embedding_bytes` says what the table costs in the model.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..errors import EmbeddingsOffloadedError, EmbedpipeError, InvalidRowsError
from ..owner.gradient import OFFLOADED
from ..pipe.derived import unwatch, watch
from ..pipe.placeholder import OffloadedEmbedding, ignore_in_ddp
from ..pipe.rowscale import recorded_scale
from ..pipe.rowsource import pipe_step
from ..ranks.shards import process_group
from ..store.table import Table
from .probe import check, refuse_displacing, swapped_in

#: Copies of the table an optimizer keeps on top of the weight and its gradient.
OPTIMIZER_COPIES = {"sgd": 0, "adagrad": 1, "adam": 2, "adamw": 2}


class TiedWeightsError(EmbedpipeError, ValueError):
    """The input embedding weight is shared with another parameter (usually the output layer)."""


def offload(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    chunk_rows: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Table:
    """Write ``model``'s input word embeddings to a new table at ``path`` and drop them from it.

    The weight ``[V, D]`` is stored bit for bit (float32, float16 or float64), then the model's
    embedding module is replaced by an :class:`OffloadedEmbedding`, so the weight's memory is
    freed once nothing else holds it (offload before building the optimizer). Refuses, before
    writing anything, bfloat16 weights and weights tied to another parameter (see :func:`untie`).
    Returns the table open for writing; close it or hand it to ``EmbeddingPipe``.
    """
    embeddings = model.get_input_embeddings()
    if isinstance(embeddings, OffloadedEmbedding):
        raise EmbeddingsOffloadedError(
            f"this model's word embeddings were already offloaded to {embeddings.path}"
        )
    weight = embeddings.weight
    if weight.dtype == torch.bfloat16:
        raise InvalidRowsError(
            "the input embeddings are bfloat16, which a zarr table cannot store; offload a float32 "
            "copy (lossless) with model.get_input_embeddings().float() first (then cast "
            "inputs_embeds to torch.bfloat16 before the model), or train in float32 with model.float()"
        )
    if weight.device.type == "meta":
        raise InvalidRowsError(
            "the input embeddings are on the meta device (not loaded); load the weights first"
        )
    # refuses a module that does more than gather rows, or scale them (Gemma, MBart...)
    placeholder = OffloadedEmbedding.replacing(
        embeddings, str(os.path.abspath(os.path.expanduser(path)))
    )
    added: list = []
    try:
        refuse_displacing(model, embeddings, placeholder)  # first: it leaves the model as it was
        _refuse_tied(model, embeddings, placeholder)
        added = watch(model)  # positions, pooled tokens it finds in input_ids (pipe/derived.py)
        check(model, embeddings, placeholder)  # NOTE [ The model probed before offload ]
        table = _write_once(
            lambda: Table.from_tensor(
                path, weight.detach(), chunk_rows=chunk_rows, overwrite=overwrite, progress=progress
            ),
            placeholder.recorded(),
            path,
        )
    except BaseException:
        unwatch(added)
        placeholder._unregister()  # a pipe on the path must not find it
        raise
    placeholder.path, placeholder.table_id = table.path, table._meta.get("id")
    model.set_input_embeddings(placeholder)
    setattr(weight, OFFLOADED, table.path)  # an optimizer built before holds it: raises at step
    ignore_in_ddp(model, placeholder)
    return table


def _refuse_tied(model: nn.Module, embeddings: nn.Module, placeholder: OffloadedEmbedding) -> None:
    weight = embeddings.weight
    tied = _tied_names(model, embeddings, placeholder)
    if not tied:
        return
    outputs = getattr(model, "get_output_embeddings", None)  # (a hand-written model may lack it)
    output = getattr(outputs(), "weight", None) if callable(outputs) else None
    remedy = (
        "call embedpipe.hf.untie(model) to give the output layer its own copy, then offload"
        if _same_storage(output, weight)
        else "give those parameters their own copy first"
    )
    name = next(n for n in _names(model, weight) if n not in tied)
    raise TiedWeightsError(
        f"the input embedding weight {name} is tied to {', '.join(tied)}; "
        f"offloading it would leave {len(tied)} parameter(s) holding the table on the accelerator: {remedy}"
    )


def _write_once(write: Any, metadata: dict[str, Any], path: Any) -> Table:
    """The new table, written by this process, or (in a process group of several ranks, where
    every rank offloads its copy of the model) by rank 0 while the others wait, then open it
    read-only; a pipe made on every rank then shards it (``embedpipe/shards.py``)."""
    group = process_group()
    rank = dist.get_rank() if group is not None else 0
    error, table = None, None
    if rank == 0:
        try:
            table = write()
            if metadata:  # the pipe's default padding_idx, the rows' scale
                table._update_metadata(**metadata)
        except Exception as e:
            error = e
    if group is None:
        if error is not None:
            raise error
        return table
    said = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(said, src=0)
    if error is not None:
        raise error
    if said[0] is not None:
        raise RuntimeError(f"rank 0 could not offload the embeddings to {path}: {said[0]}")
    return table if table is not None else Table.open(path)


def restore(model: nn.Module, source: Any) -> nn.Module:
    """Put an ``nn.Embedding`` holding the table's rows back where :func:`offload` took it out;
    returns ``model``, ready for ``save_pretrained`` (its folder loads with ``from_pretrained``).

    ``source`` is an ``EmbeddingPipe`` (its applied steps are written first, so the rows are the
    trained ones), a :class:`Table`, or a path. The rows take host or accelerator memory again:
    ``num_rows x dim`` values, on the device the model expects ``inputs_embeds`` on.
    """
    placeholder = model.get_input_embeddings()
    module = _embedding_of(model, source)
    model.set_input_embeddings(module)
    placeholder._restored = (weakref.ref(model), weakref.ref(module))  # see finish_embeds
    _RESTORED[module] = placeholder  # (kept while the model holds its rows)
    return model


#: The placeholder each restored module replaced, alive as long as the module is.
_RESTORED: weakref.WeakKeyDictionary[nn.Module, OffloadedEmbedding] = weakref.WeakKeyDictionary()


@contextmanager
def skipping_word_embeddings(model: nn.Module) -> Iterator[None]:
    """Inside the block, loading a state dict into ``model`` drops its offloaded word
    embeddings' ``weight`` (a Trainer checkpoint holds a copy of the table's rows for
    ``from_pretrained``; a resume takes the table from the checkpoint's snapshot instead).
    Elsewhere such a key is unexpected, as for any module without it."""
    placeholder = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(placeholder, OffloadedEmbedding):
        yield
        return
    placeholder._skip_weight = True
    try:
        yield
    finally:
        placeholder._skip_weight = False


@contextmanager
def restored(model: nn.Module, source: Any) -> Iterator[nn.Module]:
    """:func:`restore` for the ``with`` block only (saving a model mid-training), then the
    offloaded module again, its gradient parameter still attached."""
    placeholder = model.get_input_embeddings()
    model.set_input_embeddings(_embedding_of(model, source))
    try:
        yield model
    finally:
        model.set_input_embeddings(placeholder)


def _embedding_of(model: nn.Module, source: Any) -> nn.Module:
    placeholder = model.get_input_embeddings()
    if not isinstance(placeholder, OffloadedEmbedding):
        raise ValueError(f"the word embeddings of this {type(model).__name__} are not offloaded")
    # each checks a state dict loaded before, forgetting nothing (the placeholder may come
    # back: restored): NOTE [ A state dict keeps the table's step ]
    if hasattr(source, "flush") and hasattr(source, "table"):  # a pipe: write its steps first
        if source._owner.closed:  # its last steps are committed: read the table as it is now
            with Table.open(source.table.path, "r") as table:
                placeholder.check_table(table)
                weight, metadata = table.to_tensor(), table.metadata
        else:
            placeholder.check_table(source.table, pipe_step(source))
            source.flush()
            weight, metadata = source.table.to_tensor(), source.table.metadata
    elif isinstance(source, Table):
        placeholder.check_table(source)
        weight, metadata = source.to_tensor(), source.metadata
    else:
        with Table.open(source, "r") as table:
            placeholder.check_table(table)
            weight, metadata = table.to_tensor(), table.metadata
    expected = (placeholder.num_embeddings, placeholder.embedding_dim)
    if tuple(weight.shape) != expected:
        raise InvalidRowsError(
            f"the table holds {tuple(weight.shape)} rows but the model's embedding was {expected}"
        )
    return placeholder.restore(weight, recorded_scale(metadata))


def untie(model: nn.Module) -> nn.Module:
    """Give the output layer its own copy of a weight tied to the input embeddings; returns ``model``.

    Sets ``config.tie_word_embeddings = False`` on the model and every sub-model and recomputes
    their ``all_tied_weights_keys`` (transformers 5), so ``tie_weights()``, ``post_init()`` and a
    save/reload keep them apart. The two copies then train separately (``docs/huggingface.md``).
    """
    embeddings, output = model.get_input_embeddings(), model.get_output_embeddings()
    weight = getattr(output, "weight", None)
    if weight is not None and _same_storage(weight, getattr(embeddings, "weight", None)):
        output.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    submodels = [m for m in model.modules() if hasattr(m, "get_expanded_tied_weights_keys")]
    for submodel in submodels:
        if getattr(submodel.config, "tie_word_embeddings", False):
            submodel.config.tie_word_embeddings = False
    for submodel in submodels:
        submodel.all_tied_weights_keys = submodel.get_expanded_tied_weights_keys(all_submodels=True)
    return model


def embedding_bytes(source: Any, optimizer: str | None = "adam", *, dtype: Any = None) -> int:
    """Accelerator bytes an input embedding table costs while trained inside the model.

    weight + gradient + optimizer state: ``optimizer`` "sgd" adds nothing, "adagrad" one copy,
    "adam"/"adamw" two; ``None`` means a frozen table (weight only). ``source`` is a model (also
    an offloaded one), an embedding module, a :class:`Table` or a ``(num_rows, dim)`` shape;
    ``dtype`` (default: the source's, else float32) sets the bytes per value.
    """
    if hasattr(source, "get_input_embeddings"):
        source = source.get_input_embeddings()
    if isinstance(source, Table):
        shape, source_dtype = (source.num_rows, source.dim), source.dtype
    elif isinstance(source, OffloadedEmbedding):
        shape, source_dtype = (source.num_embeddings, source.embedding_dim), source.dtype
    elif isinstance(source, nn.Module):
        shape, source_dtype = tuple(source.weight.shape), source.weight.dtype
    else:
        shape, source_dtype = tuple(source), torch.float32
    if optimizer is not None and str(optimizer).lower() not in OPTIMIZER_COPIES:
        raise ValueError(
            f"optimizer must be one of {sorted(OPTIMIZER_COPIES)} or None, got {optimizer!r}"
        )
    copies = 1 if optimizer is None else 2 + OPTIMIZER_COPIES[str(optimizer).lower()]
    dtype = source_dtype if dtype is None else dtype
    itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else np.dtype(dtype).itemsize
    return int(np.prod(shape)) * itemsize * copies


def _same_storage(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """True when ``a`` and ``b`` are one tensor or views of one (non-empty) storage."""
    if a is None or b is None:
        return False
    ptr = a.untyped_storage().data_ptr()
    return a is b or (ptr != 0 and ptr == b.untyped_storage().data_ptr())


def _names(model: nn.Module, weight: torch.Tensor) -> list[str]:
    return [
        n for n, p in model.named_parameters(remove_duplicate=False) if _same_storage(p, weight)
    ]


def _tied_names(
    model: nn.Module, embeddings: nn.Module, placeholder: OffloadedEmbedding
) -> list[str]:
    """Parameters that would still hold the weight once ``placeholder`` replaced ``embeddings``.

    Tried on the model itself and undone, so that models whose ``set_input_embeddings`` also
    replaces aliases of the module (encoder and decoder sharing one table) are not refused.
    """
    with swapped_in(model, placeholder):
        return _names(model, embeddings.weight)
