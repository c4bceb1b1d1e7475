"""The training process's side of an owner process: :class:`RemoteOwner`.

``EmbeddingPipe(..., owner="process")`` starts an owner process (``server.py``) and talks to it
through this object, which stands where an in-process :class:`~embedpipe.owner.owner.Owner`
would for the pipe, its loaders and its batches. What stays in the training process is what must:

- the claim: a batch's unique ids and ring slot go to the owner, its final rows come back
  (the owner reads the ring slot itself: the workers' ring is shared with it);
- the pending gradient, as ``pipe.parameter.grad`` (``owner/gradient.py``): backward, clipping
  and the optimizer step see it here; each step's ``(U, D)`` gradient goes to the owner
  (rows and gradients cross in shared memory beside the connection: ``transfer.py``);
- ``inputs_embeds``, made from the rows on the batch's device.

The cache, its policy, the optimizer state, the writeback and every read and write of the table
live in the owner process. DataLoader workers read the shared cache directly, as with an owner
thread (its block crosses to this process as a descriptor); with ``num_workers=0`` the owner
reads each batch's rows, so this process never reads the table's files.

A step is sent without waiting for a reply; an error it meets in the owner (a full disk) is raised
by the next call that waits. An owner process that dies raises
:class:`~embedpipe.errors.OwnerDiedError` at the next call, naming it and the checkpoint the table
reopens at.
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import os
import subprocess
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..cache import budget
from ..cache.ring import BatchRing
from ..cache.sharedrows import SharedRows
from ..cache.shm import SharedBlock
from ..errors import OwnerDiedError
from ..ids import as_ids, unique_inverse
from ..optim import RowOptimizer
from ..owner import durability
from ..owner.batchorder import Ahead
from ..owner.gradcheck import refuse_non_finite, without_padding
from ..owner.gradient import TableGradient
from ..owner.lookahead import LOOKAHEAD, look_blind, start_stream
from ..owner.owner import take_options
from ..store.checkpoints import Checkpoint, latest
from ..store.layout import read_table_metadata
from ..store.table import Table
from ..worker.batch import EmbeddedBatch
from ..worker.looked_up import LookedUp
from ..worker.orphans import exit_reason
from .channel import Channel, ChannelClosed, interrupts_held
from .foresight import RemoteStream
from .reach import connect, start_owner
from .transfer import Transfer

#: How long ``close()`` waits for the owner process to exit once it has committed.
EXIT_SECONDS = 30.0

#: Channels of this process, closed in a forked child (a DataLoader worker) so that the owner
#: process sees the connection end when the training process does.
_channels: weakref.WeakSet[Channel] = weakref.WeakSet()


def _close_in_child() -> None:
    for channel in list(_channels):
        channel.sock.close()


os.register_at_fork(after_in_child=_close_in_child)


class RemoteOwner:
    """An owner process, seen from the training process (see the module docstring)."""

    shards = None  # a pipe sharded over ranks has one owner per rank: not in a process yet
    writeback = None
    reads_rows_at_claim = True  # with num_workers=0 the owner reads the rows, not the lookup

    def __init__(
        self,
        table: Table,
        *,
        policy: str,
        cache_rows: int,
        optimizer: RowOptimizer | None,
        options: dict[str, Any],
        keep: int | None,
        description: str,
        parameter: torch.nn.Parameter | None = None,
        owns_table: bool = False,
        address: str | None = None,
        lookahead: int = 0,
    ) -> None:
        take_options(self, table, optimizer, options, owns_table)
        #: The owner process's policy sees the loaders' next batches (``foresight.py``).
        self.looks_ahead = policy in LOOKAHEAD and lookahead > 0 and 0 < cache_rows < table.num_rows
        self.stream: RemoteStream | None = None
        self.blind = False  # foresight kept missing: no more streams (``look_blind``)
        self._sources: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()  # (for ``stream``, as an owner's)
        self.address = address  # of a service (``embedpipe serve``); None: a process of our own
        self._claimed = False  # a batch was claimed
        self._owed = 0  # replies the owner process owes to requests a signal interrupted
        self._last_stats: dict[str, int] | None = None  # as the owner closed
        self.finish_embeds: Callable[..., torch.Tensor] = lambda embeds, ids: embeds
        self._lock = threading.Lock()
        self._rings: weakref.WeakKeyDictionary[BatchRing, int] = weakref.WeakKeyDictionary()
        self._dropped: list[int] = []
        self._numbers = itertools.count()
        #: The program's ``Table`` holds the writer lock: it lends it to the owner process as a
        #: descriptor of the same open file (so no other writer can take it in between)
        self._lent = optimizer is not None and table._lock is not None
        if self._lent and table._modified:  # the owner opens the last checkpoint: commit them
            table._commit(table.step)
        lock_fd = table._lock.fd if self._lent else None
        self.process: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.owner_pid: int | None = None  # said by the owner when it has opened the table
        self.submitted = 0  # steps sent (every request says how many: ``job.py``)
        self.transfer: Transfer | None = None  # reply rows and gradients (``transfer.py``)
        opening = {
            "op": "open",
            "path": table.path,
            "root": table.root,
            "lock_fd": lock_fd,
            "description": description,
            "optimizer": optimizer,
            "keep": keep,
            "policy": policy,
            "lookahead": lookahead,
            "cache_rows": cache_rows,
            "options": options,
        }
        try:
            (applied, self.owner_pid, layout), _, fds = self._open(opening)
            self.shared = SharedRows.__new__(SharedRows)
            self.shared.__setstate__({"block": SharedBlock.adopt(layout, fds[0])})
        except BaseException:
            self._stop()
            self._take_table_back(died=True)
            raise
        if address is not None and optimizer is not None and applied != table.step:
            opened = table.step
            self._stop()
            self._take_table_back(died=False)
            raise ValueError(
                f"this job opened {table.path} at step {opened}, but its service holds it "
                f"at step {applied} (another job trained it since, or an older checkpoint was "
                "asked for): open the table again and resume from that step"
            )
        self.submitted = self.start_step = applied
        if optimizer is not None:
            table._reopen(live=True)  # reads see the owner's steps (after a flush): the live arrays
        self.gradient = (
            TableGradient(table, optimizer, self.check_step, self.submit, parameter)
            if optimizer is not None
            else None
        )

    def _open(self, opening: dict[str, Any]) -> Any:
        """Reach the owner (start one, or connect to a service) and open the table there."""
        if self.address is None:
            self.process, channel = start_owner(opening["lock_fd"])
        else:
            channel = connect(self.address, self.table.path)
        self._connected(channel)
        return self._request(opening)

    def _connected(self, channel: Channel) -> None:
        self.channel = channel
        _channels.add(channel)  # closed in forked children

    def _describe_owner(self) -> str:
        if self.process is not None:
            return f"the owner process of table {self.table.path} (pid {self.process.pid})"
        pid = f" (pid {self.owner_pid})" if self.owner_pid is not None else ""
        return f"the table service at {self.address}{pid}"

    # ----------------------------------------------------------------------------- the loop
    @property
    def trains(self) -> bool:
        return self.optimizer is not None

    @property
    def trains_now(self) -> bool:
        return self.gradient is not None and self.gradient.trains()

    @property
    def behind(self) -> int:
        return 0 if self.consistency == "exact" else self.max_staleness

    def before_lookup(self) -> None:
        if self.optimizer is not None and self.consistency == "exact":
            self._request({"op": "wait", "behind": 0})

    def claim(self, item: LookedUp, ring: BatchRing | None, pin: bool) -> EmbeddedBatch:
        """The batch of a worker's lookup: the rows the owner process sends back (NOTE
        [ Corrections, not rows ] in ``server.py``), and the others copied out of the ring here
        once it has: the fewer rows a claim copies, the shorter the loop's wait."""
        self.check_open()
        if self.gradient is not None and not self._claimed:
            self.gradient.see_optimizers()  # before a hand-written warmup changes their rates
        self._claimed = True
        rows, have, into = item.rows, item.rows is not None, None
        if item.slot >= 0 and ring is not None:  # after the reply: the rows it did not send
            rows, have = None, ring.holds(item.slot, item.tag)
            into = np.empty((len(item.unique_ids), self.table.dim), dtype=self.table.dtype)
        sent = item.rows if item.slot < 0 and item.rows is not None else np.empty(0)
        arrays = (item.unique_ids, sent)
        if item.deferred is not None:
            arrays += (item.deferred,)
        stream = self.stream
        transfer = self._transfer()  # before the claim: its reply may put rows there
        (step, tick, generation, blind, every, _), got, _ = self._request(
            {"op": "claim", "ring": self._ring_number(ring), "slot": item.slot, "tag": item.tag,
             "lookup_step": item.lookup_step, "hits": item.hits, "misses": item.misses,
             "trains_now": self.trains_now, "have": have,
             "foreseen": stream is not None and stream.take_claim()},
            arrays, shared_rows=5, into=into,
        )  # fmt: skip
        if blind and stream is not None:
            stream.blind = True  # the loader says why, and stops looking ahead
            stream.failure = blind if isinstance(blind, str) else None  # the child's error
        transfer.replied(step, generation)
        fresh = got[-1]  # sent, or copied out of the transfer block (into `into`) by _request
        if every:  # every row, read by the owner
            rows = fresh
        else:  # the rows re-read since the lookup; with a ring, the others from its slot
            rows = into if rows is None else rows
            if fresh is not rows:
                rows[got[0]] = fresh
            if rows is into and not ring.read_except(item.slot, item.tag, into, got[0]):
                (step, tick, generation), (rows,), _ = self._request(  # overwritten: all again
                    {"op": "relookup"}, (item.unique_ids,)
                )
        return EmbeddedBatch._handed_off(item, rows, self, pin, step, tick, generation)

    def _transfer(self) -> Transfer:
        """The block for reply rows and gradients, sent at the first claim or step (``transfer.py``)."""
        if self.transfer is None:
            transfer = Transfer.make(self.table.dim, self.table.dtype)
            self._request({"op": "transfer", "layout": transfer.layout()}, fds=(transfer.block.fd,))
            self.transfer = transfer
        return self.transfer

    def refresh(self, batch: EmbeddedBatch) -> None:
        """As ``Owner.refresh``: re-read the rows steps changed since the batch's rows were read."""
        if self.optimizer is None:
            return
        if batch.step >= self.submitted - self.behind and batch.generation == self.generation:
            return
        self.check_open()
        (step, tick, generation), (stale, fresh), _ = self._request(
            {"op": "refresh", "tick": batch.tick}, (batch._unique_ids.numpy(),)
        )
        batch._refreshed(torch.from_numpy(stale), torch.from_numpy(fresh), step, tick, generation)

    def relookup(self, batch: EmbeddedBatch, ids: torch.Tensor) -> None:
        """As ``Owner.relookup``: the batch's ids were edited in place."""
        self.check_open()
        edited = as_ids(ids.detach().cpu(), self.table.num_rows, what="edited batch ids")
        unique_ids, inverse = unique_inverse(edited, self.table.num_rows)
        (step, tick, generation), (rows,), _ = self._request({"op": "relookup"}, (unique_ids,))
        batch._relooked(unique_ids, inverse, rows, step, tick, generation)

    def on_grad(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        if self.closed:
            raise RuntimeError(
                "this EmbeddingPipe is closed: the embedding gradient of this batch cannot be applied"
            )
        self._add_gradient(*without_padding(unique_ids, grad, self.padding_idx))

    def _add_gradient(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        self.gradient.add(unique_ids, grad)

    def check_step(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        self.check_open()
        if self.check_finite:
            refuse_non_finite(ids, grad, self.submitted + 1)

    def submit(self, ids: torch.Tensor, grad: torch.Tensor, lr: float | None) -> None:
        """Send one step's gradient to the owner process (no reply: see the module docstring)."""
        step = self.submitted + 1
        slot = self._transfer().put_gradient(step, self.generation, grad)
        dtype = getattr(torch, self.table.dtype.name)
        sent = () if slot >= 0 else (grad.detach().to("cpu", dtype).numpy(),)
        self.submitted = step  # first: a Ctrl-C held back until the step is sent is raised after
        self._request({"op": "submit", "lr": lr, "slot": slot}, (ids.numpy(), *sent), reply=False)

    # ----------------------------------------------------------------------------- the table
    def before_read(self) -> None:
        self.flush()

    def checkpoint(self) -> Checkpoint:
        return self._committed(self._call("checkpoint"))

    def flush(self) -> None:
        self._call("flush")

    def save(self, folder: str) -> Checkpoint:
        return self._committed(self._call("save", folder))

    def stats(self) -> dict[str, int]:
        if self.closed and self._last_stats is not None:
            return dict(self._last_stats)
        return self._call("stats")

    def load(self, source: Table) -> None:
        self.check_open()
        loaded, _, _ = self._request({"op": "load", "folder": source.path})
        self.generation, self.submitted = loaded
        self._committed(None)  # this process's handle: the table's step, its checkpoints

    def close(self, raise_errors: bool = True) -> None:
        """Commit and stop the owner process, then take the table back (as ``Owner.close``)."""
        if self.closed:
            return
        if self.stream is not None:
            self.end_stream(self.stream)
        if self.gradient is not None:
            self.gradient.close(stacklevel=5)  # the caller of pipe.close
        try:
            (self._last_stats,), _, _ = self._request({"op": "close", "raise_errors": raise_errors})
        except OwnerDiedError:
            raise
        except BaseException as e:
            if getattr(e, "_owner_closed", False) or isinstance(e, Warning):  # -W error
                self._finish()
            raise  # else the owner is open still: close() can be called again
        self._finish()

    def correct(self, error: object) -> None:
        durability.correct(self, error)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this EmbeddingPipe is closed; make a new one")

    def start_stream(
        self, dataset: Any, ids_key: str, order: Ahead, source: Any, defer: SharedBlock | None
    ) -> RemoteStream | None:
        """As ``Owner.start_stream``, the stream in the owner process (``foresight.py``)."""
        return start_stream(
            self, lambda: RemoteStream.start(self, dataset, ids_key, order, source, defer)
        )

    def end_stream(self, stream: RemoteStream) -> None:
        stream.stop()
        if self.stream is stream:
            self.stream = None

    def look_blind(self, why: str) -> None:
        look_blind(self, why)

    def _source_number(self, source: Any) -> int:
        """The number the owner process knows a loader by (its streams', its claims')."""
        return self._sources.setdefault(source, len(self._sources) + 1)

    # ----------------------------------------------------------------------------- internals
    def _committed(self, checkpoint: Any) -> Any:
        """The owner process committed: this process's handle reads the table's metadata again."""
        self.table._reopen(live=True)
        return checkpoint

    def _call(self, name: str, *args: Any) -> Any:
        self.check_open()
        (value,), _, _ = self._request({"op": "call", "name": name, "args": args})
        return value

    def _request(
        self,
        message: dict[str, Any],
        arrays: tuple[np.ndarray, ...] = (),
        reply: bool = True,
        fds: tuple[int, ...] = (),
        shared_rows: int | None = None,
        into: np.ndarray | None = None,
    ) -> Any:
        """Send ``message`` and return the owner process's reply (``ok`` values, arrays,
        descriptors), raising its error. A Ctrl-C is held back while bytes cross and taken while
        the reply is awaited: then the reply is owed, and read and dropped before the next
        request, so the two processes never fall out of step. ``shared_rows``: which ``ok`` value
        counts the reply's rows in the transfer block: copied out here, before another thread's
        request can overwrite them, as the last array (into ``into``, at ``got[0]``, if given)."""
        message.setdefault("after", self.submitted)
        with self._lock, interrupts_held() as interrupted:
            if self._dropped:
                message["drop_rings"], self._dropped = self._dropped, []
            try:
                while self._owed:  # replies to requests a signal interrupted: not ours
                    self.channel.receive()
                    self._owed -= 1
                self.channel.send(message, arrays, fds)
                if not reply:
                    return None
                self._owed += 1
                answer, got, received = self.channel.receive(waiting=interrupted)
                self._owed -= 1
                if shared_rows is not None and "ok" in answer and answer["ok"][shared_rows] >= 0:
                    got = [*got, self.transfer.take_reply(answer["ok"][shared_rows], got, into)]
            except ChannelClosed as e:
                raise self._died() from e
        error = answer.get("error")
        for category, text in answer["warnings"]:
            kind = getattr(builtins, category, None) or getattr(budget, category, RuntimeWarning)
            kind = kind if isinstance(kind, type) and issubclass(kind, Warning) else RuntimeWarning
            with contextlib.suppress(Warning) if error is not None else contextlib.nullcontext():
                warnings.warn(text, kind, stacklevel=3)  # -W error: it must not hide the error
        if error is not None:
            error._owner_closed = answer.get("closed", False)
            raise error
        return answer["ok"], got, received

    def _ring_number(self, ring: BatchRing | None) -> int:
        """The number the owner process knows ``ring`` by; sent to it the first time."""
        if ring is None:
            return -1
        number = self._rings.get(ring)
        if number is None:
            number = next(self._numbers)
            block = ring.block
            layout = {name: (shape, dtype.str) for name, (shape, dtype) in block.layout.items()}
            self._request(
                {"op": "ring", "ring": number, "layout": layout, "depth": ring.depth,
                 "rows_per_slot": ring.rows_per_slot},
                fds=(block.fd,),
            )  # fmt: skip
            self._rings[ring] = number
            weakref.finalize(ring, self._dropped.append, number)
        return number

    def _died(self) -> OwnerDiedError:
        """The owner process is gone: the error that says so, and where the table reopens."""
        self.closed = True
        broken = self.channel.broken
        who = self._describe_owner()
        if self.process is None:  # not ours: all we know is that its connection ended
            how = "stopped, or it ended the connection: it drops a job one of whose ranks is gone"
        else:
            deadline = time.monotonic() + (0.0 if broken else 5.0)
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            code = self.process.poll()
            how = "still running" if code is None else exit_reason(code)
        if broken is not None:  # out of step: nothing it says can be trusted now
            how = f"stopped: the connection to it was {broken} (a signal? Ctrl-C?)"
        try:  # where the table reopens: its latest commit (``checkpoints.recover``)
            last = latest(str(self.table.path))
            step = last.step if last is not None else read_table_metadata(self.table.path)["step"]
        except (OSError, KeyError, ValueError):
            step = "?"
        self._stop()
        self._take_table_back(died=True)
        return OwnerDiedError(
            f"{who} is gone ({how}); the table reopens at its last checkpoint, step {step}: "
            "make a new pipe to go on from there (steps since are lost)"
        )

    def _finish(self) -> None:
        self.closed = True
        if self.process is not None:
            try:
                self.process.wait(EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                self._stop()
        self.channel.close()
        self._take_table_back(died=False)

    def _stop(self) -> None:
        """End the connection; an owner process of our own, too (never a service)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.channel is not None:
            self.channel.close()

    def _take_table_back(self, died: bool) -> None:
        """The owner process has ended: the table's handle here sees the checkpoint it committed;
        if it died, a lent lock's handle first takes the live arrays back to that checkpoint
        (they hold what the owner wrote since). A service's job reads its last checkpoint: the
        live arrays are the service's, and the next job's."""
        table = self.table
        table._release_claim()
        if self._lent and died:
            table._roll_back()
        if self.optimizer is not None:
            table._reopen(live=self.address is None)
        if self.owns_table:
            table.close()
