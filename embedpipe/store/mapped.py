"""Chunk files kept mapped for writing rows: the table's writes in the owner process.

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
  is a ``SIGBUS`` here where ``pwrite`` would have raised ``EIO``: the owner process ends, and the
  table reopens at its last checkpoint, as after any crash of it.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import OrderedDict

import numpy as np

#: The most bytes of chunk files one array keeps mapped (page cache: the kernel reclaims them as
#: it reclaims any cached file page; they count in the owner process's resident set).
MAPPED_BYTES = 1 << 30

#: ``posix_fallocate`` errors that mean "this file system cannot", not "the disk is full".
_CANNOT = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV}


class MappedChunks:
    """The chunk files of one array that are mapped for writing (see the NOTE).

    ``path_of(chunk)`` names a chunk's file; each is ``chunk_bytes`` long, rows of ``dtype``
    (``(rows, dim)`` each). ``limit``: the most bytes mapped at once.
    """

    def __init__(
        self, path_of, chunk_rows: int, dim: int, dtype: np.dtype, limit: int = MAPPED_BYTES
    ) -> None:
        self.path_of = path_of
        self.shape = (chunk_rows, dim)
        self.dtype = dtype
        self.chunk_bytes = chunk_rows * dim * dtype.itemsize
        self.most = max(1, limit // self.chunk_bytes)
        self.enabled = True
        self._maps: OrderedDict[int, tuple[int, mmap.mmap]] = OrderedDict()  # chunk: (inode, map)
        self._lock = threading.Lock()  # the writeback thread and a request's admission write

    def rows(self, chunk: int) -> np.ndarray | None:
        """The chunk's rows, mapped to write in place; None where the caller writes with
        ``pwrite``: no file (a format-1 chunk never written), a file a checkpoint shares, or a
        file system that cannot allocate ahead. Raises ``OSError`` (ENOSPC) on a full disk."""
        if not self.enabled:
            return None
        path = self.path_of(chunk)
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
                held = self._map(path, stat.st_size)
                if held is None:
                    self._maps.pop(chunk, None)
                    return None
                self._maps[chunk] = held
                while len(self._maps) > self.most:
                    self._maps.popitem(last=False)  # unmapped once no write uses it
            self._maps.move_to_end(chunk)
            return np.frombuffer(held[1], dtype=self.dtype).reshape(self.shape)

    def _map(self, path: str, size: int) -> tuple[int, mmap.mmap] | None:
        if size != self.chunk_bytes:
            return None  # the pwrite path says what is wrong with it
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if _has_holes(fd, size):
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno not in _CANNOT:
                        raise
                    self.enabled = False
                    return None
            return os.fstat(fd).st_ino, mmap.mmap(fd, size)  # MAP_SHARED, read and write
        finally:
            os.close(fd)


def map_writes(table, limit: int = MAPPED_BYTES) -> None:
    """Write ``table``'s rows through mapped chunk files from now on (see the NOTE); 0: one
    ``pwrite`` per row, the default."""
    table._mapped_bytes = limit
    table._rows.clear()  # made again, mapping


def _has_holes(fd: int, size: int) -> bool:
    """Whether the file has a range with no disk blocks (``SEEK_HOLE``; by its block count
    where the file system cannot say)."""
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < size
    except (OSError, AttributeError):
        return os.fstat(fd).st_blocks * 512 < size
