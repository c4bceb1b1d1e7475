"""The owner's copies of rows for an optimizer step, beside the cache (``rowcache.py``): the
staged copies of a training batch's rows the cache lacks, the lookahead reader's reads for the
batches in flight, and a step's working copy prepared at its batch's hand-off.

NOTE [ A step prepared at its batch's hand-off ]
In exact mode (over the whole table) a training batch's hand-off knows every row of the batch as
it is after the last step: they are the rows it hands out. It also knows their optimizer state:
the cache's or the table's, and for the rows the last step changed, that step's own (the step
may not have put them back yet). So :meth:`RowCache.stage` makes the working copy of the batch's
step there, while the training process computes, and the step that follows takes it as is
(:meth:`RowCache.gather` copies nothing; a step without the padding row takes a subset): the
copy that was on the path from the gradient to the next hand-off is off it. Measured with an
owner process, a 5% cache, D = 768 and a simulated accelerator step of 10 ms: 1-2 ms of a
30 ms batch. The copy is of the step after ``key`` (the snapshot generation and the step its
rows are final after) and is used only by that step, only if it holds every id of the step; a
reset of the cache drops it. Any other step (two batches in one step, a step another batch's
hand-off came between) takes it as a staged copy, whose tick decides which of its rows are
still current, as for every staged copy (consistency.md, invariant 4); the copy's cached rows
were then copied for nothing, so the next :data:`PREPARE_RETRY` steps prepare none (a loop that
accumulates two batches a step, or reads the next batch's ``inputs_embeds`` before the step,
pays for it once in 17 steps). The rows it read for the batch's uncached ids, and their state,
are kept as they are: they are what that step puts back if its write to the table fails, so the
step copies nothing for that either (measured as above: 1.8-2.0 ms on the claim's path before).
An owner process whose hand-off read the batch ahead (NOTE [ A hand-off read ahead ] in
``owner/reads.py``) holds every row of it, final, in an array of its own: that array becomes
the copy's rows, and only the state is gathered. A loader that draws the next batch ahead, as
Accelerate's does, still gets its copies: a batch is claimed when the model first reads it. Merging two batches'
copies into one would copy more than the step's own gather. Not in bounded mode nor
for a rank's shard: their hand-offs do not hand out final rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Steps that prepare no working copy after one that could not take its copy (two batches a
#: step, a batch read before the step of the one before), before one tries again.
PREPARE_RETRY = 16

#: A copy of rows the cache lacks: (sorted ids, their rows, the clock tick they were read at).
Copy = tuple[np.ndarray, np.ndarray, int]


def find_sorted(had: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where ``ids`` are in ``had`` (sorted, non-empty): ``(hit, at)``, ``had[at[i]] == ids[i]``
    where ``hit[i]``."""
    at = np.minimum(np.searchsorted(had, ids), len(had) - 1)
    return had[at] == ids, at


def from_copies(
    copies: Iterable[Copy], ids: np.ndarray, last_updated: np.ndarray, dim: int, dtype: Any
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``ids`` that ``copies`` (the first that has an id wins) hold and no step
    changed since (``last_updated`` at most the copy's tick): returns ``(found, rows)``, ``rows``
    valid where ``found``. The owner's copies: a training batch's rows staged for its step
    (``RowCache.stage``) and the lookahead reader's reads for batches in flight."""
    found = np.zeros(len(ids), dtype=bool)
    rows = np.empty((len(ids), dim), dtype=dtype)
    for had, had_rows, tick in copies:
        if not len(had):
            continue
        hit, at = find_sorted(had, ids)
        hit &= ~found & (last_updated[ids] <= tick)
        rows[hit] = had_rows[at[hit]]
        found |= hit
    return found, rows


@dataclass
class Prepared:
    """A training batch's ``rows`` and optimizer ``state`` (U, D) of ``ids`` (sorted), as they
    are after step ``key[1]`` of snapshot generation ``key[0]``: the working copy of the step that
    follows, made while the training process computes (NOTE [ A step prepared at its batch's
    hand-off ])."""

    key: tuple[int, int]
    ids: np.ndarray
    slots: np.ndarray  # at its making: the rows then uncached are what a fallback needs
    rows: np.ndarray
    state: dict[str, np.ndarray]
    tick: int
    #: the uncached rows (``slots < 0``) and their state as in ``rows`` and ``state`` before
    #: the step changes them: what the step puts back if its table write fails (the arrays the
    #: copy was made from, so the step copies nothing for it)
    before: tuple[np.ndarray, dict[str, np.ndarray]] | None = None

    def as_copy(self) -> Copy:
        """The rows (and state) that were not cached, as :meth:`RowCache.stage` keeps them."""
        rest = self.slots < 0
        parts = [self.rows[rest], *(array[rest] for array in self.state.values())]
        return self.ids[rest], np.hstack(parts) if len(parts) > 1 else parts[0], self.tick
