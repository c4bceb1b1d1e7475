"""Shared memory beside an owner process's connection: the rows of claim replies and the
gradients of steps cross there, not through the socket (:class:`Transfer`).

NOTE [ Rows and gradients through shared memory ]
A claim's reply carries the rows steps changed since the lookup (often half of a batch's 1,000+
rows) and a step carries its (U, D) gradient: 3-4 MiB a batch each way at D = 768. Through a Unix
socket each costs two copies, and since the socket holds a few hundred KiB the sender and the
receiver take turns, on a machine whose cores the model, the workers and the owner share
(measured, 2 cores: 4-8 ms of the loop's critical path a batch). The training process makes one
block at the first request that needs it and sends its descriptor; then:

- a claim's reply rows: the owner writes them into ``reply`` and says how many; the training
  process copies them out while it still holds the connection (two threads may claim through
  one pipe). Requests on a connection are served one at a time, so the next reply cannot
  overwrite them first;
- a step's gradient: the training process writes it into one of two ``grad`` slots, in turn,
  and sends the slot's number; the owner's writeback computes the step from it in place. Slot
  ``s % 2`` is written for step ``s`` only once a reply said that step ``s - 2`` is computed
  (every reply of a claim says which step its rows hold; in exact mode one claim comes between
  two steps, so that is always known); otherwise, and for anything larger than the block, the
  bytes go through the socket as before.

Rows: :data:`ROWS` per array, fewer for wide rows (at most :data:`MOST_BYTES` each); pages the
rows never reach are never touched, so the memory used is what the batches need.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..cache.shm import SharedBlock

#: Rows of the reply array and of each gradient slot.
ROWS = 4096
#: The most bytes of each of the three arrays.
MOST_BYTES = 64 << 20
#: Gradient slots, written in turn.
SLOTS = 2


class Transfer:
    """The block of one connection (see the NOTE): made by the training process
    (:meth:`make`), adopted by the owner process (:meth:`adopt`)."""

    def __init__(self, block: SharedBlock) -> None:
        self.block = block
        self.reply = block["reply"]
        self.grad = block["grad"]
        self.rows = len(self.reply)
        #: (training process) the (generation, step) each gradient slot holds, and the last a
        #: reply said is computed: a load in between (a new generation) drained every step
        self.holds = [(-1, -1)] * SLOTS
        self.computed = (-1, -1)

    @classmethod
    def make(cls, dim: int, dtype: Any) -> Transfer:
        dtype = np.dtype(dtype)
        rows = max(1, min(ROWS, MOST_BYTES // (dim * dtype.itemsize)))
        return cls(
            SharedBlock({"reply": ((rows, dim), dtype, 0), "grad": ((SLOTS, rows, dim), dtype, 0)})
        )

    def layout(self) -> dict[str, Any]:
        return {name: (shape, dtype.str) for name, (shape, dtype) in self.block.layout.items()}

    @classmethod
    def adopt(cls, layout: dict[str, Any], fd: int) -> Transfer:
        return cls(SharedBlock.adopt(layout, fd))

    # ----------------------------------------------------------------- the owner process
    def put_reply(self, rows: np.ndarray, picked: np.ndarray | None = None) -> int:
        """Write a reply's rows (``rows[picked]``: gathered straight into the block); their
        number, or -1 if they do not fit (send them instead)."""
        n = len(rows) if picked is None else len(picked)
        if n > self.rows:
            return -1
        if picked is None:
            self.reply[:n] = rows
        else:
            np.take(rows, picked, axis=0, out=self.reply[:n])
        return n

    def gradient(self, slot: int, n: int) -> torch.Tensor:
        """The gradient the training process wrote into ``slot`` (a view: used in place)."""
        return torch.from_numpy(self.grad[slot, :n])

    # ----------------------------------------------------------------- the training process
    def take_reply(self, n: int, got: list = (), into: np.ndarray | None = None) -> np.ndarray:
        """A copy of the reply's ``n`` rows (before the next request); with ``into`` and the
        positions they go to (``got[0]``), copied there."""
        if into is None or not got:
            return self.reply[:n].copy()
        into[got[0]] = self.reply[:n]
        return into

    def put_gradient(self, step: int, generation: int, grad: torch.Tensor) -> int:
        """Write step ``step``'s gradient into its slot; the slot, or -1 (send it instead):
        too large, or the step that slot held is not known to be computed yet."""
        slot = step % SLOTS
        held_generation, held = self.holds[slot]
        used = held < 0 or held_generation != generation or self.computed >= (generation, held)
        if len(grad) > self.rows or not used:
            return -1
        torch.from_numpy(self.grad[slot, : len(grad)]).copy_(grad.detach())
        self.holds[slot] = (generation, step)
        return slot

    def replied(self, step: int, generation: int) -> None:
        """A reply said that the owner's rows hold step ``step``: its gradient is used."""
        self.computed = max(self.computed, (generation, step))
