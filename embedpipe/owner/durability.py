"""The table's durability, for the owner: checkpoints, snapshots saved and loaded, and close.

What :class:`~embedpipe.owner.owner.Owner` does to make its steps last on disk, as functions of the
owner: :func:`checkpoint` and :func:`commit` (every queued step applied, every updated row
written, then committed with its step), :func:`flush`, :func:`save` and :func:`snapshot` (a
checkpoint copied into a table of its own), :func:`load` (a snapshot made the table), :func:`close`
and :func:`finish_close` (the last commit, and the table released), and the messages of failed
table writes (:func:`write_error`, :func:`correct`).

The owner keeps methods of the same names (``_commit``, ``_snapshot``, ``_finish_close``) that call
these functions, and the functions call each other through the owner: a
:class:`~embedpipe.ranks.shard_owner.ShardOwner` overrides some of them, and its overrides run.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Protocol

from ..errors import TableExistsError, TableWriteError, WritebackError
from ..store import checkpoints

if TYPE_CHECKING:
    from ..cache.rowcache import RowCache
    from ..cache.sharedrows import SharedRows
    from ..optim import RowOptimizer
    from ..store.checkpoints import Checkpoint
    from ..store.table import Table
    from .gradient import TableGradient
    from .lookahead import Stream
    from .writeback import Writeback


class Owner(Protocol):
    """What durability takes from the table's owner (``owner.py``, which imports this module):
    its table, cache, lock, writeback and pending gradient, and the steps a sharded owner
    overrides, called through it."""

    table: Table
    cache: RowCache
    shared: SharedRows
    lock: threading.Lock
    optimizer: RowOptimizer | None
    writeback: Writeback | None
    gradient: TableGradient | None
    stream: Stream | None
    owns_table: bool
    closed: bool
    generation: int
    _step_in_progress: int | None

    @property
    def applied_step(self) -> int: ...

    def check_open(self) -> None: ...

    def checkpoint(self) -> Checkpoint: ...

    def _commit(self) -> Checkpoint: ...

    def _snapshot(self, checkpoint: Checkpoint, folder: str) -> TableWriteError | None: ...

    def _restore(self, source: Table) -> None: ...

    def _finish_close(self, error: BaseException | None, hung: bool) -> BaseException | None: ...

    def correct(self, error: object) -> None: ...

    def end_stream(self, stream: Stream) -> None: ...


def write_error(owner: Owner, e: OSError, what: str) -> TableWriteError:
    step = owner._step_in_progress
    when = f"at step {step}" if step is not None else f"after step {owner.applied_step}"
    last = owner.table.checkpoints
    at = f"step {last[-1].step}" if last else "its last checkpoint"
    return TableWriteError(
        e.errno,
        f"{what} of table {owner.table.path} {when} failed: {e.strerror or e}"
        + (f": {e.filename}" if e.filename else "")
        + f"; the table reopens at its last checkpoint ({at}). Free space and call close() "
        "or checkpoint() again to keep the steps applied since",
    )


# ----------------------------------------------------------------------------- checkpoints
def checkpoint(owner: Owner) -> Checkpoint:
    """Apply every queued step, write every updated row and its state, and commit them with
    the step as a checkpoint (NOTE [ Checkpoint commit ] in ``checkpoints.py``)."""
    owner.check_open()
    if owner.writeback is not None:
        owner.writeback.wait()
    return owner._commit()


def commit(owner: Owner) -> Checkpoint:
    owner.cache._check()
    with owner.lock:  # no hand-off evicts and no step writes while the files are linked
        owner.cache.flush()
        step = owner.applied_step
        try:
            return owner.table._commit(step)
        except OSError as e:
            if isinstance(e, TableWriteError):
                raise
            raise write_error(owner, e, "the checkpoint") from e


def flush(owner: Owner) -> None:
    """Apply what is queued and write every updated row to the table's live arrays."""
    owner.check_open()
    if owner.writeback is None:
        return
    owner.writeback.wait()
    with owner.lock:
        owner.cache.flush()


def save(owner: Owner, folder: str) -> Checkpoint:
    """Commit a checkpoint, then copy it into ``folder`` (which must not exist) as a table
    of its own."""
    if os.path.exists(folder):
        raise _exists(folder)  # before anything is written
    checkpoint = owner.checkpoint()
    error = owner._snapshot(checkpoint, folder)
    if error is not None:
        raise error
    return checkpoint


def snapshot(owner: Owner, checkpoint: Checkpoint, folder: str) -> TableWriteError | None:
    """Copy ``checkpoint`` into ``folder``; the error, if that failed."""
    try:
        checkpoints.snapshot(checkpoint.path, folder)
    except OSError as e:
        return TableWriteError(
            e.errno, f"saving a snapshot of {owner.table.path} into {folder} failed: {e}"
        )
    return None


# NOTE [ A load keeps the pending gradient ]
# torch's load_state_dict (and Accelerate's load_state, Lightning's checkpoint load) sets the
# weights and leaves every .grad as it is: a gradient accumulated before the load is applied,
# to the loaded weights, by the next optimizer step. A load used to drop the table's pending
# gradient instead, so a load_state in the middle of an accumulation group stepped the dense
# weights with their whole group's gradient and the table with the part after the load only
# (found by a probe: 2.7e-4 from nn.Embedding, silently). Now the table's stays pending too, in
# every owner; the next step applies it to the snapshot's rows.


def load(owner: Owner, source: Table) -> None:
    """Make the table the snapshot ``source`` (read-only, checked compatible by the pipe):
    queued steps are applied first, then the cache is emptied without writing it back, and
    the snapshot is committed as the newest checkpoint. A gradient no step has taken stays
    pending, as ``.grad`` stays when torch loads a state dict (NOTE [ A load keeps the pending
    gradient ] above)."""
    owner.check_open()
    owner.cache._check()
    if owner.writeback is not None:
        owner.writeback.wait()
    with owner.lock, owner.cache._guard(f"loading the snapshot {source.path}"):
        owner.cache.reset()
        owner._restore(source)
        if owner.writeback is not None:
            owner.writeback.restart_at(source.step)
        owner.shared.publish(owner.cache.clock)
        owner.generation += 1


# ----------------------------------------------------------------------------- lifecycle
def close(owner: Owner, raise_errors: bool = True) -> None:
    """Apply what is queued, write every updated row, commit a checkpoint, stop the thread
    and release the table. Can be called again after it raised: what failed is retried.

    If the writeback thread failed at step t, steps before t are committed (a step whose
    table write failed is undone first), then the error is raised. If the cache cannot be
    trusted (an interrupted update), nothing is committed: the table stays at its last
    checkpoint.
    """
    if owner.closed:
        return
    if owner.stream is not None:
        owner.end_stream(owner.stream)
    error: BaseException | None = None
    if owner.writeback is not None:
        owner.gradient.close()
        try:
            owner.writeback.close()
        except (WritebackError, TableWriteError) as e:
            error = error or e
    hung = owner.writeback is not None and owner.writeback.alive  # a write hangs: leave it
    error = owner._finish_close(error, hung)
    owner.closed = True
    if error is not None and raise_errors:
        raise error


def finish_close(owner: Owner, error: BaseException | None, hung: bool) -> BaseException | None:
    """Commit what is trustworthy and release the table; returns the error close() raises
    (``error``: the writeback's). A failed commit raises here: close() can be retried."""
    if owner.cache.broken is None and not hung:
        changed = owner.table._modified or owner.cache.dirty.any()
        if changed or owner.applied_step != owner.table.step:
            owner._commit()  # raises on a full disk: close() may be called again
        owner.correct(error)  # its message said where the table reopens
    elif not hung:
        owner.table._roll_back()  # nothing trustworthy to commit: back to the last checkpoint
    owner.table._release_claim()
    if hung and getattr(owner, "releases_when_hung", True):  # (a service ends instead)
        owner.table._abandon()  # never commit, nor roll back, under a thread still writing
    elif owner.owns_table:
        owner.table.close()
    return error


def correct(owner: Owner, error: object) -> None:
    """A commit followed ``error`` (``close()`` after the writeback failed, or leaving the
    pipe's ``with`` block with the error on its way): a table write error said the table
    reopens at the checkpoint before it; make it say the step it reopens at now."""
    mine = f"of table {owner.table.path} "  # (an error of another table, being handled)
    if isinstance(error, TableWriteError) and error.strerror and mine in error.strerror:
        failed = error.strerror.split("; the table reopens", 1)[0]
        if failed != error.strerror:
            error.strerror = (
                f"{failed}; the steps applied before it were committed when the pipe "
                f"closed: the table reopens at step {owner.table.step}"
            )


def _exists(folder: str) -> TableExistsError:
    return TableExistsError(f"{folder} already exists; save the checkpoint into a new folder")
