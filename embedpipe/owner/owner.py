"""The owner: what the training process does for an :class:`~embedpipe.EmbeddingPipe`.

The owner holds the table, the shared cache and the writeback thread (invariant 1: it is the only
writer). Three kinds of code call it:

- the batch, in the training loop: :meth:`Owner.hand_off` when it is claimed and
  :meth:`Owner.refresh` when the model reads it (NOTE [ Rows are final when the model first
  reads them ] in ``batch.py``);
- the gradient hook, during backward: :meth:`Owner.on_grad`, which adds to the table's pending
  gradient (``gradient.py``), and the optimizer step that takes it: :meth:`Owner.submit`;
- the writeback thread: :meth:`Owner.apply` per step, :meth:`Owner.clean_ahead` when idle.

Its checkpoints, snapshots and close are the functions of ``durability.py``, which its methods of
the same names call. An owner owns a range of the table's rows, all of them in one process. A
pipe sharded over a process group's ranks has one owner a rank, the only writer of its range:
:class:`~embedpipe.ranks.shard_owner.ShardOwner`, which meets the others in ``shards.py``.

The hand-off and the writeback thread both change the cache; ``self.lock`` serialises them.

The owner keeps no reference to the user's ``EmbeddingPipe`` handle (the writeback thread holds
the owner, so a reference back would keep a dropped pipe alive for good). The handle closes the
owner when the user closes it, or when it is collected (``pipe/handle.py``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..cache import budget, ordering
from ..cache.policy import LRU, Lookahead
from ..cache.ring import BatchRing
from ..cache.rowcache import RowCache
from ..cache.sharedrows import SharedRows
from ..cache.shm import SharedBlock
from ..errors import TableWriteError
from ..ids import as_ids, unique_inverse
from ..optim import RowOptimizer, update_in_float32
from ..store.checkpoints import Checkpoint
from ..store.table import Table
from ..worker.batch import EmbeddedBatch
from ..worker.looked_up import LookedUp
from . import durability, lookahead, reads
from .batchorder import Ahead
from .computed import Computed
from .foresee import BatchIds, IdsReader
from .gradcheck import refuse_non_finite, without_padding
from .gradient import TableGradient
from .lookahead import Stream
from .reads import ReadAhead
from .writeback import Writeback

#: The owner's counters (``stats()``); ``relookups``: batches whose ids were edited in place
#: after their lookup; ``remote_rows``, ``served_rows``: a sharded pipe's rows from other ranks,
#: and to them; ``read_ahead``: hand-offs whose rows were read before their claim (``reads.py``).
COUNTS = ("batches", "hits", "misses", "deferred", "filled_ahead", "refreshed", "relookups",
          "ring_overruns", "remote_rows", "served_rows", "read_ahead")  # fmt: skip


#: Hand-offs between two looks at the memory a filling cache will still take (NOTE [ A cache
#: that fills past the memory ] in ``cache/budget.py``): the pages it took, then the room left.
FILL_CHECK_EVERY = 8


def take_options(
    owner: Any, table: Table, optimizer: RowOptimizer | None, options: dict[str, Any], owns: bool
) -> None:
    """The attributes every owner has (this one, and an owner process's client), from the
    table and the pipe's options."""
    owner.table = table
    #: The rows the owner keeps, caches and steps, ``[lo, hi)``: all of them, unless sharded.
    owner.owned = (0, table.num_rows)
    owner.optimizer = optimizer
    owner.consistency = options["consistency"]
    owner.max_staleness = options["max_staleness"] or 0
    owner.padding_idx = options["padding_idx"]
    owner.check_finite = options["check_finite"]
    owner.owns_table = owns
    owner.pid = os.getpid()  # a forked child inherits a copy of the owner, and owns nothing
    #: Workers read the shared cache, unless this CPU cannot order that (``ordering.py``)
    owner.workers_read_shared = ordering.MODE != "owner"
    owner.closed = False
    owner.generation = 0  # snapshots loaded: step numbers restart, batches claimed before are stale


class Owner:
    """The owner side of a pipe; see the module docstring. Options are validated by the pipe."""

    #: The ranks a sharded table is split over (``ShardOwner``); None: one process.
    shards = None

    def __init__(
        self,
        table: Table,
        policy: LRU,
        optimizer: RowOptimizer | None,
        options: dict[str, Any],
        *,
        owns_table: bool,
        parameter: torch.nn.Parameter | None = None,
    ) -> None:
        take_options(self, table, optimizer, options, owns_table)
        state = tuple(optimizer.state_init()) if optimizer is not None else ()
        self.shared = SharedRows(table.num_rows, policy.cache_rows, table.dim, table.dtype)
        self.cache = RowCache(self.shared, policy, self._fetch, self._store, state=state)
        self.lock = threading.Lock()
        self.start_step = table.step
        self.writeback, self.gradient = None, None  # a Writeback, a TableGradient: to train
        if optimizer is not None:
            self.writeback = Writeback(self.apply, idle=self.clean_ahead, step=table.step)
            self.gradient = TableGradient(table, optimizer, self.check_step, self.submit, parameter)
        self.counts = dict.fromkeys(COUNTS, 0)
        self._filling = policy.cache_rows > 0  # the cache may still fill: NOTE in cache/budget.py
        self._unfilled: int | None = None  # what it would still take at the last look
        self._step_in_progress: int | None = None  # for the messages of failed table writes
        self._computed: Computed | None = None  # the last step's rows, once computed
        #: The policy sees the loader's next batches (``lookahead.py``); ``stream`` feeds it.
        #: Not when the cache holds the whole table: nothing to choose then.
        self.looks_ahead = isinstance(policy, Lookahead) and 0 < policy.cache_rows < table.num_rows
        self.stream: Stream | None = None
        #: ``inputs_embeds`` as the models offloaded to this table take them (their dtype, their
        #: embedding's scale: ``placeholder.finish_embeds``); the pipe hands it down.
        self.finish_embeds: Callable[..., torch.Tensor] = lambda embeds, ids: embeds
        self.blind = False  # foresight kept missing: no more streams (``look_blind``)

    # ------------------------------------------------------------------------- training loop
    @property
    def trains(self) -> bool:
        return self.optimizer is not None

    @property
    def submitted(self) -> int:
        """The table's steps so far, applied or queued (the table's own step once applied)."""
        return self.writeback.submitted

    @property
    def trains_now(self) -> bool:
        """The table takes gradients: it has an optimizer and its parameter requires grad
        (``model.get_input_embeddings().requires_grad_(False)`` freezes it, as an embedding)."""
        return self.gradient is not None and self.gradient.trains()

    def before_lookup(self) -> None:
        """Before a lookup in the training loop (``num_workers=0``), in exact mode: wait for the
        steps submitted (no dearer than at the claim), so the lookup reads no row twice."""
        if self.writeback is not None and self.consistency == "exact":
            self.writeback.wait()

    def claim(self, item: LookedUp, ring: BatchRing | None, pin: bool) -> EmbeddedBatch:
        """A worker's lookup as the loop's batch: its ring slot's rows, then :meth:`hand_off`."""
        rows = item.rows
        if item.slot >= 0 and ring is not None:
            rows = ring.read(item.slot, item.tag, len(item.unique_ids))  # None: overwritten
        return self.hand_off(item, rows, pin)

    def hand_off(self, item: LookedUp, rows: np.ndarray | None, pin: bool = False) -> EmbeddedBatch:
        """The batch of a worker's lookup (main thread): ``rows``, its copy of its unique rows
        (None: the owner reads them, its ring slot was overwritten or workers do not read shared
        memory on this CPU), made final by :meth:`final_rows`; ``pin``: in pinned memory."""
        rows, step, tick = self.final_rows(item, rows)
        return EmbeddedBatch._handed_off(item, rows, self, pin, step, tick, self.generation)

    def final_rows(
        self,
        item: LookedUp,
        rows: np.ndarray | None,
        deliver: Callable[[np.ndarray, np.ndarray | None, int, int], None] | None = None,
        ahead: ReadAhead | None = None,
    ) -> tuple[np.ndarray, int, int]:
        """A lookup's rows as of the steps applied so far, with their step and clock tick.

        Reads the misses left to the owner and re-reads the rows changed since the lookup began,
        then waits for the writeback as the consistency mode requires (NOTE [ A hand-off reads
        while the step computes ] in ``computed.py``), re-reads what changed meanwhile, admits
        the misses; ``deliver(rows, stale, step, tick)`` runs once the rows are final, before the
        admission (an owner process sends them then: the admission runs while the training
        process goes on); ``stale``: the positions re-read, or None when the owner read them all.
        ``ahead``: the lookup's rows read before its claim (NOTE [ A hand-off read ahead ] in
        ``reads.py``), if they are its ids'.
        """
        self.check_open()
        if self.counts["batches"] == 0 and self.gradient is not None:
            self.gradient.see_optimizers()  # before a hand-written warmup changes their rates
        if self.writeback is not None:  # a failed step's error, before any read of the rows
            self.writeback.raise_error()
        ids = item.unique_ids
        with self.lock:
            rows, newer, read_at, hits, misses = reads.read_rows(self, item, rows, ahead)
        self._wait_for_rows()  # in exact mode, the reads above ran while the last step computed
        with self.lock:
            computed = self._last_computed()
            step = self.applied_step if computed is None else computed.step  # the rows hold it
            # the rows the last step changed: taken from `computed`, and re-read from nowhere else
            changed, where = np.zeros(len(ids), dtype=bool), None
            if computed is not None:
                changed, where = computed.find(ids)
            since = self.cache.last_updated[ids] > read_at  # steps applied since (or a load)
            again = np.flatnonzero(since & ~changed)
            rows[again] = self.cache.current(ids[again])
            stale = None if newer is None else np.flatnonzero(newer | since | changed)
            if stale is not None or ahead is not None:  # (read ahead: the rows changed since)
                self.counts["refreshed"] += (
                    int((since | changed).sum()) if stale is None else len(stale)
                )
            if where is not None:
                rows[changed] = computed.rows[where]
            tick = self.cache.clock
            if deliver is not None:
                deliver(rows, stale, step, tick)
            if self.writeback is not None:
                self.writeback.handed_off(step)  # its writes go on now (NOTE in writeback.py)
            if self.looks_ahead:
                self.cache.policy.training = self.trains_now
            mine, my_rows = ids, rows
            owned = self.owns(ids)
            if owned is not None:  # the other rows come from their owners at the read
                mine, my_rows = ids[owned], rows[owned]
            self.cache.admit(mine, my_rows)
            if self.trains_now:  # its step reads them not again (NOTE in cache/copies.py)
                key = (self.generation, step) if self.takes_computed_rows else None
                new = {} if where is None else {k: v[where] for k, v in computed.state.items()}
                # every row: in this process, or read ahead (an owner process's has only some)
                whole = owned is None and (deliver is None or ahead is not None)
                given = whole and deliver is not None  # the owner process's, handed over
                self.cache.stage(mine, my_rows, key, (changed, new), whole, given)
                if self.looks_ahead:
                    self.cache.policy.hold(ids)
        self.counts["batches"] += 1
        self.counts["hits"] += hits
        self.counts["misses"] += misses
        if self._filling and self.counts["batches"] % FILL_CHECK_EVERY == 0:  # NOTE in budget.py
            self._look_at_the_fill()
        return rows, step, tick

    def _look_at_the_fill(self) -> None:
        """Warn if what the cache will still take will not fit; looked at (the room left: 11
        file reads, ~0.6 ms) only where the cache took pages since the last look: a cache whose
        batches' rows are all in it (a whole table cached) takes no more."""
        unfilled = self.cache.unfilled_bytes()
        if unfilled == self._unfilled:
            return
        self._unfilled, self._filling = unfilled, False  # once, even if it raises (-W error)
        self._filling = budget.warn_if_fill_will_not_fit(unfilled, self.shared.cache_rows)

    def relookup(self, batch: EmbeddedBatch, ids: torch.Tensor) -> None:
        """``batch``'s ids were edited in place after its rows were looked up: gather the rows
        of the new ones, as a hand-off would (NOTE [ Ids edited in place ] in ``batch.py``)."""
        self.check_open()
        edited = as_ids(ids.detach().cpu(), self.table.num_rows, what="edited batch ids")
        unique_ids, inverse = unique_inverse(edited, self.table.num_rows)
        rows, step, tick = self.current_rows(unique_ids)
        batch._relooked(unique_ids, inverse, rows, step, tick, self.generation)

    def current_rows(self, unique_ids: np.ndarray) -> tuple[np.ndarray, int, int]:
        """The newest rows of ``unique_ids`` (ids edited in place), under a hand-off's waits,
        with their step and clock tick."""
        self._wait_for_steps()
        step = self.applied_step
        with self.lock:
            rows = self.cache.current(unique_ids)
            tick = self.cache.clock
        self.counts["relookups"] += 1
        return rows, step, tick

    def refresh(self, batch: EmbeddedBatch) -> None:
        """Make a batch's rows final as the model reads them: if steps were submitted since its
        rows were read (it waited in a prefetcher), wait for them and re-read the rows they
        changed. Nothing to do in the common case, a batch read before the next step."""
        if self.writeback is None:
            return
        if (
            batch.step >= self.writeback.submitted - self.behind
            and batch.generation == self.generation
        ):
            return
        self.check_open()
        stale, fresh, step, tick = self.changed_rows(batch._unique_ids.numpy(), batch.tick)
        batch._refreshed(
            torch.from_numpy(stale), torch.from_numpy(fresh), step, tick, self.generation
        )

    def changed_rows(self, ids: np.ndarray, since: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Which of ``ids`` steps changed after clock tick ``since`` (waiting for the steps
        submitted, as a hand-off does), their newest rows, and the step and tick they are at."""
        self._wait_for_steps()
        step = self.applied_step
        with self.lock:
            stale = np.flatnonzero(self.cache.last_updated[ids] > since)
            fresh = self.cache.current(ids[stale])
            tick = self.cache.clock
        self.counts["refreshed"] += len(stale)
        return stale, fresh, step, tick

    def start_stream(
        self, dataset: Any, ids_key: str, order: Ahead, source: Any, defer: SharedBlock | None
    ) -> Stream | None:
        """A loader's epoch whose order is known: it feeds the lookahead policy's window, unless
        another loader's epoch does, or foresight is off (then None)."""

        def make() -> Stream:  # the fork comes first, before the stream's threads exist
            ids_of = BatchIds(dataset, ids_key, self.padding_idx, self.table.num_rows)
            reader = IdsReader(order.inner, ids_of, first=order.drawn)
            return Stream(self, reader, order.drawn, source, defer, order)

        return lookahead.start_stream(self, make)

    def end_stream(self, stream: Stream) -> None:
        stream.stop()
        if self.stream is stream:
            self.stream = None

    def look_blind(self, why: str) -> None:
        lookahead.look_blind(self, why)

    @property
    def behind(self) -> int:
        """Steps a batch's rows may miss: 0 in exact mode, ``max_staleness`` in bounded mode."""
        return 0 if self.consistency == "exact" else self.max_staleness

    def _wait_for_steps(self) -> None:
        if self.writeback is not None:
            self.writeback.wait(self.behind)

    @property
    def takes_computed_rows(self) -> bool:
        """Exact mode over the whole table: a hand-off takes the last step's rows as computed, the
        step writes the table outside the lock (NOTE in ``computed.py``); else under it."""
        return self.consistency == "exact" and self.owned == (0, self.table.num_rows)

    def _wait_for_rows(self) -> None:
        """A hand-off's wait: as :meth:`_wait_for_steps`, but in exact mode over the whole
        table only until the last step's rows are computed (then :meth:`_last_computed`)."""
        if not self.takes_computed_rows:
            self._wait_for_steps()
        elif self.writeback is not None:
            self.writeback.wait(0, computed=True)

    def _last_computed(self) -> Computed | None:
        """Under the lock, after the wait: the last step's computed rows, which the hand-off
        takes (exact mode, this snapshot, not applied yet); None: the cache has every step.
        Looked at here, not at the wait: another thread's step or snapshot load may come
        between (NOTE in ``computed.py``)."""
        exact = self.takes_computed_rows and self.writeback is not None
        computed = self._computed if exact else None
        if computed is None or computed.generation != self.generation:
            return None
        return computed if self.writeback.applied < computed.step else None

    def owns(self, ids: np.ndarray) -> np.ndarray | None:
        """Which of ``ids`` this owner keeps, as a mask; None when it keeps them all."""
        lo, hi = self.owned
        if lo == 0 and hi == self.table.num_rows:
            return None
        return (ids >= lo) & (ids < hi)

    def on_grad(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """The gradient hook (inside backward): add the rows' gradient to the table's pending
        gradient. The padding row gets none, as in ``nn.Embedding``: not even in a global norm."""
        if self.closed:
            raise RuntimeError(
                "this EmbeddingPipe is closed: the embedding gradient of this batch cannot be applied"
            )
        self._add_gradient(*without_padding(unique_ids, grad, self.padding_idx))

    def _add_gradient(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        self.gradient.add(unique_ids, grad)

    def check_step(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Refuse a step of a closed pipe, or of a non-finite gradient (before it is taken)."""
        self.check_open()
        if self.check_finite:
            refuse_non_finite(ids, grad, self.writeback.submitted + 1)

    def submit(self, ids: torch.Tensor, grad: torch.Tensor, lr: float | None) -> None:
        """Queue one optimizer step of the rows ``ids`` (the pending gradient, taken by an
        optimizer step or ``pipe.step()``, checked by :meth:`check_step`)."""
        grad = grad.detach().to("cpu", getattr(torch, self.table.dtype.name))
        ids = ids.numpy()
        owned = self.owns(ids)
        if owned is not None:  # every rank took the same step: apply this rank's rows
            ids, grad = ids[owned], grad[torch.from_numpy(owned)]
        self.writeback.submit(ids, grad, lr)

    # ------------------------------------------------------------------------- writeback thread
    def apply(self, ids: np.ndarray, grad: torch.Tensor, step: int, lr: float | None) -> None:
        """One optimizer step (``lr`` None: the optimizer's own); the update and the table write
        run outside the lock, so hand-offs go on: in exact mode a hand-off waits only until the
        new rows are computed, and takes the step's from there (NOTE [ A hand-off waits for
        the step's rows, not its writes ])."""
        with self.lock:
            pinned = self.cache.pin(ids, (self.generation, step - 1))
            if self.looks_ahead:
                self.cache.policy.release()  # the step's rows are pinned now
        try:
            work = self.cache.gather(ids, pinned)  # outside the lock: only this step changes them
            before = work.uncached()  # for a failed table write
            update_in_float32(self.optimizer, work.rows, work.state, grad, step, lr)
            self._computed = Computed(step, ids, work.rows, self.generation, work.state)
            self.writeback.computed_now(step)  # a hand-off waiting for this step goes on
            if self.takes_computed_rows:  # NOTE [ A step's writes wait for the hand-off after it ]
                self.writeback.hold(step)
            self._step_in_progress = step
            outside = self.takes_computed_rows  # else a hand-off must not see rows half-written
            if outside:
                self.cache.write_uncached(work, before)  # hand-offs go on meanwhile
            with self.lock:
                if not outside:
                    self.cache.write_uncached(work, before)
                tick = self.cache.put_back(work)
                self.shared.publish(tick)  # last: a lookup that saw the tick sees the rows
        except BaseException:
            with self.lock:
                self.cache.unpin(pinned.slots)
            raise
        finally:
            self._step_in_progress = None

    def clean_ahead(self) -> None:
        """Writeback thread, queue empty: write cold dirty rows while the loop is elsewhere."""
        if self.shared.cache_rows:
            with self.lock:
                self.cache.clean_ahead()

    # ------------------------------------------------------------------------- table I/O
    def _fetch(self, ids: np.ndarray, name: str) -> np.ndarray:
        return self.table._array(name).read(ids)

    def _store(self, ids: np.ndarray, rows: np.ndarray, name: str) -> None:
        try:
            self.table._store(ids, rows, name)
        except OSError as e:
            raise durability.write_error(self, e, "writing rows") from e

    @property
    def applied_step(self) -> int:
        return self.writeback.applied if self.writeback is not None else self.table.step

    # ---------------------------- checkpoints: ``durability.py`` (ShardOwner overrides some)
    def checkpoint(self) -> Checkpoint:
        """Apply every queued step, write every updated row and commit them as a checkpoint."""
        return durability.checkpoint(self)

    def _commit(self) -> Checkpoint:
        return durability.commit(self)

    def flush(self) -> None:
        """Apply what is queued and write every updated row to the table's live arrays."""
        durability.flush(self)

    def before_read(self) -> None:
        """Before a public read of the table (``table.read``): it sees the steps so far."""
        self.flush()

    def save(self, folder: str) -> Checkpoint:
        """Commit a checkpoint, then copy it into ``folder`` as a table of its own."""
        return durability.save(self, folder)

    def _snapshot(self, checkpoint: Checkpoint, folder: str) -> TableWriteError | None:
        return durability.snapshot(self, checkpoint, folder)

    def load(self, source: Table) -> None:
        """Make the table the snapshot ``source``, as the newest checkpoint."""
        durability.load(self, source)

    def _restore(self, source: Table) -> None:
        self.table._restore(source.root, self.optimizer)

    # ------------------------------------------------------------------------- lifecycle
    def close(self, raise_errors: bool = True) -> None:
        """Commit every step and release the table; can be called again after it raised."""
        durability.close(self, raise_errors)

    def _finish_close(self, error: BaseException | None, hung: bool) -> BaseException | None:
        return durability.finish_close(self, error, hung)

    def correct(self, error: object) -> None:
        """A commit followed ``error``: make a table write error say the step it reopens at."""
        durability.correct(self, error)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this EmbeddingPipe is closed; make a new one")

    def stats(self) -> dict[str, int]:
        cache = self.cache.counts
        return {
            **self.counts,
            # the lookups' misses they read themselves, and what the owner read
            "rows_read": self.counts["misses"] - self.counts["deferred"] + cache["rows_read"],
            **{k: cache[k] for k in ("rows_written", "evictions", "cleaned_ahead", "staged")},
            "prepared": cache["prepared"],
            "writeback_queue": self.writeback.pending if self.writeback else 0,
            "steps": self.applied_step - self.start_step,
            "cached_rows": int((self.shared.slot_id >= 0).sum()),
            "dirty_rows": int(self.cache.dirty.sum()),
        }
