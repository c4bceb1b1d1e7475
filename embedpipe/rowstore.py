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
once, with one exception: a chunk file that is also part of a committed checkpoint (its link
count is above 1, see NOTE [ Checkpoint commit ] in ``checkpoints.py``) is first copied and the
copy renamed over the live name, so a checkpoint never changes; readers notice the new inode. Replacing whole chunks instead would rewrite ``chunk_rows`` rows for every scattered row
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

from .checkpoints import copy_sparse, unlink, write_all
from .errors import CorruptTableError

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
    """Rows of a zarr array through the general zarr API (any store, any codec).

    ``complete``: every chunk of the array has a file (tables of format 2 on), so a missing one
    is damage, not a chunk that was never written; it raises :class:`CorruptTableError`.
    """

    def __init__(self, array: zarr.Array, *, complete: bool = True) -> None:
        self.array = array
        self.num_rows, self.dim = array.shape
        self.chunk_rows = array.chunks[0]
        self.dtype = np.dtype(array.dtype)
        self.complete = complete

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows for ``ids`` (1-D int64, in range), in the order of ``ids``."""
        unique_ids, inverse = np.unique(ids, return_inverse=True)
        chunks, _ = group_by_chunk(unique_ids, self.chunk_rows)
        if self.complete:
            for chunk in chunks:
                self._check_exists(chunk)
        try:
            rows = self.array.get_orthogonal_selection((unique_ids, slice(None)))
        except Exception as e:  # a codec that cannot decode a chunk: find which one
            for chunk in chunks:
                try:
                    self.read_chunk(chunk)
                except Exception:
                    raise self._damaged(
                        chunk, f"cannot be decoded ({type(e).__name__}: {e})"
                    ) from e
            raise
        return np.asarray(rows)[inverse]

    def _check_exists(self, chunk: int) -> None:
        if not isinstance(self.array.store_path.store, LocalStore):
            return  # remote stores: zarr reads a missing chunk as the fill value
        key = self.array.metadata.encode_chunk_key((chunk, 0))
        path = os.path.join(self._where(), key)
        if not os.path.exists(path):
            raise self._damaged(chunk, f"is missing ({path})")

    def _damaged(self, chunk: int, what: str) -> CorruptTableError:
        first = chunk * self.chunk_rows
        last = min(first + self.chunk_rows, self.num_rows) - 1
        return CorruptTableError(
            f"chunk {chunk} (rows {first}..{last}) of {self._where()} {what}; the table is "
            "damaged, or it is a checkpoint that was deleted while open: reopen the table, or "
            "open an earlier checkpoint with Table.open(path, step=N)"
        )

    def _where(self) -> str:
        store = self.array.store_path.store
        return os.path.join(str(getattr(store, "root", store)), self.array.path)

    def read_chunk(self, chunk: int) -> np.ndarray:
        start = chunk * self.chunk_rows
        return np.asarray(self.array[start : min(start + self.chunk_rows, self.num_rows)])

    def write_chunk(self, chunk: int, rows: np.ndarray) -> None:
        start = chunk * self.chunk_rows
        self.array[start : start + len(rows)] = rows

    def fill_all(self, value: float) -> None:
        """Give every chunk a file holding ``value`` everywhere (a new array)."""
        for chunk in range(-(-self.num_rows // self.chunk_rows)):
            self.fill_chunk(chunk, value)

    def fill_chunk(self, chunk: int, value: float) -> None:
        rows = min(self.chunk_rows, self.num_rows - chunk * self.chunk_rows)
        self.write_chunk(chunk, np.full((rows, self.dim), value, dtype=self.dtype))

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

    def __init__(self, array: zarr.Array, root: str, *, complete: bool = True) -> None:
        super().__init__(array, complete=complete)
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

    def _where(self) -> str:
        return self.root

    def _mapped(self, chunk: int) -> np.ndarray:
        """The chunk's rows as a read-only array over its current file (see the NOTE)."""
        path = self._path(chunk)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            if self.complete:
                raise self._damaged(chunk, f"is missing ({path})") from None
            return np.broadcast_to(self.fill, (self.chunk_rows, self.dim))  # format 1: fill
        cached = self._maps.get(chunk)
        if cached is not None and cached[0] == inode:
            self._maps.move_to_end(chunk)
            return cached[2]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # replaced or deleted since the stat: look again
            return self._mapped(chunk)
        with open(fd, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino  # the file we map, even if replaced since stat
            size = os.fstat(f.fileno()).st_size
            if size != self.chunk_rows * self.row_bytes:
                raise self._damaged(
                    chunk, f"has {size} bytes, not {self.chunk_rows * self.row_bytes} ({path})"
                )
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
        """Write rows in place in their chunk files, one ``pwrite`` per row (see the NOTE); a
        chunk file shared with a checkpoint is copied first. Raises ``OSError`` on a full disk,
        after which some of the rows may be written and others not."""
        data = np.ascontiguousarray(rows, dtype=self.dtype.newbyteorder("<"))
        chunks, positions = group_by_chunk(ids, self.chunk_rows)
        for chunk, pos in zip(chunks, positions):
            pos = pos[np.argsort(ids[pos])]  # ascending offsets within the file
            path = self._path(chunk)
            fd, copy = self._open_private(chunk)
            if fd < 0:  # format 1: a chunk never written has no file yet
                self._rewrite_chunk(chunk, ids[pos], rows[pos])
                continue
            try:
                for i in pos.tolist():
                    offset = int(ids[i] - chunk * self.chunk_rows) * self.row_bytes
                    write_all(fd, data[i].data, offset)
                if copy is not None:
                    os.replace(copy, path)
            except BaseException:
                if copy is not None:
                    unlink(copy)
                raise
            finally:
                os.close(fd)

    def _open_private(self, chunk: int) -> tuple[int, str | None]:
        """The chunk's file open for writing, and None; or, if a checkpoint shares the file, a
        private copy open for writing and its name, to be renamed over the chunk once the rows
        are in it (copy-on-write: the checkpoint keeps the old file). (-1, None) for a format-1
        table with no file for the chunk yet.

        The rows go into the copy before the rename: ext4 starts writing a file renamed over
        another at once, and rows written after the rename would dirty its pages again
        (measured: a copied chunk reached the disk twice per checkpoint interval)."""
        path = self._path(chunk)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            if self.complete:
                raise self._damaged(chunk, f"is missing ({path})") from None
            return -1, None
        if os.fstat(fd).st_nlink == 1:
            return fd, None
        copy = f"{path}.{os.getpid()}.tmp"
        try:
            out = os.open(copy, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                copy_sparse(fd, out)
            except BaseException:
                os.close(out)
                raise
        except BaseException:
            unlink(copy)
            raise
        finally:
            os.close(fd)
        return out, copy

    def read_chunk(self, chunk: int) -> np.ndarray:
        rows = len(
            range(chunk * self.chunk_rows, min((chunk + 1) * self.chunk_rows, self.num_rows))
        )
        if not self.complete and not os.path.exists(self._path(chunk)):
            return np.full((rows, self.dim), self.fill, dtype=self.dtype)
        return np.array(self._mapped(chunk)[:rows])

    def fill_chunk(self, chunk: int, value: float) -> None:
        if value != 0:
            return super().fill_chunk(chunk, value)
        path = self._path(chunk)  # zeros: a sparse file, no disk space until written
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.truncate(self.chunk_rows * self.row_bytes)
        os.replace(tmp, path)

    def write_chunk(self, chunk: int, rows: np.ndarray) -> None:
        # zarr v3 stores an edge chunk at full size: pad the last chunk's file to chunk_rows.
        if len(rows) < self.chunk_rows:
            pad = np.full((self.chunk_rows - len(rows), self.dim), self.fill, dtype=self.dtype)
            rows = np.concatenate([rows, pad])
        path = self._path(chunk)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                write_all(
                    f.fileno(), np.ascontiguousarray(rows, dtype=self.dtype.newbyteorder("<"))
                )
        except BaseException:
            unlink(tmp)
            raise
        os.replace(tmp, path)  # atomic: readers see the old chunk or the new one

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()  # mappings do not cross processes
        return state


def row_access(array: zarr.Array, *, complete: bool = True) -> ZarrRows:
    """The fastest row reader/writer that handles ``array``."""
    root = RawRows.supports(array)
    if root is None:
        return ZarrRows(array, complete=complete)
    return RawRows(array, root, complete=complete)
