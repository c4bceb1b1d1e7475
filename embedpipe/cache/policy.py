"""Which missed rows to cache, and which cached rows to evict for them: LRU, LFU and lookahead.

The owner tells a policy two things at each hand-off: which ids the batch used and where they
sit (:meth:`LRU.record`), and which of the batch's missed ids could be admitted
(:meth:`LRU.plan`, which answers with the ids to admit and the slots to free for them). Both are
vectorised over the batch: a hand-off costs O(U), plus every few hand-offs one ``argpartition``
over the slots (NOTE [ The cold pool ]).

- ``"lru"`` admits every miss and evicts the slots used longest ago.
- ``"lfu"`` counts, per table row, the batches that used it (4 bytes per row, halved every
  ``10 x cache_rows`` uses so old popularity fades), evicts the cached row with the lowest
  count, and admits a missed row only if it is used more often than the row it would evict.
  Without that admission test a batch with more misses than the cache has cold slots evicts hot
  rows for one-off ids.
- ``"lookahead"`` knows the ids of the batches the loader will hand off next (``lookahead.py``
  reads them from the dataset in the sampler's order) and keeps the rows used soonest: see
  NOTE [ Scores kept per slot ]
LFU and lookahead rank slots by numbers kept per table row (uses, next use, held). Gathering those
for every slot at every hand-off costs random reads over the whole index: measured 20 ms a batch
for a 314k-row cache over a 3.1M-row table. So each slot's score is kept (``score``, 8 bytes a
slot) and recomputed only for the rows whose numbers change: the batch recorded, the batch
foreseen or moved past, rows held or released, a slot emptied; all but the periodic halving of
LFU's counts are O(rows of a batch). The recency tie-break is ``last_used x 2^-32``, which does
not change as the clock moves (``(last_used + 1) / (clock + 2)`` did, for every slot). The cache
attaches its index (``attach``); a policy used without one scores from scratch.

NOTE [ The cold pool ]
Choosing a hand-off's victims among every slot is an ``argpartition`` of the whole cache
(measured: 45% of the training process's time at a 262k-row cache, frozen, 2 workers, cold
disk, uniform ids; 1.6 ms a hand-off at 314k slots). LFU and lookahead keep instead a pool of
the coldest slots: one ``argpartition`` picks the ``POOL_FACTOR`` x (victims + kept slots)
coldest and sets the bar at the highest score among them; from then on every slot whose score
is set at or below the bar (a rescore, a slot emptied) joins the pool, and a plan picks its
victims among the pool's slots still at or below the bar. Every slot scored below the bar is in
the pool, so the victims' scores are those a partition of every slot would give (slots tied at
the bar are interchangeable), and so is which missed rows are admitted. When the pool has fewer
victims than a plan needs, the next partition of every slot makes a new one: one every few
hand-offs in a full cache, not one each. The writeback's cleaning ahead (``coldest_of``: the
coldest dirty rows) takes them from the pool too, or partitions every slot when it cannot. A
slot is in the pool at most once and the kept slots are found by marks, not sorts (measured:
an admission of 1,000 uniform ids into a full cache of 262,144 slots, LFU, 7.3 ms with a
partition of every slot, 1.3 ms with a pool deduplicated by ``np.unique``, 0.6 ms with marks).

NOTE [ The lookahead window ]. Without a window (an iterable dataset) it is LFU.
- ``"auto"`` is lookahead: it read as many rows as Belady's optimum (within 2%) at every cache
  size measured, where LFU read up to 1.5x (docs/benchmarks.md). A frozen pipe whose table fits
  in memory makes it LFU (no window: NOTE [ A frozen table that fits in memory ] in
  pipe/defaults.py).

NOTE [ The lookahead window ]
The window is the next ``window`` batches, in the order they will be looked up (``foresee``
appends one, ``advance`` drops the one being dispatched to a worker). For every table row the policy keeps
``next_use``, the number of the first batch in the window that uses it, and for every (batch,
row) entry the number of the next batch after it that uses the row, linked as batches are
foreseen; so both calls cost O(rows of the batch), never a scan of the window. Eviction is
Belady's rule inside the window (the cached row used furthest ahead goes first) and LFU beyond it
(rows no foreseen batch uses go before any that one does, least used first); a missed row is
admitted only if it is worth more than the row it would evict, by the same measure. Rows whose
``held`` count is above 0 are never evicted: rows of batches dispatched to a worker and not
claimed yet (their lookup may still be copying them; ``lookahead.Stream``), and rows of batches
handed out for training whose optimizer step has not gathered them yet (``hold``/``release``:
evicting one would cost a read at the step and a write after it). While training, a missed row is admitted over any row no
foreseen batch uses, since the step will update it: it is then written once, when it is evicted,
not read and written at the step.
"""

from __future__ import annotations

from collections import deque

import numpy as np

POLICIES = ("lru", "lfu", "lookahead", "auto")
#: Batches the lookahead policy sees ahead, by default.
DEFAULT_WINDOW = 64
#: Batches handed out for training whose rows the lookahead policy holds until a step.
MAX_HELD = 16
#: The cold pool's size, in plans' worth of victims (NOTE [ The cold pool ]).
POOL_FACTOR = 8


class LRU:
    """Admit every miss; evict the slots used longest ago (empty slots first)."""

    name = "lru"
    slot_bytes = 8  # the policy's own memory per cache slot (last_used) ...
    row_bytes = 0  # ... and per table row
    #: The rows of the batch being handed off are not evicted for its own misses.
    keeps_batch = True

    def __init__(self, cache_rows: int, num_rows: int) -> None:
        self.cache_rows = cache_rows
        self.clock = 0
        self.last_used = np.full(cache_rows, -1, dtype=np.int64)  # -1: empty

    def record(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """The current batch used ``ids`` (unique); ``slots`` holds them (-1: not cached)."""
        self.clock += 1
        self.last_used[slots[slots >= 0]] = self.clock

    def forget(self, slots: np.ndarray) -> None:
        """``slots`` were emptied."""
        self.last_used[slots] = -1

    def slot_score(self, slot_ids: np.ndarray) -> np.ndarray:
        """Per slot: lower is evicted first; ``slot_ids`` is the id in each slot (-1: empty)."""
        return self.last_used.astype(np.float64)

    def plan(
        self, candidates: np.ndarray, keep: np.ndarray, slot_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Which ``candidates`` (this batch's uncached ids) to admit, and the slots to free for them.

        Called before :meth:`record` for the batch. Never frees a slot in ``keep``. Returns the
        positions in ``candidates`` to admit and as many slots, coldest first.
        """
        victims, victim_scores = self._coldest(len(candidates), keep, slot_ids)
        if len(victims) == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        chosen = self._choose(candidates, victim_scores)
        return chosen, victims[: len(chosen)].astype(np.int64)

    def _coldest(
        self, wanted: int, keep: np.ndarray, slot_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``wanted`` slots that may be freed (not in ``keep``, a finite score), coldest
        first, and their scores: a partition of every slot."""
        score = self.slot_score(slot_ids)
        score[keep] = np.inf
        usable = np.flatnonzero(np.isfinite(score))
        return self._pick(usable, score[usable], wanted)

    @staticmethod
    def _pick(slots: np.ndarray, score: np.ndarray, wanted: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``wanted`` coldest of ``slots`` (all of them if fewer), coldest first."""
        n = min(wanted, len(slots))
        part = np.argpartition(score, n - 1)[:n] if 0 < n < len(slots) else np.arange(n)
        part = part[np.argsort(score[part], kind="stable")]
        return slots[part], score[part]

    def _choose(self, candidates: np.ndarray, victim_scores: np.ndarray) -> np.ndarray:
        return np.arange(len(victim_scores))  # LRU admits every miss that finds a slot

    def coldest_of(self, wanted: int, allowed: np.ndarray, slot_ids: np.ndarray) -> np.ndarray:
        """The ``wanted`` coldest slots where ``allowed`` (a mask over the slots; fewer if
        fewer are allowed), coldest first: the slots the next hand-offs free first."""
        score = self.slot_score(slot_ids)
        usable = np.flatnonzero(allowed & np.isfinite(score))
        return self._pick(usable, score[usable], wanted)[0]


class LFU(LRU):
    """Evict the least frequently used row; admit a miss only if it is used more often."""

    name = "lfu"
    row_bytes = 4  # uses

    slot_bytes = LRU.slot_bytes + 8 + 2  # score; in the cold pool, marked (NOTE [ The cold pool ])

    def __init__(self, cache_rows: int, num_rows: int) -> None:
        super().__init__(cache_rows, num_rows)
        self.uses = np.zeros(num_rows, dtype=np.int32)  # batches that used each row
        self._since_halving = 0
        self._halve_every = 10 * max(cache_rows, 1)
        #: Each slot's score, kept up to date as rows change (NOTE [ Scores kept per slot ]).
        self.score = np.full(cache_rows, -1.0)
        self._index: tuple[np.ndarray, np.ndarray] | None = None  # the cache's (slot_of, slot_id)
        #: NOTE [ The cold pool ]: slots, every one scored below the bar among them (and some
        #: scored above it since); slots that joined since the last plan; the bar (-inf: none).
        self._pool = np.empty(0, dtype=np.int64)
        self._joined: list[np.ndarray] = []
        self._bar = -np.inf
        self._in_pool = np.zeros(cache_rows, dtype=bool)  # each slot at most once in the pool
        self._mark = np.zeros(cache_rows, dtype=bool)  # a plan's kept slots, while it runs

    def attach(self, slot_of: np.ndarray, slot_id: np.ndarray) -> None:
        """The cache's index (id -> slot, slot -> id): the policy rescores a row's slot when the
        row's numbers change."""
        self._index = (slot_of, slot_id)

    def record(self, ids: np.ndarray, slots: np.ndarray) -> None:
        super().record(ids, slots)
        self.uses[ids] += 1
        self._since_halving += len(ids)
        if self._since_halving >= self._halve_every:  # let old popularity fade
            self.uses >>= 1
            self._since_halving = 0
            if self._index is not None:
                self._rescore_slots(np.flatnonzero(self._index[1] >= 0))
        cached = slots >= 0
        self._rescore_slots(slots[cached], ids[cached])

    def forget(self, slots: np.ndarray) -> None:
        super().forget(slots)
        self.score[slots] = -1.0
        self._join_pool(slots)

    def row_score(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The score of rows ``ids`` in ``slots``: uses dominate, ties go by recency (a
        fraction below 1 that grows with the batch that last used the slot)."""
        return self.uses[ids] + self.last_used[slots] * 2.0**-32

    def slot_score(self, slot_ids: np.ndarray) -> np.ndarray:
        if self._index is not None:
            return self.score.copy()
        occupied = np.flatnonzero(slot_ids >= 0)  # not attached to a cache: from scratch
        score = np.full(len(slot_ids), -1.0)
        score[occupied] = self.row_score(slot_ids[occupied], occupied)
        return score

    def _rescore(self, ids: np.ndarray) -> None:
        """Rows ``ids`` changed numbers: rescore the slots of those that are cached."""
        if self._index is not None and len(ids):
            slots = self._index[0][ids].astype(np.int64)
            cached = slots >= 0
            self._rescore_slots(slots[cached], ids[cached])

    def _rescore_slots(self, slots: np.ndarray, ids: np.ndarray | None = None) -> None:
        if len(slots):
            ids = self._index[1][slots] if ids is None else ids
            self.score[slots] = self.row_score(ids, slots)
            self._join_pool(slots)

    # ------------------------------------------------------------------ the cold pool
    def _join_pool(self, slots: np.ndarray) -> None:
        """``slots`` were scored again: those now at or below the bar join the pool."""
        if self._bar == -np.inf:
            return
        if len(slots) > len(self.score) // POOL_FACTOR:  # most slots (LFU's halving): start over
            self._bar = -np.inf
            self._pool, self._joined = self._pool[:0], []
            self._in_pool[:] = False
            return
        low = slots[self.score[slots] <= self._bar]
        new = np.unique(low[~self._in_pool[low]]).astype(np.int64) if len(low) else low
        if len(new):
            self._joined.append(new)  # then marked: an interrupt between leaves a duplicate,
            self._in_pool[new] = True  # which a plan never frees twice (``_coldest``)

    def _coldest(
        self, wanted: int, keep: np.ndarray, slot_ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if self._index is None:  # (scores from scratch: no pool)
            return super()._coldest(wanted, keep, slot_ids)
        if self._bar != -np.inf:
            pool, score = self._compact()
            usable = np.flatnonzero(~self._kept(pool, keep))
            if len(usable) >= wanted:
                victims, scores = self._pick(pool[usable], score[usable], wanted)
                if len(np.unique(victims)) == len(victims):  # (else interrupted: made again)
                    return victims, scores
        return self._new_pool(wanted, keep)

    def coldest_of(self, wanted: int, allowed: np.ndarray, slot_ids: np.ndarray) -> np.ndarray:
        if self._index is None or self._bar == -np.inf:
            return super().coldest_of(wanted, allowed, slot_ids)
        pool, score = self._compact()
        ok = allowed[pool]
        if ok.sum() < wanted:  # (every slot, then; the pool stays for the plans)
            return super().coldest_of(wanted, allowed, slot_ids)
        return self._pick(pool[ok], score[ok], wanted)[0]

    def _compact(self) -> tuple[np.ndarray, np.ndarray]:
        """The pool's slots still at or below the bar (the others warmed up since and leave
        it), and their scores."""
        pool = np.concatenate([self._pool, *self._joined])
        score = self.score[pool]
        low = score <= self._bar
        self._pool, self._joined = pool[low], []
        self._in_pool[pool[~low]] = False  # (an interrupt before: they rejoin at the next pool)
        return self._pool, score[low]

    def _kept(self, pool: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Per slot of ``pool``: whether it is in ``keep`` (marks, not a sort)."""
        try:
            self._mark[keep] = True
            return self._mark[pool]
        finally:
            self._mark[keep] = False

    def _new_pool(self, wanted: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Partition every slot: the victims of this plan, and a new pool (and bar, set last:
        interrupted before, the next plan partitions every slot again)."""
        self._bar = -np.inf
        size = POOL_FACTOR * (wanted + len(keep))
        if size >= len(self.score):  # the whole cache: a pool would save nothing
            return super()._coldest(wanted, keep, self._index[1])
        pool = np.argpartition(self.score, size - 1)[:size]
        score = self.score[pool]
        finite = np.isfinite(score)
        self._pool, self._joined = pool[finite], []
        self._in_pool[:] = False
        self._in_pool[self._pool] = True
        if finite.any():
            self._bar = score[finite].max()
        usable = np.flatnonzero(finite & ~self._kept(pool, keep))
        if len(usable) >= wanted:
            return self._pick(pool[usable], score[usable], wanted)
        self._bar = -np.inf  # more kept slots than the pool holds: every slot, this time
        return super()._coldest(wanted, keep, self._index[1])

    def _choose(self, candidates: np.ndarray, victim_scores: np.ndarray) -> np.ndarray:
        # Pair the most valued candidates with the coldest victims; admit while the candidate wins.
        value = self._value(candidates)
        order = np.argsort(-value, kind="stable")[: len(victim_scores)]
        wins = value[order] > victim_scores[: len(order)]
        return order[: int(np.argmin(wins)) if not wins.all() else len(order)]

    def _value(self, candidates: np.ndarray) -> np.ndarray:
        """A missed row's worth, on the scale of :meth:`slot_score`."""
        return (self.uses[candidates] + 1).astype(np.float64)  # with this batch, not recorded yet


#: A next use that is not in the window (no batch foreseen uses the row).
NEVER = np.iinfo(np.int64).max
#: Scores: rows a foreseen batch uses rank above every frequency score (``_FAR - next use``,
#: exact in float64), rows of a training batch's step just below them.
_FAR = 2.0**52
_TRAINING = 2.0**45


class Lookahead(LFU):
    """Belady's rule within the batches ahead, LFU beyond them (NOTE [ The lookahead window ])."""

    name = "lookahead"
    row_bytes = LFU.row_bytes + 8 + 8 + 2  # next_use, _latest, held

    def __init__(self, cache_rows: int, num_rows: int, window: int = 64) -> None:
        super().__init__(cache_rows, num_rows)
        self.window = window
        #: Stop looking ahead when foresight keeps missing (``auto``; ``lookahead.Stream``).
        self.gives_up = False
        #: A hand-off admits its missed rows over rows no foreseen batch uses (set while training).
        self.training = False
        self.next_use = np.full(num_rows, NEVER, dtype=np.int64)  # soonest foreseen batch
        self.held = np.zeros(num_rows, dtype=np.int16)  # rows of handed-out batches not stepped yet
        self._held: list[np.ndarray] = []
        self._latest = np.full(num_rows, -1, dtype=np.int64)  # each row's last entry foreseen
        self._after = np.empty(4096, dtype=np.int64)  # per entry: the next batch using its row
        self._base = 0  # entry number of _after[0]
        self._entries = 0  # entries (batch, row) foreseen so far
        self._batches: deque[tuple[int, np.ndarray, int]] = deque()  # (number, ids, first entry)
        self._foreseen = 0  # batches foreseen so far: the next one's number

    # ------------------------------------------------------------------ the window
    def foresee(self, ids: np.ndarray) -> None:
        """Append a batch to the window: ``ids`` (sorted unique int64) will be handed off after
        every batch foreseen before it."""
        number, first = self._foreseen, self._entries
        self._reserve(len(ids))
        prev = self._latest[ids]
        live = prev >= self._front_entry()
        self._after[prev[live] - self._base] = number  # the row's previous entry now has a next
        self._after[first - self._base : first - self._base + len(ids)] = NEVER
        self._latest[ids] = np.arange(first, first + len(ids))
        self.next_use[ids] = np.minimum(self.next_use[ids], number)
        self._entries += len(ids)
        self._foreseen += 1
        self._batches.append((number, ids, first))
        self._rescore(ids)

    def advance(self) -> None:
        """The front batch of the window is being handed off: its rows' next uses move on."""
        if not self._batches:
            return
        _, ids, first = self._batches.popleft()
        start = first - self._base
        self.next_use[ids] = self._after[start : start + len(ids)]
        self._rescore(ids)

    def restart(self) -> None:
        """Forget the window (a new epoch, or a loader whose order is not known)."""
        for _, ids, _ in self._batches:
            self.next_use[ids] = NEVER
            self._rescore(ids)
        self._batches.clear()
        self._base = self._entries  # every entry before is dead: _latest no longer links to it

    @property
    def foreseen(self) -> int:
        """Batches in the window."""
        return len(self._batches)

    def _front_entry(self) -> int:
        return self._batches[0][2] if self._batches else self._entries

    def _reserve(self, n: int) -> None:
        if self._entries + n - self._base <= len(self._after):
            return
        front = self._front_entry()
        live = self._after[front - self._base : self._entries - self._base]
        grown = np.empty(max(len(self._after), 2 * (len(live) + n)), dtype=np.int64)
        grown[: len(live)] = live
        self._after, self._base = grown, front

    @property
    def keeps_batch(self) -> bool:  # type: ignore[override]
        """A frozen batch has its copy of its rows: they stay only if they are worth it."""
        return self.training

    # ------------------------------------------------------------------ held rows
    def hold(self, ids: np.ndarray) -> None:
        """A training batch was handed out: keep its rows until its optimizer step gathers them
        (at most the last :data:`MAX_HELD` batches: an evaluation loop that takes no step holds
        nothing for long)."""
        self.adjust_held(ids, 1)
        self._held.append(ids)
        if len(self._held) > MAX_HELD:
            self.adjust_held(self._held.pop(0), -1)

    def release(self) -> None:
        """An optimizer step gathered (pinned) its rows: the batches held so far are done."""
        for ids in self._held:
            self.adjust_held(ids, -1)
        self._held.clear()

    def adjust_held(self, ids: np.ndarray, by: int) -> None:
        """Count ``ids`` (unique) held ``by`` more times (a batch dispatched: +1, claimed: -1)."""
        self.held[ids] += by
        self._rescore(ids)

    # ------------------------------------------------------------------ the policy
    def row_score(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        due = self.next_use[ids]
        score = np.where(due != NEVER, _FAR - due.astype(np.float64), super().row_score(ids, slots))
        score[self.held[ids] > 0] = np.inf
        return score

    def _value(self, candidates: np.ndarray) -> np.ndarray:
        value = np.full(len(candidates), _TRAINING) if self.training else super()._value(candidates)
        due = self.next_use[candidates]
        foreseen = due != NEVER
        value[foreseen] = _FAR - due[foreseen]
        return value


def make_policy(name: str, cache_rows: int, num_rows: int, window: int = DEFAULT_WINDOW) -> LRU:
    """The policy called ``name`` (one of :data:`POLICIES`) for a cache of ``cache_rows`` slots;
    ``window``: batches the lookahead policy sees ahead (0: LFU)."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    if name == "lru":
        return LRU(cache_rows, num_rows)
    if name == "lfu" or window == 0:
        return LFU(cache_rows, num_rows)
    policy = Lookahead(cache_rows, num_rows, window)
    policy.gives_up = name == "auto"
    return policy
