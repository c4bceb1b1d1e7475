"""Table: the authoritative embedding table on disk, a zarr v3 group.

::

    table.zarr/                 zarr v3 group; attributes["embedpipe"] holds the metadata
      weight/                   (num_rows, dim) array, chunks of whole rows
      state/<name>/             optimizer state, same row index (Adagrad "sum", Adam "exp_avg"...)
      checkpoints/<seq>-step-<step>/   committed checkpoints (hard links, see checkpoints.py)

The layout and metadata are described in ``docs/table-format.md``; any zarr v3 reader opens the
arrays. Only one process writes a table at a time (invariant 1): it holds an ``flock`` on the
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
from tqdm.auto import tqdm
from zarr.codecs import BloscCodec, BytesCodec, ZstdCodec

from . import checkpoints
from .checkpoints import Checkpoint
from .errors import (
    InvalidIdsError,
    InvalidRowsError,
    ReadOnlyTableError,
    TableExistsError,
    TableFormatError,
    TableNotFoundError,
    TableOwnedError,
)
from .ids import as_ids
from .lock import WriterLock
from .rowstore import ZarrRows, row_access

#: 2: every chunk has a file, checkpoints/, the lock is on the folder. 1 is read, and upgraded
#: when opened to write.
FORMAT_VERSION = 2
READS_FORMATS = (1, 2)
WEIGHT = "weight"
STATE_GROUP = "state"
#: Checkpoints kept when nothing else is said (``EmbeddingPipe(keep=...)`` changes it).
DEFAULT_KEEP = 3

#: Default chunk size in bytes: about 1 MiB of rows (docs/table-benchmark.md has the numbers).
CHUNK_BYTES = 1 << 20
#: Rows generated per block by the initializer; blocks are seeded separately, so the initial
#: table depends on (seed, num_rows, dim) and not on the chunking.
INIT_BLOCK_ROWS = 4096

DTYPES = ("float32", "float16", "float64")
COMPRESSORS = ("none", "zstd", "blosc")


def default_chunk_rows(num_rows: int, dim: int, dtype: str = "float32") -> int:
    """Rows per chunk: the power of two nearest :data:`CHUNK_BYTES`, at most ``num_rows``."""
    row_bytes = dim * np.dtype(dtype).itemsize
    rows = 1 << max(0, round(np.log2(max(1, CHUNK_BYTES // row_bytes))))
    return max(1, min(rows, num_rows))


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

    def __init__(
        self, path: str | os.PathLike[str], mode: str = "r", *, step: int | None = None
    ) -> None:
        """Open the table at ``path``; prefer :meth:`open`, which documents the arguments."""
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        self.path = str(Path(path).expanduser().resolve())
        self.mode = mode
        self._lock: WriterLock | None = None
        self._owner: str | None = None
        self._modified = False
        meta = _read_table_metadata(self.path)
        if meta.get("checkpoint"):
            raise TableFormatError(
                f"{self.path} is a checkpoint inside a table; open the table with "
                f"Table.open(table_path, step={meta.get('step')}) instead"
            )
        self._pin: checkpoints.Pin | None = None
        if mode == "r+":
            self._lock = WriterLock(self.path)
            try:
                root = self._open_to_write(meta, step)
            except BaseException:
                self._lock.release()
                self._lock = None
                raise
        else:
            root = self._pin_checkpoint(meta, step)
        self._open_root(root)

    def _pin_checkpoint(self, meta: dict[str, Any], step: int | None) -> str:
        """The checkpoint a reader opens, pinned so that pruning leaves it alone (a commit may
        prune the one just chosen: then choose again)."""
        for _ in range(10):
            root = self._checkpoint_to_read(meta, step)
            if root == self.path:  # format 1: no checkpoints
                return root
            try:
                self._pin = checkpoints.Pin(root)
                return root
            except FileNotFoundError:
                continue
        raise TableFormatError(f"could not open a checkpoint of {self.path}: they keep changing")

    def _checkpoint_to_read(self, meta: dict[str, Any], step: int | None) -> str:
        """The folder a reader opens: the latest checkpoint, the newest one at ``step``, or (a
        format-1 table, which has none) the table itself."""
        found = checkpoints.checkpoints(self.path)
        if not found and meta.get("format_version") != 1:
            raise TableFormatError(
                f"{self.path} has no committed checkpoint: making the table did not finish (it "
                "was interrupted or failed); delete the folder and make the table again"
            )
        if step is None:
            return found[-1].path if found else self.path
        matching = [c for c in found if c.step == step]
        if not matching:
            steps = sorted({c.step for c in found})
            raise TableNotFoundError(
                f"table {self.path} has no checkpoint at step {step}; it has steps {steps} "
                "(older ones were deleted: EmbeddingPipe(keep=...) keeps more)"
            )
        return matching[-1].path

    def _open_to_write(self, meta: dict[str, Any], step: int | None) -> str:
        """Take the table back to its latest checkpoint (or the one at ``step``, committed again
        as the newest), upgrading a format-1 table first. Returns the folder to open."""
        if meta.get("format_version") == 1:
            _upgrade_format_1(self.path, meta)
        if checkpoints.recover(self.path) is None:
            self._checkpoint_to_read(meta, None)  # says why there is none
        if step is not None:
            source = self._checkpoint_to_read(meta, step)
            checkpoints.restore(self.path, source)
            restored = _read_table_metadata(self.path)
            checkpoints.commit(self.path, restored, step, restored.get("keep", DEFAULT_KEEP))
        return self.path

    def _open_root(self, root: str) -> None:
        """Open the zarr group at ``root`` (the table, or one of its checkpoints) for reading."""
        self.root = root
        try:
            self._group = zarr.open_group(
                root, mode="r+" if root == self.path and self.mode == "r+" else "r"
            )
            meta = dict(self._group.attrs.get("embedpipe", {}))
        except (FileNotFoundError, ValueError, TypeError, KeyError) as e:
            raise TableFormatError(f"{root} is not an embedpipe table: {e}") from None
        if WEIGHT not in self._group:
            raise TableFormatError(
                f"{root} is a zarr group without a 'weight' array; "
                "make a table with `embedpipe import` or Table.create(...)"
            )
        self._meta = meta
        self._rows: dict[str, ZarrRows] = {}
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
        table = cls._create_empty(path, num_rows, dim, dtype, chunk_rows, compressor, overwrite)
        with table._creating():
            if init == "normal":
                step = table._block_rows()
                for start in tqdm(
                    range(0, num_rows, step), desc="init", unit="block", disable=not progress
                ):
                    rows = _normal_rows(seed, start, min(start + step, num_rows), dim, std)
                    table._write_range(WEIGHT, start, rows.astype(table.dtype))
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
        if isinstance(weight, (str, os.PathLike)) and hasattr(path, "shape"):
            raise TypeError(
                "Table.from_tensor(path, weight): the path comes first; got a "
                f"{type(path).__name__} of shape {tuple(path.shape)} then the path {weight!r}"
            )
        if not hasattr(weight, "shape"):
            raise TypeError(
                f"weight must be a [num_rows, dim] tensor or array, got {type(weight).__name__}"
            )
        if isinstance(weight, torch.Tensor):
            if weight.dtype == torch.bfloat16:
                raise InvalidRowsError(
                    "bfloat16 tables are not supported (zarr v3 has no bfloat16); "
                    "convert with weight.float() (lossless) first"
                )
            weight = weight.detach().cpu().numpy()
        shape = tuple(weight.shape)
        if len(shape) != 2 or 0 in shape:
            raise InvalidRowsError(
                f"weight must be a non-empty 2-D [num_rows, dim] array, got shape {shape}"
            )
        dtype = np.dtype(weight.dtype).name
        table = cls._create_empty(
            path, shape[0], shape[1], dtype, chunk_rows, compressor, overwrite
        )
        step = table._block_rows()
        with (
            table._creating(),
            tqdm(
                total=shape[0], desc="import", unit="row", unit_scale=True, disable=not progress
            ) as bar,
        ):
            for start in range(0, shape[0], step):
                block = np.asarray(weight[start : start + step])
                table._write_range(WEIGHT, start, block)
                bar.update(len(block))
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
    def _reader(cls, path: str, root: str) -> Table:
        """A read-only handle on the folder ``root`` of table ``path`` (the table itself: the
        arrays being written, which a pipe's DataLoader workers read; or a checkpoint)."""
        table = cls.__new__(cls)
        table.path, table.mode = path, "r"
        table._lock, table._owner, table._modified, table._pin = None, None, False, None
        if root != path:
            table._pin = checkpoints.Pin(root)
        table._open_root(root)
        return table

    @classmethod
    def _shard_writer(cls, path: str) -> Table:
        """A handle that writes the live arrays of a table whose writer lock rank 0 of a sharded
        pipe holds (``shards.py``): it writes the chunks of its own shard and never commits."""
        table = cls.__new__(cls)
        table.path, table.mode = path, "r+"
        table._lock, table._owner, table._modified, table._pin = None, None, False, None
        table._open_root(path)
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
    def _create_empty(
        cls,
        path: str | os.PathLike[str],
        num_rows: int,
        dim: int,
        dtype: str,
        chunk_rows: int | None,
        compressor: str,
        overwrite: bool,
    ) -> Table:
        for name, value in (("num_rows", num_rows), ("dim", dim)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {COMPRESSORS}, got {compressor!r}")
        if chunk_rows is None:
            chunk_rows = default_chunk_rows(num_rows, dim, dtype)
        if not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
        path = str(Path(path).expanduser().resolve())
        if os.path.exists(path):
            if not overwrite:
                raise TableExistsError(
                    f"{path} already exists; pick another path or pass overwrite=True (--force on the command line)"
                )
            _read_table_metadata(path)  # refuse to delete a folder that is not a table
            WriterLock(path).release()  # or a table another process is writing
            checkpoints.finish_deleting(path)
            shutil.rmtree(path, ignore_errors=True)  # a dropped table's prune may still run
            if os.path.exists(path):
                shutil.rmtree(path)
        group = zarr.open_group(path, mode="w-")
        meta = {
            "format_version": FORMAT_VERSION,
            "step": 0,
            "optimizer": None,
            "state": [],
            "compressor": compressor,
            "keep": DEFAULT_KEEP,
        }
        checkpoints.write_file(
            os.path.join(path, checkpoints.METADATA),
            checkpoints.group_metadata({"embedpipe": meta}),
        )
        _create_row_array(group, WEIGHT, num_rows, dim, dtype, int(chunk_rows), compressor)
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
        flat = ids.reshape(-1)
        self._up_to_date()
        return self._array(name).read(flat).reshape(*ids.shape, self.dim)

    def write(self, ids: Any, rows: Any, name: str = WEIGHT) -> None:
        """Write ``rows[i]`` to row ``ids[i]``; durable at the next :meth:`checkpoint`.

        Uncompressed local tables write each row in place (one ``pwrite``; a chunk shared with
        a checkpoint is copied first); other tables rewrite every chunk the ids fall in,
        atomically. ``ids`` must be unique; ``rows`` must have shape ``(len(ids), dim)`` and the
        array's dtype exactly (no silent casts). Everything is checked before the first byte is
        written.
        """
        self._check_writable()
        array = self._array(name)
        ids = as_ids(ids, self.num_rows)
        if ids.ndim != 1:
            raise InvalidIdsError(f"ids for write must be 1-D, got shape {ids.shape}")
        unique, counts = np.unique(ids, return_counts=True)
        if len(unique) != len(ids):
            raise InvalidIdsError(
                f"ids for write must be unique, id {int(unique[np.argmax(counts > 1)])} repeats; "
                "sum or pick the rows for repeated ids first"
            )
        if isinstance(rows, torch.Tensor):
            rows = rows.detach().cpu().numpy()
        rows = np.asarray(rows)
        if rows.shape != (len(ids), self.dim):
            raise InvalidRowsError(
                f"rows must have shape ({len(ids)}, {self.dim}) for {len(ids)} ids, got {rows.shape}"
            )
        if rows.dtype != array.dtype:
            raise InvalidRowsError(
                f"rows must have the table's dtype {array.dtype}, got {rows.dtype}; "
                f"cast with .astype('{array.dtype}') if that is what you mean"
            )
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
        weight = self._array(WEIGHT)
        group = zarr.open_group(self.path, mode="r+")
        _create_row_array(
            group,
            f"{STATE_GROUP}/{name}",
            self.num_rows,
            self.dim,
            self.dtype.name,
            weight.chunk_rows,
            self._meta.get("compressor", "none"),
            fill_value=fill,
        )
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
        """The training step the table's contents correspond to."""
        return int(self._meta.get("step", 0))

    def update_metadata(self, **values: Any) -> None:
        """Set metadata keys (JSON values) in the table; durable at the next :meth:`checkpoint`."""
        self._check_writable()
        self._update_metadata(**values)

    def _prepare(self, optimizer: Any, keep: int | None, shards: dict | None = None) -> None:
        """For a pipe that trains the table: ``optimizer``'s state arrays (a RowOptimizer), its
        configuration, ``keep`` and how the table is sharded (None: by one process) in the
        metadata."""
        for name, fill in optimizer.state_init().items():
            if name not in self.state_names:
                self._add_state(name, fill)
        values: dict[str, Any] = {"optimizer": optimizer.config(), "shards": shards}
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
        checkpoints.restore(self.path, source)
        keep = self._meta.get("keep", DEFAULT_KEEP)
        self._meta = _read_table_metadata(self.path)
        self._meta["keep"] = keep
        self._open_root(self.path)
        if optimizer is not None:
            for name, fill in optimizer.state_init().items():
                if name not in self.state_names:
                    self._add_state(name, fill)
            self._meta["optimizer"] = optimizer.config()
        return self._commit(self.step)

    def _roll_back(self) -> None:
        """Take the live arrays back to the latest checkpoint (what was written since is not to
        be kept: an interrupted or failed change)."""
        checkpoints.recover(self.path)
        self._meta = _read_table_metadata(self.path)
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
        total, seen = 0, set()
        for folder, subfolders, files in os.walk(self.path):
            subfolders[:] = [d for d in subfolders if not d.startswith(".trash-")]
            for f in files:
                try:
                    st = os.lstat(os.path.join(folder, f))
                except FileNotFoundError:  # deleted while we walk (a prune, a copy-on-write)
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
        return total

    # ----------------------------------------------------------------------------- owner
    def _claim(self, owner: str) -> None:
        """Make ``owner`` (a live pipe, described) the only writer through this object."""
        self._check_writable("making another pipe on this table")
        self._owner = owner

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
        reader: let its checkpoint be pruned).

        Refused while an :class:`~embedpipe.EmbeddingPipe` owns the table: close the pipe first.
        """
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
            complete = self._meta.get("format_version") != 1
            rows = self._rows[name] = row_access(array, complete=complete)
        return rows

    def _store(self, ids: np.ndarray, rows: np.ndarray, name: str = WEIGHT) -> None:
        """Write rows (checked by the caller) to the live arrays, bypassing the owner check."""
        self._modified = True
        self._array(name).write(ids, rows)

    def _block_rows(self) -> int:
        """Rows in a block of whole chunks of about 16 MiB, the unit of streaming copies."""
        chunk_bytes = self.chunk_rows * self.dim * self.dtype.itemsize
        return self.chunk_rows * max(1, (1 << 24) // chunk_bytes)

    def _write_range(self, name: str, start: int, block: np.ndarray) -> None:
        """Write whole chunks starting at ``start`` (a multiple of chunk_rows)."""
        array = self._array(name)
        for offset in range(0, len(block), array.chunk_rows):
            array.write_chunk(
                (start + offset) // array.chunk_rows, block[offset : offset + array.chunk_rows]
            )

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


def _read_table_metadata(path: str) -> dict[str, Any]:
    """The embedpipe metadata of the table folder ``path``; raises if it is not one."""
    if not os.path.exists(path):
        raise TableNotFoundError(
            f"no table at {path}; create one with Table.create(...) or `embedpipe import`"
        )
    if not os.path.isdir(path):
        raise TableFormatError(f"{path} is a file, not a table folder (a zarr v3 group)")
    try:
        attributes = checkpoints.read_attributes(path)
    except FileNotFoundError:
        raise TableFormatError(
            f"{path} is not an embedpipe table (no zarr.json in it); make one with "
            "`embedpipe import` or Table.create(...)"
        ) from None
    except (OSError, ValueError) as e:
        raise TableFormatError(
            f"{path} is not an embedpipe table: unreadable zarr.json ({e})"
        ) from None
    meta = attributes.get("embedpipe")
    if not isinstance(meta, dict):
        raise TableFormatError(
            f"{path} is a zarr group without embedpipe metadata; "
            "make a table with `embedpipe import` or Table.create(...)"
        )
    if meta.get("format_version") not in READS_FORMATS:
        raise TableFormatError(
            f"{path} has table format version {meta.get('format_version')!r}; this "
            f"embedpipe reads versions {list(READS_FORMATS)}: upgrade embedpipe"
        )
    return meta


def _upgrade_format_1(path: str, meta: dict[str, Any]) -> None:
    """Bring a format-1 table (chunks that were never written have no file; a writer.lock
    file) to format 2 and commit it as its first checkpoint. Runs under the writer lock."""
    group = zarr.open_group(path, mode="r")
    for key in [WEIGHT, *(f"{STATE_GROUP}/{n}" for n in meta.get("state", []))]:
        array = group[key].with_config({"write_empty_chunks": True})
        rows = row_access(array, complete=False)
        for chunk in range(-(-rows.num_rows // rows.chunk_rows)):
            key_path = os.path.join(path, key, array.metadata.encode_chunk_key((chunk, 0)))
            if not os.path.exists(key_path):
                rows.fill_chunk(chunk, float(array.fill_value))
    lock_file = os.path.join(path, "writer.lock")
    if os.path.exists(lock_file):
        os.unlink(lock_file)
    upgraded = {**meta, "format_version": FORMAT_VERSION, "keep": meta.get("keep", DEFAULT_KEEP)}
    # First the checkpoint, then the live metadata: interrupted in between, the table still says
    # format 1, and the next open upgrades it again.
    checkpoints.commit(path, upgraded, int(upgraded.get("step", 0)), upgraded["keep"])
    checkpoints.write_file(
        os.path.join(path, checkpoints.METADATA),
        checkpoints.group_metadata({"embedpipe": upgraded}),
    )
    meta.update(upgraded)


def _normal_rows(seed: int, start: int, stop: int, dim: int, std: float) -> np.ndarray:
    """Rows ``start:stop`` of the N(0, std^2) initial table, float32; block b is drawn from seed (seed, b)."""
    first, last = start // INIT_BLOCK_ROWS, (stop - 1) // INIT_BLOCK_ROWS
    blocks = [
        np.random.default_rng([seed, b]).standard_normal((INIT_BLOCK_ROWS, dim), dtype=np.float32)
        * np.float32(std)
        for b in range(first, last + 1)
    ]
    offset = first * INIT_BLOCK_ROWS
    return np.concatenate(blocks)[start - offset : stop - offset]


def _create_row_array(
    group: zarr.Group,
    name: str,
    num_rows: int,
    dim: int,
    dtype: str,
    chunk_rows: int,
    compressor: str,
    fill_value: float = 0.0,
) -> zarr.Array:
    compressors = {
        "none": None,
        "zstd": ZstdCodec(level=3),
        "blosc": BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
    }[compressor]
    return group.create_array(
        name,
        config={"write_empty_chunks": True},  # a chunk equal to the fill value keeps its file
        shape=(num_rows, dim),
        chunks=(min(chunk_rows, num_rows), dim),
        dtype=dtype,
        fill_value=fill_value,
        serializer=BytesCodec(endian="little"),
        compressors=compressors,
        chunk_key_encoding={"name": "default", "separator": "/"},
        dimension_names=["row", "dim"],
    )
