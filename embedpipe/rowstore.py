"""Rows of one 2-D zarr array: random reads and chunk-grouped writes.

zarr-python's selection API pays about 0.2 ms of Python per chunk it touches, which caps random
row reads at 7k-80k rows/s. A local, uncompressed array with chunks of whole rows keeps every
chunk as a plain file of C-ordered little-endian rows (zarr v3's ``bytes`` codec), so
:class:`RawRows` reads rows straight out of those files through ``mmap``, writes scattered rows
in place, and writes a whole chunk by writing a new file and renaming it over the old one.
Anything else (compressed chunks, sharding, a remote store) goes through :class:`ZarrRows` and
the general zarr API, which rewrites every chunk it touches.

Costs (measured by ``scripts/bench_table.py``, see ``docs/table-format.md``):
``RawRows.read`` costs about 30 us per chunk touched plus a memory copy per row, ``RawRows.write``
a system call per row; ``ZarrRows.write`` rewrites every chunk it touches in full.

NOTE [ Raw chunk reads and writes ]
A reader keeps each chunk file it touched mapped, keyed by the file's inode, and stats the
chunk's path on every read: a chunk replaced whole (``write_chunk``: a new file renamed over the
old one) has a new inode, so the reader maps the new file and never serves bytes older than the
last replace that finished before its read began. After copying, the reader drops the chunk's
pages from its own page tables (``MADV_DONTNEED``; they stay in the OS page cache), so a process
that reads a table many times larger than memory does not grow by what it read. Dropping later
(after some budget of rows) does not bound memory: the kernel maps a whole large folio of the
page cache per fault (measured: +1 GB RSS for 32 MiB of rows read). The drop costs about 1.8x in
read time when the same chunks are read again; in the pipe, rows read from disk are the cache's
misses, rarely read again soon.

Row writes (``write``) go in place, one ``pwrite`` per row, and are visible to every mapping at
once. Replacing whole chunks instead would rewrite ``chunk_rows`` rows for every scattered row
(measured: a 5 MB cache evicting into a 1 GiB table wrote ~100 MB per batch), which is what the
writeback does all the time. The price: a reader copying the very row being written may see a mix
of old and new bytes. embedpipe's own readers never keep such a copy: a row is written either
while it is cached (readers take it from the cache) or as part of an optimizer step, after which
the hand-off re-reads every row the step changed (docs/consistency.md, invariants 3 and 4).
"""

from __future__ import annotations

import mmap
import os
import resource
from collections import OrderedDict
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

#: How many chunk files one reader keeps mapped (see the NOTE). Python's mmap keeps a file
#: descriptor per map, so stay well inside the process's limit on open files.
MAX_MAPPED_CHUNKS = max(16, min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8))


def group_by_chunk(ids: np.ndarray, chunk_rows: int) -> tuple[list[int], list[np.ndarray]]:
    """Split positions of ``ids`` by the chunk they fall in.

    Returns the chunk numbers in increasing order and, for each, the positions in ``ids`` of the
    ids it holds.
    """
    chunk_of = ids // chunk_rows
    order = np.argsort(chunk_of, kind="stable")
    sorted_chunks = chunk_of[order]
    starts = np.flatnonzero(np.diff(sorted_chunks)) + 1
    chunks = sorted_chunks[np.r_[0, starts]].tolist() if len(ids) else []
    return chunks, np.split(order, starts) if len(ids) else []


class ZarrRows:
    """Rows of a zarr array through the general zarr API (any store, any codec)."""

    def __init__(self, array: zarr.Array) -> None:
        self.array = array
        self.num_rows, self.dim = array.shape
        self.chunk_rows = array.chunks[0]
        self.dtype = np.dtype(array.dtype)

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows for ``ids`` (1-D int64, in range), in the order of ``ids``."""
        unique_ids, inverse = np.unique(ids, return_inverse=True)
        rows = self.array.get_orthogonal_selection((unique_ids, slice(None)))
        return np.asarray(rows)[inverse]

    def read_chunk(self, chunk: int) -> np.ndarray:
        start = chunk * self.chunk_rows
        return np.asarray(self.array[start : min(start + self.chunk_rows, self.num_rows)])

    def write_chunk(self, chunk: int, rows: np.ndarray) -> None:
        start = chunk * self.chunk_rows
        self.array[start : start + len(rows)] = rows

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows[i]`` to row ``ids[i]`` (ids unique and in range), a whole chunk at a time."""
        chunks, positions = group_by_chunk(ids, self.chunk_rows)
        for chunk, pos in zip(chunks, positions):
            self._rewrite_chunk(chunk, ids[pos], rows[pos])

    def _rewrite_chunk(self, chunk: int, ids: np.ndarray, rows: np.ndarray) -> None:
        """Replace chunk ``chunk`` whole, with ``rows`` at ``ids`` (all in that chunk)."""
        block = self.read_chunk(chunk)
        block[ids - chunk * self.chunk_rows] = rows
        self.write_chunk(chunk, block)


class RawRows(ZarrRows):
    """Rows of a local, uncompressed zarr array, read and written as raw chunk files."""

    def __init__(self, array: zarr.Array, root: str) -> None:
        super().__init__(array)
        self.root = root  # the array's folder; chunk i lives at root/c/i/0
        self.row_bytes = self.dim * self.dtype.itemsize
        self.fill = np.asarray(array.fill_value, dtype=self.dtype)
        self._maps: OrderedDict[int, tuple[int, mmap.mmap | None, np.ndarray]] = OrderedDict()

    @staticmethod
    def supports(array: zarr.Array) -> str | None:
        """The array's folder when its chunks are raw files this class can read, else None."""
        store = array.store
        meta = array.metadata
        if not isinstance(store, LocalStore) or getattr(meta, "zarr_format", None) != 3:
            return None
        codecs = [c.to_dict() for c in meta.codecs]
        encoding = meta.chunk_key_encoding.to_dict()
        raw = (
            len(codecs) == 1
            and codecs[0]["name"] == "bytes"
            and (codecs[0].get("configuration") or {}).get("endian", "little") == "little"
            and encoding["name"] == "default"
            and encoding.get("configuration", {}).get("separator", "/") == "/"
            and len(array.shape) == 2
            and array.chunks[1] == array.shape[1]
        )
        return os.path.join(str(store.root), array.path) if raw else None

    def _path(self, chunk: int) -> str:
        return os.path.join(self.root, "c", str(chunk), "0")

    def _mapped(self, chunk: int) -> np.ndarray:
        """The chunk's rows as a read-only array over its current file (see the NOTE)."""
        path = self._path(chunk)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:  # never written: zarr reads it as the fill value
            return np.broadcast_to(self.fill, (self.chunk_rows, self.dim))
        cached = self._maps.get(chunk)
        if cached is not None and cached[0] == inode:
            self._maps.move_to_end(chunk)
            return cached[2]
        with open(path, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino  # the file we map, even if replaced since stat
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        m.madvise(mmap.MADV_RANDOM)  # one page per fault, no read-ahead: rows are random
        rows = np.frombuffer(m, dtype=self.dtype).reshape(-1, self.dim)
        self._maps[chunk] = (inode, m, rows)
        if len(self._maps) > MAX_MAPPED_CHUNKS:
            self._maps.popitem(last=False)  # the mmap closes when its last view goes
        return rows

    def read(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), self.dim), dtype=self.dtype)
        chunks, positions = group_by_chunk(ids, self.chunk_rows)
        for chunk, pos in zip(chunks, positions):
            out[pos] = self._mapped(chunk)[ids[pos] - chunk * self.chunk_rows]
            cached = self._maps.get(chunk)
            if cached is not None:  # drop the pages just read (see the NOTE)
                cached[1].madvise(mmap.MADV_DONTNEED)
        return out

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Write rows in place in their chunk files, one ``pwrite`` per row (see the NOTE).

        A chunk that has no file yet is written whole.
        """
        data = np.ascontiguousarray(rows, dtype=self.dtype.newbyteorder("<"))
        chunks, positions = group_by_chunk(ids, self.chunk_rows)
        for chunk, pos in zip(chunks, positions):
            pos = pos[np.argsort(ids[pos])]  # ascending offsets within the file
            try:
                fd = os.open(self._path(chunk), os.O_WRONLY)
            except FileNotFoundError:
                self._rewrite_chunk(chunk, ids[pos], rows[pos])
                continue
            try:
                for i in pos.tolist():
                    os.pwrite(
                        fd, data[i].data, int(ids[i] - chunk * self.chunk_rows) * self.row_bytes
                    )
            finally:
                os.close(fd)

    def read_chunk(self, chunk: int) -> np.ndarray:
        rows = len(
            range(chunk * self.chunk_rows, min((chunk + 1) * self.chunk_rows, self.num_rows))
        )
        try:
            with open(self._path(chunk), "rb") as f:
                data = np.frombuffer(f.read(), dtype=self.dtype).reshape(-1, self.dim)
        except FileNotFoundError:
            return np.full((rows, self.dim), self.fill, dtype=self.dtype)
        return data[:rows].copy()

    def write_chunk(self, chunk: int, rows: np.ndarray) -> None:
        # zarr v3 stores an edge chunk at full size: pad the last chunk's file to chunk_rows.
        if len(rows) < self.chunk_rows:
            pad = np.full((self.chunk_rows - len(rows), self.dim), self.fill, dtype=self.dtype)
            rows = np.concatenate([rows, pad])
        path = self._path(chunk)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(np.ascontiguousarray(rows, dtype=self.dtype.newbyteorder("<")).data)
        os.replace(tmp, path)  # atomic: readers see the old chunk or the new one

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()  # mappings do not cross processes
        return state


def row_access(array: zarr.Array) -> ZarrRows:
    """The fastest row reader/writer that handles ``array``."""
    root = RawRows.supports(array)
    return RawRows(array, root) if root is not None else ZarrRows(array)
