"""A folder ``save_pretrained`` writes holds an offloaded model's word embeddings.

NOTE [ save_pretrained on an offloaded model ]
``model.save_pretrained(folder)`` saves ``model.state_dict()``, which an offloaded embedding
leaves its rows out of: they live in the table. ``from_pretrained(folder)`` then initialises the
word embeddings afresh and only logs them as MISSING, among the heads a fine-tuning run always
sees logged: a model trained through embedpipe would come back with random word embeddings and
no error. So :func:`keep_word_embeddings` wraps ``transformers.PreTrainedModel.save_pretrained``
once, for every model, when a model is offloaded (or an ``OffloadedEmbedding`` is made) in a
process that has imported transformers. For a model holding an ``OffloadedEmbedding`` the
wrapper

1. writes the steps applied so far to the table (``pipe.flush()`` of the pipe that trains it;
   under ``torchrun`` every rank's shard together, so call ``save_pretrained`` on every rank,
   with ``is_main_process=``, as transformers asks of a distributed save);
2. calls transformers' own ``save_pretrained``;
3. on the rank that wrote the files, streams the table's rows into the folder's model file,
   under the embedding's key (a sharded save: into a shard of their own, added to the index),
   so the table is never whole in memory.

Any other model is saved as transformers saves it. ``push_to_hub=True`` raises before anything
is written (the upload would leave before the rows are added): ``model.push_to_hub(...)`` saves
through the wrapper. Trainer's checkpoints add the rows of the snapshot they hold, not the live
table's (:func:`leaving_word_embeddings_out`).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import struct
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import EmbeddingsOffloadedError, ShardMismatchError
from ..pipe.placeholder import OffloadedEmbedding
from ..pipe.rowsource import (
    check_step,
    pipe_step,
    rows_path,
    saving_rows,
    taken_at,
    trained_by,
)
from ..store.table import Table
from ..store.transfer import add_table_to_safetensors

#: The shard of a sharded save's model files that holds the word embeddings.
EMBEDDINGS_SHARD = "model-embedpipe-word-embeddings.safetensors"
_WRAPPED = "_embedpipe_keeps_word_embeddings"
_local = threading.local()


def keep_word_embeddings() -> None:
    """Wrap ``transformers.PreTrainedModel.save_pretrained`` (see the NOTE); once, and only
    where this process has imported transformers."""
    if "transformers" not in sys.modules:
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.save_pretrained
    if getattr(original, _WRAPPED, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        offloaded = offloaded_keys(self)
        if not offloaded or getattr(_local, "off", False):
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments
        if given.get("state_dict") is not None:  # the steps of those streamed checked; none kept
            given["state_dict"] = _checked(given["state_dict"], offloaded)
        state_dict = given.get("state_dict") or {}  # the rows given by the caller are theirs
        offloaded = [(key, module) for key, module in offloaded if key not in state_dict]
        if given.get("push_to_hub") and offloaded:
            raise EmbeddingsOffloadedError(
                "save_pretrained(push_to_hub=True) on a model whose word embeddings are "
                "offloaded would upload the folder before embedpipe adds them: save it with "
                "push_to_hub=False, or call model.push_to_hub(...)"
            )
        if getattr(self, "_hf_peft_config_loaded", False):  # the adapters only: no rows
            return original(self, *args, **kwargs)
        folder, variant = os.fspath(given["save_directory"]), given.get("variant")
        with rows_to_save(offloaded) as rows:  # every rank flushes, before the save
            before = model_files(folder, variant)
            with saving_rows():  # the folder holds the rows, not the table's step
                result = original(*bound.args, **bound.kwargs)
            if self.should_save_on_this_rank(given.get("is_main_process", True)):
                add_word_embeddings(folder, rows, before, variant)
        return result

    setattr(save_pretrained, _WRAPPED, True)
    PreTrainedModel.save_pretrained = save_pretrained


@contextmanager
def leaving_word_embeddings_out() -> Iterator[None]:
    """Within the block, ``save_pretrained`` in this thread saves as transformers does: a
    Trainer checkpoint adds the rows of its own snapshot afterwards."""
    was, _local.off = getattr(_local, "off", False), True
    try:
        with saving_rows():  # the folder will hold the rows, not the table's step
            yield
    finally:
        _local.off = was


def model_files(folder: str, variant: str | None = None) -> dict[str, Any]:
    """The model files ``save_pretrained`` writes in ``folder`` (one file, then the index of a
    sharded save), each with what tells a later write of it (``None``: absent)."""
    names = ("model.safetensors", "model.safetensors.index.json")
    return {
        path: _seen(path)
        for path in (os.path.join(folder, _with_variant(n, variant)) for n in names)
    }


def _seen(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def _held(path: str) -> set[str]:
    """The tensors of the safetensors file ``path``."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return set(json.loads(f.read(size))) - {"__metadata__"}


def add_word_embeddings(
    folder: str, rows: dict[str, Table], before: dict[str, Any], variant: str | None = None
) -> None:
    """Stream each table of ``rows`` into the model file ``save_pretrained`` has just written
    in ``folder`` (``before``: :func:`model_files` before it wrote) as the tensor of its key: in
    the model file, or in a shard of their own added to the index of a sharded save. Keys the
    file holds already are left as they are; warns where it wrote no model file in
    safetensors. Files an earlier save left are never taken for the new ones."""
    model_file, index_file = list(before)
    written = [path for path, seen in before.items() if _seen(path) not in (None, seen)]
    if model_file in written:
        held = _held(model_file)
        rows = {k: t for k, t in rows.items() if k not in held}
        if rows:
            add_table_to_safetensors(Path(model_file), rows)
    elif index_file in written:  # sharded: the embeddings in a shard of their own
        with open(index_file) as f:
            index = json.load(f)
        rows = {k: t for k, t in rows.items() if k not in index["weight_map"]}
        if not rows:
            return
        shard = _with_variant(EMBEDDINGS_SHARD, variant)
        shard_path = Path(folder, shard)
        shard_path.unlink(missing_ok=True)  # an earlier save's
        add_table_to_safetensors(shard_path, rows)
        index["weight_map"].update(dict.fromkeys(rows, shard))
        with open(index_file + ".tmp", "w") as f:
            json.dump(index, f, indent=2)
        os.replace(index_file + ".tmp", index_file)
    else:
        tables = sorted({t.path for t in rows.values()})
        warnings.warn(
            f"{folder}: no model.safetensors was written there, so the word embeddings "
            f"{sorted(rows)} are only in {', '.join(tables)}, and from_pretrained on the "
            "folder gives freshly initialised ones; save in safetensors, or put the rows back "
            "first with embedpipe.hf.restore",
            RuntimeWarning,
            stacklevel=4,
        )


def offloaded_keys(model: nn.Module) -> list[tuple[str, OffloadedEmbedding]]:
    """``(key of its rows, module)`` for each offloaded embedding in ``model``, under each of
    its names (BART's encoder and decoder hold the module that stands for ``shared``)."""
    return [
        (f"{name}.weight" if name else "weight", module)
        for name, module in model.named_modules(remove_duplicate=False)
        if isinstance(module, OffloadedEmbedding)
    ]


def _checked(
    state_dict: dict[str, Any], offloaded: list[tuple[str, OffloadedEmbedding]]
) -> dict[str, Any]:
    """``state_dict`` without the table's steps it holds; those of the modules whose rows it
    does not hold (they are streamed from their table) are checked against its step (NOTE
    [ A state dict keeps the table's step ] in ``pipe/rowsource.py``)."""
    state_dict = dict(state_dict)
    for key, module in offloaded:
        taken = taken_at(state_dict, key.removesuffix("weight"))
        if key not in state_dict:
            check_step(module, taken)
    return state_dict


@contextmanager
def rows_to_save(
    offloaded: list[tuple[str, OffloadedEmbedding]],
    flush: bool = True,
    given: Callable[[OffloadedEmbedding], Table | None] = lambda module: None,
) -> Iterator[dict[str, Table]]:
    """The table to stream into a saved model under each key of ``offloaded``: the one
    ``given`` for its module, else the one holding its rows (:func:`table_of`, once per module:
    BART's aliases share it); those opened here are closed after the block."""
    tables: dict[int, tuple[Table, bool]] = {}
    try:
        for _, module in offloaded:
            if id(module) not in tables:
                table = given(module)
                tables[id(module)] = (
                    (table, False) if table is not None else table_of(module, flush)
                )
        yield {key: tables[id(module)][0] for key, module in offloaded}
    finally:
        for table, opened in tables.values():
            if opened:
                table.close()


def table_of(placeholder: OffloadedEmbedding, flush: bool = True) -> tuple[Table, bool]:
    """The table holding ``placeholder``'s rows as trained so far, and whether it was opened
    here (to close): its pipe's while it is open (flushed first, unless the caller did so on
    every rank), else the table as committed. Checks a state dict loaded into the model against
    it, forgetting nothing (NOTE [ A state dict keeps the table's step ])."""
    pipe = trained_by(placeholder)
    if pipe is not None:
        placeholder.check_table(pipe.table, pipe_step(pipe))
        try:  # its applied steps in the table's files, read through its own handle
            if flush:
                pipe.flush()
        except ShardMismatchError as e:
            raise ShardMismatchError(
                f"{e}. save_pretrained on a model whose word embeddings are sharded over the "
                "ranks writes every rank's rows first: call it on every rank, with "
                "is_main_process=(rank == 0)"
            ) from e
        return pipe.table, False
    table = Table.open(rows_path(placeholder), "r")  # as committed (by the pipe's close)
    try:
        placeholder.check_table(table)
    except BaseException:
        table.close()
        raise
    return table, True


def _with_variant(name: str, variant: str | None) -> str:
    """transformers' file name for ``variant``: ``model.fp16.safetensors``."""
    if not variant:
        return name
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{variant}.{suffix}"
