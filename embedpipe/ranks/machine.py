"""The table's gradient averaged by the ranks of one machine through shared memory.

NOTE [ The gradient through shared memory ]
The ranks of a ``torchrun`` job that share one owner process (``owner="process"``:
``service/rank.py``) run on one machine, so averaging their gradient needs no socket. Each rank
writes its (ids, rows) into a shared block of its own; the ranks meet in the gradient's header
(an ``all_gather`` of one number each on embedpipe's gloo group, which a rank joins only after
writing); then each rank reads every rank's block and sums the rows, each times 1/N, in rank
order: the float operations of ``Shards.gradient``, in the same order, so the same bits.

Each rank has two blocks and writes them at alternate backward passes. A rank writes a block
again two passes later, after the header of the pass in between, which no rank joins before it
has read the block. A block has room for every row of the table (its ids, and its values at up
to 8 bytes each), but memory is taken only where it is written: the largest gradient the rank
wrote, twice.

The blocks are memfds (``cache/shm.py``: no name; the memory goes with the last process that
maps them), and each rank opens the others' through ``/proc/PID/fd/FD``, which the kernel allows
between processes of one user. If any rank cannot, every rank averages over gloo instead
(``Shards.gradient``): the same sums, through sockets.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..cache.shm import SharedBlock
from .shards import GRADIENT, Shards, average

#: Bytes a block keeps for each value of a row: room for any floating dtype of a gradient.
VALUE_BYTES = 8


class MachineGradient:
    """The gradient's average for ranks of one machine (see the NOTE); made by every rank."""

    def __init__(self, shards: Shards, blocks: list[list[SharedBlock]], dim: int) -> None:
        self.shards = shards
        self.blocks = blocks  # blocks[rank][pass % 2]
        self.dim = dim
        self.passes = 0

    @classmethod
    def make(cls, shards: Shards, num_rows: int, dim: int) -> MachineGradient | None:
        """Every rank's blocks, opened by every rank; None on every rank if a rank failed."""
        layout = {
            "ids": ((num_rows,), np.int64, 0),
            "rows": ((num_rows * dim * VALUE_BYTES,), np.uint8, 0),
        }
        try:
            mine = [SharedBlock(layout), SharedBlock(layout)]
            where = (os.getpid(), [block.fd for block in mine])
        except OSError:
            where = None
        every = shards.every(where, "sharing the gradient's memory")
        blocks: list[list[SharedBlock]] | None = None
        if all(w is not None for w in every):
            adopted = {name: (shape, dtype) for name, (shape, dtype, _) in layout.items()}
            try:
                blocks = [
                    mine
                    if rank == shards.rank
                    else [SharedBlock.adopt(adopted, _open(pid, fd)) for fd in fds]
                    for rank, (pid, fds) in enumerate(every)
                ]
            except OSError:
                blocks = None
        if not all(shards.every(blocks is not None, "opening the gradient's memory")):
            return None
        return cls(shards, blocks, dim)

    def gradient(
        self, step: int, generation: int, ids: torch.Tensor, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``Shards.gradient``: every rank's (ids, gradient), each gradient times 1/N and
        summed in rank order, over the union of the ranks' ids (sorted). Same on every rank."""
        shards, parity = self.shards, self.passes % 2
        self.passes += 1
        rows = grad.detach().to("cpu").contiguous()
        row_bytes = self.dim * rows.element_size()
        block = self.blocks[shards.rank][parity]
        block["ids"][: len(ids)] = ids.numpy()
        raw = rows.view(-1).view(torch.uint8).numpy()
        block["rows"][: len(raw)] = raw
        counts = shards._header(GRADIENT, step, generation, [len(ids)])[:, 0]  # all written
        every_id = np.concatenate([self.blocks[r][parity]["ids"][:c] for r, c in enumerate(counts)])
        every_grad = torch.cat(
            [
                torch.from_numpy(self.blocks[r][parity]["rows"][: c * row_bytes])
                .view(rows.dtype)
                .view(-1, self.dim)
                for r, c in enumerate(counts)
            ]
        )
        union = np.unique(every_id)
        total = average(union, every_id, every_grad, shards.size)
        return torch.from_numpy(union), total.to(grad.device)


def _open(pid: int, fd: int) -> int:
    """Another process's descriptor ``fd``, opened here (a process of the same user)."""
    return os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
