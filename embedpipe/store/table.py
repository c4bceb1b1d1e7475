"""Table: the authoritative embedding table on disk, a zarr v3 group.

Its folder (the weights, the optimizer's state beside them, the committed checkpoints) and
format are in ``layout.py`` and described in ``docs/table-format.md``; any zarr v3 reader opens
the arrays. Only one process writes a table at a time (invariant 1): it holds an ``flock`` on the
folder. Readers need no lock: they open a committed checkpoint, never the arrays being written,
so a reader (or a reopen after a crash) sees the table exactly as it was at a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from ..errors import (
    ReadOnlyTableError,
    TableFormatError,
    TableOwnedError,
)
from ..ids import as_ids
from . import checkpoints
from .checkpoints import Checkpoint
from .layout import (
    DEFAULT_KEEP,
    STATE_GROUP,
    WEIGHT,
    checked_rows,
    copy_rows,
    create_empty,
    create_state_array,
    fill_normal,
    nbytes_on_disk,
    open_group,
    open_to_write,
    optimizer_metadata,
    pin_checkpoint,
    read_table_metadata,
    refuse_another_optimizer,
    tensor_rows,
)
from .lock import WriterLock
from .rowstore import ZarrRows, row_access


class Table:
    """The embedding table on disk: a zarr v3 group with the weights, optimizer state and metadata.

    Make one with :meth:`create` or :meth:`from_tensor`, open one with :meth:`open`. A table
    opened with ``mode="r"`` reads a committed checkpoint (the latest, or ``step=N``) and never
    changes under its reader. One opened with ``mode="r+"`` holds the writer lock until
    :meth:`close`, writes rows in place, and makes them durable with :meth:`checkpoint` (which
    :meth:`close` calls); a crash before that reopens at the previous checkpoint. A table pickles
    as the folder it reads and reopens read-only in the receiving process, which is how
    DataLoader workers get their own handle.
    """

    _mapped_bytes = 0  # chunk file bytes an array keeps mapped to write rows (mapped.py)

    def __init__(
        self,
        path: str | os.PathLike[str],
        mode: str = "r",
        *,
        step: int | None = None,
        _lock: WriterLock | None = None,
    ) -> None:
        """Open the table at ``path``; prefer :meth:`open`, which documents the arguments
        (``_lock``: the writer lock, lent by another process)."""
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        self.path = str(Path(path).expanduser().resolve())
        self.mode = mode
        self._lock: WriterLock | None = None
        self._owner: str | None = None
        self._modified = False
        meta = read_table_metadata(self.path)
        if meta.get("checkpoint"):
            raise TableFormatError(
                f"{self.path} is a checkpoint inside a table; open the table with "
                f"Table.open(table_path, step={meta.get('step')}) instead"
            )
        self._pin: checkpoints.Pin | None = None
        if mode == "r+":
            self._lock = _lock or WriterLock(self.path)
            try:
                root = open_to_write(self.path, meta, step)
            except BaseException:
                self._lock.release()
                self._lock = None
                raise
        else:
            root, self._pin = pin_checkpoint(self.path, meta, step)
        self._open_root(root)

    def _open_root(self, root: str) -> None:
        """Open the zarr group at ``root`` (the table, or one of its checkpoints) for reading."""
        self.root = root
        mode = "r+" if root == self.path and self.mode == "r+" else "r"
        self._group, self._meta = open_group(root, mode)
        self._rows: dict[str, ZarrRows] = {}
        self._maps_reads = False  # a checkpoint's files read through windows (mapped.map_reads)
        weight = self._array(WEIGHT)
        self.num_rows, self.dim = (int(n) for n in weight.array.shape)
        self.dtype = np.dtype(weight.dtype)

    # ----------------------------------------------------------------------------- make, open
    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        num_rows: int,
        dim: int,
        *,
        dtype: str = "float32",
        init: str = "normal",
        std: float = 1.0,
        seed: int = 0,
        chunk_rows: int | None = None,
        compressor: str = "none",
        overwrite: bool = False,
        progress: bool = False,
    ) -> Table:
        """Create a table of ``num_rows x dim`` rows and return it open for writing.

        ``init="normal"`` draws every row from N(0, ``std``^2), as ``nn.Embedding`` does with
        ``std=1``; rows depend only on ``seed``, ``num_rows`` and ``dim``. ``init="zeros"`` writes
        nothing (zarr reads missing chunks as zeros). ``chunk_rows`` defaults to about 1 MiB of
        rows; ``compressor`` is ``"none"`` (default, fastest reads), ``"zstd"`` or ``"blosc"``.
        """
        if init not in ("normal", "zeros"):
            raise ValueError(f"init must be 'normal' or 'zeros', got {init!r}")
        if not (isinstance(std, (int, float)) and np.isfinite(std) and std >= 0):
            raise ValueError(f"std must be a finite number >= 0, got {std!r}")
        path = create_empty(path, num_rows, dim, dtype, chunk_rows, compressor, overwrite)
        table = cls._new_writer(path)
        with table._creating():
            if init == "normal":
                fill_normal(table._array(WEIGHT), table._block_rows(), seed, std, progress)
            else:
                table._array(WEIGHT).fill_all(0.0)
        return table

    @classmethod
    def from_tensor(
        cls,
        path: str | os.PathLike[str],
        weight: Any,
        *,
        chunk_rows: int | None = None,
        compressor: str = "none",
        overwrite: bool = False,
        progress: bool = False,
    ) -> Table:
        """Create a table holding ``weight`` ([V, D] torch tensor or numpy array), open to write.

        The rows are stored bit for bit in ``weight``'s dtype (float32, float16 or float64; cast a
        bfloat16 tensor with ``.float()`` first). Anything with ``.shape``, ``.dtype`` and row
        slicing to numpy (a ``numpy.memmap``, a safetensors slice) is copied one chunk at a time.
        """
        weight = tensor_rows(path, weight)
        shape, dtype = tuple(weight.shape), np.dtype(weight.dtype).name
        path = create_empty(path, shape[0], shape[1], dtype, chunk_rows, compressor, overwrite)
        table = cls._new_writer(path)
        with table._creating():
            copy_rows(table._array(WEIGHT), table._block_rows(), weight, progress)
        return table

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], mode: str = "r", *, step: int | None = None
    ) -> Table:
        """Open the table at ``path``.

        ``mode="r"`` reads the latest committed checkpoint, or the newest one at training step
        ``step``; rows written since (by a pipe still training, or by a process that crashed)
        are not seen. ``mode="r+"`` takes the writer lock and opens the table to write, first
        taking it back to its latest checkpoint (what a crash left is undone); with ``step`` it
        takes it back to that checkpoint instead, committed again as the newest (the newer
        checkpoints are kept until ``keep`` of them pushes them out).
        """
        return cls(path, mode, step=step)

    @classmethod
    def _reader(cls, path: str, root: str, mode: str = "r") -> Table:
        """A handle without the lock on the folder ``root`` of table ``path``: the live arrays
        (which a pipe's DataLoader workers read) or a checkpoint; ``mode="r+"``: the live arrays
        of a table whose lock rank 0 of a sharded pipe holds, for a rank to write its shard's
        chunks (``shards.py``), never to commit."""
        table = cls.__new__(cls)
        table.path, table.mode = path, mode
        table._lock, table._owner, table._modified, table._pin = None, None, False, None
        if root != path:
            table._pin = checkpoints.Pin(root)
        table._open_root(root)
        return table

    @contextmanager
    def _creating(self) -> Iterator[None]:
        """Fill a new table, then commit it as its first checkpoint; on any failure, delete it."""
        try:
            yield
            self._commit(0)
        except BaseException:
            self._lock.release()
            self._lock = None
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    @classmethod
    def _new_writer(cls, path: str) -> Table:
        """The writer of the table just made at ``path`` (:func:`~.layout.create_empty`)."""
        table = cls.__new__(cls)
        table.path, table.mode, table._owner, table._modified = path, "r+", None, True
        table._pin = None
        table._lock = WriterLock(path)
        table._open_root(path)
        return table

    # ----------------------------------------------------------------------------- rows
    @property
    def chunk_rows(self) -> int:
        """Rows per chunk of the weight array."""
        return self._array(WEIGHT).chunk_rows

    def read(self, ids: Any, name: str = WEIGHT) -> np.ndarray:
        """Rows for ``ids`` in the order of ``ids`` (duplicates and any order allowed).

        ``ids`` of shape S gives rows of shape S + (dim,). ``name`` picks an optimizer state
        array instead of the weights. Reads only the chunks the ids fall in.
        """
        ids = as_ids(ids, self.num_rows)
        self._up_to_date()
        return self._array(name).read(ids.reshape(-1)).reshape(*ids.shape, self.dim)

    def write(self, ids: Any, rows: Any, name: str = WEIGHT) -> None:
        """Write ``rows[i]`` to row ``ids[i]``; durable at the next :meth:`checkpoint`.

        Uncompressed local tables write rows in place (a chunk shared with a checkpoint is
        copied first), others rewrite every chunk the ids fall in, atomically. ``ids`` must be
        unique; ``rows`` must have shape ``(len(ids), dim)`` and the array's dtype exactly (no
        silent casts). Everything is checked before the first byte is written.
        """
        self._check_writable()
        array = self._array(name)
        ids = as_ids(ids, self.num_rows)
        rows = checked_rows(ids, rows, self.dim, array.dtype)
        self._store(ids, rows, name)

    def to_tensor(self) -> torch.Tensor:
        """The whole weight table as a [num_rows, dim] CPU tensor (reads every chunk)."""
        return torch.from_numpy(self.read_range(0, self.num_rows))

    def read_range(self, start: int, stop: int, name: str = WEIGHT) -> np.ndarray:
        """Rows ``start:stop`` as a new array (one sequential read per chunk)."""
        self._up_to_date()
        return self._array(name).read(np.arange(start, stop, dtype=np.int64))

    def iter_blocks(
        self, rows_per_block: int | None = None, name: str = WEIGHT
    ) -> Iterator[np.ndarray]:
        """The table in order, a block of whole chunks at a time (about 16 MiB by default)."""
        rows_per_block = rows_per_block or self._block_rows()
        for start in range(0, self.num_rows, rows_per_block):
            yield self.read_range(start, min(start + rows_per_block, self.num_rows), name)

    # ----------------------------------------------------------------------------- state
    @property
    def state_names(self) -> list[str]:
        """Names of the optimizer state arrays next to the weights."""
        return list(self._meta.get("state", []))

    def add_state(self, name: str, fill: float = 0.0) -> None:
        """Add an optimizer state array ``name`` (same rows, chunks and dtype), every value ``fill``."""
        self._check_writable()
        self._add_state(name, fill)

    def _add_state(self, name: str, fill: float) -> None:
        if not name.isidentifier():
            raise ValueError(f"state name must be an identifier, got {name!r}")
        if name in self.state_names:
            raise ValueError(f"state {name!r} already exists in {self.path}")
        compressor = self._meta.get("compressor", "none")
        create_state_array(self.path, name, self._array(WEIGHT), compressor, fill)
        self._group = zarr.open_group(self.path, mode="r+")
        self._array(name, known=True).fill_all(fill)
        self._update_metadata(state=[*self.state_names, name])

    # ----------------------------------------------------------------------------- metadata
    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the table's metadata: format_version, step, optimizer, state, compressor, keep."""
        return dict(self._meta)

    @property
    def step(self) -> int:
        """The step of the table's last checkpoint as this handle last read or wrote it; a pipe
        training the table is further on (``pipe.stats()["steps"]``: the steps it applied)."""
        return int(self._meta.get("step", 0))

    def update_metadata(self, **values: Any) -> None:
        """Set metadata keys (JSON values) in the table; durable at the next :meth:`checkpoint`."""
        self._check_writable()
        self._update_metadata(**values)

    def _prepare(self, optimizer: Any, keep: int | None, shards: dict | None = None) -> None:
        """For a pipe that trains the table: ``optimizer``'s state arrays and configuration,
        ``keep``, the sharding (None: one process) in the metadata."""
        refuse_another_optimizer(self._meta, optimizer, self.path)
        for name, fill in optimizer.state_init().items():
            if name not in self.state_names:
                self._add_state(name, fill)
        values: dict[str, Any] = {**optimizer_metadata(self._meta, optimizer), "shards": shards}
        if keep is not None:
            values["keep"] = keep
        if any(self.metadata.get(k) != v for k, v in values.items()):
            self._update_metadata(**values)

    def _update_metadata(self, **values: Any) -> None:
        self._meta.update(values)
        checkpoints.write_file(
            os.path.join(self.path, checkpoints.METADATA),
            checkpoints.group_metadata({"embedpipe": self._meta}),
        )
        self._modified = True

    # ----------------------------------------------------------------------------- checkpoints
    @property
    def checkpoints(self) -> list[Checkpoint]:
        """The committed checkpoints (``seq``, ``step``, ``path``, ``time``), oldest first."""
        return checkpoints.checkpoints(self.path)

    def checkpoint(self) -> Checkpoint:
        """Commit what was written as a checkpoint at the table's ``step``: after this, a crash
        or a reader sees these rows. A pipe's own ``checkpoint()`` calls this."""
        self._check_writable()
        return self._commit(self.step)

    def _commit(self, step: int) -> Checkpoint:
        """Commit the live arrays as the checkpoint of ``step`` (NOTE [ Checkpoint commit ])."""
        if self._lock is None or not self._lock.held():
            raise ReadOnlyTableError(
                f"table {self.path} is not open for writing in this process (pid {os.getpid()}); "
                "only the process that opened it with mode='r+' commits checkpoints"
            )
        meta = {**self._meta, "step": step}
        checkpoint = checkpoints.commit(self.path, meta, step, int(meta.get("keep", DEFAULT_KEEP)))
        self._update_metadata(step=step)
        self._modified = False
        return checkpoint

    def _restore(self, source: str, optimizer: Any) -> Checkpoint:
        """Make the live arrays those of the checkpoint folder ``source`` (another table's, as
        made by ``save_checkpoint``) and commit them as the newest checkpoint, at its step.
        State arrays ``optimizer`` needs and the source lacks are added."""
        kept = {"keep": self._meta.get("keep", DEFAULT_KEEP)}  # this table's own, not the
        kept.update({"id": self._meta["id"]} if "id" in self._meta else {})  # snapshot's
        checkpoints.restore(self.path, source)
        self._open_root(self.path)
        self._meta.update(kept)
        if optimizer is not None:
            for name, fill in optimizer.state_init().items():
                if name not in self.state_names:
                    self._add_state(name, fill)
            self._meta.update(optimizer_metadata(self._meta, optimizer))
        return self._commit(self.step)

    def _roll_back(self, only: Callable[[str], bool] | None = None) -> None:
        """Take the live arrays back to the latest checkpoint (what was written since is not to
        be kept: an interrupted or failed change); ``only``: those files (a shard's)."""
        checkpoints.recover(self.path, only)
        self._meta = read_table_metadata(self.path)
        self._open_root(self.path)
        self._modified = False

    def _abandon(self) -> None:
        """Release the lock without committing (a write hangs in another thread)."""
        self._owner = None
        checkpoints.finish_deleting(self.path)
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def nbytes_on_disk(self) -> int:
        """Bytes the table's folder takes on disk (hard-linked checkpoints counted once; a
        pruned checkpoint still being deleted is left out)."""
        return nbytes_on_disk(self.path)

    # ----------------------------------------------------------------------------- owner
    def _claim(self, owner: str, *, elsewhere: bool = False) -> None:
        """Make ``owner`` (a live pipe, described) the only writer through this object
        (``elsewhere``: the pipe's owner process writes; this handle may be read-only)."""
        if not elsewhere or self._lock is not None or self._owner is not None:
            self._check_writable("making another pipe on this table")
        self._owner = owner

    def _reopen(self, live: bool) -> None:
        """Read the live arrays and the metadata as they are now (an owner process writes
        them), or (not ``live``) the latest checkpoint, as ``Table.open(path)`` does."""
        if self._pin is not None:
            self._pin.release()
        root, self._pin = (self.path, None) if live else pin_checkpoint(self.path, self._meta, None)
        self._open_root(root)

    def _reads_after(self, flush: Callable[[], None]) -> None:
        """The claiming pipe's ``flush``: the public reads run it first, so that they see the
        steps applied so far, not the live files without the pipe's cached rows."""
        self._flush_before_reads = flush

    def _up_to_date(self) -> None:
        flush = getattr(self, "_flush_before_reads", None)
        if flush is not None and self._owner is not None:
            flush()

    def _release_claim(self) -> None:
        self._owner = None
        self._flush_before_reads = None

    # ----------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Commit what was written since the last checkpoint, then release the writer lock (a
        reader: let its checkpoint be pruned). Refused while an ``EmbeddingPipe`` owns it."""
        if self._owner is not None:
            self._check_writable("closing the table")
        if self._pin is not None:
            self._pin.release()
        if self._lock is not None:
            if self._modified:
                self._commit(self.step)
            checkpoints.finish_deleting(self.path)
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Table:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None and lock.held():  # dropped without close(): uncommitted writes go
            if getattr(self, "_modified", False):
                warnings.warn(
                    f"Table {self.path} was dropped without close(): writes since its last "
                    "checkpoint are not kept",
                    ResourceWarning,
                    stacklevel=2,
                )
            lock.release()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "root": self.root}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(Table._reader(state["path"], state["root"]).__dict__)

    def __repr__(self) -> str:
        return f"Table({self.path!r}, num_rows={self.num_rows}, dim={self.dim}, dtype={self.dtype.name}, mode={self.mode!r})"

    # ----------------------------------------------------------------------------- internals
    def _array(self, name: str, *, known: bool = False) -> ZarrRows:
        rows = self._rows.get(name)
        if rows is None:
            key = name if name == WEIGHT else f"{STATE_GROUP}/{name}"
            if name != WEIGHT and name not in self.state_names and not known:
                raise KeyError(f"no state array {name!r} in {self.path}; it has {self.state_names}")
            array = self._group[key].with_config({"write_empty_chunks": True})
            whole = self._meta.get("format_version") != 1  # format 1: chunks may be missing
            rows = self._rows[name] = row_access(array, whole, self._mapped_bytes, self._maps_reads)
        return rows

    def _store(self, ids: np.ndarray, rows: np.ndarray, name: str = WEIGHT) -> None:
        """Write rows (checked by the caller) to the live arrays, bypassing the owner check."""
        self._modified = True
        self._array(name).write(ids, rows)

    def _block_rows(self) -> int:
        """Rows in a block of whole chunks of about 16 MiB, the unit of streaming copies."""
        chunk_bytes = self.chunk_rows * self.dim * self.dtype.itemsize
        return self.chunk_rows * max(1, (1 << 24) // chunk_bytes)

    def _check_writable(self, doing: str = "writing through the table") -> None:
        if self._owner is not None:
            raise TableOwnedError(
                f"table {self.path} belongs to {self._owner}, its only writer; close that pipe "
                f"(pipe.close(), or leave its `with` block) before {doing}"
            )
        if self._lock is None:
            raise ReadOnlyTableError(
                f"table {self.path} is open read-only; open it with Table.open(path, mode='r+') to write"
            )
