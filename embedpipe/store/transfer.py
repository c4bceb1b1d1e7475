"""Moving a table into and out of the files models ship in.

:func:`import_table` reads one 2-D tensor from a ``.safetensors`` file, a ``.pt``/``.bin`` state
dict, a ``.npy`` array or a Hugging Face model folder (found by ``tensorfiles.py``) and writes it
into a new :class:`Table`; :func:`export_table` writes a table's weights to ``.safetensors`` or
``.npy``, and :func:`add_table_to_safetensors` adds them to an existing ``.safetensors`` file.
They stream one block of chunks at a time, so a table larger than memory moves through a few MiB
of it, and they keep the bits: a float32 table exported is byte-for-byte the tensor that was
imported.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from ..errors import (
    CorruptTableError,
    SourceFormatError,
    SourceKeyError,
    TableExistsError,
    TableFormatError,
    TableLockedError,
)
from .table import Table
from .tensorfiles import SAFETENSORS_DTYPES, open_source


def import_table(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    key: str | None = None,
    dtype: str | None = None,
    chunk_rows: int | None = None,
    compressor: str = "none",
    overwrite: bool = False,
    progress: bool = False,
) -> Table:
    """Create the table ``dst`` from the embedding tensor in ``src``; returns it open for writing.

    ``key`` names the tensor (default: the one word-embedding name found); ``dtype`` casts it
    (needed for bfloat16). The source key is recorded in the table's metadata, and a model
    folder's ``pad_token_id`` (``config.json``) as the table's ``padding_idx``, the default of a
    pipe on it.
    """
    source = open_source(src, key, dtype)
    if chunk_rows is not None and (
        not isinstance(chunk_rows, (int, np.integer))
        or isinstance(chunk_rows, bool)
        or chunk_rows < 1
    ):
        raise ValueError(
            f"chunk_rows must be a positive integer, got {chunk_rows!r} (--chunk-rows on the "
            "command line)"
        )
    out = Path(dst).expanduser()
    blocker = _file_above(out)
    if blocker is not None:
        raise TableExistsError(
            f"{out}: cannot make a table folder there, {blocker} is a file; pick another destination"
        )
    existed = out.exists()
    try:
        table = Table.from_tensor(
            out,
            source,
            chunk_rows=chunk_rows,
            compressor=compressor,
            overwrite=overwrite,
            progress=progress,
        )
    except TableFormatError:  # overwrite=True over something that is not a table: never deleted
        if not (overwrite and existed):
            raise
        raise TableExistsError(
            f"{out} exists and is not an embedpipe table; overwrite=True (--force on the command "
            "line) replaces only a table: remove it yourself or pick another destination"
        ) from None
    except TableLockedError:
        raise TableLockedError(
            f"{out} is open for writing by another process or handle; overwrite=True (--force on "
            "the command line) never replaces a table in use: close it there first or pick "
            "another destination"
        ) from None
    table.update_metadata(source={"path": str(Path(src).expanduser().resolve()), "key": source.key})
    pad = _pad_token_id(Path(src).expanduser(), table.num_rows)
    if pad is not None:  # the pipe's default padding_idx, as offload() records it
        table._update_metadata(padding_idx=pad)
    return table


def _pad_token_id(src: Path, num_rows: int) -> int | None:
    """The ``pad_token_id`` of a model folder's ``config.json`` (of the folder the weights file
    is in), if it names a row of the table."""
    config = (src if src.is_dir() else src.parent) / "config.json"
    try:
        pad = json.loads(config.read_text()).get("pad_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    return pad if isinstance(pad, int) and 0 <= pad < num_rows else None


def export_table(
    src: str | os.PathLike[str] | Table,
    dst: str | os.PathLike[str],
    *,
    key: str = "weight",
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Write the weights of table ``src`` to ``dst``: ``.safetensors`` (one tensor at ``key``) or ``.npy``.

    The file appears under its name only once it is complete.
    """
    table = src if isinstance(src, Table) else Table.open(src, "r")
    out = Path(dst).expanduser()
    suffix = out.suffix.lower()
    if suffix not in (".safetensors", ".npy"):
        raise SourceFormatError(
            f"{out}: export writes .safetensors or .npy, not {suffix or '(no suffix)'!r}"
        )
    if out.is_dir():
        raise FileExistsError(f"{out} is a folder; give a file name ending in .safetensors or .npy")
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"{out} already exists; choose another name or pass overwrite=True (--force on the "
            "command line)"
        )
    if not out.parent.is_dir():
        what = "is a file, not a folder" if out.parent.exists() else "does not exist"
        raise FileNotFoundError(
            f"{out}: the folder {out.parent} {what}; create it first or pick another destination"
        )
    if Path(table.path) in out.resolve().parents:
        raise FileExistsError(
            f"{out} is inside the table {table.path}; export to a file outside the table's folder"
        )
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tqdm(
            total=table.num_rows, desc="export", unit="row", unit_scale=True, disable=not progress
        ) as bar:
            if suffix == ".safetensors":
                _write_safetensors(table, tmp, key, bar.update)
            else:
                array = np.lib.format.open_memmap(
                    tmp, mode="w+", dtype=table.dtype, shape=(table.num_rows, table.dim)
                )
                start = 0
                for block in table.iter_blocks():
                    array[start : start + len(block)] = block
                    start += len(block)
                    bar.update(len(block))
                array.flush()
                del array
        os.replace(tmp, out)
    except CorruptTableError:
        raise  # the source is damaged: its own message says where
    except OSError as e:  # disk full, no permission: name the destination, not the temporary file
        raise type(e)(f"{out}: export failed ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------------- internals
def _write_safetensors(
    table: Table, path: Path, key: str, advance: Callable[[int], object]
) -> None:
    """Stream the table into the safetensors layout: u64 header size, JSON header, raw bytes."""
    header = {
        key: _table_entry(table, 0),
        "__metadata__": {"format": "pt", "producer": "embedpipe"},
    }
    with open(path, "wb") as f:
        _write_header(f, header)
        _write_rows(f, table, advance)


def add_table_to_safetensors(path: Path, tables: dict[str, Table]) -> None:
    """Add the weights of each table to the safetensors file ``path``, as the tensor of its
    key: the file's header and tensors are copied, then the rows streamed after them, into a
    file that replaces ``path`` once complete (a model file ``save_pretrained`` wrote gets the
    word embeddings that ``from_pretrained`` expects there). A missing ``path`` is made."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "producer": "embedpipe"}}
    size = 0
    if path.exists():
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
    held = sorted(set(tables) & set(header))
    if held:
        raise SourceKeyError(f"{path} already holds the tensors {held}")
    offsets = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    copied = end = max(offsets, default=0)
    for key, table in tables.items():
        header[key] = _table_entry(table, end)
        end = header[key]["data_offsets"][1]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            _write_header(out, header)
            if copied:
                with open(path, "rb") as f:
                    f.seek(8 + size)
                    while copied:
                        block = f.read(min(copied, 16 << 20))
                        if not block:
                            raise SourceFormatError(f"{path}: shorter than its header says")
                        out.write(block)
                        copied -= len(block)
            for table in tables.values():
                _write_rows(out, table, lambda n: None)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _table_entry(table: Table, start: int) -> dict[str, Any]:
    nbytes = table.num_rows * table.dim * table.dtype.itemsize
    return {
        "dtype": SAFETENSORS_DTYPES[table.dtype.name],
        "shape": [table.num_rows, table.dim],
        "data_offsets": [start, start + nbytes],
    }


def _write_header(f: Any, header: dict[str, Any]) -> None:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(encoded)))
    f.write(encoded)


def _write_rows(f: Any, table: Table, advance: Callable[[int], object]) -> None:
    for block in table.iter_blocks():
        f.write(np.ascontiguousarray(block, dtype=table.dtype.newbyteorder("<")).data)
        advance(len(block))


def _file_above(path: Path) -> Path | None:
    """The first existing ancestor of ``path`` when it is a file (no folder can be made under it)."""
    for parent in path.absolute().parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None
