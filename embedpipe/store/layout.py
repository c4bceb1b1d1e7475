"""The table's folder on disk: its layout and format, making it, and which folder a handle opens.

::

    table.zarr/                 zarr v3 group; attributes["embedpipe"] holds the metadata
      weight/                   (num_rows, dim) array, chunks of whole rows
      state/<name>/             optimizer state, same row index (Adagrad "sum", Adam "exp_avg"...)
      checkpoints/<seq>-step-<step>/   committed checkpoints (hard links, see checkpoints.py)

This module holds the format constants and the default chunking, reading the metadata (and
refusing what is not a table), opening its zarr group, choosing the checkpoint a reader opens or
a writer goes back to, upgrading a format-1 table, making an empty table's arrays (and a state
array), the bytes the folder takes, the checks on rows written, and a new table's first rows (the
N(0, std^2) initial rows, or a tensor copied in). :class:`~embedpipe.store.table.Table`
(``table.py``) is the handle on it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from tqdm.auto import tqdm
from zarr.codecs import BloscCodec, BytesCodec, ZstdCodec

from ..errors import (
    InvalidIdsError,
    InvalidRowsError,
    TableExistsError,
    TableFormatError,
    TableNotFoundError,
)
from . import checkpoints
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


def read_table_metadata(path: str) -> dict[str, Any]:
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


def check_compatible(table: Any, source: Any) -> None:
    """Raise unless the snapshot ``source`` (a Table) has ``table``'s shape, dtype and chunks."""
    mine = (table.num_rows, table.dim, table.dtype.name, table.chunk_rows)
    theirs = (source.num_rows, source.dim, source.dtype.name, source.chunk_rows)
    if mine != theirs:
        raise InvalidRowsError(
            f"the snapshot {source.path} holds a table of {theirs[0]} x {theirs[1]} {theirs[2]} "
            f"rows in chunks of {theirs[3]}; this pipe's table is {mine[0]} x {mine[1]} {mine[2]} "
            f"in chunks of {mine[3]}: load a snapshot of this table"
        )


def remembered_steps(meta: dict[str, Any], optimizer: Any) -> int:
    """The steps whose state the table (``meta``: its metadata, or a snapshot's) holds for the
    row ``optimizer``: none where another one trained it (this one's state starts fresh), else
    those since this one began (``optimizer_from``)."""
    if (meta.get("optimizer") or {}).get("name") != optimizer.name:
        return 0
    return int(meta.get("step", 0)) - int(meta.get("optimizer_from", 0))


def optimizer_metadata(meta: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """The metadata of a table (``meta``) that the row ``optimizer`` trains from now on: its
    configuration and, where another one trained the table, the step its state begins at."""
    values: dict[str, Any] = {"optimizer": optimizer.config()}
    if (meta.get("optimizer") or {}).get("name") != optimizer.name:
        values["optimizer_from"] = int(meta.get("step", 0))
    return values


def refuse_another_optimizer(meta: dict[str, Any], optimizer: Any, path: str) -> None:
    """Raise if the table (``meta``: its metadata, or a snapshot's) was stepped by another row
    optimizer than ``optimizer`` and ``optimizer`` would not start as a fresh torch one does:
    where it counts the table's step (Adam's bias correction, Adagrad's ``lr_decay``) or finds
    state arrays of its own left by an earlier run (Adagrad's ``sum``). SGD, or Adagrad
    without decay on a table that never had its state, starts fresh: allowed."""
    trained = (meta.get("optimizer") or {}).get("name")
    step = int(meta.get("step", 0))
    if optimizer is None or trained in (None, optimizer.name) or step == 0:
        return
    counts_steps = optimizer.name == "adam" or bool(getattr(optimizer, "lr_decay", 0))
    stale = sorted(set(optimizer.state_init()) & set(meta.get("state") or ()))
    if not counts_steps and not stale:
        return
    why = f"its state {stale} from an earlier run" if stale else "the table's step"
    raise ValueError(
        f"the table {path} was trained by {trained} up to step {step}; {optimizer.name} would "
        f"go on from {why}, where a fresh torch optimizer starts from step 1 with fresh state. "
        f"Train it with embedpipe.optim's {trained} as before, or copy its rows to a table of "
        "their own: "
        f"embedpipe.Table.from_tensor(NEW_PATH, embedpipe.Table.open({path!r}).to_tensor())"
    )


def open_group(root: str, mode: str) -> tuple[zarr.Group, dict[str, Any]]:
    """The zarr group at ``root`` (the table, or one of its checkpoints) and its embedpipe
    metadata; raises if it is not a table."""
    try:
        group = zarr.open_group(root, mode=mode)
        meta = dict(group.attrs.get("embedpipe", {}))
    except (FileNotFoundError, ValueError, TypeError, KeyError) as e:
        raise TableFormatError(f"{root} is not an embedpipe table: {e}") from None
    if WEIGHT not in group:
        raise TableFormatError(
            f"{root} is a zarr group without a 'weight' array; "
            "make a table with `embedpipe import` or Table.create(...)"
        )
    return group, meta


def checkpoint_to_read(path: str, meta: dict[str, Any], step: int | None) -> str:
    """The folder a reader opens: the latest checkpoint, the newest one at ``step``, or (a
    format-1 table, which has none) the table ``path`` itself."""
    found = checkpoints.checkpoints(path)
    if not found and meta.get("format_version") != 1:
        raise TableFormatError(
            f"{path} has no committed checkpoint: making the table did not finish (it "
            "was interrupted or failed); delete the folder and make the table again"
        )
    if step is None:
        return found[-1].path if found else path
    matching = [c for c in found if c.step == step]
    if not matching:
        steps = sorted({c.step for c in found})
        raise TableNotFoundError(
            f"table {path} has no checkpoint at step {step}; it has steps {steps} "
            "(older ones were deleted: EmbeddingPipe(keep=...) keeps more)"
        )
    return matching[-1].path


def pin_checkpoint(
    path: str, meta: dict[str, Any], step: int | None
) -> tuple[str, checkpoints.Pin | None]:
    """The checkpoint a reader opens, pinned so that pruning leaves it alone (a commit may
    prune the one just chosen: then choose again), and its pin (None: a format-1 table,
    read in place)."""
    for _ in range(10):
        root = checkpoint_to_read(path, meta, step)
        if root == path:  # format 1: no checkpoints
            return root, None
        try:
            return root, checkpoints.Pin(root)
        except FileNotFoundError:
            continue
    raise TableFormatError(f"could not open a checkpoint of {path}: they keep changing")


def open_to_write(path: str, meta: dict[str, Any], step: int | None) -> str:
    """Take the table back to its latest checkpoint (or the one at ``step``, committed again
    as the newest), upgrading a format-1 table first; under the writer lock. Returns the folder
    to open."""
    if meta.get("format_version") == 1:
        upgrade_format_1(path, meta)
    if checkpoints.recover(path) is None:
        checkpoint_to_read(path, meta, None)  # says why there is none
    if step is not None:
        source = checkpoint_to_read(path, meta, step)
        checkpoints.restore(path, source)
        restored = read_table_metadata(path)
        checkpoints.commit(path, restored, step, restored.get("keep", DEFAULT_KEEP))
    return path


def upgrade_format_1(path: str, meta: dict[str, Any]) -> None:
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


def create_empty(
    path: str | os.PathLike[str],
    num_rows: int,
    dim: int,
    dtype: str,
    chunk_rows: int | None,
    compressor: str,
    overwrite: bool,
) -> str:
    """Make an empty table (its metadata and a weight array of fill 0) at ``path``, replacing
    the table there with ``overwrite``; returns the resolved path. The caller takes the writer
    lock, fills the rows and commits the first checkpoint."""
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
        read_table_metadata(path)  # refuse to delete a folder that is not a table
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
        "id": uuid.uuid4().hex,  # which table this is: one made anew at the path is another
    }
    checkpoints.write_file(
        os.path.join(path, checkpoints.METADATA),
        checkpoints.group_metadata({"embedpipe": meta}),
    )
    create_row_array(group, WEIGHT, num_rows, dim, dtype, int(chunk_rows), compressor)
    return path


def create_row_array(
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


def create_state_array(
    path: str, name: str, weight: ZarrRows, compressor: str, fill: float
) -> None:
    """Add the optimizer state array ``name`` to the table ``path``: the rows, chunks and dtype of
    its ``weight``, every value ``fill``."""
    group = zarr.open_group(path, mode="r+")
    create_row_array(
        group,
        f"{STATE_GROUP}/{name}",
        weight.num_rows,
        weight.dim,
        weight.dtype.name,
        weight.chunk_rows,
        compressor,
        fill_value=fill,
    )


def nbytes_on_disk(path: str) -> int:
    """Bytes the table's folder takes on disk (hard-linked checkpoints counted once; a
    pruned checkpoint still being deleted is left out)."""
    total, seen = 0, set()
    for folder, subfolders, files in os.walk(path):
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


# ------------------------------------------------------------------------- rows written
def checked_rows(ids: np.ndarray, rows: Any, dim: int, dtype: np.dtype) -> np.ndarray:
    """``rows`` for a write of ``ids`` (a torch tensor made numpy), checked before the first byte
    is written: ``ids`` 1-D and unique, ``rows`` of shape ``(len(ids), dim)`` and of ``dtype``
    exactly (no silent casts)."""
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
    if rows.shape != (len(ids), dim):
        raise InvalidRowsError(
            f"rows must have shape ({len(ids)}, {dim}) for {len(ids)} ids, got {rows.shape}"
        )
    if rows.dtype != dtype:
        raise InvalidRowsError(
            f"rows must have the table's dtype {dtype}, got {rows.dtype}; "
            f"cast with .astype('{dtype}') if that is what you mean"
        )
    return rows


# ------------------------------------------------------------------------- a new table's rows
def tensor_rows(path: Any, weight: Any) -> Any:
    """``weight`` checked to be rows a new table stores (a non-empty [num_rows, dim] tensor or
    array, not bfloat16), a torch tensor made numpy; ``path`` is the new table's."""
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
    return weight


def copy_rows(array: ZarrRows, step: int, weight: Any, progress: bool) -> None:
    """Copy ``weight`` (checked by :func:`tensor_rows`) into the new table's ``array``, ``step``
    rows (whole chunks) at a time."""
    with tqdm(
        total=array.num_rows, desc="import", unit="row", unit_scale=True, disable=not progress
    ) as bar:
        for start in range(0, array.num_rows, step):
            block = np.asarray(weight[start : start + step])
            write_range(array, start, block)
            bar.update(len(block))


def fill_normal(array: ZarrRows, step: int, seed: int, std: float, progress: bool) -> None:
    """Write the N(0, std^2) initial rows (:func:`normal_rows`) into the new table's ``array``,
    ``step`` rows (whole chunks) at a time."""
    num_rows, dim = array.num_rows, array.dim
    for start in tqdm(range(0, num_rows, step), desc="init", unit="block", disable=not progress):
        rows = normal_rows(seed, start, min(start + step, num_rows), dim, std)
        write_range(array, start, rows.astype(array.dtype))


def normal_rows(seed: int, start: int, stop: int, dim: int, std: float) -> np.ndarray:
    """Rows ``start:stop`` of the N(0, std^2) initial table, float32; block b is drawn from seed (seed, b)."""
    first, last = start // INIT_BLOCK_ROWS, (stop - 1) // INIT_BLOCK_ROWS
    blocks = [
        np.random.default_rng([seed, b]).standard_normal((INIT_BLOCK_ROWS, dim), dtype=np.float32)
        * np.float32(std)
        for b in range(first, last + 1)
    ]
    offset = first * INIT_BLOCK_ROWS
    return np.concatenate(blocks)[start - offset : stop - offset]


def write_range(array: ZarrRows, start: int, block: np.ndarray) -> None:
    """Write whole chunks starting at ``start`` (a multiple of chunk_rows)."""
    for offset in range(0, len(block), array.chunk_rows):
        array.write_chunk(
            (start + offset) // array.chunk_rows, block[offset : offset + array.chunk_rows]
        )
