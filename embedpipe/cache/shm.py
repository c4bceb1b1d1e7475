"""Shared memory that dies with the processes using it, however they die.

``torch.Tensor.share_memory_()`` creates a named segment in ``/dev/shm``, copies the tensor into
it, and only then unlinks the name: an owner killed during that copy (measured: the kernel's OOM
killer while a 400 MB cache was being filled) leaves the segment behind, holding RAM until the
machine reboots. :class:`SharedBlock` never has a name: it is a ``memfd`` (Linux) or a temporary
file unlinked before it is given a size, mapped ``MAP_SHARED``. The memory goes when the last
process that maps it or holds its descriptor exits.

A block crosses into a DataLoader worker by inheritance (fork) or as a duplicated file descriptor
(spawn, forkserver: ``multiprocessing.reduction.DupFd``), and its numpy views are rebuilt there.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from multiprocessing import reduction
from typing import Any

import numpy as np


def _anonymous_fd(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("embedpipe", os.MFD_CLOEXEC)
    else:  # macOS and others: a file without a name, in the temporary folder
        with tempfile.NamedTemporaryFile(prefix="embedpipe-", delete=False) as f:
            fd = os.dup(f.fileno())
            os.unlink(f.name)  # before it has any size: a crash here leaves an empty file at most
    os.ftruncate(fd, size)
    return fd


class SharedBlock:
    """Named numpy arrays laid out in one anonymous shared mapping.

    ``SharedBlock({"rows": ((C, D), np.float32, 0.0), "ids": ((C,), np.int64, -1)})`` gives
    ``block["rows"]`` and ``block["ids"]``, filled as given, visible to every process that
    receives the block.
    """

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], Any, float]]) -> None:
        self.layout = {
            name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype, _) in layout.items()
        }
        self.fd = _anonymous_fd(max(1, self._size()))
        self._map()
        for name, (_, _, fill) in layout.items():
            if fill != 0:  # the mapping starts zeroed
                self.arrays[name].fill(fill)

    def _size(self) -> int:
        total = 0
        for shape, dtype in self.layout.values():
            total = -(-total // 64) * 64  # each array 64-byte aligned
            total += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return total

    def _map(self) -> None:
        self.mmap = mmap.mmap(self.fd, max(1, self._size()), mmap.MAP_SHARED)
        self.arrays: dict[str, np.ndarray] = {}
        offset = 0
        for name, (shape, dtype) in self.layout.items():
            offset = -(-offset // 64) * 64
            count = int(np.prod(shape, dtype=np.int64))
            self.arrays[name] = np.frombuffer(
                self.mmap, dtype=dtype, count=count, offset=offset
            ).reshape(shape)
            offset += count * dtype.itemsize

    @classmethod
    def adopt(cls, layout: dict[str, tuple[tuple[int, ...], Any]], fd: int) -> SharedBlock:
        """The block whose descriptor ``fd`` another process sent (this object closes it)."""
        block = cls.__new__(cls)
        block.layout = {
            name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in layout.items()
        }
        block.fd = fd
        block._map()
        return block

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    @property
    def nbytes(self) -> int:
        return self._size()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.layout, reduction.DupFd(self.fd)))

    def __del__(self) -> None:
        fd = getattr(self, "fd", -1)
        if fd >= 0:
            os.close(fd)  # the mapping keeps the memory alive while views exist


def _rebuild(layout: dict[str, tuple[tuple[int, ...], np.dtype]], dup: Any) -> SharedBlock:
    return SharedBlock.adopt(layout, dup.detach())
