"""Which missed rows to cache, and which cached rows to evict for them: LRU and LFU.

The owner tells a policy two things at each hand-off: which ids the batch used and where they
sit (:meth:`LRU.record`), and which of the batch's missed ids could be admitted
(:meth:`LRU.plan`, which answers with the ids to admit and the slots to free for them). Both are
vectorised over the batch: a hand-off costs O(U) plus one ``argpartition`` over the slots.

- ``"lru"`` admits every miss and evicts the slots used longest ago.
- ``"lfu"`` counts, per table row, the batches that used it (4 bytes per row, halved every
  ``10 x cache_rows`` uses so old popularity fades), evicts the cached row with the lowest
  count, and admits a missed row only if it is used more often than the row it would evict.
  Without that admission test a batch with more misses than the cache has cold slots evicts hot
  rows for one-off ids (measured in ``scripts/bench.py``: 1.39x the rows Belady's optimum reads
  at a 2% cache, against about 1.1x with it).
- ``"auto"`` is LFU: token traces are Zipf-like, and LFU read the fewest rows at every cache size
  measured (docs/benchmarks.md). A lookahead policy that reads the sampler's order is planned.
"""

from __future__ import annotations

import numpy as np

POLICIES = ("lru", "lfu", "auto")


class LRU:
    """Admit every miss; evict the slots used longest ago (empty slots first)."""

    name = "lru"

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
        score = self.slot_score(slot_ids)
        score[keep] = np.inf
        n = min(len(candidates), int(np.isfinite(score).sum()))
        if n == 0:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        victims = np.argpartition(score, n - 1)[:n] if n < len(score) else np.arange(n)
        victims = victims[np.argsort(score[victims], kind="stable")]  # coldest first
        chosen = self._choose(candidates, score[victims])
        return chosen, victims[: len(chosen)].astype(np.int64)

    def _choose(self, candidates: np.ndarray, victim_scores: np.ndarray) -> np.ndarray:
        return np.arange(len(victim_scores))  # LRU admits every miss that finds a slot


class LFU(LRU):
    """Evict the least frequently used row; admit a miss only if it is used more often."""

    name = "lfu"

    def __init__(self, cache_rows: int, num_rows: int) -> None:
        super().__init__(cache_rows, num_rows)
        self.uses = np.zeros(num_rows, dtype=np.int32)  # batches that used each row
        self._since_halving = 0
        self._halve_every = 10 * max(cache_rows, 1)

    def record(self, ids: np.ndarray, slots: np.ndarray) -> None:
        super().record(ids, slots)
        self.uses[ids] += 1
        self._since_halving += len(ids)
        if self._since_halving >= self._halve_every:  # let old popularity fade
            self.uses >>= 1
            self._since_halving = 0

    def slot_score(self, slot_ids: np.ndarray) -> np.ndarray:
        # uses dominate; (last_used + 1) / (clock + 2) < 1 breaks ties by recency; empty: -1
        occupied = slot_ids >= 0
        score = np.full(len(slot_ids), -1.0)
        score[occupied] = self.uses[slot_ids[occupied]] + (self.last_used[occupied] + 1) / (
            self.clock + 2
        )
        return score

    def _choose(self, candidates: np.ndarray, victim_scores: np.ndarray) -> np.ndarray:
        # Pair the most used candidates with the coldest victims; admit while the candidate wins.
        uses = self.uses[candidates] + 1  # with this batch, not recorded yet
        order = np.argsort(-uses, kind="stable")[: len(victim_scores)]
        wins = uses[order] > victim_scores[: len(order)]
        return order[: int(np.argmin(wins)) if not wins.all() else len(order)]


def make_policy(name: str, cache_rows: int, num_rows: int) -> LRU:
    """The policy called ``name`` ("lru", "lfu" or "auto") for a cache of ``cache_rows`` slots."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return LRU(cache_rows, num_rows) if name == "lru" else LFU(cache_rows, num_rows)
