"""A rank's side of the owner processes that the ranks of a ``torchrun`` job share, one a
machine (``job.py``): :class:`RankOwner`.

``EmbeddingPipe(..., owner="process")`` made by every rank of a process group: the first rank
of each machine starts the machine's owner process with a socket the machine's other ranks
connect to, tells them where it is (over the job's gloo group, as every exchange between ranks
goes), and they join it. From then on each rank talks to its owner as one training process
does (``client.py``), with two differences:

- **backward** averages the table's gradient over the ranks as DDP averages a replicated
  ``nn.Embedding``'s (each gradient times 1/N, summed in rank order), so
  ``pipe.parameter.grad``, a global norm and the optimizer step are the same on every rank: on
  one machine through shared memory (``ranks/machine.py``), so no rank sends another rows;
- **the step** is sent by the first rank of each machine; the others count it, and their
  requests wait in the owner for that step (``after``).

NOTE [ A shard a machine ]
With ranks on several machines (a machine: a host, and torchrun's node rank), the table is
split by row range, at chunk boundaries, into one shard a machine, and each machine's owner
process is the only owner of its shard's rows (its cache, optimizer state, writeback and chunk
files), as a rank is with ``owner="thread"`` (``ranks/shards.py``, NOTE [ One table over N
ranks ]); rank 0's owner holds the writer lock. The ranks meet as the row-sharded ranks do:

- **rows**: at the read of a batch, each rank asks one rank of each other machine (at its own
  place on its machine) for the batch's rows of that machine's shard; that rank asks its owner
  process (``rows``: after the steps so far, as a hand-off);
- **gradient**: every rank's, averaged over every rank (``Shards.gradient``: the ids to every
  rank, the rows by a gather or a sparse all-reduce); every machine's first rank sends the
  step's rows of its shard;
- **checkpoints**: every owner writes its rows (``flush``), all agree, rank 0's owner commits
  (``checkpoint``, or ``save`` into a folder), all agree; an owner never commits on its own
  (``MachineShardOwner``), so a failure leaves the last commit of every shard;
- **loading a snapshot**: every other owner applies its queued steps and drops its cache
  (``drain``), all agree, rank 0's owner restores every shard's files and commits them, all
  agree, the others read the files again (``reopened``).

Each exchange starts with a header every rank contributes to, so ranks out of step raise
together; an owner that dies makes its machine's ranks raise ``OwnerDiedError``, and the other
machines' ranks ``PeerLostError`` when those ranks' connections close.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import tempfile
from typing import Any

import numpy as np
import torch

from ..errors import (
    DistributedNotSupportedError,
    OwnerDiedError,
    PeerLostError,
    ShardMismatchError,
)
from ..ranks.ddp import SyncedGradient
from ..ranks.machine import MachineGradient
from ..ranks.shard_owner import fetch_remote, writer_on_rank_0
from ..ranks.shards import CLOSE, COMMIT, FLUSH, LOAD, Shards
from ..store.checkpoints import Checkpoint
from ..store.table import Table
from ..worker.batch import EmbeddedBatch
from .channel import Channel
from .client import RemoteOwner
from .job import pipe_facts
from .reach import connect, start_owner


class RankOwner(RemoteOwner):
    """:class:`RemoteOwner` for a rank of ``shards``' group (grouped ``by_machine``); the other
    arguments as its."""

    def __init__(self, shards: Shards, *args: Any, **kwargs: Any) -> None:
        self.shards = shards
        self._synced: SyncedGradient | None = None  # (made at the first backward)
        #: Several machines, each owner process the owner of its machine's shard (NOTE [ A
        #: shard a machine ]); else one owner process for every rank, and shared gradient memory
        self.several = len(shards.machines) > 1
        self.machine: MachineGradient | None = None
        self.remote_rows = 0  # rows this rank's batches got from other machines
        self.met = False  # the ranks met at close
        super().__init__(*args, **kwargs)
        self.owned = shards.owned
        #: (steps submitted, generation) when every machine's owner last wrote its rows
        self.written = (self.submitted, self.generation)
        if shards.first_of_machine and len(shards.machines[shards.shard]) > 1:
            shards.at_header = self._at_header  # NOTE [ Ranks out of step in an owner process ]

    def _request(self, message: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        message.setdefault("loaded", self.generation)  # first: the steps count from its load
        message.setdefault("after", self.submitted)  # then: a rank that steps meanwhile has
        message.setdefault("headers", self.shards.headers)  # entered a header more (NOTE)
        return super()._request(message, *args, **kwargs)

    def _at_header(self, headers: int, step: int) -> None:
        """This rank sends its machine's steps: it tells its owner process that it enters a
        header, so that a rank waiting there for a step it will not send raises."""
        if not self.closed:
            self._request({"op": "header", "headers": headers, "step": step}, reply=False)

    def _open(self, opening: dict[str, Any]) -> Any:
        """The first rank of each machine starts the machine's owner process: rank 0 first,
        lent the writer lock (its owner opens and prepares the table), then the other machines'
        (on their shards); then every other rank joins its machine's."""
        shards = self.shards
        mine = pipe_facts(opening)  # every rank's pipe as rank 0's, before anything starts
        expected = shards.agree(None, "checking the pipes agree", mine)
        shards.agree(
            None
            if mine == expected
            else ValueError(
                f"rank {shards.rank} made its pipe with {mine}, rank 0 with {expected} (table, "
                "cache_rows, policy, optimizer, keep, consistency, padding_idx, check_finite): "
                "make the same pipe on every rank"
            ),
            "checking the pipes agree",
        )
        if self.several:
            opening = {**opening, "shard": shards.owned}
        first = shards.first_of_machine
        error: BaseException | None = None
        reply, address = None, None
        folder = tempfile.mkdtemp(prefix="embedpipe-") if first and self.address is None else None
        try:
            for rank_0 in (True, False):
                if first and shards.leader == rank_0:
                    try:
                        reply, address = self._start(opening, folder)
                    except BaseException as e:
                        error = e
                shards.agree(error, "starting the owner processes")
            addresses = shards.every(address, "finding the owner processes")
            if not first:
                try:
                    found = addresses[shards.machines[shards.shard][0]]
                    if self.address is None:  # the owner process the machine's first rank started
                        self._connected(Channel.connect(found))
                    else:  # the service, and the job there by its name
                        self._connected(connect(self.address, self.table.path))
                    join = {"op": "join", "rank": shards.rank, "job": found}
                    reply = self._request({**opening, **join})
                except BaseException as e:
                    error = e
            shards.agree(error, "joining the owner processes")
            if not self.several:  # NOTE [ The gradient through shared memory ]
                self.machine = MachineGradient.make(shards, self.table.num_rows, self.table.dim)
        except BaseException:
            shards.close()
            raise
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)  # every rank joined, or none will
        return reply

    def _start(self, opening: dict[str, Any], folder: str | None) -> tuple[Any, str]:
        """This machine's owner process, listening in ``folder`` for the machine's other ranks;
        the table opened there. Returns the reply and the address. With a service
        (``embedpipe serve``): the job opened there for its ranks on this machine, and the job's
        name, by which they join it."""
        ranks = len(self.shards.machines[self.shards.shard])
        if self.address is not None:
            token = secrets.token_hex(8)
            self._connected(connect(self.address, self.table.path))
            return self._request({**opening, "ranks": ranks, "job": token}), token
        address = os.path.join(folder, "owner.sock")
        listener = _listen(address, ranks)
        try:
            self.process, channel = start_owner(opening["lock_fd"], "job", listener.fileno(), ranks)
        finally:
            listener.close()
        self._connected(channel)
        return self._request(opening), address

    def _describe_owner(self) -> str:
        shards = self.shards
        ranks = shards.machines[shards.shard]
        rows = f", rows {shards.owned[0]:,} to {shards.owned[1]:,}," if self.several else ""
        if self.address is not None:
            return (
                f"the table service at {self.address} (table {self.table.path}{rows} pid "
                f"{self.owner_pid}) that the {len(ranks)} ranks of this machine share"
            )
        return (
            f"the owner process of table {self.table.path}{rows} that the {len(ranks)} ranks of "
            f"this machine share (pid {self.owner_pid}, started by rank {ranks[0]})"
        )

    # ----------------------------------------------------------------------------- the loop
    def refresh(self, batch: EmbeddedBatch) -> None:
        """This machine's rows as one owner's; then, with several machines, the batch's rows
        of other machines' shards, from them, unless fetched since the last step
        (``Shards.rows``: every rank reads its batch at the same point of the loop, so every
        rank takes part). In that order: after a load this owner's cache takes every row for
        changed, the other shards' too, and re-reads them from the files, which lack the rows
        other owners cache; the fetch then puts theirs in their places."""
        super().refresh(batch)
        if self.several:
            self.remote_rows += fetch_remote(self, batch, self.submitted, self._serve)

    def relookup(self, batch: EmbeddedBatch, ids: torch.Tensor) -> None:
        if self.several:
            raise DistributedNotSupportedError(
                "a batch's ids were edited in place after its rows were looked up; a table "
                "sharded over machines cannot look up the new ids alone (every rank would have "
                "to join): make the edit in the dataset or the collate_fn, which run before "
                "the lookup"
            )
        super().relookup(batch, ids)

    def _serve(self, ids: np.ndarray) -> np.ndarray:
        """Rows of this machine's shard for ranks of other machines, after the steps so far."""
        _, (rows,), _ = self._request({"op": "rows"}, (ids,))
        return rows

    def check_step(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        super().check_step(ids, grad)
        if self._synced is not None:
            self._synced.check_step()

    def _add_gradient(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Every rank's gradient, averaged as DDP averages .grad (NOTE [ The gradient averaged
        as DDP averages .grad ] in ``ranks/ddp.py``): the same pending gradient everywhere."""
        exchange = self.machine if self.machine is not None else self.shards
        if self._synced is None:
            self._synced = SyncedGradient(self.gradient)
        self._synced.add(
            unique_ids,
            grad,
            lambda ids, rows: exchange.gradient(self.submitted, self.generation, ids, rows),
        )

    def submit(self, ids: torch.Tensor, grad: torch.Tensor, lr: float | None) -> None:
        """The first rank of each machine sends the step's rows of its shard; the others count
        it (their requests wait in the owner for it)."""
        if not self.shards.first_of_machine:
            self.submitted += 1
            return
        if self.several:
            mine = torch.from_numpy(self.shards.owns(ids.numpy()))
            ids, grad = ids[mine], grad[mine.to(grad.device)]
        super().submit(ids, grad, lr)

    def stats(self) -> dict[str, int]:
        """The owner process's counts (its machine's), and this rank's exchanges'."""
        return {**super().stats(), **self.shards.bytes, "remote_rows": self.remote_rows}

    # ----------------------------------------------------------------------------- the table
    def _write_rows(self, what: str) -> None:
        """Every machine's owner applied its queued steps and wrote its rows to the live files,
        or an error on every rank."""
        error: BaseException | None = None
        if self.shards.first_of_machine:
            try:
                self._call("flush")
            except BaseException as e:
                error = e
        self.shards.agree(error, what)
        self.written = (self.submitted, self.generation)

    def _commit_machines(self, doing: int, name: str, *args: Any) -> Checkpoint:
        """One commit for every machine's shard: every owner writes its rows, all agree, then
        rank 0's owner (which holds the lock) commits (``name``: ``checkpoint``, or ``save``
        into a folder), all agree."""
        self.check_open()
        self.shards.begin(doing, self.submitted, self.generation)
        self._write_rows("writing its rows for a checkpoint")
        error: BaseException | None = None
        checkpoint = None
        if self.shards.leader:
            try:
                checkpoint = self._call(name, *args)
            except BaseException as e:
                error = e
        checkpoint = self.shards.agree(error, "committing the checkpoint", checkpoint)
        return self._committed(checkpoint)

    def checkpoint(self) -> Checkpoint:
        if not self.several:
            return super().checkpoint()
        return self._commit_machines(COMMIT, "checkpoint")

    def save(self, folder: str) -> Checkpoint:
        if not self.several:
            return super().save(folder)
        return self._commit_machines(COMMIT, "save", folder)

    def flush(self) -> None:
        if not self.several:
            return super().flush()
        self.check_open()
        self.shards.begin(FLUSH, self.submitted, self.generation)
        self._write_rows("writing its rows (flush)")

    def before_read(self) -> None:
        """As ``ShardOwner.before_read``: with several machines the files hold every shard's
        rows only when no step was submitted since every owner wrote its rows."""
        if not self.several:
            return super().before_read()
        if self.written != (self.submitted, self.generation):
            raise DistributedNotSupportedError(
                f"the table {self.table.path} is sharded over {len(self.shards.machines)} "
                "machines and has stepped since their owner processes last wrote their rows, "
                "so its files lack rows they hold in their caches: call pipe.flush() on every "
                "rank first (or read a checkpoint: Table.open(path) after pipe.checkpoint())"
            )

    def load(self, source: Table) -> None:
        """Several machines: every other machine's owner applies its queued steps and drops its
        cache, all agree, rank 0's owner restores every shard's files from the snapshot and
        commits it, all agree, then the others read the files again (as ``ShardOwner._restore``)."""
        if not self.several:
            return super().load(source)
        self.check_open()
        shards = self.shards
        shards.begin(LOAD, self.submitted, self.generation)
        other = shards.first_of_machine and not shards.leader
        error: BaseException | None = None
        if other:
            try:
                self._call("drain")
            except BaseException as e:
                error = e
        shards.agree(error, f"stopping its writes to load the snapshot {source.path}")
        loaded = None
        if shards.leader:
            try:
                loaded, _, _ = self._request({"op": "load", "folder": source.path})
            except BaseException as e:
                error = e
        generation, step = shards.agree(error, f"loading the snapshot {source.path}", loaded)
        if other:
            try:
                self._call("reopened", step)  # (its steps counted as before the load)
            except BaseException as e:
                error = e
        shards.agree(error, f"opening the files of the snapshot {source.path}")
        self.generation, self.submitted = generation, step
        self.written = (self.submitted, self.generation)  # the files are the snapshot
        self._committed(None)  # this rank's handle: the table's step, its checkpoints

    def close(self, raise_errors: bool = True) -> None:
        """The ranks meet first, so that ranks out of step raise where one would wait for good
        in its owner process for another that waits for it in an exchange; several machines:
        one last commit of every shard together (or none: the owners never commit on their
        own). Then each owner process is closed."""
        if not self.closed and self.gradient is not None:
            self.gradient.close(stacklevel=5)  # (its warning at the caller of pipe.close)
        if not self.closed and self.shards.lost is None and not self.met:
            try:
                self._meet_at_close()
            except OwnerDiedError:
                self.machine = None
                self.shards.close()
                raise
        if not self.closed and self.shards.lost is not None:
            self._leave()
            if raise_errors:
                raise self.shards.lost
            return
        error: BaseException | None = None
        if self.several and not self.closed and self.written != (None, None):
            try:
                self._commit_machines(CLOSE, "checkpoint")
            except BaseException as e:
                error = e
            self.written = (None, None)  # a close() again does not commit again
        try:
            super().close(raise_errors)
        finally:
            if self.closed:
                self.machine = None  # its blocks: unmapped when collected
                self.shards.close()
        if error is not None and raise_errors:
            raise error

    def _meet_at_close(self) -> None:
        """The close's header (``shards.lost`` when the ranks are out of step). Every rank
        first tells its owner process that it closes (``OwnerDiedError`` if it is gone): from
        the rank that sends the machine's steps, that no more come, so a rank waiting there
        for one raises, and meets this one here."""
        self._request({"op": "closing"}, reply=False)
        if self.several and self.written != (None, None):
            return  # the last commit begins with the header
        self.met = True  # once: a close() again (its request failed) does not meet again
        with contextlib.suppress(PeerLostError, ShardMismatchError):  # (kept in shards.lost)
            self.shards.begin(CLOSE, self.submitted, self.generation)

    def _leave(self) -> None:
        """This rank's exchanges failed (a peer lost, ranks out of step, its rows not served):
        it meets the other ranks no more, where its machine's others may wait for it in a
        collective (a close meeting with them would wait as long). It leaves its owner process
        without a close: the owner ends (a rank gone), the table stays at its last checkpoint,
        and the other ranks raise as this rank's connections end."""
        self.closed = True
        if self.stream is not None:
            self.end_stream(self.stream)
        if self.gradient is not None:
            self.gradient.close(stacklevel=6)
        self._stop()
        self._take_table_back(died=True)
        self.machine = None
        self.shards.close()


def open_shared(
    table: Table | str | os.PathLike[str], shards: Shards, served: bool = False
) -> tuple[Table, bool]:
    """This rank's handle on the table its ranks' owner process trains: rank 0 opens it to
    write (its lock goes to the owner process) and commits what it changed (an offload's
    metadata), then the others open it to read, at that checkpoint; ``served`` (a service
    holds the lock): every rank opens it to read. An error on any rank is raised on every rank.
    Returns the handle and whether the pipe closes it."""
    owns_table = not isinstance(table, Table)
    opened: Table | None = None if owns_table else table
    error: BaseException | None = None
    try:
        try:
            if served and opened is None:
                opened = Table.open(table, "r")
            elif shards.leader and not served:
                opened = writer_on_rank_0(table)
                if opened._modified:  # the other ranks read the checkpoint: make it this
                    opened._commit(opened.step)
        except BaseException as e:
            error = e
        shards.agree(error, "opening the table")
        try:
            if not shards.leader and not served:
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
