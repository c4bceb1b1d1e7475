"""Which cache slots to free when rows must be admitted: LRU and LFU.

A policy keeps a few numbers per slot (not per table row) and is told two things by the owner at
each hand-off: which slots the batch used (:meth:`touch`) and how many slots it needs freed
(:meth:`victims`). Both are vectorised over the batch, so a hand-off costs O(U) for the touch and
O(cache_rows) for a victim search (``argpartition``), not O(U log C) Python operations.

``"auto"`` resolves to LFU: token traces are Zipf-like, a few ids appear in nearly every batch,
and LRU of a cache much smaller than the vocabulary keeps evicting them for one-off ids (measured
in ``scripts/bench.py``). A lookahead policy that reads the sampler's order is planned (DESIGN.md).
"""

from __future__ import annotations

import numpy as np

POLICIES = ("lru", "lfu", "auto")


class LRU:
    """Evict the slots used longest ago; empty slots go first."""

    name = "lru"

    def __init__(self, cache_rows: int) -> None:
        self.clock = 0
        self.last_used = np.full(cache_rows, -1, dtype=np.int64)  # -1: empty

    def touch(self, slots: np.ndarray) -> None:
        """The current batch used ``slots`` (hits and newly admitted rows)."""
        self.clock += 1
        self.last_used[slots] = self.clock

    def forget(self, slots: np.ndarray) -> None:
        """``slots`` were emptied."""
        self.last_used[slots] = -1

    def _score(self) -> np.ndarray:
        return self.last_used

    def victims(self, n: int, keep: np.ndarray) -> np.ndarray:
        """``n`` slots to free, lowest score first, never one of ``keep``.

        Returns fewer than ``n`` slots only when fewer than ``n`` slots are outside ``keep``.
        """
        score = self._score().astype(np.float64)
        score[keep] = np.inf
        n = min(n, len(score) - len(np.unique(keep)))
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        chosen = np.argpartition(score, n - 1)[:n] if n < len(score) else np.arange(len(score))
        return chosen[np.isfinite(score[chosen])].astype(np.int64)


class LFU(LRU):
    """Evict the slots used by the fewest batches since they were admitted; ties go to LRU."""

    name = "lfu"

    def __init__(self, cache_rows: int) -> None:
        super().__init__(cache_rows)
        self.uses = np.zeros(cache_rows, dtype=np.int64)

    def touch(self, slots: np.ndarray) -> None:
        super().touch(slots)
        self.uses[slots] += 1

    def forget(self, slots: np.ndarray) -> None:
        super().forget(slots)
        self.uses[slots] = 0

    def _score(self) -> np.ndarray:
        # uses dominates; last_used / (clock + 1) < 1 breaks ties by recency.
        return self.uses + (self.last_used + 1) / (self.clock + 2)


def make_policy(name: str, cache_rows: int) -> LRU:
    """The policy called ``name`` ("lru", "lfu" or "auto") for a cache of ``cache_rows`` slots."""
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return LRU(cache_rows) if name == "lru" else LFU(cache_rows)
