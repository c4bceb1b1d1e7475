"""Row shards: one table trained by the ranks of a ``torch.distributed`` job, each rank the only
owner of a range of its rows.

NOTE [ One table over N ranks ]
Inside an initialised process group of N > 1 ranks (``torchrun``), a pipe that trains its table is
split by row range, at chunk boundaries, into N shards; rank i owns shard i: its cache, its
optimizer state and its writeback, exactly as a single-process pipe owns the whole table, and no
two ranks ever write one chunk file. Each rank's DataLoader workers read only that rank's rows;
the rest of a batch comes from the other owners. Three collectives, on a gloo group of embedpipe's
own (rows live in host memory; DDP's traffic on the default group is never interleaved with ours):

- **rows** (when the model reads a batch: ``ShardOwner.refresh``): each rank asks every owner for the
  batch's rows it does not own (``all_to_all_single`` of ids, then of rows). An owner first waits
  for its writeback to apply the steps submitted so far, so the rows are those an ``nn.Embedding``
  replicated by DDP would hold at that moment.
- **gradient** (in backward, when the rows' gradient arrives: ``ShardOwner._add_gradient``):
  every rank's gradient rows, each scaled by 1/N and summed in rank order: DDP's averaged
  gradient of a replicated ``nn.Embedding``, restricted to the rows that have one, by a sparse
  all-reduce (NOTE [ The gradient's sparse all-reduce ]). Every rank then holds the same
  ``pipe.parameter.grad``, so ``clip_grad_norm_`` computes the norm DDP would on every rank,
  and accumulation adds as ``.grad`` does.
- **step**: no message. Every rank takes the same gradient at the same optimizer step; each owner
  applies the rows of its shard and ignores the others.

Checkpoints are one commit for all shards (``ShardOwner.checkpoint``): every owner writes its
dirty rows, all agree that they did, then rank 0, which holds the table's writer lock, commits the
live arrays as one checkpoint (hard links: ``checkpoints.py``); a rank writing after that copies
the chunk first, as a single owner does. A crash before the commit leaves the previous checkpoint.
Loading a snapshot is the same order: every owner applies its queued steps and stops writing,
all agree, then rank 0 restores every shard's files::

    rank 0:   header | write rows | agree | commit (link, fsync, rename) | agree
    rank k:   header | write rows | agree | (waits)                       | agree

Every exchange starts with a header that every rank contributes to: what it is doing, its step,
its count of loaded snapshots. Ranks that disagree (one reads a batch while another steps, one
has stepped once more) raise :class:`~embedpipe.errors.ShardMismatchError` on every rank instead
of exchanging the wrong tensors. A rank that dies or stops answering makes the others raise
:class:`~embedpipe.errors.PeerLostError` at their next exchange: at once when its connections
close, after ``timeout`` seconds when it hangs.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import PeerLostError, ShardMismatchError

# NOTE [ The gradient's sparse all-reduce ]
# DDP all-reduces a replicated table's dense (V, D) gradient: 2 (N-1)/N x V x D values a rank
# sends. The pipe's gradient is sparse (U rows a rank); gathering every rank's rows to every
# rank grows with N ((N-1) x U rows a rank receives). So, per backward pass:
#
#   1. every rank's ids to every rank (``all_gather``, 8 bytes an id): each rank now knows the
#      union and what every rank would send, and so does the same as every other below;
#   2. the rows by whichever moves fewer over all ranks:
#      - a gather: every rank's rows to every rank (padded to the largest), N (N-1) x max U;
#      - a sparse all-reduce: a reduce-scatter, each row to the rank that sums it (row ``r`` on
#        rank ``r mod N``: interleaved, so a vocabulary sorted by frequency spreads its hot rows
#        over every rank), then an all-gather of the sums, every rank's to every rank: about
#        (N-1)/N x N U + (N-1) x union.
#      Either way each row is summed over the ranks, each times 1/N, in rank order (one
#      ``index_add_`` over the rows in rank order: the same float operations in the same
#      order), so the result is bit for bit the same, and every rank ends with it whole.
#
# With the sparse all-reduce a rank sends about (N-1)/N x (U + union) rows and receives as
# many: at most U + V rows whatever N is, against DDP's 2 (N-1)/N x V; only the ids (8 bytes
# each, against a row's D x 4) grow with N. Every rank ends with the whole averaged gradient,
# so ``clip_grad_norm_`` computes DDP's global norm from ``pipe.parameter.grad`` (a
# reduce-scatter alone, U rows a rank, would leave each rank a part of it: a norm computed from
# parts sums in another order than torch's, and the clipped table would differ in rounding).

#: What a rank does in an exchange (the header's first value); every rank must do the same.
ROWS, GRADIENT, COMMIT, LOAD, CLOSE, FLUSH = 1, 2, 3, 4, 5, 6
_DOING = {
    ROWS: "reading a batch's rows",
    GRADIENT: "adding a backward pass's gradient",
    COMMIT: "taking a checkpoint",
    LOAD: "loading a snapshot",
    CLOSE: "closing the pipe",
    FLUSH: "flushing the pipe",
}
#: What ranks out of step are told to do.
IN_STEP = (
    "Every rank must run the same loop: read each batch's inputs_embeds, run backward and step "
    "as the others do (a DistributedSampler with drop_last=True gives every rank the same "
    "number of batches); or a rank closed its pipe early, on an error of its own (its log says)"
)
#: Seconds a rank waits for the others at an exchange before it raises: torch's own default for
#: a process group (30 minutes), since a rank may rightly be busy that long between two
#: exchanges (rank 0 writing a large model's checkpoint while the others wait at their next
#: batch). A rank that dies is seen at once, whatever this is.
DEFAULT_TIMEOUT = 1800.0


def process_group(group: Any = None) -> Any:
    """``group``, or the default process group when one of more than one rank is initialised;
    None when this process trains alone."""
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def split(num_rows: int, chunk_rows: int, shards: int) -> np.ndarray:
    """The row bounds of ``shards`` shards, whole chunks each: shard i is rows
    ``[bounds[i], bounds[i + 1])``. With fewer chunks than shards, some shards are empty."""
    chunks = -(-num_rows // chunk_rows)
    edges = np.arange(shards + 1, dtype=np.int64) * chunks // shards
    return np.minimum(edges * chunk_rows, num_rows)


def average(union: np.ndarray, ids: np.ndarray, rows: torch.Tensor, ranks: int) -> torch.Tensor:
    """The rows of ``union`` (sorted ids): each of ``rows`` (of ``ids``: every rank's, in rank
    order) times 1/``ranks``, summed in that order by one ``index_add_``, as DDP divides, then
    sums. Every way the ranks average the gradient sums here, so all give the same bits."""
    total = torch.zeros(len(union), rows.shape[1], dtype=rows.dtype)
    where = torch.from_numpy(np.searchsorted(union, ids))
    return total.index_add_(0, where, rows * (1.0 / ranks))


# NOTE [ A fork never frees a process group ]
# A gloo process group's destructor joins the group's threads. A DataLoader worker is forked
# from a training process that may hold one as cyclic garbage (a closed pipe's ``Shards``, still
# in a cycle with its pipe); a garbage collection in the worker frees it there, where its
# threads do not exist, and the worker waits on them forever (found: an Accelerate loop under
# torchrun with owner='process' hung at its second pipe's first batch, one worker of rank 1 in
# ``~ProcessGroupGloo`` inside ``gc_collect_main``). So once this process has made a group,
# every fork freezes the collector's objects first (``gc.freeze``, constant time): the child
# never collects what it inherited, and the parent unfreezes at once. A freeze the program made
# itself is left as it is.

_fork_hooks = False


def _freeze_for_forks() -> None:
    global _fork_hooks
    if _fork_hooks:
        return
    _fork_hooks = True
    froze = [False]

    def before() -> None:
        froze[0] = gc.get_freeze_count() == 0
        if froze[0]:
            gc.freeze()

    def after_in_parent() -> None:
        if froze[0]:
            gc.unfreeze()

    os.register_at_fork(before=before, after_in_parent=after_in_parent)


class Shards:
    """This rank's place in a sharded table, and the collectives of the NOTE.

    ``group``: the user's process group (the default one for ``torchrun``); embedpipe talks on a
    gloo group over the same ranks, made here (every rank of the job must make its pipe).
    """

    def __init__(self, group: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        ranks = dist.get_process_group_ranks(group)
        _freeze_for_forks()  # NOTE [ A fork never frees a process group ]
        self.group = dist.new_group(
            ranks, timeout=datetime.timedelta(seconds=timeout), backend="gloo"
        )
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.timeout = timeout
        #: Shard ``i`` is rows ``[bounds[i], bounds[i + 1])``; this rank's is ``shard``, and
        #: ``servers[i]`` is the rank that answers this rank's requests for shard i's rows. Every
        #: rank owns a shard of its own, unless the ranks are grouped by machine (``by_machine``).
        self.bounds = np.zeros(self.size + 1, dtype=np.int64)
        self.shard = self.rank
        self.servers = np.arange(self.size)
        self.machines = [[r] for r in range(self.size)]
        #: The first failure (a peer lost, ranks out of step): every later exchange raises it.
        self.lost: PeerLostError | ShardMismatchError | None = None
        #: Headers this rank entered; ``at_header(headers, step)`` is told before each (the
        #: step-sending rank of an owner process: NOTE [ Ranks out of step in an owner process ]).
        self.headers = 0
        self.at_header: Callable[[int, int], None] | None = None
        #: Bytes of ids, rows and gradients this rank sent to and received from the others,
        #: by exchange (``pipe.stats()``: ``rows_sent_bytes``, ...); headers not counted.
        self.bytes = dict.fromkeys(
            (
                "rows_sent_bytes",
                "rows_received_bytes",
                "gradient_sent_bytes",
                "gradient_received_bytes",
            ),
            0,
        )

    def by_machine(self) -> None:
        """One shard per machine instead of per rank (the ranks of a machine share one owner
        process: ``service/rank.py``): machines in the order of their first rank, a machine
        being a host and torchrun's node rank (``GROUP_RANK``: owner processes standing in for
        machines on one host). A request for a shard's rows goes to the rank of that machine
        at this rank's place on its own machine (round robin where the counts differ)."""
        where = (socket.gethostname(), os.environ.get("GROUP_RANK", ""))
        every = self.every(where, "finding the ranks' machines")
        machines = list(dict.fromkeys(every))
        self.machines = [[r for r, m in enumerate(every) if m == machine] for machine in machines]
        self.shard = machines.index(where)
        place = self.machines[self.shard].index(self.rank)
        self.servers = np.array([ranks[place % len(ranks)] for ranks in self.machines])

    @property
    def leader(self) -> bool:
        """Rank 0 holds the table's writer lock and commits the checkpoints."""
        return self.rank == 0

    @property
    def first_of_machine(self) -> bool:
        """The first rank of this rank's machine (``by_machine``): it starts the machine's owner."""
        return self.rank == self.machines[self.shard][0]

    def plan(self, num_rows: int, chunk_rows: int) -> None:
        self.bounds = split(num_rows, chunk_rows, len(self.servers))

    def layout(self) -> dict[str, Any]:
        """The table's ``shards`` metadata (``embedpipe info`` shows it)."""
        return {"ranks": self.size, "bounds": self.bounds.tolist()}

    @property
    def owned(self) -> tuple[int, int]:
        """The rows this rank's shard holds, ``[lo, hi)``."""
        return int(self.bounds[self.shard]), int(self.bounds[self.shard + 1])

    def owns(self, ids: np.ndarray) -> np.ndarray:
        lo, hi = self.owned
        return (ids >= lo) & (ids < hi)

    def owner_of(self, ids: np.ndarray) -> np.ndarray:
        """The rank each of ``ids`` is asked of."""
        return self.servers[np.searchsorted(self.bounds, ids, side="right") - 1]

    def describe(self) -> str:
        lo, hi = self.owned
        return f"rank {self.rank} of {self.size} (rows {lo:,} to {hi:,})"

    # --------------------------------------------------------------------------- exchanges
    def _count(self, exchange: str, sent: int, received: int) -> None:
        self.bytes[f"{exchange}_sent_bytes"] += int(sent)
        self.bytes[f"{exchange}_received_bytes"] += int(received)

    def _call(self, what: str, collective: Callable[[], Any]) -> Any:
        """Run a collective; a peer that died or hangs becomes a PeerLostError (see the NOTE)."""
        if self.lost is not None:
            raise self.lost
        start = time.monotonic()
        try:
            return collective()
        except RuntimeError as e:  # gloo: "Connection closed by peer", a timeout
            waited = time.monotonic() - start
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.lost = PeerLostError(
                f"rank {self.rank} of {self.size} (pid {os.getpid()}) lost the other ranks of the "
                f"sharded table while {what}, after {waited:.1f} s: {cause}. A rank died or stopped "
                "answering (its own log says why), or waits elsewhere while this one reads "
                "batches, steps or checkpoints alone (an evaluation on rank 0 only: run it on "
                "every rank, or through a pipe of its own on a copy); the table reopens at its "
                "last checkpoint, which every rank reached together"
            )
            raise self.lost from e

    def _header(self, doing: int, step: int, generation: int, values: list[int]) -> np.ndarray:
        """Every rank's header (rank, [doing, step, generation, *values]); raises on every rank
        if they are not doing the same thing at the same step. Every header has the same size
        (values padded to one per rank), so that ranks out of step exchange headers they can
        compare: gloo aborts the process on a collective whose sizes differ between ranks."""
        padded = [*values, *[0] * (self.size - len(values))]
        self.headers += 1
        if self.at_header is not None and self.lost is None:
            self.at_header(self.headers, step)
        mine = torch.tensor([doing, step, generation, *padded], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._call(_DOING[doing], lambda: dist.all_gather(parts, mine, group=self.group))
        headers = torch.stack(parts).numpy()
        if (headers[:, :3] != headers[0, :3]).any():
            lines = [
                f"rank {r}: {_DOING.get(int(h[0]), h[0])} at step {h[1]} (snapshots loaded: {h[2]})"
                for r, h in enumerate(headers)
            ]
            self.lost = ShardMismatchError(
                "the ranks of a sharded table are out of step: " + "; ".join(lines) + f". {IN_STEP}"
            )
            raise self.lost  # the collectives are out of step: none may run again
        return headers[:, 3:]

    def rows(
        self,
        step: int,
        generation: int,
        wanted: np.ndarray,
        serve: Callable[[np.ndarray], np.ndarray],
        dim: int,
        dtype: np.dtype,
    ) -> np.ndarray:
        """The rows ``wanted`` (ids this rank does not own, sorted), from their owners; this
        rank answers the others' requests with ``serve(ids)`` (rows of ids it owns)."""
        owners = self.owner_of(wanted)
        counts = np.bincount(owners, minlength=self.size)
        asked = self._header(ROWS, step, generation, counts.tolist())  # asked[i, k]: i asks k
        to_me = asked[:, self.rank]
        if not asked.any():
            return np.empty((0, dim), dtype=dtype)
        # in the order of the ranks asked (shards by machine need not be: ``by_machine``)
        order = np.argsort(owners, kind="stable")
        requests = torch.empty(int(to_me.sum()), dtype=torch.int64)
        self._call(
            _DOING[ROWS],
            lambda: dist.all_to_all_single(
                requests,
                torch.from_numpy(np.ascontiguousarray(wanted[order], dtype=np.int64)),
                to_me.tolist(),
                counts.tolist(),
                group=self.group,
            ),
        )
        failed: BaseException | None = None
        try:
            served = np.ascontiguousarray(serve(requests.numpy()), dtype=dtype)
        except BaseException as e:  # a failed write of an evicted row, a writeback error
            # The others wait in the exchange below: complete it (with rows that are never
            # used), then refuse every later exchange. The others raise PeerLostError at their
            # next one (backward's), so no step ever takes these rows.
            failed, served = e, np.zeros((int(to_me.sum()), dim), dtype=dtype)
        answer = torch.from_numpy(served)
        got = torch.empty((len(wanted), dim), dtype=answer.dtype)
        self._call(
            _DOING[ROWS],
            lambda: dist.all_to_all_single(
                got, answer, counts.tolist(), to_me.tolist(), group=self.group
            ),
        )
        row_bytes = dim * answer.element_size()  # ``wanted`` holds no id of this rank's
        self._count(
            "rows",
            len(wanted) * 8 + len(served) * row_bytes,
            len(served) * 8 + len(wanted) * row_bytes,
        )
        if failed is not None:
            self.lost = ShardMismatchError(
                f"{self.describe()} failed to serve its rows to the other ranks "
                f"({type(failed).__name__}: {failed}); the ranks cannot go on together"
            )
            raise failed
        rows = np.empty((len(wanted), dim), dtype=dtype)
        rows[order] = got.numpy()
        return rows

    def gradient(
        self, step: int, generation: int, ids: torch.Tensor, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's (ids, gradient), each gradient times 1/N and summed in rank order: the
        average DDP takes, over the union of the ranks' ids (sorted). Same on every rank.

        The ids go to every rank first; then the rows by whichever of a gather and a sparse
        all-reduce moves fewer (NOTE [ The gradient's sparse all-reduce ])."""
        counts = self._header(GRADIENT, step, generation, [len(ids)])[:, 0].tolist()
        n, top = self.size, max(counts)
        padded_ids = torch.zeros(top, dtype=torch.int64)
        padded_ids[: len(ids)] = ids
        all_ids = [torch.empty_like(padded_ids) for _ in range(n)]
        self._call(_DOING[GRADIENT], lambda: dist.all_gather(all_ids, padded_ids, group=self.group))
        self._count("gradient", (n - 1) * top * 8, (n - 1) * top * 8)
        every = [t[:c].numpy() for t, c in zip(all_ids, counts)]
        union = np.unique(np.concatenate(every))
        # rows sent over every rank: a gather pads each rank's to the largest; the sparse
        # all-reduce sends the rows another rank sums, then each sum to every other rank
        gathered = n * (n - 1) * top
        reduced = sum(int((e % n != r).sum()) for r, e in enumerate(every)) + (n - 1) * len(union)
        rows = grad.detach().to("cpu")
        total = (
            self._gather(every, top, rows, union)
            if gathered <= reduced
            else self._reduce(every, rows, union)
        )
        return torch.from_numpy(union), total.to(grad.device)

    def _gather(
        self, every: list[np.ndarray], top: int, rows: torch.Tensor, union: np.ndarray
    ) -> torch.Tensor:
        """Every rank's rows to every rank (padded to the largest), summed here."""
        padded = torch.zeros(top, rows.shape[1], dtype=rows.dtype)
        padded[: len(rows)] = rows
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._call(_DOING[GRADIENT], lambda: dist.all_gather(parts, padded, group=self.group))
        moved = (self.size - 1) * padded.numel() * padded.element_size()
        self._count("gradient", moved, moved)
        every_grad = torch.cat([t[: len(e)] for t, e in zip(parts, every)])
        return average(union, np.concatenate(every), every_grad, self.size)

    def _reduce(
        self, every: list[np.ndarray], rows: torch.Tensor, union: np.ndarray
    ) -> torch.Tensor:
        """Each row summed by rank ``row mod N``, the sums sent to every rank."""
        n, me, dim, dtype = self.size, self.rank, rows.shape[1], rows.dtype
        row_bytes = dim * rows.element_size()
        # this rank's rows, grouped by the rank that sums them (stable: each group keeps its order)
        order = np.argsort(every[me] % n, kind="stable")
        sends = np.bincount(every[me] % n, minlength=n)
        gets = np.array([int((e % n == me).sum()) for e in every])
        parts = torch.empty((int(gets.sum()), dim), dtype=dtype)
        mine = rows[torch.from_numpy(order)]
        self._call(
            _DOING[GRADIENT],
            lambda: dist.all_to_all_single(
                parts, mine, gets.tolist(), sends.tolist(), group=self.group
            ),
        )
        self._count(
            "gradient", (sends.sum() - sends[me]) * row_bytes, (gets.sum() - gets[me]) * row_bytes
        )
        # this rank's sums, in rank order: the float operations of one index_add_ over every
        # rank's rows, for these rows
        owner = union % n
        summed_ids = union[owner == me]
        got_ids = np.concatenate([e[e % n == me] for e in every])
        summed = average(summed_ids, got_ids, parts, n)
        # every rank's sums to every rank
        sizes = np.bincount(owner, minlength=n)
        out = torch.empty((len(union), dim), dtype=dtype)
        self._call(
            _DOING[GRADIENT],
            lambda: dist.all_to_all_single(
                out, summed.repeat(n, 1), sizes.tolist(), [len(summed_ids)] * n, group=self.group
            ),
        )
        self._count(
            "gradient", (n - 1) * len(summed_ids) * row_bytes, (len(union) - sizes[me]) * row_bytes
        )
        total = torch.empty_like(out)
        total[torch.from_numpy(np.argsort(owner, kind="stable"))] = out  # back in id order
        return total

    def leave(self, error: BaseException) -> None:
        """This rank leaves on ``error`` and meets the others no more: its close commits
        nothing (NOTE [ A rank that fails alone ] in ``pipe/unclosed.py``)."""
        if self.lost is None:
            self.lost = PeerLostError(
                f"{self.describe()} left the sharded table on {type(error).__name__}, without "
                "meeting the other ranks: the table stays at its last checkpoint"
            )

    def begin(self, doing: int, step: int, generation: int) -> None:
        """The header of an exchange that moves no tensors (a checkpoint, a load, close)."""
        self._header(doing, step, generation, [])

    def agree(self, error: BaseException | None, what: str, result: Any = None) -> Any:
        """Every rank's outcome of ``what``: raises on every rank if one failed, else returns
        rank 0's ``result``."""
        mine = None if error is None else f"{type(error).__name__}: {error}"
        outcomes: list[Any] = [None] * self.size
        self._call(what, lambda: dist.all_gather_object(outcomes, (mine, result), group=self.group))
        failed = [(r, e) for r, (e, _) in enumerate(outcomes) if e is not None]
        if failed:
            if error is not None:
                raise error
            rank, message = failed[0]
            raise ShardMismatchError(f"rank {rank} failed {what}: {message}")
        return outcomes[0][1]

    def every(self, value: Any, what: str) -> list[Any]:
        """Every rank's ``value`` (small: pickled), in rank order."""
        values: list[Any] = [None] * self.size
        self._call(what, lambda: dist.all_gather_object(values, value, group=self.group))
        return values

    def close(self) -> None:
        if self.lost is None:
            with contextlib.suppress(RuntimeError, ValueError):  # gone with the default group
                dist.destroy_process_group(self.group)
