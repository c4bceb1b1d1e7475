"""The shard of a table a service serves (``embedpipe serve TABLE --shard i/S``): its rows, its
files, the check that a job's machine trains those rows, and its files as of the last
checkpoint before a job trains them (NOTE [ Shard services ] in ``serve.py``)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from ..ranks.shards import split
from ..store import checkpoints
from ..store.mapped import changing_files
from ..store.table import Table

#: Rows a block when a later shard fills its chunks of a state array (bounded memory).
FILL_CHUNKS = 16


class ServedShard:
    """Shard ``i`` of ``count`` of ``table``: rows ``[lo, hi)``, split at chunk boundaries as a
    job of ``count`` machines splits them (``ranks/shards.py``)."""

    def __init__(self, table: Table, i: int, count: int) -> None:
        if not 0 <= i < count:
            raise ValueError(f"--shard is i/S with 0 <= i < S, got {i}/{count}")
        self.i, self.count = i, count
        bounds = split(table.num_rows, table.chunk_rows, count)
        self.rows = int(bounds[i]), int(bounds[i + 1])
        self.chunks = self.rows[0] // table.chunk_rows, -(-self.rows[1] // table.chunk_rows)
        #: The first shard's service holds the writer lock, commits, and writes the metadata
        self.locks = i == 0
        self.files = checkpoints.shard_files(self.chunks, others=self.locks)

    def describe(self) -> str:
        return f"rows {self.rows[0]:,} to {self.rows[1]:,} (shard {self.i}/{self.count})"

    def settle(self, table: Table, state_init: dict[str, float]) -> None:
        """Before a job trains it: the shard's files as of the last checkpoint (what a job
        dropped, or a service that died, left is taken back), and, for a later shard, its
        chunks of the state arrays as the first shard's service left the table's metadata:
        those added since the checkpoint filled afresh (a dropped job may have written them
        after that service filled them), those dropped since removed. ``state_init``: the
        job's optimizer's (``RowOptimizer.state_init``)."""
        table._roll_back(self.files)
        last = checkpoints.latest(table.path)
        if last is not None and last.step != table.step:
            raise RuntimeError(
                f"table {table.path}: its newest checkpoint here is of step {last.step}, its "
                f"metadata says step {table.step} (a shared filesystem not yet showing the "
                "first shard's last commit?); try again in a moment"
            )
        if self.locks:  # (it prepares the job's arrays, every chunk of them)
            return
        folder = os.path.join(table.path, "state")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            if not os.path.isdir(os.path.join(folder, name)):
                continue
            if name not in table.state_names:
                self._remove(os.path.join(folder, name))
            elif last is None or not os.path.isdir(os.path.join(last.path, "state", name)):
                self._fill(table, name, state_init.get(name, 0.0))

    def _fill(self, table: Table, name: str, value: float) -> None:
        lo, hi = self.rows
        step = FILL_CHUNKS * table.chunk_rows
        for start in range(lo, hi, step):
            ids = np.arange(start, min(start + step, hi))
            table._store(ids, np.full((len(ids), table.dim), value, dtype=table.dtype), name)

    def _remove(self, array: str) -> None:
        """This shard's chunk files of an array the table no longer has, and their folders
        once empty (the array's own, when no shard's chunk is left in it)."""
        for chunk in range(*self.chunks):
            where = os.path.join(array, "c", str(chunk))
            with changing_files():  # (NOTE [ A chunk checked once until its files change ])
                for name in os.listdir(where) if os.path.isdir(where) else ():
                    checkpoints.unlink(os.path.join(where, name))
            for empty in (where, os.path.join(array, "c"), array):
                with contextlib.suppress(OSError):
                    os.rmdir(empty)


def check(shard: ServedShard | None, theirs: Any, address: str, path: str) -> None:
    """A job's machine trains ``theirs`` (rows ``[lo, hi)``; None: a job of one machine, the
    whole table): the rows the service at ``address`` serves, or a ``ValueError`` naming both."""
    theirs = None if theirs is None else (int(theirs[0]), int(theirs[1]))
    if theirs == (shard.rows if shard is not None else None):
        return
    wanted = "the whole table" if theirs is None else f"rows {theirs[0]:,} to {theirs[1]:,}"
    remedy = (
        "a job of one machine needs a service of the whole table (embedpipe serve TABLE)"
        if theirs is None
        else "each machine's ranks need the service of their machine's shard: embedpipe "
        "serve TABLE --shard i/S on machine i of S (rank 0's machine first)"
    )
    serves = f"{path} {shard.describe()}" if shard is not None else f"{path} (the whole table)"
    raise ValueError(
        f"the service at {address} serves {serves}, and this job's machine trains {wanted}: "
        f"{remedy}"
    )


def shard_of(text: str | None) -> tuple[int, int] | None:
    """``--shard i/S``: shard i of S, 0 <= i < S."""
    if text is None:
        return None
    i, _, count = text.partition("/")
    if not (i.isdigit() and count.isdigit() and int(i) < int(count)):
        raise ValueError(
            f"--shard is i/S, shard i of S with 0 <= i < S (0/2 and 1/2 for two machines), "
            f"got {text!r}"
        )
    return int(i), int(count)
