"""A step's new rows, computed and not yet written: what an exact-mode hand-off takes them from.

NOTE [ A hand-off waits for the step's rows, not its writes ]
In exact mode a batch's rows must hold every step submitted before its hand-off. The hand-off of
batch t+1 comes right after the step of batch t, so it used to wait for that whole step: read the
rows and their state, compute the update, write the rows the cache lacks to the table, put the
cached ones back into the cache, publish. Only the computed rows matter to the hand-off: it
re-reads the rows of steps since the lookup anyway, and step t's are in the writeback thread's
hands as soon as the update is computed. So :meth:`Owner.apply` publishes them there
(:class:`Computed`, and ``Writeback.computed_now``) before it writes anything, and writes the
table outside the owner's lock; a hand-off in exact mode waits for that moment only
(``Owner._wait_for_rows``), then, under the lock:

- the rows of steps before t are final in the cache and the table (the thread applies steps in
  order: step t is computed only once step t-1 is written and published);
- every row of the batch that step t changed is taken from the computed rows, whatever the
  cache or the table held for it a moment before (the table write of those rows may be under
  way: a read of them could be torn, and is overwritten here);
- the batch is told it holds step t's rows (its ``step``), at the clock tick before step t's
  (its ``tick``): a later refresh re-reads step t's rows once more, which is harmless.

The rest runs beside the step's writes: the table write takes its own lock (``RowCache.io_lock``)
against the hand-off's evictions, and touches only rows of step t, none of which a hand-off
reads from the table (it takes them from here) or evicts dirty (they are admitted clean, and
made dirty only when the step puts them back under the owner's lock). A step whose table write
fails raises at the next call into the pipe, as before; a batch handed off meanwhile holds that
step's rows, and the loop stops at its next step.

A hand-off on another thread than the steps (a loader iterated in a thread of the program's)
may find, once it holds the lock, a later step computed since its wait, even put back, or a
snapshot loaded: so it looks again under the lock, and takes the last computed step's rows if
that step is of this generation and not yet applied (the steps before it are written), else
none, and says the rows hold that step. (Found by review; the owner process serves one request
at a time.)

Not with ``max_staleness`` nor with a table sharded over ranks (the other shards' rows come from
their owners, who know nothing of this): there a hand-off may run before the step's
``last_updated`` moves and would not re-read a row the step is half way through writing, so the
step writes the table under the owner's lock, as before (``Owner.takes_computed_rows``).

NOTE [ A hand-off reads while the step computes ]
The hand-off of batch t+1 arrives while step t computes, and most of what it reads does not
depend on step t: the misses left to the owner, the rows steps before t changed since the lookup.
So it reads those first, under the lock, noting the clock tick, and only then waits (on its own
core, an owner process's reads overlap the step's arithmetic). Under the lock again it re-reads
the rows whose ``last_updated`` passed that tick (steps applied meanwhile; a snapshot load moves
every row's) and takes those of the last computed step from it, as above. A read of the first
pass can be torn only where a step's table write is under way, and that step is then either
applied since (re-read) or the last computed (taken from it). In bounded mode and for a rank's
shard the steps write under the lock, so the first pass reads whole rows there too. The rows
re-read in the second pass are among those an owner process sends back (``stale``). Measured
beside a simulated accelerator (owner process, 5% cache, 2 cores): docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cache.copies import find_sorted


@dataclass
class Computed:
    """Step ``step``'s new rows ``rows`` of ``ids`` (unique), as the writeback thread computed
    them, in the snapshot generation ``generation``."""

    step: int
    ids: np.ndarray
    rows: np.ndarray
    generation: int
    state: dict[str, np.ndarray] = field(default_factory=dict)  # the rows' optimizer state
    order: np.ndarray = field(init=False)
    sorted_ids: np.ndarray = field(init=False)

    def __post_init__(self) -> None:  # in the writeback thread, not the hand-off
        self.order = np.argsort(self.ids)
        self.sorted_ids = self.ids[self.order]

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``ids`` (unique) the step changed, as a mask, and where their new rows are
        in :attr:`rows` (in the order of the mask's set positions)."""
        if not len(self.ids) or not len(ids):
            return np.zeros(len(ids), dtype=bool), np.zeros(0, dtype=np.int64)
        hit, at = find_sorted(self.sorted_ids, ids)
        return hit, self.order[at[hit]]
