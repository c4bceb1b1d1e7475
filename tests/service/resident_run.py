"""Trains a table through an owner process with a cache of ``FRACTION`` of its rows, then
prints this process's resident bytes, the bytes it read from disk while it trained after the
page cache was dropped (-1 if it could not be; its reaped children's reads left out), and its
owner process's disk reads meanwhile.

Run as ``python -m tests.service.resident_run TABLE FRACTION`` (``test_service.py``).
"""

from __future__ import annotations

import os
import resource
import sys

import numpy as np
import torch

import embedpipe


def field(path: str, name: str) -> int:
    with open(path) as f:
        return next(int(line.split()[1]) for line in f if line.startswith(name))


def main(path: str, fraction: float) -> None:
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
        resident = field("/proc/self/status", "VmRSS:") * 1024
        del loader
    print(resident, read, owner_read)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
