"""Chunk files kept mapped: the table's writes in the owner process, and a frozen pipe's reads of
a checkpoint that fits in memory.

NOTE [ Mapped row writes ]
A row written with ``pwrite`` costs a system call (measured: 3-4 us on ext4 for a 3 KiB row, the
most of :meth:`RawRows.write`'s time; an evicting step writes ~1,900 rows and as many of their
optimizer state). A chunk file kept mapped (``MAP_SHARED``) takes a step's rows of that chunk in
one numpy scatter, with no system call and, once its pages are mapped and dirty, no fault
(measured: 2.6 ms against 10 ms for 1,900 rows of 768 floats). The pages are the page cache's, as
``pwrite``'s are, so every reader's ``preadv`` sees the rows at once, a crash of the process loses
nothing the kernel holds, and a checkpoint's ``fsync`` writes them.

Only the owner process maps (:func:`map_writes`): a mapped page counts in the resident set of
the process that maps it, and the training process's memory must not grow with the table (with
the owner in a thread, rows are written with ``pwrite``). Not the owner of one machine's
shard of a table sharded over machines either: its chunk files may be on a filesystem shared
between machines (NFS), where a ``stat``'s link count may be cached and another machine's
``fsync`` does not write this machine's mapped pages; it writes with ``pwrite`` as a rank of
``owner="thread"`` does. The mapped bytes are bounded (``MAPPED_BYTES``): the chunks written
least recently are unmapped first.

A write through a mapping must never land where ``pwrite`` would not have, so each write looks
at the chunk's path first (a ``stat``, as a read does):

- a file that a checkpoint shares (more than one link) is not written in place: the caller copies
  it first (copy-on-write, ``RawRows._open_private``) and maps the copy at its next write;
- a file replaced since it was mapped (a new inode: a restored snapshot, a chunk written whole)
  is mapped again, the old mapping dropped;
- a file with holes (a chunk of zeros is a sparse file, ``fill_chunk``) is allocated first
  (``posix_fallocate``): a page of a hole written through a mapping on a full disk would kill the
  process with ``SIGBUS``; allocated first, a full disk is an ``OSError`` (``TableWriteError``)
  before any row is written. A file system that cannot allocate ahead is written with
  ``pwrite`` from then on. An I/O error of the disk itself while a page is read in to be written
  is a ``SIGBUS`` here where ``pwrite`` would have raised ``EIO`` (and, through the window below,
  where a read's ``preadv`` would have): the owner process ends, and the table reopens at its
  last checkpoint, as after any crash of it.

An array that fits in the bound, on Linux, with chunks of whole pages, is mapped into one window:
an address range the size of the array is reserved (no access: a stray touch is a crash, never
a silent read of zeros) and each chunk file is mapped over its own part of it (``MAP_FIXED``) at
its first write. A step's rows, spread over most of the chunks, then go in with one numpy scatter
instead of one per chunk (measured, 800 rows of 768 floats over 120 chunks: 4.5 ms with a
mapping a chunk, of which 2.1 ms numpy's per-call overhead per chunk and 0.9 ms finding the
mapping; the scatter alone 0.3-0.5 ms). The owner's reads of rows in chunks so mapped come out of
the window the same way, one gather where ``RawRows.read`` makes a system call a row (800 rows:
1.2 against 3.4-3.7 ms); only a chunk whose mapping is still its file's (the same inode) is read
there; the lookahead reader's reads too (its own handle, the owner's window). The checks above
stay per chunk, a ``stat`` each. With a 5% cache at D = 768 with ``owner="process"``, the owner
process's CPU fell from 60-64 to 44-46 ms a batch.

NOTE [ A chunk checked once until its files change ]
The ``stat`` a chunk at every write and read was most of their cost once the rows went through
the window (measured, 700 rows of 768 floats over 120 chunks: a write 1.1 ms, of which the
checks 0.7 ms; a read 1.35 ms, of which 0.6 ms), and a step writes and reads four times (its
rows, their state, the clean rows ahead, the misses): 5 ms of the owner process's 24 ms a batch
at D = 768. What the checks look for, a checkpoint's link, a restore's or a copy-on-write's new
file, only the process that holds the table's writer lock makes, and only one process maps: that
owner (the training process's handle is claimed and raises, a frozen pipe's owner and the owners
of one machine's shard do not map). So every change this process makes to a chunk's file or its
names runs inside :func:`changing_files` (``checkpoints.py``, ``rowstore.py``), and a chunk
found mapped in the window, current and not shared is not looked at again until the next such
change: a write or read whose chunks are all so checked is one scatter or gather. As before, the
owner's lock keeps a checkpoint's links from running beside a write.

NOTE [ A checkpoint read through a window ]
A handle opened read-only reads a committed checkpoint (``Table.open`` pins one), whose files
never change: a writer copies a chunk that a checkpoint shares before writing it (NOTE [ Raw
chunk reads and writes ] in ``rowstore.py``) and a restore or a whole chunk's write renames a
new file over the live name. So nothing a read of it checks (a ``stat`` a chunk for a replaced
file) can change, and :class:`MappedReads` maps each chunk file read-only into one window at
its first read and takes a batch's rows in one gather (measured, 530 rows of 256 floats from the
page cache: 0.14 ms, against 1.8 ms with ``RawRows.read``'s ``preadv`` a row). It gives up what
that NOTE keeps: the pages it touches count in the reading process's resident set (shared pages
of the page cache, which the kernel reclaims as any), so a pipe reads so only a table that fits
in memory (``pipe/defaults.py``, NOTE [ A frozen table that fits in memory ]); and a chunk file
truncated under a mapping (damage from outside) ends the reading process with ``SIGBUS``, where
``preadv`` would raise :class:`~embedpipe.errors.CorruptTableError`. A chunk with no file or of
the wrong size when first read is never mapped: read as before, its damage named. The live
arrays (a handle open for writing) are never read so (:func:`map_reads`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import platform
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

#: The most bytes of chunk files one array keeps mapped (page cache: the kernel reclaims them as
#: it reclaims any cached file page; they count in the owner process's resident set).
MAPPED_BYTES = 1 << 30

#: ``posix_fallocate`` errors that mean "this file system cannot", not "the disk is full".
_CANNOT = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV}

#: Whether an array that can be mapped into one window is (see the NOTE; tests turn it off to
#: try the mapping a chunk that larger arrays get).
WINDOW = True

#: Linux's ``mmap`` flags the mmap module does not name (the window, see the NOTE).
_MAP_FIXED, _NORESERVE, _PROT_NONE = 0x10, 0x4000, 0
_FLAGS_KNOWN = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")

#: Changes this process made to chunk files or their names (NOTE [ A chunk checked once until
#: its files change ]).
_changes = 0
_changing = threading.Lock()  # (two threads changing files at once must not lose a count)

#: The most chunk files a read window maps (each is a mapping of its own: Linux allows a process
#: ``vm.max_map_count``, 65,530 by default); a larger array is read with ``preadv``.
MAX_READ_CHUNKS = 16_384


@contextlib.contextmanager
def changing_files() -> Iterator[None]:
    """This process links, replaces or removes chunk files inside the block: every mapped chunk
    is checked again at its next write or read (see the NOTE). Counted at both ends, so that a
    check made while the files change is not kept."""
    global _changes
    with _changing:
        _changes += 1
    try:
        yield
    finally:
        with _changing:
            _changes += 1


class MappedChunks:
    """The chunk files of one array that are mapped for writing (see the NOTE).

    ``path_of(chunk)`` names a chunk's file; each is ``chunk_bytes`` long, rows of ``dtype``
    (``(rows, dim)`` each); ``chunks`` of them. ``limit``: the most bytes mapped at once.
    """

    def __init__(
        self, path_of, chunk_rows: int, dim: int, dtype: np.dtype, chunks: int, limit: int
    ) -> None:
        self.path_of = path_of
        self.shape = (chunk_rows, dim)
        self.dtype = dtype
        self.chunk_bytes = chunk_rows * dim * dtype.itemsize
        self.most = max(1, limit // self.chunk_bytes)
        self.enabled = True
        #: chunk: (inode, its own mapping, or None for its part of the window)
        self._maps: OrderedDict[int, tuple[int, mmap.mmap | None]] = OrderedDict()
        self._lock = threading.Lock()  # the writeback thread and a request's admission write
        fits = WINDOW and 0 < chunks <= self.most
        self._window = _reserve(chunks, self.shape, dtype) if fits else None
        #: Per chunk: mapped in the window, its path's file, no other name; checked since
        #: ``_changes`` was ``_checked_at`` (NOTE [ A chunk checked once until its files change ])
        self._checked = np.zeros(chunks if self._window is not None else 0, dtype=bool)
        self._checked_at = _changes

    def write(self, ids: np.ndarray, data: np.ndarray) -> np.ndarray:
        """Write ``data[k]`` as row ``ids[k]`` in place wherever its chunk file can be mapped
        (:meth:`rows`): in one scatter where the array has a window (see the NOTE), else one a
        chunk. Returns the mask of the rows written; the caller writes the others with
        ``pwrite``."""
        chunk_of = ids // self.shape[0]
        if self._window is not None and self.enabled and self._still_checked()[chunk_of].all():
            self._window.reshape(-1, self.shape[1])[ids] = data
            return np.ones(len(ids), dtype=bool)
        chunks, where = np.unique(chunk_of, return_inverse=True)
        views = [self.rows(chunk) for chunk in chunks.tolist()]
        done = np.array([view is not None for view in views], dtype=bool)[where]
        if self._window is not None:
            rows = self._window.reshape(-1, self.shape[1])
            if done.all():
                rows[ids] = data
            else:
                rows[ids[done]] = data[done]
            return done
        order = np.argsort(where, kind="stable")
        bounds = np.searchsorted(where[order], np.arange(len(chunks) + 1))
        for k, view in enumerate(views):
            if view is not None:
                at = order[bounds[k] : bounds[k + 1]]
                view[ids[at] - chunks[k] * self.shape[0]] = data[at]
        return done

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``ids`` whose chunks are mapped into the window, their files still the
        chunks' (a ``stat`` each, as :meth:`rows` does, but for chunks checked since the last
        change, see the NOTE): the mask of those ids and their rows in order, the others left to
        the caller (all of them without a window)."""
        if self._window is None or not self._maps:
            return np.zeros(len(ids), dtype=bool), np.empty((0, self.shape[1]), dtype=self.dtype)
        if self._still_checked()[ids // self.shape[0]].all():
            return np.ones(len(ids), dtype=bool), self._window.reshape(-1, self.shape[1])[ids]
        chunks, where = np.unique(ids // self.shape[0], return_inverse=True)
        done = np.array([self._current(chunk) for chunk in chunks.tolist()], dtype=bool)[where]
        rows = self._window.reshape(-1, self.shape[1])
        return done, rows[ids if done.all() else ids[done]]

    def _current(self, chunk: int) -> bool:
        """Whether the chunk's part of the window maps the chunk's file as it is now."""
        with self._lock:
            since = _changes  # before the stat: a change during it is seen at the next call
            held = self._maps.get(chunk)
            if held is None or held[1] is not None:
                return False
            try:
                stat = os.stat(self.path_of(chunk))
            except FileNotFoundError:
                return False
            self._mark(chunk, stat, held[0], since)
            return stat.st_ino == held[0]

    def _still_checked(self) -> np.ndarray:
        """The chunks checked since this process last changed chunk files (see the NOTE)."""
        if self._checked_at != _changes:
            with self._lock:
                since = _changes
                if self._checked_at != since:
                    self._checked[:] = False
                    self._checked_at = since
        return self._checked

    def _mark(self, chunk: int, stat: os.stat_result, inode: int, since: int) -> None:
        """Under the lock: the chunk's path's ``stat`` (taken when ``_changes`` was ``since``)
        shows the file mapped into the window, with no other name: checked until a change."""
        if self._window is not None and since == _changes == self._checked_at:
            self._checked[chunk] = stat.st_ino == inode and stat.st_nlink == 1

    def rows(self, chunk: int) -> np.ndarray | None:
        """The chunk's rows, mapped to write in place; None where the caller writes with
        ``pwrite``: no file (a format-1 chunk never written), a file a checkpoint shares, or a
        file system that cannot allocate ahead. Raises ``OSError`` (ENOSPC) on a full disk."""
        if not self.enabled:
            return None
        path = self.path_of(chunk)
        since = _changes  # before the stat: a change during it is seen at the next call
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        with self._lock:
            if stat.st_nlink != 1:  # shared with a checkpoint: the caller copies it first
                self._maps.pop(chunk, None)
                return None
            held = self._maps.get(chunk)
            if held is None or held[0] != stat.st_ino:  # not mapped yet, or replaced since
                self._maps.pop(chunk, None)  # no entry left for a mapping that failed
                held = self._map(path, stat.st_size, chunk)
                if held is None:
                    self._maps.pop(chunk, None)
                    return None
                self._maps[chunk] = held
                while len(self._maps) > self.most:
                    self._maps.popitem(last=False)  # unmapped once no write uses it
            self._maps.move_to_end(chunk)
            if held[1] is None:
                self._mark(chunk, stat, held[0], since)
                return self._window[chunk]
            return np.frombuffer(held[1], dtype=self.dtype).reshape(self.shape)

    def _map(self, path: str, size: int, chunk: int) -> tuple[int, mmap.mmap | None] | None:
        if size != self.chunk_bytes:
            return None  # the pwrite path says what is wrong with it
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            opened = os.fstat(fd)  # the file mapped: checked again, in case the path changed
            if opened.st_nlink != 1 or opened.st_size != size:
                return None
            if _has_holes(fd, size):
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno not in _CANNOT:
                        raise
                    self.enabled = False
                    return None
            if self._window is None:
                return opened.st_ino, mmap.mmap(fd, size)  # MAP_SHARED, read and write
            _map_over(self._window[chunk], fd)
            return opened.st_ino, None
        finally:
            os.close(fd)


class MappedReads:
    """The chunk files of one array of a checkpoint, mapped read-only into one window as they
    are first read (NOTE [ A checkpoint read through a window ]): a batch's rows in one gather.

    ``path_of(chunk)`` names a chunk's file; ``chunks`` of them, ``(chunk_rows, dim)`` rows of
    ``dtype`` each. A chunk with no file (zeros never written) or of the wrong size is never
    mapped: the caller reads it as before (and names the damage).
    """

    def __init__(self, path_of, chunk_rows: int, dim: int, dtype: np.dtype, chunks: int) -> None:
        self.path_of = path_of
        self.shape = (chunk_rows, dim)
        self.dtype = dtype
        self.chunk_bytes = chunk_rows * dim * dtype.itemsize
        fits = WINDOW and 0 < chunks <= MAX_READ_CHUNKS
        self._window = _reserve(chunks, self.shape, dtype) if fits else None
        self._mapped = np.zeros(chunks, dtype=bool)
        self._tried = np.zeros(chunks, dtype=bool)  # (a chunk that cannot be mapped: tried once)
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple:  # another process maps anew (a forked one inherits the window)
        return MappedReads, (self.path_of, *self.shape, self.dtype, len(self._mapped))

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The mask of ``ids`` whose chunks are mapped (mapped now if they were not) and their
        rows, in order; the others are the caller's."""
        if self._window is None:
            return np.zeros(len(ids), dtype=bool), np.empty((0, self.shape[1]), dtype=self.dtype)
        chunk_of = ids // self.shape[0]
        done = self._mapped[chunk_of]
        if not done.all() and not self._tried[chunk_of[~done]].all():
            for chunk in np.unique(chunk_of[~done]).tolist():
                self._map(chunk)
            done = self._mapped[chunk_of]
        rows = self._window.reshape(-1, self.shape[1])
        return done, rows[ids if done.all() else ids[done]]

    def _map(self, chunk: int) -> None:
        with self._lock:
            if self._tried[chunk]:
                return
            self._tried[chunk] = True  # a checkpoint's file: what it is now, it stays
            try:
                fd = os.open(self.path_of(chunk), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                if os.fstat(fd).st_size == self.chunk_bytes:
                    _map_over(self._window[chunk], fd, mmap.PROT_READ)
                    self._mapped[chunk] = True
            except OSError:  # no more mappings allowed (ENOMEM): left to ``preadv``
                pass
            finally:
                os.close(fd)


def map_writes(table, limit: int = MAPPED_BYTES) -> None:
    """Write ``table``'s rows through mapped chunk files from now on (see the NOTE); 0: one
    ``pwrite`` per row, the default."""
    table._mapped_bytes = limit
    table._rows.clear()  # made again, mapping


def map_reads(table) -> bool:
    """Read ``table``'s rows through read-only windows from now on, if it reads a checkpoint,
    whose files never change (NOTE [ A checkpoint read through a window ]); returns whether
    it does. Not the live arrays, which a writer changes."""
    if table.mode != "r" or table._pin is None:
        return False
    if not table._maps_reads:
        table._maps_reads = True
        table._rows.clear()  # made again, mapping
    return True


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int64)  # fmt: skip
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def _reserve(chunks: int, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray | None:
    """A window: ``chunks`` chunks (``shape`` rows of ``dtype`` each) worth of address space, no
    access until a chunk file is mapped over its part (NOTE [ Mapped row writes ]); None where
    chunks are not whole pages, not Linux on a machine whose ``mmap`` flags are known, or the
    address space is refused (a limit on it, strict overcommit). The reservation is an ``mmap``
    object, so it is unmapped (with every chunk mapped into it) only once no array made from it
    is left."""
    chunk_bytes = shape[0] * shape[1] * dtype.itemsize
    if not _FLAGS_KNOWN or chunk_bytes % mmap.PAGESIZE:
        return None
    size = chunks * chunk_bytes
    try:
        reserved = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    except OSError:
        return None
    window = np.frombuffer(reserved, dtype=dtype).reshape(chunks, *shape)
    if _libc().mprotect(window.ctypes.data, size, _PROT_NONE) != 0:
        return None  # left readable and writable: no window
    return window


def _map_over(part: np.ndarray, fd: int, prot: int = mmap.PROT_READ | mmap.PROT_WRITE) -> None:
    """Map the whole of file ``fd``, shared (``prot``: readable and writable), over the window's
    ``part`` (exactly its size), replacing whatever was mapped there."""
    address = part.ctypes.data
    got = _libc().mmap(address, part.nbytes, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != address:
        code = ctypes.get_errno()
        # a failed MAP_FIXED may have unmapped the part: reserve it again, so that no other
        # mapping is ever placed there (a later map over it would replace that one)
        anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE | _MAP_FIXED
        _libc().mmap(address, part.nbytes, _PROT_NONE, anonymous, -1, 0)
        raise OSError(code, f"mapping a chunk file into the table's window: {os.strerror(code)}")


def _has_holes(fd: int, size: int) -> bool:
    """Whether the file has a range with no disk blocks (``SEEK_HOLE``; by its block count
    where the file system cannot say)."""
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < size
    except (OSError, AttributeError):
        return os.fstat(fd).st_blocks * 512 < size
