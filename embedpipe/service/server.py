"""The owner process: a table's :class:`~embedpipe.owner.owner.Owner`, served to one training
process over a :class:`~embedpipe.service.channel.Channel`.

The training process starts it (``main`` with ``FD PARENT``, the socket's
other end as ``FD``) and sends what the owner needs to open the table; from then on this process
is the table's only writer: it holds the writer lock, the cache and its policy, the optimizer
state, the writeback thread and every read and write of the table's files. The training process
keeps the pending gradient (``pipe.parameter``) and builds ``inputs_embeds``; DataLoader workers
read the shared cache directly, as they do from an owner thread.

Requests are served one at a time, in the order they were sent, so a step is applied after the
hand-offs before it and a hand-off sees the steps before it, as in one process. A hand-off's
reply goes out as soon as its rows are final; its admission into the cache (evictions, their
writes) runs after, while the training process goes on (``Owner.final_rows``). An error that
comes after the reply, or of a request that has none (a step), is the reply to the next request.

NOTE [ Corrections, not rows ]
A batch's unique rows are several MB (2,300 rows of 768 floats: 7 MB); sending them back and
forth would cost two more copies of them per batch than the owner thread pays. So the training
process takes the rows out of the workers' ring slot itself, as the owner thread does, and says
whether the slot still holds them (``have``). This process copies from the slot only the rows
the cache lacks and the workers read (the ones it may admit, and stage for the step), re-reads
the rows steps changed since the lookup, and sends back only those (positions and rows, gathered
straight into the transfer block), with the misses the workers left to it (while a lookahead
stream reads them: ``lookahead.py``). It sends every row only when it read them all itself: the
slot was overwritten, or the lookup left the rows to it (``num_workers=0``).

The training process copies from the slot only the rows the reply did not send, after the reply
(straight into the batch's array, as it copies the reply's out of the block): one copy of each
row where it made two of most (measured beside a simulated accelerator, D = 768, 5% cache: the
loop's wait in ``next()`` 1 ms shorter, 9.2-9.5 against 10.2-10.6 ms). The slot is still the
batch's then, as at the request (NOTE [ Ring slots ] in ``ring.py``: a worker comes back to it
only after the claim); if it was overwritten all the same (an order the DataLoader does not
promise), the training process asks for every row again (``relookup``), as a batch whose ids
were edited does.

Warnings raised here (a failed write ahead of need) go back with the next reply and are raised
again in the training process.

This process ends with its training process however that ends: the connection's end (EOF) or
a parent that is no longer the one that started it ends it at once, without a commit: the table
stays at its last checkpoint, as after a crash of one process.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import torch

from ..cache.policy import make_policy
from ..cache.ring import BatchRing
from ..cache.shm import SharedBlock
from ..owner.foresee import IdsReader
from ..owner.lookahead import Stream
from ..owner.owner import Owner
from ..owner.reads import ReadAhead, read_ahead
from ..store.lock import WriterLock
from ..store.mapped import map_writes
from ..store.table import Table
from ..worker.looked_up import LookedUp
from .channel import NO_REPLY, Channel, ChannelClosed
from .transfer import Transfer

#: How often the owner process looks whether its training process is still its parent.
PARENT_POLL_SECONDS = 0.2


class ServedOwner(Owner):
    """An owner whose training process says, with each hand-off, whether the table trains now
    (its ``pipe.parameter`` requires grad)."""

    trains_now = True
    CALLS: tuple[str, ...] = ()


class MachineShardOwner(ServedOwner):
    """The owner process of one machine's shard of a table trained by the ranks of several
    machines (``service/rank.py``): the ranks commit every checkpoint together, rank 0's owner
    process for them all, so this one never commits on its own. Closing it releases the table
    as it is: at the ranks' last commit, or ahead of it after a failure (the table reopens at
    that commit)."""

    #: What the ranks ask of it by name (``Server.do_call``), besides an owner's own.
    CALLS = ("drain", "reopened")

    def _finish_close(self, error: BaseException | None, hung: bool) -> BaseException | None:
        self.table._release_claim()
        if self.owns_table:  # (a service's table: its lock stays with the service)
            self.table._abandon()  # the lock, without a commit (rank 0's owner holds it)
        return error

    def drain(self) -> None:
        """Before rank 0's owner restores a snapshot into every shard's files: apply what is
        queued and drop the cache's rows unwritten, as a load does first; nothing is written
        from here until :meth:`reopened` (the ranks send no step in between)."""
        self.check_open()
        self.cache._check()
        if self.writeback is not None:
            self.writeback.wait()
        with self.lock, self.cache._guard("loading a snapshot"):
            self.cache.reset()
            # untrusted until every shard's files are the snapshot's: if the load fails, no
            # commit takes this shard's files without the rows just dropped
            self.cache._broken = "loading a snapshot was interrupted"

    def reopened(self, step: int) -> tuple[int, int]:
        """Rank 0's owner restored the snapshot of ``step`` and committed it: read the table's
        files again and go on from that step, as a load does last."""
        with self.lock:
            self.cache._broken = None  # (``drain``)
            self.table._meta = Table._reader(self.table.path, self.table.path, "r+")._meta
            self.table._open_root(self.table.path)
            if self.writeback is not None:
                self.writeback.restart_at(step)
            self.shared.publish(self.cache.clock)
            self.generation += 1
        return self.generation, self.applied_step


class Server:
    """Serves one training process's requests until it closes the pipe (or is gone)."""

    def __init__(self, channel: Channel, lent: dict[int, int] | None = None) -> None:
        self.channel = channel
        self.lent = lent or {}  # the training process's descriptor numbers to this process's
        self.owner: ServedOwner | None = None
        self.rings: dict[int, BatchRing] = {}
        self.later: BaseException | None = None  # the error of a request already answered
        self.transfer: Transfer | None = None  # rows and gradients in shared memory
        self.ahead: ReadAhead | None = None  # the next claim's rows, read before it
        self.missed = 0  # such reads in a row that their claim could not use (this stream's)
        self.draws: list[int] = []  # the stream's draws told before a claim, taken after it
        self.warned: list[tuple[str, str]] = []
        self.done = False

    # ----------------------------------------------------------------------------- the loop
    def run(self, first: tuple[dict[str, Any], list, list] | None = None) -> None:
        """Serve requests until the training process closes the pipe; ``first``: its first
        request, already received (a service reads it to know what the connection is)."""
        warnings.showwarning = self._keep_warning
        while not self.done:
            message, arrays, fds = first if first is not None else self.channel.receive()
            first = None
            for ring in message.pop("drop_rings", ()):
                self.rings.pop(ring, None)
            op = message.pop("op", None)
            try:
                if self.later is not None and op not in NO_REPLY and op != "close":
                    error, self.later = self.later, None
                    raise error
                self.handle(op, message, arrays, fds)
            except (ChannelClosed, KeyboardInterrupt):  # gone; or a service told to stop
                raise
            except BaseException as e:  # carried to the training process
                for fd in fds:  # descriptors no handler took
                    with contextlib.suppress(OSError):
                        os.close(fd)
                if op in NO_REPLY:  # no reply to give it to: the next request's
                    self.later = self.later or e
                else:
                    self.reply_error(e)

    def handle(self, op: str, message: dict[str, Any], arrays: list, fds: list) -> None:
        if self.draws and op not in ("claim", "drawn"):
            self.take_draws()
        getattr(self, f"do_{op}")(message, arrays, fds)

    def reply(self, *values: Any, arrays: tuple[np.ndarray, ...] = ()) -> None:
        warned, self.warned = self.warned, []
        self.channel.send({"ok": values, "warnings": warned}, arrays)

    def reply_error(self, error: BaseException, **more: Any) -> None:
        warned, self.warned = self.warned, []
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:  # it would not cross as it is: its text
            error = RuntimeError(f"{type(error).__name__}: {error}")
        self.channel.send({"error": error, "warnings": warned, **more})

    def _keep_warning(self, message: Any, category: type, *rest: Any, **kw: Any) -> None:
        self.warned.append((category.__name__, str(message)))

    # ----------------------------------------------------------------------------- requests
    def open_table(self, m: dict[str, Any]) -> tuple[Table, bool]:
        """The table the training process asked for, and whether the owner closes it."""
        if m["optimizer"] is None:  # frozen: the rows the training process's handle reads
            return Table._reader(m["path"], m["root"]), True
        if m.get("shard") is not None and m["lock_fd"] is None:  # rank 0's owner holds the lock
            return Table._reader(m["path"], m["path"], "r+"), True
        if m["lock_fd"] is not None:  # the training process's Table lends its lock
            fd = self.lent[m["lock_fd"]] if self.lent else m["lock_fd"]  # (a fork's numbers)
            return Table(m["path"], "r+", _lock=WriterLock.borrowed(m["path"], fd)), True
        return Table.open(m["path"], "r+"), True

    def do_open(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        optimizer = m["optimizer"]
        table, owns_table = self.open_table(m)
        shard = m.get("shard")  # a machine's rows of a table sharded over machines
        try:
            if optimizer is not None:
                if table._lock is not None:
                    table._claim(m["description"])
                    table._prepare(optimizer, m["keep"])
                else:  # a machine's shard, without the lock: rank 0's owner prepared the table
                    table._owner = m["description"]
                if shard is None:  # (a machine's shard writes as a rank's: NOTE in mapped.py)
                    map_writes(table)  # this process alone grows by what it maps
            policy = make_policy(m["policy"], m["cache_rows"], table.num_rows, m["lookahead"])
            kind = ServedOwner if shard is None else MachineShardOwner
            self.owner = kind(table, policy, optimizer, m["options"], owns_table=owns_table)
            if shard is not None:
                self.owner.owned = tuple(shard)
        except BaseException:
            table._release_claim()
            if owns_table:
                table.close()
            raise
        if optimizer is not None:
            table._reads_after(self.owner.before_read)
        self.reply_opened()

    def reply_opened(self) -> None:
        """The owner's step, this process's pid, and the cache's block (its descriptor)."""
        block = self.owner.shared.block
        layout = {name: (shape, dtype.str) for name, (shape, dtype) in block.layout.items()}
        self.channel.send(
            {"ok": (self.owner.applied_step, os.getpid(), layout), "warnings": []},
            fds=(block.fd,),
        )

    def do_ring(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        ring = BatchRing.__new__(BatchRing)
        block = SharedBlock.adopt(m["layout"], fds[0])
        fds.clear()  # the block has it now
        ring.__setstate__(
            {"depth": m["depth"], "rows_per_slot": m["rows_per_slot"], "block": block}
        )
        self.rings[m["ring"]] = ring
        self.reply()

    def do_transfer(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """The training process's block for reply rows and gradients (``transfer.py``)."""
        self.transfer = Transfer.adopt(m["layout"], fds[0])
        fds.clear()  # the block has it now
        self.reply()

    def do_claim(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """A batch's claim: the training process takes the others out of the ring (``have``:
        the slot holds them); this process reads from the slot only the rows the cache lacks
        (to admit them), and sends back only the rows it re-read (NOTE [ Corrections, not
        rows ])."""
        owner = self.owner
        owner.trains_now = m["trains_now"]
        ring = self.rings.get(m["ring"])
        unique_ids = arrays[0]
        stream = owner.stream
        if m["foreseen"] and stream is not None:  # a batch of the loader whose order it sees
            stream.claim(unique_ids)
        blind = m["foreseen"] and stream is not None and stream.blind and (stream.failure or True)
        deferred = arrays[2] if len(arrays) > 2 else None
        ahead, self.ahead = self.ahead, None  # NOTE [ A hand-off read ahead ] in reads.py
        if ahead is not None:
            serves = m["have"] and ahead.serves(unique_ids, owner.generation)
            self.missed = 0 if serves else self.missed + 1
            ahead = ahead if serves else None
        item = LookedUp({}, unique_ids, unique_ids, m["slot"], m["tag"], None, m["lookup_step"],
                        m["hits"], m["misses"], deferred)  # fmt: skip
        rows = arrays[1] if arrays[1].ndim == 2 else None  # rows that did not fit the ring
        if ahead is None and rows is None and m["have"] and item.slot >= 0 and ring is not None:
            lacked = owner.shared.slot_of[unique_ids] < 0
            if deferred is not None:
                lacked[deferred] = False  # not in the slot: this process reads them
            lacked = np.flatnonzero(lacked)
            rows = ring.read_some(item.slot, item.tag, len(unique_ids), lacked)  # None: overwritten
        answered = False

        def deliver(final: np.ndarray, stale: np.ndarray | None, step: int, tick: int) -> None:
            nonlocal answered
            every = stale is None or not m["have"]
            if not every and deferred is not None and len(deferred):
                stale = np.union1d(stale, deferred)  # and the misses the workers left to it
            picked = None if every else stale
            # NOTE [ Rows and gradients through shared memory ]: the rows there if they fit
            shared = self.transfer.put_reply(final, picked) if self.transfer is not None else -1
            sent = () if shared >= 0 else (final if every else final[stale],)
            if not every:
                sent = (stale, *sent)
            self.reply(step, tick, owner.generation, blind, every, shared, arrays=sent)
            answered = True

        try:
            owner.final_rows(item, rows, deliver, ahead)
        except BaseException as e:
            if not answered or not isinstance(e, Exception):  # a service told to stop: now
                raise
            self.later = e  # the admission after the reply failed: say it at the next request
            return
        self.take_draws()
        if m["foreseen"] and m["have"] and item.slot >= 0:  # the next batch's, while it computes
            self.ahead = read_ahead(owner, self.missed)

    def do_stream(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """A loader's epoch foreseen (NOTE [ Foresight in an owner process ]): the training
        process forked the child that reads the ids ahead and sends its pipes (and the loader's
        flag that has the workers leave their misses); the stream runs here, at the policy."""
        owner = self.owner
        ids = IdsReader.adopt(fds[0], fds[1])
        defer = SharedBlock.adopt(m["defer"], fds[2]) if m["defer"] is not None else None
        fds.clear()  # the reader and the block have them now
        if owner.stream is not None:
            owner.end_stream(owner.stream)
        owner.stream = Stream(owner, ids, m["first"], m["source"], defer)
        self.ahead, self.missed = None, 0
        self.reply()

    def do_drawn(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """The DataLoader drew batch ``number`` of the stream's epoch (no reply). It draws at the
        ``next()`` that claims an earlier batch, so the draw is taken once that claim is
        answered, with the lookahead reader's reads for it (NOTE [ A hand-off read ahead ] in
        ``reads.py``), unless that claim's batch would not be found in flight without it."""
        stream = self.owner.stream
        if stream is None or stream.source != m["source"]:
            return
        if stream.judged_from is not None and any(
            n > stream.claimed for n, _ in stream.in_flight_ids
        ):
            self.draws.append(m["number"])
        else:
            stream._drawn(m["number"])

    def take_draws(self) -> None:
        draws, self.draws = self.draws, []
        for number in draws:
            if self.owner.stream is not None:
                self.owner.stream._drawn(number)

    def do_end_stream(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """The stream's epoch is over or left (no reply)."""
        stream = self.owner.stream
        if stream is not None and stream.source == m["source"]:
            self.owner.end_stream(stream)

    def do_caught_up(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        stream = self.owner.stream
        self.reply(stream is None or stream.caught_up)

    def do_refresh(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        stale, fresh, step, tick = self.owner.changed_rows(arrays[0], m["tick"])
        self.reply(step, tick, self.owner.generation, arrays=(stale, fresh))

    def do_relookup(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        rows, step, tick = self.owner.current_rows(arrays[0])
        self.reply(step, tick, self.owner.generation, arrays=(rows,))

    def do_rows(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """Rows of this machine's shard for a rank of another machine (``Shards.rows``): after
        the steps submitted so far, recorded by the cache's policy as uses."""
        owner, ids = self.owner, arrays[0]
        owner._wait_for_steps()
        with owner.lock:
            rows = owner.cache.current(ids)
            owner.cache.admit(ids, rows)
        owner.counts["served_rows"] += len(ids)
        self.reply(arrays=(rows,))

    def do_submit(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        ids = arrays[0]
        slot = m["slot"]  # in the transfer block, or -1: sent
        grad = self.transfer.gradient(slot, len(ids)) if slot >= 0 else torch.from_numpy(arrays[1])
        self.owner.submit(torch.from_numpy(ids), grad, m["lr"])

    def do_closing(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """A rank of a job is about to close (no reply): this owner serves it alone."""

    def do_wait(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        if self.owner.writeback is not None:
            self.owner.writeback.wait(m["behind"])
        self.reply(self.owner.applied_step)

    def do_call(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """The owner's methods that take and give small values: checkpoint, flush, stats..."""
        if m["name"] not in ("checkpoint", "flush", "save", "stats", *self.owner.CALLS):
            raise ValueError(f"the owner process does not serve {m['name']!r}")
        self.reply(getattr(self.owner, m["name"])(*m["args"]))

    def do_load(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        self.owner.load(Table.open(m["folder"], "r"))
        self.reply(self.owner.generation, self.owner.applied_step)

    def do_close(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """Commit and release the table; this process then ends. A close that failed and left
        the owner open (a full disk) can be asked again."""
        try:
            self.owner.close(m["raise_errors"])
        except BaseException as e:
            if not isinstance(e, Exception):  # a service told to stop
                raise
            self.done = self.owner.closed
            self.reply_error(e, closed=self.owner.closed)
            return
        self.done = True
        later, self.later = self.later, None  # an error after a reply: said after the commit
        if later is not None and m["raise_errors"]:
            self.owner.correct(later)
            self.reply_error(later, closed=True)
        else:
            self.reply(self.owner.stats())  # the pipe's stats() after close

    def abandon(self, seconds: float = 10.0) -> bool:
        """The training process is gone without closing: drop the steps since the last
        checkpoint (queued or applied to the live arrays) and release the table, as a crash of
        one process would leave it. False: a table write hangs, and only this process's exit
        leaves the table safely (a reopen recovers the checkpoint)."""
        owner, self.owner = self.owner, None
        if owner is None or owner.closed:
            return True
        if owner.stream is not None:  # its threads, and its copies of the child's pipes
            owner.end_stream(owner.stream)
        owner.closed = True
        if owner.writeback is not None and not owner.writeback.abandon(seconds):
            return False
        if owner.optimizer is not None:
            self.take_back(owner.table)
        owner.table._release_claim()
        if owner.owns_table:
            owner.table.close()
        return True

    def take_back(self, table: Table) -> None:
        """Take ``table`` back to its last checkpoint (a job dropped): all of it, as this
        process is its only writer."""
        table._roll_back()


def watch_parent(parent: int) -> None:
    """End this process at once when the training process that started it is gone (however it
    ended: this process is then re-parented)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="embedpipe-watch-parent", daemon=True).start()


def become_owner(fd: int, parent: int) -> Channel:
    """This process as a training process's owner: a Ctrl-C is not its own, it ends with its
    parent, leaves the cores to the training process; the connection at ``fd``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the training process's to take
    watch_parent(parent)
    torch.set_num_threads(1)  # the training process's cores are its own
    gc.freeze()  # torch's import: 1e5s of objects no collection here need walk again
    return Channel(socket.socket(fileno=fd))


def main(argv: list[str]) -> int:
    """``FD PARENT``: serve the training process at the socket ``FD``."""
    return serve(int(argv[0]), int(argv[1]))


def serve(fd: int, parent: int, lent: dict[int, int] | None = None) -> int:
    """Serve the training process at the socket ``fd``; ``lent``: the descriptors it lent, its
    numbers to this process's (a zygote's fork has them under other numbers)."""
    server = Server(become_owner(fd, parent), lent)
    try:
        server.run()
    except ChannelClosed:  # the training process is gone: leave the table at its checkpoint
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
