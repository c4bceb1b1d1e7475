"""A rank's side of the owner process that the ranks of a ``torchrun`` job on one machine share
(``job.py``): :class:`RankOwner`.

``EmbeddingPipe(..., owner="process")`` made by every rank of a process group: rank 0 starts
the owner process (lent its writer lock) with a socket the other ranks connect to, tells them
where it is (over the job's gloo group, as every exchange between ranks goes), and they join
it. From then on each rank talks to the owner as one training process does (``client.py``),
with two differences:

- **backward** averages the table's gradient over the ranks as DDP averages a replicated
  ``nn.Embedding``'s (each gradient times 1/N, summed in rank order), through shared memory
  (``ranks/machine.py``), so ``pipe.parameter.grad``, a global norm and the optimizer step are
  the same on every rank;
- **the step** is sent by rank 0 alone; the other ranks count it, and their requests wait in
  the owner for rank 0's step (``after``).

Every rank's DataLoader workers read the one shared cache and the gradient goes through shared
memory: no rank sends another rows.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

import torch

from ..errors import DistributedNotSupportedError
from ..ranks.machine import MachineGradient
from ..ranks.shard_owner import writer_on_rank_0
from ..ranks.shards import Shards
from ..store.table import Table
from .channel import Channel
from .client import RemoteOwner
from .reach import start_owner


class RankOwner(RemoteOwner):
    """:class:`RemoteOwner` for a rank of ``shards``' group; the other arguments as its."""

    def __init__(self, shards: Shards, *args: Any, **kwargs: Any) -> None:
        self.shards = shards
        self.machine: MachineGradient | None = None  # the ranks' shared gradient memory
        super().__init__(*args, **kwargs)

    def _open(self, opening: dict[str, Any]) -> Any:
        """Rank 0 starts the owner and opens the table; then the others join it."""
        shards = self.shards
        error: BaseException | None = None
        reply, address = None, None
        folder = tempfile.mkdtemp(prefix="embedpipe-") if shards.leader else None
        try:
            if shards.leader:
                try:
                    address = os.path.join(folder, "owner.sock")
                    listener = _listen(address, shards.size)
                    try:
                        self.process, channel = start_owner(
                            opening["lock_fd"], "job", listener.fileno(), shards.size
                        )
                    finally:
                        listener.close()
                    self._connected(channel)
                    reply = self._request(opening)
                except BaseException as e:
                    error = e
            here = (address, socket.gethostname())
            address, machine = shards.agree(error, "starting the owner process", here)
            if not shards.leader:
                try:
                    if machine != socket.gethostname():
                        raise DistributedNotSupportedError(
                            f"rank {shards.rank} runs on {socket.gethostname()}, rank 0 on "
                            f"{machine}: owner='process' serves the ranks of one machine; "
                            "use owner='thread' (each rank owns a shard of the table)"
                        )
                    self._connected(Channel.connect(address))
                    reply = self._request({**opening, "op": "join", "rank": shards.rank})
                except BaseException as e:
                    error = e
            shards.agree(error, "joining the owner process of the ranks")
            # NOTE [ The gradient through shared memory ] in ``ranks/machine.py``
            self.machine = MachineGradient.make(shards, self.table.num_rows, self.table.dim)
        except BaseException:
            shards.close()
            raise
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)  # every rank joined, or none will
        return reply

    def _describe_owner(self) -> str:
        return (
            f"the owner process of table {self.table.path} that the {self.shards.size} ranks "
            f"share (pid {self.owner_pid}, started by rank 0)"
        )

    def _add_gradient(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Every rank's gradient, averaged as DDP does: the same pending gradient everywhere."""
        exchange = self.machine if self.machine is not None else self.shards
        union, total = exchange.gradient(self.submitted, self.generation, unique_ids, grad)
        super()._add_gradient(union, total)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), **self.shards.bytes}  # this rank's exchanges' bytes

    def submit(self, ids: torch.Tensor, grad: torch.Tensor, lr: float | None) -> None:
        if self.shards.leader:
            super().submit(ids, grad, lr)
        else:
            self.submitted += 1  # rank 0 sent the same step

    def close(self, raise_errors: bool = True) -> None:
        try:
            super().close(raise_errors)
        finally:
            if self.closed:
                self.machine = None  # its blocks: unmapped when collected
                self.shards.close()


def open_shared(table: Table | str | os.PathLike[str], shards: Shards) -> tuple[Table, bool]:
    """This rank's handle on the table its ranks' owner process trains: rank 0 opens it to
    write (its lock goes to the owner process) and commits what it changed (an offload's
    metadata), then the others open it to read, at that checkpoint; an error on any rank is
    raised on every rank. Returns the handle and whether the pipe closes it."""
    owns_table = not isinstance(table, Table)
    opened: Table | None = None if owns_table else table
    error: BaseException | None = None
    try:
        try:
            if shards.leader:
                opened = writer_on_rank_0(table)
                if opened._modified:  # the other ranks read the checkpoint: make it this
                    opened._commit(opened.step)
        except BaseException as e:
            error = e
        shards.agree(error, "opening the table")
        try:
            if not shards.leader:
                if opened is None:
                    opened = Table.open(table, "r")
                else:
                    opened._reopen(live=False)  # the checkpoint rank 0 just committed
        except BaseException as e:
            error = e
        shards.agree(error, "opening the table")
    except BaseException:
        if owns_table and opened is not None:
            opened.close()
        shards.close()
        raise
    return opened, owns_table


def _listen(path: str, ranks: int) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # this user's only: ``path`` is in a folder of mode 0700 (``mkdtemp``), and the owner
    # checks each connection's user; no umask, which would hold for every thread of the process
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(ranks)
    return listener
