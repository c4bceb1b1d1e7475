"""Rows of one 2-D zarr array: random reads and chunk-grouped writes.

zarr-python's selection API pays about 0.2 ms of Python per chunk it touches, which caps random
row reads at 7k-80k rows/s. A local, uncompressed array with chunks of whole rows keeps every
chunk as a plain file of C-ordered little-endian rows (zarr v3's ``bytes`` codec), so
:class:`RawRows` reads rows straight out of those files with ``preadv``, writes scattered rows
in place, and writes a whole chunk by writing a new file and renaming it over the old one.
Anything else (compressed chunks, sharding, a remote store) goes through :class:`ZarrRows` and
the general zarr API, which rewrites every chunk it touches.

Costs (measured by ``scripts/bench_table.py``, see ``docs/table-format.md``, and by the cold-disk
section of the benchmark, ``docs/cold-reads.md``): ``RawRows.read`` costs a ``stat`` per chunk
touched and a system call per row; ``RawRows.write`` a system call per row (none through a
mapping, ``mapped.py``); ``ZarrRows.write`` rewrites every chunk it touches in full.

NOTE [ Raw chunk reads and writes ]
A reader keeps each chunk file it touched open, keyed by the file's inode, and stats the chunk's
path on every read: a chunk replaced whole (``write_chunk``: a new file renamed over the old one)
has a new inode, so the reader opens the new file and never serves bytes older than the last
replace that finished before its read began. An open file that falls out of the reader's table is
closed when the last read using it is done (another thread may still be reading it).

Rows are read with ``preadv`` into the output, never mapped (but for the chunks the owner process
has mapped to write, at most ``mapped.MAPPED_BYTES``, and a frozen pipe's checkpoint that fits in
memory, ``mapped.py``), so a process that reads a table many times larger than memory does not
grow by what it read: the pages stay in the OS page cache, not in the process (an earlier
``mmap`` reader had to drop its pages after each copy with ``MADV_DONTNEED``; the kernel maps a
whole large folio per fault, +1 GB RSS for 32 MiB of rows read otherwise). A batch is read in
two passes, so that a cold disk sees the whole batch at once::

    pass 1, per row:  preadv(RWF_NOWAIT) -> in the page cache: copied, done
                                         -> not (EAGAIN): the kernel has started reading its
                                            page (readahead, exactly the page: FADV_RANDOM)
    pass 2, per row left:  preadv (blocking), in the same order: the pages are in flight

Pass 1 issues every missed row of the batch to the disk before waiting for any, from one thread:
the device sees a queue as deep as the batch's misses, not one read at a time (measured, see
``docs/cold-reads.md``: cold reads 2.6-5.5x the earlier ``mmap`` reader and faster than 16
threads of ``pread``; warm reads 2-7x, a system call per row costing less than a page fault).
Where ``RWF_NOWAIT`` is not supported (not Linux, or a file system that refuses it) every row
takes pass 2, one blocking read at a time. No threads, so nothing to restart in a forked
DataLoader worker: inherited file descriptors read as well in the child.

Row writes (``write``) go in place, one ``pwrite`` per row (in the owner process through the
chunk's mapping: NOTE [ Mapped row writes ] in ``mapped.py``), and are visible to every reader
at once, with one exception: a chunk file that is also part of a committed checkpoint (its link
count is above 1, see NOTE [ Checkpoint commit ] in ``checkpoints.py``) is first copied and the
copy renamed over the live name, so a checkpoint never changes; readers notice the new inode.
Replacing whole chunks instead would rewrite ``chunk_rows`` rows for every scattered row
(measured: a 5 MB cache evicting into a 1 GiB table wrote ~100 MB per batch), which is what the
writeback does all the time. The price: a reader copying the very row being written may see a mix
of old and new bytes. embedpipe's own readers never keep such a copy: a row is written either
while it is cached (readers take it from the cache) or as part of an optimizer step, after which
the hand-off re-reads every row the step changed (docs/consistency.md, invariants 3 and 4).
"""

from __future__ import annotations

import errno
import functools
import os
import resource
from collections import OrderedDict
from contextlib import suppress
from typing import Any

import numpy as np
import zarr
from zarr.storage import LocalStore

from ..errors import CorruptTableError
from .checkpoints import copy_sparse, unlink, write_all
from .mapped import MappedChunks, MappedReads, changing_files

#: How many chunk files one reader keeps open (see the NOTE): well inside the process's limit on
#: open files.
MAX_OPEN_CHUNKS = max(16, min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8))

#: ``preadv`` flag: fail with EAGAIN instead of waiting for the disk (0 where there is none).
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def chunk_path(root: str, chunk: int) -> str:
    """The file of chunk ``chunk`` of the raw array in folder ``root``."""
    return f"{root}/c/{chunk}/0"


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

    #: Rows a read found outside the page cache, and whether reads can tell (``RawRows``).
    rows_waited = 0
    tells_page_cache = False

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

    def check(self) -> None:
        """Raise :class:`CorruptTableError` for the first chunk file that is missing (or, for
        raw chunks, of the wrong size): what ``embedpipe info`` checks."""
        for chunk in range(-(-self.num_rows // self.chunk_rows)):
            self._check_chunk(chunk)

    def _check_chunk(self, chunk: int) -> None:
        if self.complete:
            self._check_exists(chunk)

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


class _ChunkFile:
    """A chunk file open for reading, closed when the last reference goes (see the NOTE)."""

    __slots__ = ("fd", "inode")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.inode = -1

    def __del__(self, _close: Any = os.close) -> None:  # bound now: os may be gone at exit
        _close(self.fd)


class RawRows(ZarrRows):
    """Rows of a local, uncompressed zarr array, read and written as raw chunk files."""

    def __init__(self, array: zarr.Array, root: str, *, complete: bool = True) -> None:
        super().__init__(array, complete=complete)
        self.root = root  # the array's folder; chunk i lives at root/c/i/0
        self.row_bytes = self.dim * self.dtype.itemsize
        self.fill = np.asarray(array.fill_value, dtype=self.dtype)
        self._files: OrderedDict[int, _ChunkFile] = OrderedDict()
        self._nowait = bool(_NOWAIT)
        #: Rows that were not in the page cache when read (pass 2 of the NOTE), for benchmarks.
        self.rows_waited = 0
        #: The chunk files mapped for writing, where the owner process writes (``map_writes``),
        #: or to read, a checkpoint's, where a frozen pipe's lookup reads (``map_reads``).
        self.mapped: MappedChunks | MappedReads | None = None

    @property
    def tells_page_cache(self) -> bool:  # type: ignore[override]
        """Whether :attr:`rows_waited` counts rows the page cache lacked (with ``RWF_NOWAIT``),
        not every row (without it, every row takes the blocking pass)."""
        return self._nowait

    def map_writes(self, limit: int) -> None:
        """Write rows through mapped chunk files, at most ``limit`` bytes (0: ``pwrite`` a row)."""
        self.mapped = MappedChunks(*self._chunk_files(), limit) if limit else None

    def map_reads(self) -> None:
        """Read rows through a read-only window (NOTE [ A checkpoint read through a window ])."""
        self.mapped = MappedReads(*self._chunk_files())

    def _chunk_files(self) -> tuple[Any, int, int, np.dtype, int]:
        """What a mapping needs: the files' names, their rows, the dtype, how many there are."""
        path_of = functools.partial(chunk_path, self.root)  # not self: no cycle keeps it mapped
        chunks = -(-self.num_rows // self.chunk_rows)
        return path_of, self.chunk_rows, self.dim, self.dtype.newbyteorder("<"), chunks

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
        return chunk_path(self.root, chunk)

    def _check_chunk(self, chunk: int) -> None:
        self._opened(chunk)  # raises for a missing file or one of the wrong size

    def _where(self) -> str:
        return self.root

    def _opened(self, chunk: int) -> _ChunkFile | None:
        """The chunk's current file, open for reading (see the NOTE); None for a chunk with no
        file in a format-1 table (it reads as the fill value)."""
        path = self._path(chunk)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            if self.complete:
                raise self._damaged(chunk, f"is missing ({path})") from None
            return None
        cached = self._files.get(chunk)
        if cached is not None and cached.inode == inode:
            with suppress(KeyError):  # another thread may have dropped it just now
                self._files.move_to_end(chunk)
            return cached
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # replaced or deleted since the stat: look again
            return self._opened(chunk)
        opened = _ChunkFile(fd)
        stat = os.fstat(fd)
        opened.inode, size = stat.st_ino, stat.st_size  # the file we read, even if replaced since
        if size != self.chunk_rows * self.row_bytes:
            raise self._damaged(
                chunk, f"has {size} bytes, not {self.chunk_rows * self.row_bytes} ({path})"
            )
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a miss reads its page, no more
        self._files[chunk] = opened
        if len(self._files) > MAX_OPEN_CHUNKS:
            with suppress(KeyError):
                self._files.popitem(last=False)  # closed once no read holds it
        return opened

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows for ``ids`` (1-D int64, in range), in the order of ``ids``: rows in the page
        cache are copied at once, the others are all sent to the disk before waiting for any
        (see the NOTE). Cost: a ``stat`` per chunk touched, one or two system calls per row
        (per-row work stays in plain Python: numpy's per-call overhead per chunk cost more);
        in the owner process, rows of the chunks it has mapped into its window are copied from
        there in one gather (NOTE [ Mapped row writes ] in ``mapped.py``)."""
        out = np.empty((len(ids), self.dim), dtype=self.dtype)  # out: (N, D)
        if len(ids) == 0:
            return out
        rest = np.arange(len(ids))  # the rows to read from the files
        if self.mapped is not None:  # rows in a window (the owner's, a checkpoint's): one gather
            done, rows = self.mapped.read(ids)
            if done.all():
                return rows.view(self.dtype)
            out[done] = rows
            rest = np.flatnonzero(~done)
        order = rest[np.argsort(ids[rest], kind="stable")]  # chunk by chunk, rows ascending
        out_bytes = memoryview(out).cast("B")
        rb = self.row_bytes
        chunk_of = (ids[order] // self.chunk_rows).tolist()
        offsets = (ids[order] % self.chunk_rows * rb).tolist()
        waiting: list[tuple[_ChunkFile, int, int, int]] = []  # (file, chunk, position, offset)
        current, opened = -1, None
        for i, chunk, offset in zip(order.tolist(), chunk_of, offsets):
            if chunk != current:
                current, opened = chunk, self._opened(chunk)
            if opened is None:
                out[i] = self.fill
            elif not self._nowait or not self._read_now(
                opened.fd, out_bytes[i * rb : (i + 1) * rb], offset
            ):
                waiting.append((opened, chunk, i, offset))
        self.rows_waited += len(waiting)
        for opened, chunk, i, offset in waiting:
            self._read_exactly(opened.fd, out_bytes[i * rb : (i + 1) * rb], offset, chunk)
        return out

    def _read_now(self, fd: int, row: memoryview, offset: int) -> bool:
        """Copy the row if the page cache has all of it; else False, its read started."""
        try:
            return os.preadv(fd, [row], offset, _NOWAIT) == len(row)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = False  # this file system cannot: read one row at a time
            return False

    def _read_exactly(self, fd: int, row: memoryview, offset: int, chunk: int) -> None:
        done = 0
        while done < len(row):
            got = os.preadv(fd, [row[done:]], offset + done)
            if got == 0:
                raise self._damaged(chunk, "ends before its last row; it was truncated")
            done += got

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Write rows in place in their chunk files, one ``pwrite`` per row (see the NOTE), or
        through the chunk's mapping where the owner process maps them (``map_writes``); a
        chunk file shared with a checkpoint is copied first. Raises ``OSError`` on a full disk,
        after which some of the rows may be written and others not."""
        data = np.ascontiguousarray(rows, dtype=self.dtype.newbyteorder("<"))
        if isinstance(self.mapped, MappedChunks):  # in place, no system call
            left = ~self.mapped.write(ids, data)
            if not left.any():
                return
            ids, data = ids[left], np.ascontiguousarray(data[left])
        view, rb = memoryview(data).cast("B"), self.row_bytes
        chunks, positions = group_by_chunk(ids, self.chunk_rows)
        for chunk, pos in zip(chunks, positions):
            pos = pos[np.argsort(ids[pos])]  # ascending offsets within the file
            path = self._path(chunk)
            fd, copy = self._open_private(chunk)
            if fd < 0:  # format 1: a chunk never written has no file yet
                self._rewrite_chunk(chunk, ids[pos], data[pos])
                continue
            try:
                self._write_rows(fd, view, pos, (ids[pos] - chunk * self.chunk_rows) * rb)
                if copy is not None:
                    with changing_files():
                        os.replace(copy, path)
            except BaseException:
                if copy is not None:
                    unlink(copy)
                raise
            finally:
                os.close(fd)

    def _write_rows(self, fd: int, view: memoryview, rows: np.ndarray, offsets: np.ndarray) -> None:
        """Row ``rows[k]`` of ``view`` at byte ``offsets[k]`` of ``fd``, one ``pwrite`` each: the
        loop is the cost (a system call per row), so it does no other work per row."""
        rb = self.row_bytes
        for start, offset in zip((rows * rb).tolist(), offsets.tolist()):
            if os.pwrite(fd, view[start : start + rb], offset) != rb:  # short: finish it
                write_all(fd, view[start : start + rb], offset)

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
        rows = min(self.chunk_rows, self.num_rows - chunk * self.chunk_rows)
        opened = self._opened(chunk)
        if opened is None:
            return np.full((rows, self.dim), self.fill, dtype=self.dtype)
        out = np.empty((rows, self.dim), dtype=self.dtype)
        self._read_exactly(opened.fd, memoryview(out).cast("B"), 0, chunk)
        return out

    def fill_chunk(self, chunk: int, value: float) -> None:
        if value != 0:
            return super().fill_chunk(chunk, value)
        path = self._path(chunk)  # zeros: a sparse file, no disk space until written
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.truncate(self.chunk_rows * self.row_bytes)
        with changing_files():
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
        with changing_files():
            os.replace(tmp, path)  # atomic: readers see the old chunk or the new one

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = OrderedDict()  # file descriptors do not cross processes
        if isinstance(self.mapped, MappedChunks):
            state["mapped"] = None  # nor mappings to write: only the owner process maps
        return state


def row_access(
    array: zarr.Array, complete: bool = True, mapped_bytes: int = 0, maps_reads: bool = False
) -> ZarrRows:
    """The fastest row reader/writer that handles ``array``; ``mapped_bytes``: see
    :meth:`RawRows.map_writes`; ``maps_reads``: :meth:`RawRows.map_reads`."""
    root = RawRows.supports(array)
    if root is None:
        return ZarrRows(array, complete=complete)
    rows = RawRows(array, root, complete=complete)
    rows.map_reads() if maps_reads else rows.map_writes(mapped_bytes)
    return rows
