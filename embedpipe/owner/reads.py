"""A hand-off's first reads: a lookup's rows as of the steps applied so far, read at its claim
(:func:`read_rows`), or, in an owner process whose loader it foresees, read for the next batch
before its claim (:func:`read_ahead`).

NOTE [ A hand-off read ahead ]
In an owner process, a claim's first links are its reads: the rows of the misses the workers
left to it, the rows earlier steps changed since the lookup, and the rows of the slot the cache
lacks (measured beside a simulated accelerator, D = 768, 5% cache: 3-5 ms of a 10 ms claim, on
the loop's path). The owner process knows the next batch the loader hands off: the first one in
flight after the last claimed, with its ids as foreseen, and its misses read by the lookahead
reader (NOTE [ Misses read by the owner ] in ``lookahead.py``; the lookahead policy keeps its
cached rows cached from its dispatch to its claim). So once a claim has been answered and its
admission and its step's working copy made, while the training process computes, it waits for
the writes of the last step (in exact mode: else the rows of that step would be read again at
the claim) and reads every row of that next batch, at the clock tick ``tick``: from the reader's
buffer where no step changed the row since, else from the cache or the table. At its claim, if
the batch's unique ids are the ones foreseen (and no snapshot was loaded since), those rows are
the hand-off's first reads, as if made at ``tick``: the rows changed since are re-read or
overlaid from the last step, as after any first read (NOTE [ A hand-off reads while the step
computes ] in ``computed.py``), and the owner process sends every row, so the training process
copies nothing out of the ring. A batch whose ids were not the ones foreseen (a dataset with
randomness) is read at its claim, as ever; after :data:`MISSED` such batches in a row a stream
reads no further batch ahead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..cache.copies import from_copies
from ..worker.looked_up import LookedUp

#: The table's owner (``owner.py``, which imports this module): its lock, cache, counters,
#: stream, table and snapshot generation.
Owner = Any

#: Batches read ahead in a row that their claim could not use, after which a stream reads
#: none further ahead (its foresight is not exact: a dataset with randomness).
MISSED = 4


@dataclass
class ReadAhead:
    """Every row of the foreseen unique ``ids`` of a batch, as at clock tick ``tick`` of
    snapshot generation ``generation``."""

    ids: np.ndarray
    rows: np.ndarray
    tick: int
    generation: int

    def serves(self, ids: np.ndarray, generation: int) -> bool:
        return generation == self.generation and np.array_equal(ids, self.ids)


def read_ahead(owner: Owner, missed: int = 0) -> ReadAhead | None:
    """The rows of the next batch the stream's loader hands off, read now (see the NOTE); None:
    no stream, ``missed`` batches read ahead in a row not used, that batch not dispatched yet,
    or its misses not yet read by the reader (then they would be read twice)."""
    stream = owner.stream
    if stream is None or stream.stopped or stream.blind or missed >= MISSED:
        return None
    if owner.writeback is not None and owner.behind == 0:
        owner.writeback.wait()  # the last step's writes, else its rows are read again at the claim
    with owner.lock:
        following = next((b for b in stream.in_flight_ids if b[0] > stream.claimed), None)
        if following is None or following[0] not in stream.buffers:
            return None
        ids, cache = following[1], owner.cache
        table = owner.table
        found, rows = from_copies(
            [stream.buffers[following[0]]], ids, cache.last_updated, table.dim, table.dtype
        )
        if not found.all():
            rows[~found] = cache.current(ids[~found])
        return ReadAhead(ids, rows, cache.clock, owner.generation)


def read_rows(
    owner: Owner, item: LookedUp, rows: np.ndarray | None, ahead: ReadAhead | None = None
) -> tuple[np.ndarray, np.ndarray | None, int, int, int]:
    """Under the owner's lock: a lookup's rows as of the steps applied now (``ahead``: as read
    ahead, see the NOTE), which were re-read (None: all were read here), the clock tick they are
    at, and the lookup's hits and misses."""
    ids, hits, misses, newer = item.unique_ids, item.hits, item.misses, None
    counts, cache = owner.counts, owner.cache
    if ahead is not None:
        if owner.stream is not None:
            owner.stream.ready = None  # the reader's rows of this batch: in ``ahead`` already
        deferred = 0 if item.deferred is None else len(item.deferred)
        counts["deferred"] += deferred
        counts["filled_ahead"] += deferred
        counts["read_ahead"] += 1
        return ahead.rows, None, ahead.tick, hits, misses
    if rows is None:
        if item.lookup_step >= 0:
            counts["ring_overruns"] += 1
            # the rows its worker left to the owner: read here (by current()), not by the worker
            counts["deferred"] += 0 if item.deferred is None else len(item.deferred)
        else:  # the owner does the lookup: count it here, its misses as the owner's
            hits = int((owner.shared.slot_of[ids] >= 0).sum())
            misses = len(ids) - hits
            counts["deferred"] += misses  # read (and counted) by current()
        rows = cache.current(ids)
    else:
        if item.deferred is not None and len(item.deferred):
            read_deferred(owner, ids, rows, item.deferred)
        newer = cache.last_updated[ids] > item.lookup_step
        again = np.flatnonzero(newer)
        rows[again] = cache.current(ids[again])
    return rows, newer, cache.clock, hits, misses


def read_deferred(owner: Owner, ids: np.ndarray, rows: np.ndarray, deferred: np.ndarray) -> None:
    """The misses a worker left to the owner (NOTE [ Misses read by the owner ] in
    ``lookahead.py``): from the lookahead reader's buffer, else the cache or the table."""
    owner.counts["deferred"] += len(deferred)
    if owner.stream is not None:
        found, read = owner.stream.take(ids[deferred], rows.shape[1], rows.dtype)
        rows[deferred[found]] = read[found]
        owner.counts["filled_ahead"] += int(found.sum())
        deferred = deferred[~found]
    if len(deferred):
        rows[deferred] = owner.cache.current(ids[deferred])
