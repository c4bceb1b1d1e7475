"""The reader of a conversion's output: :class:`ConvertedShard`, a map-style Dataset over the
zarr group :func:`~embedpipe.tools.convert.convert` writes, and :class:`ChunkRows`, which reads a
row of one of its arrays with one ``pread`` and writes a batch as a whole chunk file (NOTE
[ Reading one row ]). Also the group's record as both sides see it: its attribute name and format
version, the arrays it lists, reading it back, and the table's :func:`fingerprint`.
(``convert.py`` holds the NOTEs on the record's completeness and on bfloat16.)
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import zarr
from torch.utils.data import Dataset

from ..errors import EmbedpipeError, IncompleteConversionError, ShardFormatError
from ..store.table import Table

#: The group attribute holding the conversion's record (NOTE [ A conversion is complete ... ]).
ATTRIBUTE = "embedpipe_convert"
FORMAT_VERSION = 1


def _array_names(record: Mapping[str, Any]) -> list[str]:
    """``inputs_embeds`` first, then ``attention_mask`` and the copied fields."""
    return ["inputs_embeds", *dict.fromkeys(["attention_mask", *record["fields"]])]


def _read_record(out: str) -> dict[str, Any]:
    try:
        with open(os.path.join(out, "zarr.json"), encoding="utf-8") as f:
            return json.load(f).get("attributes", {}).get(ATTRIBUTE) or {}
    except (OSError, ValueError):
        return {}


def fingerprint(table: Table) -> str:
    """A blake2b hash of the table's weights (streamed a block at a time), shape and dtype."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{table.num_rows}x{table.dim}:{table.dtype.name}".encode())
    for block in table.iter_blocks():
        digest.update(np.ascontiguousarray(block).tobytes())
    return digest.hexdigest()


class ConvertedShard(Dataset):
    """A map-style Dataset over a conversion made by :func:`convert`: item ``i`` is a dict of
    tensors, ``inputs_embeds`` (L, D), ``attention_mask`` (L,) and the copied fields, read
    lazily, one ``pread`` per array (NOTE [ Reading one row ]); each process opens its own
    handles, so DataLoader workers can share it.

    Raises :class:`~embedpipe.errors.IncompleteConversionError` for a conversion that never
    finished; warns (``UserWarning``) when the table it was made from has changed since.
    """

    def __init__(self, path: str | os.PathLike[str], check_table: bool = True) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"{self.path} does not exist; give the folder convert wrote")
        record = _read_record(self.path)
        if not record:
            raise ShardFormatError(f"{self.path} is not an embedpipe conversion (no {ATTRIBUTE})")
        if record.get("format_version", 0) > FORMAT_VERSION:
            raise ShardFormatError(
                f"{self.path} is a conversion of format {record['format_version']}; this "
                f"embedpipe reads format {FORMAT_VERSION}: upgrade embedpipe"
            )
        if not record.get("complete"):
            raise IncompleteConversionError(
                f"{self.path} is an incomplete conversion ({record.get('rows_done', 0)} of "
                f"{record.get('num_rows')} rows written); finish it with embedpipe convert ... "
                "--resume"
            )
        self.record = record
        self.names = _array_names(record)
        self._arrays: dict[str, Any] | None = None
        self._pid = -1
        if check_table:
            self._check_table()

    def _check_table(self) -> None:
        path = self.record["table"]
        if not os.path.exists(path):
            return
        try:
            with Table.open(path, "r") as table:
                now = fingerprint(table)
        except EmbedpipeError:
            return
        if now != self.record["table_fingerprint"]:
            warnings.warn(
                f"the table {path} has changed since {self.path} was converted from it (step "
                f"{self.record['table_step']} then); convert the shard again for its new rows",
                UserWarning,
                stacklevel=3,
            )

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.record["dtype"])

    def __len__(self) -> int:
        return int(self.record["num_rows"])

    def _open(self) -> dict[str, ChunkRows]:
        if self._arrays is None or self._pid != os.getpid():
            group = zarr.open_group(self.path, mode="r")
            self._arrays = {name: ChunkRows(self.path, name, group[name]) for name in self.names}
            self._pid = os.getpid()
        return self._arrays

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} is outside the {len(self)} rows of {self.path}")
        index = int(index) % len(self)
        arrays = self._open()
        item = {name: torch.from_numpy(a.read(index)) for name, a in arrays.items()}
        if self.record["dtype"] == "bfloat16":
            item["inputs_embeds"] = item["inputs_embeds"].view(torch.bfloat16)
        return item

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None, "_pid": -1}

    def __repr__(self) -> str:
        r = self.record
        return f"ConvertedShard({self.path!r}, [{r['num_rows']}, {r['length']}, {r['dim']}] {r['dtype']})"


class ChunkRows:
    """Rows of an uncompressed array convert writes: a batch written as its chunk file, a row
    read straight from its chunk file.

    NOTE [ Reading one row ]
    Arrays are chunked by the batch size along N, so a chunk of ``inputs_embeds`` holds a whole
    batch (64 x 512 x 768 float32 is 96 MiB); zarr reads the whole chunk for one row. A chunk
    file of an array with only the ``bytes`` codec is its C-ordered little-endian values, edge
    chunks at full size, so row ``i`` is ``row_bytes`` at offset ``(i % chunk) * row_bytes`` of
    file ``c/<i // chunk>/0/0``: one ``pread``. A chunk zarr never wrote (every value the fill
    value 0: zarr skips empty chunks) reads as zeros. Other layouts go through zarr.

    Writes take the same shortcut: a batch starts at a chunk boundary and fills the chunk (the
    last one is padded with the fill value, as zarr stores edge chunks), so it is written as
    the chunk file's bytes, without zarr's codec pipeline and event loop (zarr's API took 1.3x
    as long for 25 MiB chunks). A write cut short leaves a short file, which a resume writes again.
    """

    def __init__(self, folder: str, name: str, array: Any) -> None:
        self.array = array
        self.chunk = array.chunks[0]
        self.shape = tuple(array.shape[1:])
        self.dtype = np.dtype(array.dtype).newbyteorder("<")
        self.row_bytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.raw = _is_raw(array)
        self.files = os.path.join(folder, name, "c")
        self.tail = "/0" * len(self.shape)

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows ``start:start + len(rows)``, ``start`` a chunk boundary, ``rows`` a whole chunk
        or the last one."""
        if not self.raw:
            self.array[start : start + len(rows)] = rows
            return
        chunk = start // self.chunk
        if start % self.chunk or (
            len(rows) != self.chunk and start + len(rows) != self.array.shape[0]
        ):
            raise ValueError(f"rows {start}:{start + len(rows)} are not chunk {chunk}")
        if len(rows) == self.chunk:
            data = np.ascontiguousarray(rows, self.dtype)
        else:
            data = np.zeros((self.chunk, *self.shape), self.dtype)
            data[: len(rows)] = rows
        path = f"{self.files}/{chunk}{self.tail}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(memoryview(data).cast("B"))

    def read(self, index: int) -> np.ndarray:
        if not self.raw:
            return np.asarray(self.array[index])
        chunk, offset = divmod(index, self.chunk)
        row = np.empty(self.shape, self.dtype)
        try:
            with open(f"{self.files}/{chunk}{self.tail}", "rb", buffering=0) as f:
                got = os.preadv(
                    f.fileno(), [row.reshape(-1).view(np.uint8)], offset * self.row_bytes
                )
        except FileNotFoundError:
            row[...] = 0
            got = self.row_bytes
        if got != self.row_bytes:
            raise OSError(f"{self.files}/{chunk}{self.tail} is truncated; convert the shard again")
        return row.astype(self.dtype.newbyteorder("="), copy=False)


def _is_raw(array: Any) -> bool:
    """An array of the layout :class:`ChunkRows` reads: bytes codec only, "/" chunk keys."""
    meta = array.metadata.to_dict()
    codecs = [c.get("name") for c in meta.get("codecs", [])]
    encoding = meta.get("chunk_key_encoding", {})
    return (
        codecs == ["bytes"]
        and encoding.get("name") == "default"
        and encoding.get("configuration", {}).get("separator", "/") == "/"
    )
