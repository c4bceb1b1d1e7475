"""Trains a table through an owner process with a cache of ``FRACTION`` of its rows, then
prints this process's resident bytes outside the pipe's shared blocks, its resident bytes of the
cache's block, the bytes it read from disk while it trained after the page cache was dropped (-1
if it could not be; its reaped children's reads left out), its owner process's disk reads
meanwhile, and the table's files this process opened, held open or mapped while it trained (named
on stderr; it must have none).

The bytes read count every file: a page of a shared library or a module first touched under load
after the drop reads as much as a chunk of the table would. The table's files are told apart by
name: an audit hook sees every ``open`` and ``os.open`` of this process (zarr's reads and the
mapped store's both open the chunk's file), and ``/proc/self/fd`` and ``/proc/self/maps`` show
any opened before and still held.

The resident bytes are taken after ``malloc_trim``: glibc keeps freed heap pages it could give
back, as many as the process's allocation history leaves, and that history differs between two
fresh runs by up to 120 MB (measured: a 0.5 cache's run 465 MB against a 0.01 cache's 346 MB,
with the same live data). The ring's pages this process read are left out too: they depend on
how many batches the workers had in flight (the ring is the same size for every cache).

Run as ``python -m tests.service.resident_run TABLE FRACTION`` (``test_service.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import sys

import numpy as np
import torch

import embedpipe


def field(path: str, name: str) -> int:
    with open(path) as f:
        return next(int(line.split()[1]) for line in f if line.startswith(name))


def resident(block_address: int) -> tuple[int, int]:
    """This process's resident bytes outside the pipe's shared blocks (memfds), and those of the
    mapping at ``block_address``."""
    outside = inside = 0
    name, start, end = "", 0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's first line: range, perms, ..., name
                start, end = (int(x, 16) for x in fields[0].split("-"))
                name = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "Rss:":
                size = int(fields[1]) * 1024
                if start <= block_address < end:
                    inside += size
                elif not name.startswith("/memfd:"):
                    outside += size
    return outside, inside


def table_files(folder: str, opened: list[str]) -> list[str]:
    """The table's files (under ``folder``) this process opened (``opened``, from the audit hook),
    holds open or maps now."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
    with open("/proc/self/maps") as f:
        held += [line.split(maxsplit=5)[5].strip() for line in f if len(line.split()) > 5]
    inside = [name for name in opened + held if name.startswith(folder + os.sep)]
    if opened:
        print(f"files opened while it trained: {sorted(set(opened))}", file=sys.stderr)
    return sorted({name for name in inside if os.path.isfile(name)})


def watch_opens(opened: list[str]) -> None:
    """Appends to ``opened`` the path of every file this process (not a forked child) opens."""
    me = os.getpid()

    def hook(event: str, args: tuple) -> None:
        if event == "open" and os.getpid() == me and isinstance(args[0], (str, bytes)):
            opened.append(os.path.realpath(os.fsdecode(args[0])))

    sys.addaudithook(hook)


def main(path: str, fraction: float) -> None:
    folder = os.path.realpath(path)
    opened: list[str] = []
    table = embedpipe.Table.open(path)
    rows = table.num_rows
    rng = np.random.default_rng(0)
    data = [{"input_ids": torch.from_numpy(rng.zipf(1.1, 128) % rows)} for _ in range(20 * 32)]
    with embedpipe.EmbeddingPipe(
        path,
        cache_rows=int(rows * fraction),
        optimizer=embedpipe.optim.Adagrad(lr=0.1),
        owner="process",
    ) as pipe:
        loader = pipe.loader(
            data, batch_size=32, num_workers=2, persistent_workers=True, ring_rows=4096
        )
        owner_io = f"/proc/{pipe._owner.process.pid}/io"
        for batch in loader:  # warm-up: imports, workers
            batch["inputs_embeds"].sum().backward()
            pipe.step()
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            dropped = True
        except OSError:
            dropped = False
        before, owner_before = field("/proc/self/io", "read_bytes:"), field(owner_io, "read_bytes:")
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        watch_opens(opened)
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
        for _ in range(2):
            for batch in loader:
                batch["inputs_embeds"].sum().backward()
                pipe.step()
        # a child reaped adds its reads to this process's (the lookahead's foresight child, one
        # an epoch, reads the dataset's copy and the code it runs): counted apart, in blocks of
        # 512 bytes, each child's rounded down
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - children
        read = field("/proc/self/io", "read_bytes:") - before - 512 * reaped if dropped else -1
        owner_read = field(owner_io, "read_bytes:") - owner_before
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
        files = table_files(folder, opened)
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)
        cache = pipe._owner.shared.block
        outside, cache_resident = resident(next(iter(cache.arrays.values())).ctypes.data)
        del loader
    print(outside, cache_resident, read, owner_read, len(files))
    print(f"table files: {files}; major faults while it trained: {faults}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
