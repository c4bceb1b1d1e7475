"""The row cache, the owner's side of the shared cache (``sharedrows.py``).

:class:`SharedRows` is the part that crosses processes: the row slab and its index, readable
without locks from any DataLoader worker (NOTE [ Seqlock reads of the shared cache ] there).
:class:`RowCache` is the owner's side: admission and eviction through a policy, optimizer state
for cached rows, dirty bits, and the write to the table that must happen before a dirty slot is
reused (invariant 3). Its writes to the shared rows go through :class:`SharedRows`, each inside
the slot's seqlock.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..errors import EmbedpipeError
from .copies import PREPARE_RETRY, Copy, Prepared, find_sorted, from_copies
from .policy import LRU
from .sharedrows import SharedRows, take_rows

#: Training batches whose uncached rows are kept for their step (``RowCache.stage``).
MAX_STAGED = 16

Fetch = Callable[[np.ndarray, str], np.ndarray]  # (ids, array name) -> rows, from the table
Store = Callable[[np.ndarray, np.ndarray, str], None]  # (ids, rows, array name) -> None


class CacheBrokenError(EmbedpipeError, RuntimeError):
    """An interruption left the cache in a state that cannot be trusted; the table on disk is
    untouched since its last checkpoint."""


@dataclass
class Pinned:
    """A step's ``ids`` and their ``slots`` (-1: not cached), pinned; the ``staged`` copies
    (newest first) the step may take its uncached rows from, or the ``prepared`` working copy
    (``at``: where the step's ids are in it, None where in the same order)."""

    ids: np.ndarray
    slots: np.ndarray
    staged: list[Copy]
    prepared: Prepared | None = None
    at: np.ndarray | None = None


@dataclass
class Update:
    """One optimizer step's working copy: ``rows`` and ``state`` (U, D) of ``ids``; ``slots`` -1
    where the id was not cached. The optimizer changes ``rows`` and ``state`` in place."""

    ids: np.ndarray
    slots: np.ndarray
    rows: np.ndarray
    state: dict[str, np.ndarray]
    #: :meth:`uncached`, already copied (:attr:`Prepared.before`)
    before: tuple[np.ndarray, dict[str, np.ndarray]] | None = None

    def uncached(self) -> Update:
        """A copy of the rows and state that are not cached (what
        :meth:`RowCache.write_uncached` writes to the table, and puts back if that write fails)."""
        rest = self.slots < 0
        if self.before is not None:
            return Update(self.ids[rest], self.slots[rest], *self.before)
        return Update(
            self.ids[rest],
            self.slots[rest],
            self.rows[rest],  # fancy indexing: copies
            {k: v[rest] for k, v in self.state.items()},
        )


class RowCache:
    """The owner's cache: ``cache_rows`` slots over a table reached through ``fetch``/``store``.

    ``state`` names the optimizer state arrays kept for cached rows (owner memory, not shared;
    loaded from the table the first time a row is updated). Memory: ``cache_rows x dim x itemsize``
    shared for the rows, as much again per state array, plus 8 bytes per table row (the shared
    ``slot_of`` and ``last_updated``). Not thread-safe: the pipe serialises callers with one lock.
    """

    def __init__(
        self,
        shared: SharedRows,
        policy: LRU,
        fetch: Fetch,
        store: Store,
        *,
        state: tuple[str, ...] = (),
    ) -> None:
        self.shared = shared
        self.policy = policy
        if hasattr(policy, "attach"):
            policy.attach(shared.slot_of, shared.slot_id)
        self.fetch = fetch
        self.store = store
        size, dim = shared.rows.shape
        self.dirty = np.zeros(size, dtype=bool)
        self.state = {name: np.zeros((size, dim), dtype=shared.rows.dtype) for name in state}
        self.state_loaded = np.zeros(size, dtype=bool)
        self.pinned = np.zeros(size, dtype=bool)  # slots an optimizer step is computing on
        #: rows of training batches the cache lacks, as handed out: (ids, rows, tick) (``stage``)
        self.staged: deque[Copy] = deque(maxlen=MAX_STAGED)
        self.prepared: Prepared | None = None  # the last training batch's, to be its step's
        self._unprepared = 0  # steps left that prepare no copy (PREPARE_RETRY)
        self.last_admitted = 0  # rows the last hand-off admitted: about what the next evicts
        #: A cache of every row of the table never evicts: its admissions take free slots, its
        #: policy keeps no use counts (20% of a training batch's hand-off, measured), and no rows
        #: are written ahead of evictions that never come.
        self.holds_table = size >= len(shared.slot_of)
        self.clock = 0  # ticks: one per applied step (and one per reset); published to workers
        self.last_updated = np.zeros(len(shared.slot_of), dtype=np.int32)  # tick of last change
        self.shared.publish(0)
        self.counts = dict.fromkeys(
            ("evictions", "rows_read", "rows_written", "cleaned_ahead", "staged", "prepared"), 0
        )
        self._broken: str | None = None  # what was interrupted, once the cache cannot be trusted
        #: The table's writes, one at a time: a step's :meth:`write_uncached` runs outside the
        #: owner's lock, beside a hand-off's evictions (a chunk is copied on write: not twice).
        self.io_lock = threading.Lock()
        self._counting = threading.Lock()

    # ----------------------------------------------------------------- hand-off (main thread)
    def current(self, ids: np.ndarray) -> np.ndarray:
        """The newest rows of ``ids``: from the cache where cached, else from the table."""
        self._check()
        slots = self.shared.slot_of[ids].astype(np.int64)
        cached = slots >= 0
        rows = take_rows(self.shared.rows, np.maximum(slots, 0))  # the uncached: read below
        if not cached.all():
            rows[~cached] = self._fetch(ids[~cached], "weight")
        return rows

    def admit(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Record a batch's use of ``ids`` (unique) and cache those the policy admits, with ``rows``.

        Frees slots through the policy, writing dirty victims to the table first; never evicts a
        row an optimizer step is working on, nor one of this batch unless the policy says
        (``keeps_batch``) the batch's copy is all it needs. Safe to interrupt anywhere:
        what is done is consistent, the rest is not done.
        """
        self._check()
        if self.shared.cache_rows == 0:
            return
        slots = self.shared.slot_of[ids].astype(np.int64)
        new = np.flatnonzero(slots < 0)
        if len(new):
            if self.holds_table:  # a free slot for every row: no policy to ask
                admitted, free = new, np.flatnonzero(self.shared.slot_id < 0)[: len(new)]
            else:
                keep = np.flatnonzero(self.pinned)
                if self.policy.keeps_batch:
                    keep = np.concatenate([slots[slots >= 0], keep])
                chosen, free = self.policy.plan(ids[new], keep, self.shared.slot_id)
                admitted = new[chosen]
            self._replace(free, ids[admitted], rows[admitted])
            # where the batch's ids are now (unless the policy keeps them, the batch has its copy:
            # its own rows may have gone for its misses)
            slots = self.shared.slot_of[ids].astype(np.int64)
            self.last_admitted = len(admitted)
        if not self.holds_table:
            self.policy.record(ids, slots)

    def unfilled_bytes(self) -> int:
        """Memory this cache will still take as it fills (NOTE [ A cache that fills past the
        memory ] in ``budget.py``): its shared block's pages not yet touched (the kernel's count
        of the block's pages), and that share of its optimizer state (zeros not yet touched)."""
        size, fresh = len(self.shared.block.mmap), self.shared.rows.nbytes
        fresh += self.shared.version.nbytes  # the parts of the block made untouched (zeros)
        untouched = max(0, size - os.fstat(self.shared.block.fd).st_blocks * 512)
        state = sum(array.nbytes for array in self.state.values())
        return untouched + state * min(untouched, fresh) // max(1, fresh)

    # ----------------------------------------------------------------- writeback thread
    def pin(self, ids: np.ndarray, key: tuple[int, int] | None = None) -> Pinned:
        """Pin the cached rows of ``ids`` (unique) for an optimizer step, with their state
        loaded: no admission evicts them until :meth:`put_back`, and only the step changes them,
        so :meth:`gather` can copy them outside the owner's lock while hand-offs go on. Takes
        the staged copies of the batches handed out so far: they are in this step, or never
        will be; and the prepared working copy where it is of the step before (``key``: the
        generation and the step number before this one) and holds every id of this step."""
        self._check()
        slots = self.shared.slot_of[ids].astype(np.int64)
        s = slots[slots >= 0]
        self._load_state(s)
        self.pinned[s] = True
        prepared, self.prepared, at = self.prepared, None, None
        if prepared is not None:
            fits = prepared.key == key and len(ids) > 0 and len(prepared.ids) > 0
            if fits:
                hit, at = find_sorted(prepared.ids, ids)
                fits = bool(hit.all())
            self._unprepared = 0 if fits else PREPARE_RETRY  # the loop's pattern: copies wasted
            if not fits:
                self.staged.append(prepared.as_copy())
                prepared = None
            elif len(ids) == len(prepared.ids) and (at == np.arange(len(ids))).all():
                at = None  # the batch's own ids, in its order: no copy
        elif self._unprepared:
            self._unprepared -= 1
        staged = list(reversed(self.staged))
        self.staged.clear()
        return Pinned(ids, slots, staged, prepared, at)

    def gather(self, ids: np.ndarray, pinned: Pinned | None = None) -> Update:
        """Copies of the rows and state of ``ids`` (unique) for an optimizer step, pinned by
        :meth:`pin` (under the owner's lock; this copy needs none) or here."""
        pinned = self.pin(ids) if pinned is None else pinned
        slots = pinned.slots
        prepared = pinned.prepared
        if prepared is not None:  # made at the batch's hand-off: the step copies nothing
            self.counts["staged"] += int((slots < 0).sum())
            self.counts["prepared"] += 1
            if pinned.at is None:
                same = np.array_equal(slots < 0, prepared.slots < 0)  # else some were evicted
                before = prepared.before if same else None
                return Update(ids, slots, prepared.rows, prepared.state, before)
            take = {k: take_rows(v, pinned.at) for k, v in prepared.state.items()}
            return Update(ids, slots, take_rows(prepared.rows, pinned.at), take)
        rest = np.flatnonzero(slots < 0)
        rows, state = self._cached(slots)
        if len(rest):  # the batches' staged copies first, the table for the others
            dim = rows.shape[1]
            found, staged = from_copies(
                pinned.staged, ids[rest], self.last_updated, dim * self.staged_width, rows.dtype
            )
            got, lack = rest[found], rest[~found]
            rows[got] = staged[found, :dim]
            for k, name in enumerate(self.state, 1):
                state[name][got] = staged[found, k * dim : (k + 1) * dim]
            self.counts["staged"] += len(got)
            if len(lack):
                rows[lack] = self._fetch(ids[lack], "weight")
                for name in self.state:
                    state[name][lack] = self._fetch(ids[lack], name)
        return Update(ids, slots, rows, state)

    def _cached(
        self, slots: np.ndarray, rows: bool = True
    ) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
        """Copies of the rows (``rows``: else None) and state in ``slots``; where a slot is -1,
        slot 0's, for the caller to replace."""
        at = np.maximum(slots, 0)
        state = {k: take_rows(v, at) for k, v in self.state.items()}
        return take_rows(self.shared.rows, at) if rows else None, state

    @property
    def staged_width(self) -> int:
        """Rows of width ``dim`` a staged copy holds side by side: the row and its state."""
        return 1 + len(self.state)

    def stage(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        key: tuple[int, int] | None = None,
        stepped: tuple[np.ndarray, dict[str, np.ndarray]] | None = None,
        whole: bool = False,
        given: bool = False,
    ) -> None:
        """Keep the rows of a training batch that are not cached, with their optimizer state
        read from the table now (a copy, current at this tick), for its optimizer step, so the
        step reads neither (the last :data:`MAX_STAGED` batches). Its cached rows get their state
        now too: the hand-off runs while the training process computes; the step waits on it.

        With ``key`` (the generation and the step the batch's rows are final after), the
        batch's whole working copy is prepared instead, every row and its state: ``stepped``
        holds the mask of the ids that step changed and their new state. ``rows`` need hold
        only the rows the cache lacks and those the step changed, unless ``whole``: it holds
        every row, final, and the copy is a copy of it (one copy, not a gather of the cached rows
        and two overlays), or, ``given`` too, ``rows`` itself, which the caller hands over (an
        owner process whose hand-off read the batch ahead). Not for the :data:`PREPARE_RETRY`
        steps after a step that could not take its copy.
        """
        slots = self.shared.slot_of[ids].astype(np.int64)
        self._load_state(slots[slots >= 0])
        missing = np.flatnonzero(slots < 0)
        if key is not None and not self._unprepared:
            # the cached rows from the cache (an owner process has only the others in ``rows``)
            mine, state = self._cached(slots, rows=not whole)
            kept = rows[missing]  # a copy: kept, as the uncached rows before the step
            kept_state = {
                name: self._fetch(ids[missing], name) if len(missing) else array[missing]
                for name, array in state.items()
            }
            if whole:
                mine = rows if given else rows.copy()
            else:
                mine[missing] = kept
                if stepped is not None:  # the last step's rows, which the cache may not have yet
                    mine[stepped[0]] = rows[stepped[0]]
            for name, values in kept_state.items():
                state[name][missing] = values
            if stepped is not None:  # ... and their state
                for name, values in stepped[1].items():
                    state[name][stepped[0]] = values
                changed = np.flatnonzero(stepped[0][missing])  # (``kept`` has their rows)
                for name, values in kept_state.items():
                    values[changed] = state[name][missing[changed]]
            if self.prepared is not None:  # two batches in one step: both are its copies
                self.staged.append(self.prepared.as_copy())
            before = (kept, kept_state)
            self.prepared = Prepared(key, ids, slots, mine, state, self.clock, before)
        elif len(missing):
            held = ids[missing]
            parts = [rows[missing], *(self._fetch(held, name) for name in self.state)]
            self.staged.append((held, np.hstack(parts) if len(parts) > 1 else parts[0], self.clock))

    def write_uncached(self, update: Update, before: Update) -> None:
        """Write the updated rows that were not cached at :meth:`gather` to the table, first: if
        the write fails, the cache is untouched. ``before`` holds those rows and their state as
        they were (:meth:`Update.uncached`): if the write fails midway, the rows already written
        are put back, so the table holds the step before, whole, and the error is raised; if even
        that fails the cache is marked broken. Touches only the table and the update: the owner
        runs it outside its lock (its table writes are serialised on their own)."""
        ids, rows, state = update.ids, update.rows, update.state
        rest = np.flatnonzero(update.slots < 0)
        if len(rest):
            try:
                self._store(ids[rest], rows[rest], {k: v[rest] for k, v in state.items()})
            except BaseException as e:
                self._roll_back(before, e)
                raise

    def put_back(self, update: Update) -> int:
        """Put the updated rows into their pinned slots (after :meth:`write_uncached`); returns
        the clock tick of this update, for the owner to publish.

        A row that was not cached at :meth:`gather` is in the table already; if a hand-off has
        admitted it since, its cached copy is replaced too, so no update is lost.
        """
        ids, slots, rows, state = update.ids, update.slots, update.rows, update.state
        cached = slots >= 0
        rest = np.flatnonzero(~cached)
        with self._guard("an optimizer step's update of the cached rows"):
            if len(rest):
                now = self.shared.slot_of[ids[rest]].astype(np.int64)
                admitted = now >= 0
                if admitted.any():
                    picked = rest[admitted]
                    self._put_rows(
                        now[admitted], rows[picked], {k: v[picked] for k, v in state.items()}
                    )
                    self.dirty[now[admitted]] = False  # the table has it already
                # the cached ones go on below (every row cached: all of them, with no copy)
                slots, rows = slots[cached], rows[cached]
                state = {k: v[cached] for k, v in state.items()}
            self._put_rows(slots, rows, state)
            self.pinned[slots] = False
            self.clock += 1
            self.last_updated[ids] = self.clock
        return self.clock

    def _roll_back(self, before: Update, error: BaseException) -> None:
        """Put the rows and state of a step whose table write failed back as they were."""
        try:
            self._store(before.ids, before.rows, before.state)
        except BaseException as again:
            self._broken = f"an optimizer step's table write failed ({error}) and could not be undone ({again})"

    def unpin(self, slots: np.ndarray) -> None:
        """Release the slots of a step that failed between :meth:`pin` and :meth:`put_back`."""
        self.pinned[slots[slots >= 0]] = False

    def _put_rows(self, slots: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray]) -> None:
        self.shared.overwrite(slots, rows)
        for name, array in self.state.items():
            array[slots] = state[name]
        self.state_loaded[slots] = True
        self.dirty[slots] = True

    def clean_ahead(self) -> int:
        """Write the coldest dirty rows (about two hand-offs' worth of evictions) to the table, so
        that the hand-offs that evict them find them clean; returns how many were written.

        Runs only once the cache is full (before that nothing is evicted), and never where it
        holds the whole table (nothing is ever evicted).
        """
        self._check()
        wanted = 2 * self.last_admitted
        if wanted == 0 or self.holds_table or (self.shared.slot_id < 0).sum() >= wanted:
            return 0
        slots = self.policy.coldest_of(wanted, self.dirty & ~self.pinned, self.shared.slot_id)
        self._write_back(slots)
        self.counts["cleaned_ahead"] += len(slots)
        return len(slots)

    def flush(self) -> int:
        """Write every dirty row (and its state) to the table; returns how many."""
        self._check()
        slots = np.flatnonzero(self.dirty)
        self._write_back(slots)
        return len(slots)

    def reset(self) -> None:
        """Empty the cache without writing anything back (the table was replaced under it): every
        lookup in flight is re-read at hand-off, since every row counts as changed now."""
        with self._guard("emptying the cache"):
            self.shared.clear(np.flatnonzero(self.shared.slot_id >= 0))
            self.policy.forget(np.arange(self.shared.cache_rows))
            self.dirty[:] = self.state_loaded[:] = self.pinned[:] = False
            self.prepared, self._unprepared = None, 0
            self.clock += 1
            self.last_updated[:] = self.clock

    @property
    def broken(self) -> str | None:
        """What was interrupted, if the cache can no longer be trusted."""
        return self._broken

    # ----------------------------------------------------------------- internals
    def _replace(self, slots: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Give ``slots`` to ``ids`` with ``rows``, evicting what they hold."""
        self._evict(slots[self.shared.slot_id[slots] >= 0])
        self.policy.forget(slots)
        self.state_loaded[slots] = False  # before the slots take their new ids
        self.dirty[slots] = False
        self.shared.put(slots, ids, rows)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Mark the cache broken if the block does not run to its end (an exception, a signal)."""
        self._check()
        try:
            yield
        except BaseException:
            self._broken = f"{what} was interrupted"
            raise

    def _check(self) -> None:
        if self._broken is not None:
            raise CacheBrokenError(
                f"the embedding cache cannot be trusted ({self._broken}); the table on disk is "
                "still at its last checkpoint: close this pipe and make a new one"
            )

    def _evict(self, slots: np.ndarray) -> None:
        self._write_back(slots[self.dirty[slots]])  # invariant 3: before the slot is released
        self.state_loaded[slots] = False
        self.shared.clear(slots)
        self.counts["evictions"] += len(slots)

    def _write_back(self, slots: np.ndarray) -> None:
        if len(slots) == 0:
            return
        ids = self.shared.slot_id[slots]
        state = {name: array[slots] for name, array in self.state.items()}
        self._store(ids, self.shared.rows[slots], state)
        self.dirty[slots] = False

    def _load_state(self, slots: np.ndarray) -> None:
        missing = slots[~self.state_loaded[slots]]
        if len(missing) and self.state:
            ids = self.shared.slot_id[missing]
            for name, array in self.state.items():
                array[missing] = self._fetch(ids, name)
        self.state_loaded[missing] = True

    def count_read(self, rows: int) -> None:
        """Rows read from the table, counted: a step's reads run outside the owner's lock."""
        with self._counting:
            self.counts["rows_read"] += rows

    def _fetch(self, ids: np.ndarray, name: str) -> np.ndarray:
        if name == "weight":
            self.count_read(len(ids))
        return self.fetch(ids, name)

    def _store(self, ids: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray]) -> None:
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():  # one pass over the chunks
            order = np.argsort(ids)
            ids, rows = ids[order], rows[order]
            state = {name: values[order] for name, values in state.items()}
        with self.io_lock:
            self.store(ids, rows, "weight")
            for name, values in state.items():
                self.store(ids, values, name)
            self.counts["rows_written"] += len(ids)
