"""The row cache: one block of shared memory that every worker reads and only the owner writes.

:class:`SharedRows` is the part that crosses processes: the row slab and its index, readable
without locks from any DataLoader worker. :class:`RowCache` is the owner's side: admission and
eviction through a policy, optimizer state for cached rows, dirty bits, and the write to the
table that must happen before a dirty slot is reused (invariant 3).

NOTE [ Seqlock reads of the shared cache ]
Only the owner changes a slot, and it does so between two increments of the slot's version::

    owner:   version[s] += 1 (odd)  ->  change slot_id / rows / slot_of  ->  version[s] += 1 (even)
    worker:  s = slot_of[id];  v1 = version[s];  copy rows[s];  check slot_id[s] == id;  v2 = version[s]
             the copy is good iff v1 == v2 and v1 is even and the slot still holds id

A worker never waits: a copy that fails the check is a miss, and the row is read from the table.
That read is never older than the cache was when the lookup began, because a dirty row is written
to the table before its slot is released (``RowCache._evict``), and an update that lands after the
lookup began is caught at hand-off by ``last_updated[id] > lookup_step`` (invariant 4).
The protocol relies on stores and loads not being reordered across numpy calls, which holds on
x86-64 (total store order); see docs/consistency.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .policy import LRU

Fetch = Callable[[np.ndarray, str], np.ndarray]  # (ids, array name) -> rows, from the table
Store = Callable[[np.ndarray, np.ndarray, str], None]  # (ids, rows, array name) -> None


def _shared(shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> torch.Tensor:
    return torch.full(shape, fill, dtype=dtype).share_memory_()


class SharedRows:
    """The shared arrays of the cache; pickles as shared-memory handles, not copies.

    ``rows`` (C, D) the cached rows; ``slot_id`` (C,) the id in each slot or -1; ``version`` (C,)
    the seqlock counters; ``slot_of`` (V,) the slot of each id or -1 (4 bytes per table row);
    ``clock[0]`` the number of optimizer steps applied (the owner's ``applied_step``).
    """

    def __init__(self, num_rows: int, cache_rows: int, dim: int, dtype: torch.dtype) -> None:
        self.tensors = {
            "rows": _shared((cache_rows, dim), dtype, 0),
            "slot_id": _shared((cache_rows,), torch.int64, -1),
            "version": _shared((cache_rows,), torch.int64, 0),
            "slot_of": _shared((num_rows,), torch.int32, -1),
            "clock": _shared((1,), torch.int64, 0),
        }
        self._views()

    def _views(self) -> None:
        for name, tensor in self.tensors.items():
            setattr(self, name, tensor.numpy())

    def __getstate__(self) -> dict[str, Any]:
        return {"tensors": self.tensors}  # torch's reducers share the memory, numpy would copy

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = state["tensors"]
        self._views()

    @property
    def cache_rows(self) -> int:
        return len(self.slot_id)

    @property
    def applied_step(self) -> int:
        return int(self.clock[0])

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Seqlock-validated copies of the cached rows of ``ids`` (unique, int64).

        Returns ``(rows, hit)``: ``rows`` (U, D) holds the row of every id with ``hit`` True
        (other rows are garbage). Never blocks; see the NOTE at the top of this module.
        """
        slots = self.slot_of[ids].astype(np.int64)
        out = np.empty((len(ids), self.rows.shape[1]), dtype=self.rows.dtype)
        cached = np.flatnonzero(slots >= 0)
        s = slots[cached]
        before = self.version[s]
        out[cached] = self.rows[s]
        good = (self.slot_id[s] == ids[cached]) & (before & 1 == 0)
        good &= self.version[s] == before
        hit = np.zeros(len(ids), dtype=bool)
        hit[cached[good]] = True
        return out, hit

    # The owner's writes, each inside the slot's seqlock. Slots must be unique.
    def put(self, slots: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
        """Give ``slots`` to ``ids`` with ``rows`` (the slots must be empty)."""
        self.version[slots] += 1
        self.slot_id[slots] = ids
        self.rows[slots] = rows
        self.slot_of[ids] = slots
        self.version[slots] += 1

    def overwrite(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """New contents for occupied ``slots``."""
        self.version[slots] += 1
        self.rows[slots] = rows
        self.version[slots] += 1

    def clear(self, slots: np.ndarray) -> None:
        """Empty ``slots``."""
        self.version[slots] += 1
        self.slot_of[self.slot_id[slots]] = -1
        self.slot_id[slots] = -1
        self.version[slots] += 1


@dataclass
class Update:
    """One optimizer step's working copy: ``rows`` and ``state`` (U, D) of ``ids``; ``slots`` -1
    where the id was not cached. The optimizer changes ``rows`` and ``state`` in place."""

    ids: np.ndarray
    slots: np.ndarray
    rows: np.ndarray
    state: dict[str, np.ndarray]


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
        step: int = 0,
    ) -> None:
        self.shared = shared
        self.policy = policy
        self.fetch = fetch
        self.store = store
        size, dim = shared.rows.shape
        self.dirty = np.zeros(size, dtype=bool)
        self.state = {name: np.zeros((size, dim), dtype=shared.rows.dtype) for name in state}
        self.state_loaded = np.zeros(size, dtype=bool)
        self.pinned = np.zeros(size, dtype=bool)  # slots an optimizer step is computing on
        self.last_admitted = 0  # rows the last hand-off admitted: about what the next evicts
        self.last_updated = np.full(len(shared.slot_of), step, dtype=np.int32)
        self.shared.clock[0] = step
        self.counts = {"evictions": 0, "rows_read": 0, "rows_written": 0, "cleaned_ahead": 0}

    # ----------------------------------------------------------------- hand-off (main thread)
    def current(self, ids: np.ndarray) -> np.ndarray:
        """The newest rows of ``ids``: from the cache where cached, else from the table."""
        slots = self.shared.slot_of[ids].astype(np.int64)
        rows = np.empty((len(ids), self.shared.rows.shape[1]), dtype=self.shared.rows.dtype)
        cached = slots >= 0
        rows[cached] = self.shared.rows[slots[cached]]
        if not cached.all():
            rows[~cached] = self._fetch(ids[~cached], "weight")
        return rows

    def admit(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Record a batch's use of ``ids`` (unique) and cache those the policy admits, with ``rows``.

        Frees slots through the policy, writing dirty victims to the table first; never evicts a
        row of this batch or one an optimizer step is working on.
        """
        if self.shared.cache_rows == 0:
            return
        slots = self.shared.slot_of[ids].astype(np.int64)
        new = np.flatnonzero(slots < 0)
        if len(new):
            keep = np.concatenate([slots[slots >= 0], np.flatnonzero(self.pinned)])
            chosen, free = self.policy.plan(ids[new], keep, self.shared.slot_id)
            admitted = new[chosen]
            self._evict(free[self.shared.slot_id[free] >= 0])
            self.policy.forget(free)
            self.shared.put(free, ids[admitted], rows[admitted])
            self.state_loaded[free] = False
            slots[admitted] = free
            self.last_admitted = len(admitted)
        self.policy.record(ids, slots)

    # ----------------------------------------------------------------- writeback thread
    def gather(self, ids: np.ndarray) -> Update:
        """Copies of the rows and state of ``ids`` (unique) for an optimizer step.

        Cached rows are pinned: no admission evicts them until :meth:`scatter`, so the step can be
        computed outside the pipe's lock while hand-offs go on.
        """
        slots = self.shared.slot_of[ids].astype(np.int64)
        cached = slots >= 0
        s = slots[cached]
        self._load_state(s)
        self.pinned[s] = True
        rows = self.current(ids)
        state = {name: np.empty_like(rows) for name in self.state}
        for name, array in self.state.items():
            state[name][cached] = array[s]
            if not cached.all():
                state[name][~cached] = self._fetch(ids[~cached], name)
        return Update(ids, slots, rows, state)

    def scatter(self, update: Update, step: int) -> None:
        """Put the updated rows back: into their pinned slots, and into the table for the rest.

        A row that was not cached at :meth:`gather` is written to the table; if a hand-off has
        admitted it since, its cached copy is replaced too, so no update is lost.
        """
        ids, slots, rows, state = update.ids, update.slots, update.rows, update.state
        cached = slots >= 0
        if not cached.all():  # first the table: if the write fails, the cache is untouched
            rest = np.flatnonzero(~cached)
            self._store(ids[rest], rows[rest], {k: v[rest] for k, v in state.items()})
            now = self.shared.slot_of[ids[rest]].astype(np.int64)
            admitted = now >= 0
            if admitted.any():
                picked = rest[admitted]
                self._put_rows(
                    now[admitted], rows[picked], {k: v[picked] for k, v in state.items()}
                )
                self.dirty[now[admitted]] = False  # the table has it already
        s = slots[cached]
        self._put_rows(s, rows[cached], {k: v[cached] for k, v in state.items()})
        self.pinned[s] = False
        self.last_updated[ids] = step

    def unpin(self, update: Update) -> None:
        """Release the slots of a step that failed between :meth:`gather` and :meth:`scatter`."""
        self.pinned[update.slots[update.slots >= 0]] = False

    def _put_rows(self, slots: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray]) -> None:
        self.shared.overwrite(slots, rows)
        for name, array in self.state.items():
            array[slots] = state[name]
        self.state_loaded[slots] = True
        self.dirty[slots] = True

    def clean_ahead(self) -> int:
        """Write the coldest dirty rows (about two hand-offs' worth of evictions) to the table, so
        that the hand-offs that evict them find them clean; returns how many were written.

        Runs only once the cache is full (before that nothing is evicted).
        """
        wanted = 2 * self.last_admitted
        if wanted == 0 or (self.shared.slot_id < 0).sum() >= wanted:
            return 0
        candidates = self.dirty & ~self.pinned
        score = self.policy.slot_score(self.shared.slot_id)
        score[~candidates] = np.inf
        # coldest first: only dirty rows among the next `wanted` victims need writing
        coldest = (
            np.argpartition(score, wanted - 1)[:wanted]
            if wanted < len(score)
            else np.arange(len(score))
        )
        slots = coldest[np.isfinite(score[coldest])]
        self._write_back(slots)
        self.counts["cleaned_ahead"] += len(slots)
        return len(slots)

    def flush(self) -> int:
        """Write every dirty row (and its state) to the table; returns how many."""
        slots = np.flatnonzero(self.dirty)
        self._write_back(slots)
        return len(slots)

    # ----------------------------------------------------------------- internals
    def _evict(self, slots: np.ndarray) -> None:
        self._write_back(slots[self.dirty[slots]])  # invariant 3: before the slot is released
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

    def _fetch(self, ids: np.ndarray, name: str) -> np.ndarray:
        self.counts["rows_read"] += len(ids) if name == "weight" else 0
        return self.fetch(ids, name)

    def _store(self, ids: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray]) -> None:
        order = np.argsort(ids)  # one pass over the chunks
        self.store(ids[order], rows[order], "weight")
        for name, values in state.items():
            self.store(ids[order], values[order], name)
        self.counts["rows_written"] += len(ids)
