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
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import EmbeddingsOffloadedError, ShardMismatchError
from ..pipe.placeholder import OffloadedEmbedding, saving_rows, trained_by
from ..store.table import Table
from ..store.transfer import add_table_to_safetensors, export_table

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
        given = signature.bind(self, *args, **kwargs).arguments
        state_dict = given.get("state_dict") or {}  # the rows given by the caller are theirs
        offloaded = [(key, module) for key, module in offloaded if key not in state_dict]
        if given.get("push_to_hub"):
            raise EmbeddingsOffloadedError(
                "save_pretrained(push_to_hub=True) on a model whose word embeddings are "
                "offloaded would upload the folder before embedpipe adds them: save it with "
                "push_to_hub=False, or call model.push_to_hub(...)"
            )
        tables = [_table_of(placeholder) for _, placeholder in offloaded]
        try:
            with saving_rows():  # the folder holds the rows, not the table's step
                result = original(self, *args, **kwargs)
            if self.should_save_on_this_rank(given.get("is_main_process", True)):
                folder = os.fspath(given["save_directory"])
                for (key, _), (table, _) in zip(offloaded, tables):
                    add_word_embeddings(folder, table, key, given.get("variant"))
        finally:
            for table, opened in tables:
                if opened:
                    table.close()
        return result

    setattr(save_pretrained, _WRAPPED, True)
    PreTrainedModel.save_pretrained = save_pretrained


@contextmanager
def leaving_word_embeddings_out() -> Iterator[None]:
    """Within the block, ``save_pretrained`` in this thread saves as transformers does: a
    Trainer checkpoint adds the rows of its own snapshot afterwards."""
    _local.off = True
    try:
        with saving_rows():  # the folder will hold the rows, not the table's step
            yield
    finally:
        _local.off = False


def add_word_embeddings(folder: str, table: Table, key: str, variant: str | None = None) -> None:
    """Stream ``table``'s rows into the model file(s) ``save_pretrained`` wrote in ``folder``
    as the tensor ``key``; warns where it wrote none in safetensors."""
    model_file = os.path.join(folder, _with_variant("model.safetensors", variant))
    index_file = os.path.join(folder, _with_variant("model.safetensors.index.json", variant))
    if os.path.isfile(model_file):
        add_table_to_safetensors(Path(model_file), table, key)
    elif os.path.isfile(index_file):  # sharded: the embeddings in a shard of their own
        shard = _with_variant(EMBEDDINGS_SHARD, variant)
        export_table(table, os.path.join(folder, shard), key=key)
        with open(index_file) as f:
            index = json.load(f)
        index["weight_map"][key] = shard
        with open(index_file + ".tmp", "w") as f:
            json.dump(index, f, indent=2)
        os.replace(index_file + ".tmp", index_file)
    else:
        warnings.warn(
            f"{folder} holds no model.safetensors: the word embeddings {key} are only in "
            f"{table.path}, and from_pretrained on the folder gives freshly initialised ones; "
            "save in safetensors, or put the rows back first with embedpipe.hf.restore",
            RuntimeWarning,
            stacklevel=4,
        )


def offloaded_keys(model: nn.Module) -> list[tuple[str, OffloadedEmbedding]]:
    """``(key of its rows, module)`` for each offloaded embedding in ``model``."""
    return [
        (f"{name}.weight" if name else "weight", module)
        for name, module in model.named_modules()
        if isinstance(module, OffloadedEmbedding)
    ]


def _table_of(placeholder: OffloadedEmbedding) -> tuple[Table, bool]:
    """The table holding ``placeholder``'s rows as trained so far, and whether it was opened
    here (to close): the pipe's, flushed, while it is open; else the table as committed."""
    pipe = trained_by(placeholder)
    if pipe is not None and not pipe._owner.closed:
        placeholder.check_loaded_step()  # NOTE [ A state dict keeps the table's step ]
        try:  # its applied steps in the table's files, read through its own handle
            pipe.flush()
        except ShardMismatchError as e:
            raise ShardMismatchError(
                f"{e}. save_pretrained on a model whose word embeddings are sharded over the "
                "ranks writes every rank's rows first: call it on every rank, with "
                "is_main_process=(rank == 0)"
            ) from e
        return pipe.table, False
    path = pipe.table.path if pipe is not None else placeholder.path
    table = Table.open(path, "r")
    try:
        placeholder.check_loaded_step(table.step)
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
