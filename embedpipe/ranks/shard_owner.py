"""The owner of one shard of a table trained by the ranks of a ``torch.distributed`` job.

What runs here runs in a rank's training process, as :class:`~embedpipe.owner.owner.Owner` does: a
``ShardOwner`` is that owner for the rows ``[lo, hi)`` of its rank's shard (its cache, optimizer
state and writeback), plus the places where the ranks meet, in the collectives of ``shards.py``
(NOTE [ One table over N ranks ]):

- the model's read of a batch (:meth:`refresh`): the rows other ranks own, from them, and this
  rank's rows for them (:meth:`_serve`);
- backward (:meth:`_add_gradient`): every rank's gradient, averaged as DDP averages it;
- ``flush``, ``checkpoint``, ``save``, ``load`` and ``close``: one operation of every shard, each
  starting with a header that every rank contributes, so ranks that disagree raise together.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import DistributedNotSupportedError, WritebackError
from ..optim import RowOptimizer
from ..owner.durability import _exists
from ..owner.owner import Owner
from ..store.checkpoints import Checkpoint
from ..store.table import Table
from ..worker.batch import EmbeddedBatch
from .ddp import SyncedGradient
from .shards import CLOSE, COMMIT, FLUSH, LOAD, Shards


class ShardOwner(Owner):
    """:class:`Owner` of this rank's shard (``shards.owned``); the other arguments as Owner's."""

    def __init__(self, shards: Shards, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shards = shards
        self._synced: SyncedGradient | None = None  # (made at the first backward)
        self.owned = shards.owned
        #: (steps submitted, generation) when every rank last wrote its rows to the files.
        self.written = (self.writeback.submitted, self.generation)

    # ------------------------------------------------------------------------- training loop
    def relookup(self, batch: EmbeddedBatch, ids: torch.Tensor) -> None:
        raise DistributedNotSupportedError(
            "a batch's ids were edited in place after its rows were looked up; a table sharded "
            "over ranks cannot look up the new ids alone (every rank would have to join): make "
            "the edit in the dataset or the collate_fn, which run before the lookup"
        )

    def refresh(self, batch: EmbeddedBatch) -> None:
        """The owner's own refresh, then the rows other ranks own, unless fetched since the
        steps the consistency mode lets a batch miss. Every rank reads its batch at the same
        point of the loop, so every rank takes part. In that order: after a load the cache
        takes every row for changed, the other shards' too, and re-reads them from the files,
        which lack the rows other ranks cache; the fetch then puts theirs in their places."""
        if self.writeback is None:
            return
        super().refresh(batch)
        self.counts["remote_rows"] += fetch_remote(
            self, batch, self.writeback.submitted, self._serve
        )

    def _serve(self, ids: np.ndarray) -> np.ndarray:
        """Rows of this shard for the other ranks: with the steps submitted so far (as the
        consistency mode requires), recorded by the cache's policy as uses."""
        self._wait_for_steps()
        with self.lock:
            rows = self.cache.current(ids)
            self.cache.admit(ids, rows)
        self.counts["served_rows"] += len(ids)
        return rows

    def check_step(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        super().check_step(ids, grad)
        if self._synced is not None:
            self._synced.check_step()

    def _add_gradient(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Every rank's gradient, averaged as DDP averages .grad (NOTE [ The gradient averaged
        as DDP averages .grad ] in ``ddp.py``): the same pending gradient everywhere."""
        if self._synced is None:
            self._synced = SyncedGradient(self.gradient)
        self._synced.add(
            unique_ids,
            grad,
            lambda ids, rows: self.shards.gradient(
                self.writeback.submitted, self.generation, ids, rows
            ),
        )

    def stats(self) -> dict[str, int]:
        return {**super().stats(), **self.shards.bytes}  # this rank's exchanges' bytes

    # ------------------------------------------------------------------------- checkpoints
    def _begin(self, doing: int) -> None:
        self.shards.begin(doing, self.writeback.submitted, self.generation)

    def flush(self) -> None:
        """Every rank's queued steps applied and rows written: call it on every rank."""
        self.check_open()
        self._begin(FLUSH)
        self._write_rows("writing its rows (flush)")

    def checkpoint(self) -> Checkpoint:
        self.check_open()
        self._begin(COMMIT)
        return self._commit_shards()

    def _write_rows(self, what: str) -> None:
        """This shard's queued steps applied and updated rows written to the live files on
        every rank, or an error on every rank."""
        error: BaseException | None = None
        try:
            self.writeback.wait()
            self.cache._check()
            with self.lock:
                self.cache.flush()
        except BaseException as e:
            error = e
        self.shards.agree(error, what)
        self.written = (self.writeback.submitted, self.generation)

    def _commit_shards(self) -> Checkpoint:
        """Every shard's rows written, then one commit by rank 0, which holds the lock."""
        self._write_rows("writing its rows for a checkpoint")
        error: BaseException | None = None
        checkpoint = None
        if self.shards.leader:
            try:
                checkpoint = self._commit()
            except BaseException as e:
                error = e
        checkpoint = self.shards.agree(error, "committing the checkpoint", checkpoint)
        self.table._meta["step"] = checkpoint.step
        return checkpoint

    def before_read(self) -> None:
        """Before a public read of the table (``table.read``, ``to_tensor``): the live files hold
        every rank's rows only when no step was submitted since every rank wrote its rows
        (``flush``, ``checkpoint``); a read in between would miss the other ranks' cached rows,
        so it raises instead (a flush here would wait for ranks that do not read)."""
        if self.written != (self.writeback.submitted, self.generation):
            raise DistributedNotSupportedError(
                f"the table {self.table.path} is sharded over {self.shards.size} ranks and "
                f"{self.shards.describe()} has stepped since the ranks last wrote their rows, "
                "so its files lack rows the other ranks hold in their caches: call "
                "pipe.flush() on every rank first (or read a checkpoint: "
                "Table.open(path) after pipe.checkpoint())"
            )

    def save(self, folder: str) -> Checkpoint:
        """Every rank commits its shard, rank 0 copies the checkpoint into ``folder``."""
        error: BaseException | None = None
        if self.shards.leader and os.path.exists(folder):
            error = _exists(folder)
        checkpoint = self.checkpoint()  # every rank, before any rank may raise
        if self.shards.leader and error is None:
            error = self._snapshot(checkpoint, folder)
        self.shards.agree(error, f"saving a snapshot into {folder}")
        return checkpoint

    def load(self, source: Table) -> None:
        self.check_open()
        self._begin(LOAD)
        super().load(source)
        self.written = (self.writeback.submitted, self.generation)  # the files are the snapshot

    def _restore(self, source: Table) -> None:
        """Rank 0 restores every shard's files; the others open them again. Called under the
        owner's lock, after its writeback applied every queued step: no rank writes a row
        (a step, a write ahead) from the first agreement to the second."""
        self.shards.agree(None, f"stopping its writes to load the snapshot {source.path}")
        error: BaseException | None = None
        if self.shards.leader:
            try:
                super()._restore(source)
            except BaseException as e:
                error = e
        self.shards.agree(error, f"loading the snapshot {source.path}")
        if not self.shards.leader:
            self.table._meta = Table._reader(self.table.path, self.table.path, "r+")._meta
            self.table._open_root(self.table.path)

    # ------------------------------------------------------------------------- lifecycle
    def _finish_close(self, error: BaseException | None, hung: bool) -> BaseException | None:
        """One last checkpoint of every shard together, or none (a rank failed or died: the
        table reopens at the last checkpoint they all reached)."""
        committed = False
        try:
            self._begin(CLOSE)
            if hung:  # every rank raises it (the others wait for this rank's rows)
                failed = WritebackError(f"a table write hangs on {self.shards.describe()}")
                self.shards.agree(failed, "writing its rows for a checkpoint")
            self._commit_shards()
            committed = True
        except BaseException as e:
            error = error or e
        self.table._release_claim()
        if self.shards.leader and not committed:
            self.table._abandon()  # the live files may hold a part of a step: never commit them
        elif self.owns_table:
            self.table.close()
        self.shards.close()
        return error


def fetch_remote(
    owner: Any, batch: EmbeddedBatch, submitted: int, serve: Callable[[np.ndarray], np.ndarray]
) -> int:
    """The rows of ``batch`` that other shards hold, from their owners (``Shards.rows``; this
    rank answers theirs with ``serve``), unless fetched since the steps the consistency mode
    lets a batch miss; returns how many. ``owner``: a :class:`ShardOwner`, or a rank's client
    of its machine's owner process (``service/rank.py``)."""
    fetched, generation = batch.fetched
    if fetched >= submitted - owner.behind and generation == owner.generation:
        return 0
    owner.check_open()
    ids = batch._unique_ids.numpy()
    remote = np.flatnonzero(~owner.shards.owns(ids))
    table = owner.table
    rows = owner.shards.rows(
        submitted, owner.generation, ids[remote], serve, table.dim, table.dtype
    )
    # the owners applied at least submitted - behind steps before they answered
    batch._fetched(
        torch.from_numpy(remote), torch.from_numpy(rows), submitted - owner.behind, owner.generation
    )
    return len(remote)


def open_shard(
    table: Table | str | os.PathLike[str],
    shards: Shards,
    optimizer: RowOptimizer,
    keep: int | None,
    same: tuple[Any, ...],
    creator: str,
) -> tuple[Table, bool]:
    """This rank's handle on a sharded table: rank 0 opens it to write (the writer lock, the
    checkpoints) and prepares it, then the others open handles that write their shards; every
    rank checks that they all made the same pipe (``same``: the options that change the
    training). ``creator`` names the pipe's maker for a second writer's error."""
    owns_table = not isinstance(table, Table)
    opened: Table | None = None if owns_table else table
    error: BaseException | None = None
    if shards.leader:
        try:
            opened = writer_on_rank_0(table)
            opened._claim(f"{creator}, rank 0 of a sharded pipe")
            shards.plan(opened.num_rows, opened.chunk_rows)
            opened._prepare(optimizer, keep, shards.layout())
        except BaseException as e:
            error = e
    try:
        path = shards.agree(error, "opening the table", opened.path if shards.leader else None)
        if not shards.leader:
            if opened is not None:
                opened.close()  # a handle of its own: rank 0 holds the lock
            opened, owns_table = Table._reader(path, path, "r+"), True
            opened._owner = f"{creator}, {shards.describe()}"
        shards.plan(opened.num_rows, opened.chunk_rows)
        facts = (opened.path, opened.num_rows, opened.dim, opened.dtype.name, optimizer.config())
        facts += same
        mine = facts if shards.leader else None
        expected = shards.agree(None, "checking the pipes agree", mine)
        if facts != expected:
            error = ValueError(
                f"{shards.describe()} made its pipe on {facts}, rank 0 on {expected} "
                "(path, rows, dim, dtype, optimizer, consistency, max_staleness, padding_idx, "
                "check_finite): make the same pipe on every rank"
            )
        shards.agree(error, "checking the pipes agree")
        idle = np.flatnonzero(np.diff(shards.bounds) == 0)
        if shards.leader and len(idle):
            warnings.warn(
                f"{len(idle)} of the {shards.size} ranks own no rows of {opened.path}: its "
                f"{opened.num_rows:,} rows are {-(-opened.num_rows // opened.chunk_rows)} chunk(s) "
                f"of {opened.chunk_rows:,} and a shard is whole chunks; make the table with "
                "smaller chunks (Table.create or embedpipe.hf.offload with chunk_rows=...) to "
                "spread its rows over every rank",
                RuntimeWarning,
                stacklevel=3,
            )
    except BaseException:
        if opened is not None:
            opened._release_claim()
            if owns_table or not shards.leader:
                opened.close()
        shards.close()
        raise
    return opened, owns_table


def writer_on_rank_0(table: Table | str | os.PathLike[str]) -> Table:
    """Rank 0's handle on the table its ranks train: ``table`` opened to write (a path), or
    checked to be (a Table)."""
    opened = Table.open(table, "r+") if not isinstance(table, Table) else table
    if opened.mode != "r+":
        raise ValueError(
            f"the pipe updates {opened.path}: open it with Table.open(path, mode='r+') on rank "
            "0 (or pass the path, on every rank)"
        )
    return opened
