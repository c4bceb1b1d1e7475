"""Where an offloaded module's rows are: the pipe that reads them, its table, and the table's
step a state dict of the model was taken at.

NOTE [ A state dict keeps the table's step ]
A model's ``state_dict()`` leaves the offloaded rows out: they live in the table. Loading a
state dict taken earlier (an early stop going back to its best weights, a k-fold reset, a
resume, Lightning's ``ckpt_path``) restores every other weight and leaves the table where it
is, so the model pairs the weights of one step with the word embeddings of another, with no
error; with ``nn.Embedding`` the rows would go back too. So each state dict holds the table's
step: the steps taken so far where a pipe in this process trains the table, the step of the
table a pipe reads, or that of the table on disk (:func:`table_step`). It is stored under
``<embedding>._extra_state`` (torch's name for a module's extra state, which torch's
distributed checkpoint and ``torch.func`` handle), as 8 base-256 digits in an int64 tensor (a
state dict cast to bfloat16 or float16 keeps them exact). Loading one records the step in the
module; a state dict without it leaves an earlier record as it was (a partial load, an
adapter's), and Trainer's resume, which loads weights and table together, replaces it. The next
read of a batch through a pipe (:func:`check_step`, the newest module on the table: the one the
batch is made for), ``save_pretrained`` (of the model, or of a state dict given to it, for the
rows it streams), Trainer's ``save_model`` and ``restore``/``restored`` compare it with the
step of the table the rows come from, and raise :class:`EmbeddingsOffloadedError` where they
differ. Only a read through the pipe that trains the rows forgets it, where they agree (the
table's snapshot of that step was loaded too, with ``pipe.load_checkpoint``, as Lightning's
resume does; or nothing stepped since): an evaluation or a save of the best weights with a copy
of the best table is right, and training on from the last table's rows still raises. A state
dict taken while a record is pending holds the recorded step (its weights are that step's).
Only a pipe that trains the rows, or one attached to the model, becomes the rows' source
(:func:`read_through`) for ``save_pretrained`` and the step in a state dict. A step cannot
tell two tables, or two branches of one training, apart at the same step: the check is against
going back in the dense weights alone. ``save_pretrained`` leaves the key out of the folder
(:func:`saving_rows`): it holds the rows.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import EmbeddingsOffloadedError, TableOwnedError
from ..store.table import Table

#: The key, after the module's prefix, of the table's step in a state dict.
STEP_KEY = "_extra_state"
_DIGITS = 8

#: The pipe whose table holds each module's rows (weakly), and that table's path.
_PIPES: weakref.WeakKeyDictionary[Any, tuple[weakref.ref[Any], str]] = weakref.WeakKeyDictionary()
#: The last pipe made to train a table in this process (weakly), and how many were, by the
#: table's real path.
_TRAINERS: dict[str, tuple[weakref.ref[Any], int]] = {}
_saving = threading.local()


def trains(pipe: Any) -> None:
    """``pipe`` trains its table from now on (a frozen pipe on it here must not read it)."""
    key = os.path.realpath(pipe.table.path)
    _TRAINERS[key] = (weakref.ref(pipe), trainings(key) + 1)


def trainings(path: str | os.PathLike[str]) -> int:
    """How many pipes of this process were made to train the table at ``path``."""
    return _TRAINERS.get(os.path.realpath(path), (None, 0))[1]


def check_not_trained_here(path: str | os.PathLike[str], since: int | None = None) -> None:
    """Raise if an open pipe of this process trains the table at ``path``, which a frozen pipe
    reads: it would read the table's files without the rows the other's cache holds, or,
    opened by path, the checkpoint it opened; an evaluation on them would see stale rows.
    ``since``: :func:`trainings` when the frozen pipe opened the table; a pipe made to train
    it since (closed or not) left it reading stale rows too."""
    ref, count = _TRAINERS.get(os.path.realpath(path), (None, 0)) if _TRAINERS else (None, 0)
    trainer = None if ref is None else ref()
    if since is not None and count != since and (trainer is None or trainer._owner.closed):
        raise TableOwnedError(
            f"this pipe reads the table {path} as of the checkpoint it opened, and a pipe of "
            "this process has trained the table since: its rows here would be stale. Make a "
            "new EmbeddingPipe on the table once that pipe closed (it reads the rows trained), "
            "or read evaluation batches through the pipe that trains it (pipe.loader(eval_dataset))"
        )
    if trainer is None or trainer._owner.closed:
        return
    raise TableOwnedError(
        f"the table {path} is trained by an open EmbeddingPipe of this process "
        f"({trainer.table._owner or 'made earlier'}): a pipe that only reads it would see its "
        "files without the steps that pipe's cache holds (stale rows). Read evaluation batches "
        "through the pipe that trains it (pipe.loader(eval_dataset): they see every step so "
        "far), or evaluate a snapshot (pipe.save_checkpoint(folder), then "
        "EmbeddingPipe(folder))"
    )


def read_through(module: Any, pipe: Any) -> None:
    """``pipe``'s table holds ``module``'s rows from now on: ``pipe`` adopted it, was attached
    to it, or read a batch for it as the pipe that trains it. A frozen pipe never takes the
    place of an open one that trains the rows (whose files lack its cached rows)."""
    current = trained_by(module)
    trains = current is not None and current.optimizer is not None
    if current is pipe or (pipe.optimizer is None and trains):
        return  # (every batch a training pipe reads asks again)
    _PIPES[module] = (weakref.ref(pipe), pipe.table.path)


def read_like_its_table(module: Any) -> None:
    """``module`` was just unpickled: the open pipe that reads another module of its table in
    this process (the model it was pickled from) holds its rows too."""
    for other, (ref, _) in list(_PIPES.items()):
        pipe = ref()
        if other is not module and other.path == module.path and trained_by(other) is pipe:
            read_through(module, pipe)
            return


def check_same_table(module: Any, table: Any) -> None:
    """Raise if ``table`` (a Table) is not the one ``module``'s rows were offloaded to, but one
    made anew at its path since (``offload(other_model, path, overwrite=True)``)."""
    mine, theirs = getattr(module, "table_id", None), table._meta.get("id")
    if mine is not None and theirs is not None and mine != theirs:
        raise EmbeddingsOffloadedError(
            f"the table at {table.path} was made anew since this model's word embeddings were "
            "offloaded to it (an offload of another model with overwrite=True?): its rows are "
            "another table's. If they are this model's (a snapshot of its table loaded into "
            "this one), pipe.attach(model) on the pipe that trains it makes them its"
        )


def trained_by(module: Any) -> Any:
    """The open pipe whose table holds ``module``'s rows; None if it is closed or gone."""
    ref, _ = _PIPES.get(module, (lambda: None, None))
    pipe = ref()
    return None if pipe is None or pipe._owner.closed else pipe


def rows_path(module: Any) -> str:
    """The path of the table holding ``module``'s rows: the last pipe's that read them (a copy
    of its table, attached), open or not; else its own."""
    _, path = _PIPES.get(module, (None, None))
    return module.path if path is None else path


def table_step(module: Any) -> int | None:
    """The step of the table holding ``module``'s rows: the steps its pipe has taken (queued
    ones too) where one trains it, the step of the table a pipe reads, or of the table on disk;
    None where there is none."""
    pipe = trained_by(module)
    if pipe is not None:
        return pipe_step(pipe)
    try:
        with Table.open(rows_path(module), "r") as table:
            return table.step
    except Exception:  # moved, deleted, damaged, being rebuilt: a state dict leaves it out
        return None


def pipe_step(pipe: Any) -> int:
    """The step of the table ``pipe`` reads: the steps it has taken (queued ones too) where it
    trains the table, else the table's own."""
    return pipe._owner.submitted if pipe.optimizer is not None else pipe.table.step


@contextmanager
def saving_rows() -> Iterator[None]:
    """Within the block, state dicts taken in this thread leave the table's step out: the
    folder being saved holds the rows themselves (``save_pretrained``)."""
    was, _saving.rows = getattr(_saving, "rows", False), True
    try:
        yield
    finally:
        _saving.rows = was


def stamp(module: Any, destination: dict[str, Any], prefix: str) -> None:
    """Put the table's step in ``destination``, a state dict being taken."""
    if getattr(_saving, "rows", False):
        return
    step = getattr(module, "_loaded_step", None)  # a state dict loaded, not yet checked: its
    if step is None:  # weights are of that step
        step = table_step(module)
    if step is not None:
        destination[prefix + STEP_KEY] = encoded(step)


def encoded(step: int) -> torch.Tensor:
    """``step`` as a state dict holds it: base-256 digits, exact in any float dtype."""
    return torch.tensor([(step >> (8 * i)) & 255 for i in range(_DIGITS)], dtype=torch.int64)


def taken_at(state_dict: dict[str, Any], prefix: str, pop: bool = True) -> int | None:
    """The table's step a state dict was taken at, if it holds one (removed if ``pop``)."""
    value = state_dict.pop(prefix + STEP_KEY, None) if pop else state_dict.get(prefix + STEP_KEY)
    if not isinstance(value, torch.Tensor) or value.numel() != _DIGITS:
        return None
    return sum(round(float(d)) << (8 * i) for i, d in enumerate(value.flatten().tolist()))


def check_step(
    module: Any, taken: int | None, step: int | None = None, path: str | None = None
) -> bool:
    """Raise if ``taken``, the table's step a state dict of the model was taken at, is not
    ``step``, that of the table at ``path`` (default: the table holding ``module``'s rows,
    :func:`table_step`); returns whether the two were compared (False where one is unknown)."""
    if taken is None:
        return False
    step = table_step(module) if step is None else step
    if step is None:
        return False
    if taken != step:
        raise EmbeddingsOffloadedError(
            f"a state dict of this model (or the model pickled whole) was taken when the table "
            f"{path or rows_path(module)} had "
            f"taken {taken} steps, and it has taken {step}: loading it restores the model's "
            "other weights, not its word embeddings, which live in the table. Put the "
            f"table's snapshot of step {taken} in its place (pipe.load_checkpoint(folder) on "
            "the pipe that trains it; or read it through a pipe on the snapshot, attached with "
            f"pipe.attach(model)), or use a state dict taken at step {step}"
        )
    return True
