"""Rows read from disk by each cache policy on a trace of token ids, and Belady's optimum.

What ``embedpipe advise`` and the benchmark share. A trace is cut into batches; each batch reads
its unique ids, and a row a batch reads from disk is counted once per batch (the lookup
deduplicates ids before it reads). :func:`rows_read` replays one policy at one cache size;
:func:`miss_ratio_curve` replays several over a range of sizes; ``advice.py`` adds the memory
each size costs and picks the size for a memory budget.

The policies:

- ``"belady"``: Belady's MIN with bypass, at batch granularity: after each batch the cache keeps,
  of the rows it held and the rows just read, the ``cache_rows`` used again soonest; a row never
  used again is not kept. No policy of that size reads fewer rows: the optimum to compare with.
- ``"lru"``, ``"lfu"``, ``"auto"`` (and every other name ``embedpipe.cache.policy`` knows): embedpipe's
  own policy, replayed through its real :class:`~embedpipe.cache.sharedrows.SharedRows` and
  :class:`~embedpipe.cache.rowcache.RowCache` at row width 1, in the order a loader with ``num_workers=0``
  runs (:func:`replay_pipe`), so a real pipe over the same trace reports the same
  ``stats()["rows_read"]``.
- ``"worker_lru"``: the obvious cache, a ``cachetools.LRUCache`` of ``cache_rows`` rows in each of
  ``workers`` DataLoader workers that take the batches round-robin (so ``workers`` times the
  memory); ``"worker_lru_split"``: the same with ``cache_rows // workers`` each (the same memory).
- ``"lazy"``: no cache; every unique id of every batch is read.

Costs: the embedpipe policies are vectorised per batch (a few numpy calls over the batch and the
slots); Belady and the per-worker LRU run a Python loop over the batch's ids (about a second per
million id uses).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import cachetools
import numpy as np

from ..cache import policy as policies
from ..cache.rowcache import RowCache
from ..cache.sharedrows import SharedRows

#: embedpipe's own policies (replayed through its cache code), as ``embedpipe.cache.policy`` lists them.
PIPE_POLICIES: tuple[str, ...] = tuple(policies.POLICIES)
#: Every policy :func:`rows_read` knows, the optimum first.
POLICIES: tuple[str, ...] = ("belady", *PIPE_POLICIES, "worker_lru", "worker_lru_split", "lazy")

Progress = Callable[[str, int], None]  # (policy, cache_rows), called after each replay


def batch_sets(ids: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """The sorted unique ids (int64) of each batch of ``batch_size`` samples.

    ``ids``: (samples, seq_len) token ids, one sample per row, or 1-D (one id per sample). A last
    batch with fewer samples is kept, as a DataLoader without ``drop_last`` keeps it.
    """
    ids = np.asarray(ids)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if ids.ndim not in (1, 2):
        raise ValueError(
            f"a trace holds (samples, seq_len) or (samples,) token ids, got shape {ids.shape}"
        )
    return [
        np.unique(ids[start : start + batch_size]).astype(np.int64, copy=False)
        for start in range(0, len(ids), batch_size)
    ]


def rows_read(
    sets: Sequence[np.ndarray],
    num_rows: int,
    cache_rows: int,
    policy: str,
    *,
    window: int = 64,
    workers: int = 2,
) -> int:
    """Rows read from disk over the batches ``sets`` (each sorted unique int64 ids < ``num_rows``)
    with a cache of ``cache_rows`` rows under ``policy`` (one of :data:`POLICIES`).

    ``window``: the batches a lookahead policy knows ahead; ``workers``: the DataLoader workers of
    the per-worker LRU baselines.
    """
    cache_rows = min(int(cache_rows), num_rows)  # as EmbeddingPipe clamps it
    if cache_rows < 0:
        raise ValueError(f"cache_rows must be >= 0, got {cache_rows}")
    if policy == "belady":
        return rows_read_belady(sets, num_rows, cache_rows)
    if policy == "lazy":
        return sum(len(u) for u in sets)
    if policy == "worker_lru":
        return rows_read_worker_lru(sets, cache_rows, workers)
    if policy == "worker_lru_split":
        return rows_read_worker_lru(sets, cache_rows // max(workers, 1), workers)
    if policy in PIPE_POLICIES:
        return replay_pipe(sets, num_rows, cache_rows, policy, window=window)
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def miss_ratio_curve(
    sets: Sequence[np.ndarray],
    num_rows: int,
    cache_sizes: Sequence[int],
    policies: Sequence[str] = POLICIES,
    *,
    window: int = 64,
    workers: int = 2,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Rows read by every policy at every cache size.

    Returns ``{"cache_rows": [sizes...], "rows_read": {policy: [rows read at each size]},
    "lazy": rows read with no cache, "batches": len(sets)}``; the miss ratio at a size is
    ``rows_read / lazy``. ``progress(policy, cache_rows)`` is called after each replay.
    """
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {POLICIES}")
    sizes = [min(int(c), num_rows) for c in cache_sizes]
    nexts = next_uses(sets) if "belady" in policies else None
    curve: dict[str, list[int]] = {p: [] for p in policies}
    for c in sizes:
        for p in policies:
            if p == "belady":
                curve[p].append(_belady_heap(sets, nexts, num_rows, c))
            else:
                curve[p].append(rows_read(sets, num_rows, c, p, window=window, workers=workers))
            if progress is not None:
                progress(p, c)
    return {
        "cache_rows": sizes,
        "rows_read": curve,
        "lazy": sum(len(u) for u in sets),
        "batches": len(sets),
    }


# ----------------------------------------------------------------------------- embedpipe
def replay_pipe(
    sets: Sequence[np.ndarray], num_rows: int, cache_rows: int, policy: str, *, window: int = 64
) -> int:
    """embedpipe's own cache code on the trace, as a loader with ``num_workers=0`` runs it.

    For each batch t: the lookup copies hits out of :class:`SharedRows` and counts the misses (as
    ``worker.Lookup``), then the hand-off admits the batch (``RowCache.admit``, as
    ``Owner.hand_off``). A policy that looks ahead (one with ``foresee``) knows the next
    ``window`` batches, t + 1 .. t + window, by the hand-off of batch t: it moved past batch t
    (``advance``) when the loader drew it, and its reader then foresaw batch t + window (as
    ``lookahead.py`` does once its reader thread has caught up). Rows the cache reads itself (a prefetch)
    count too, as ``stats()["rows_read"]`` counts them. Rows are one float wide; no disk.
    """
    shared = SharedRows(num_rows, cache_rows, 1, np.float32)
    cache = RowCache(
        shared,
        policies.make_policy(policy, cache_rows, num_rows, window=window),
        fetch=lambda ids, name: np.zeros((len(ids), 1), np.float32),
        store=lambda ids, rows, name: None,
    )
    foresee = getattr(cache.policy, "foresee", None)
    if foresee is not None:
        for u in sets[:window]:
            foresee(u)
    misses = 0
    for t, u in enumerate(sets):
        rows, hit = shared.read(u)  # the lookup
        misses += len(u) - int(hit.sum())
        if foresee is not None:
            cache.policy.advance()  # batch t is dispatched: the window moves past it...
            if t + window < len(sets):
                foresee(sets[t + window])  # ...and takes in the next batch
        cache.admit(u, rows)  # the hand-off
    return misses + cache.counts["rows_read"]


# ----------------------------------------------------------------------------- per-worker LRU
def lru_lookup(cache: cachetools.LRUCache, ids: list[int]) -> list[int]:
    """The per-worker LRU's lookup: touch the hits, return the misses (not yet inserted)."""
    return [i for i in ids if cache.get(i) is None]  # get() of a hit makes it the newest


def rows_read_worker_lru(sets: Sequence[np.ndarray], cache_rows: int, workers: int) -> int:
    """A ``cachetools.LRUCache`` of ``cache_rows`` rows in each of ``workers`` workers; worker w
    sees batches w, w + workers, ... (as a DataLoader hands them out) and inserts its misses."""
    if cache_rows < 1:
        return sum(len(u) for u in sets)
    caches = [cachetools.LRUCache(maxsize=cache_rows) for _ in range(max(workers, 1))]
    read = 0
    for t, u in enumerate(sets):
        cache = caches[t % len(caches)]
        misses = lru_lookup(cache, u.tolist())
        read += len(misses)
        for i in misses:
            cache[i] = True
    return read


# ----------------------------------------------------------------------------- Belady
def next_uses(sets: Sequence[np.ndarray]) -> list[np.ndarray]:
    """For each batch t and each id in it, the next batch after t that uses the id
    (``len(sets)`` if none)."""
    n = len(sets)
    if n == 0:
        return []
    ids = np.concatenate(sets)
    when = np.repeat(np.arange(n), [len(u) for u in sets])
    order = np.lexsort((when, ids))  # by id, then by batch
    nxt_sorted = np.full(len(ids), n, dtype=np.int64)
    same = ids[order][1:] == ids[order][:-1]
    nxt_sorted[:-1][same] = when[order][1:][same]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    return np.split(nxt, np.cumsum([len(u) for u in sets])[:-1])


def rows_read_belady(sets: Sequence[np.ndarray], num_rows: int, cache_rows: int) -> int:
    """Belady's MIN with bypass at batch granularity (see the module docstring); a max-heap on
    next use with lazy deletion, O(log C) per id use."""
    return _belady_heap(sets, next_uses(sets), num_rows, cache_rows)


def _belady_heap(
    sets: Sequence[np.ndarray], nexts: list[np.ndarray], num_rows: int, cache_rows: int
) -> int:
    end = len(sets)
    cached = np.zeros(num_rows, dtype=bool)
    due = np.full(num_rows, -1, dtype=np.int64)  # next use of each cached id
    heap: list[tuple[int, int]] = []  # (-next use, id); stale when it disagrees with due[id]
    size = read = 0
    for u, nxt in zip(sets, nexts, strict=True):
        hit = cached[u]
        read += len(u) - int(hit.sum())
        hit_ids, hit_next = u[hit], nxt[hit]
        due[hit_ids] = hit_next
        for i, n in zip(hit_ids.tolist(), hit_next.tolist(), strict=True):
            heapq.heappush(heap, (-n, i))
        for i, n in zip(u[~hit].tolist(), nxt[~hit].tolist(), strict=True):
            if n >= end or cache_rows == 0:
                continue  # never used again: bypass
            if size >= cache_rows:
                while True:  # the cached row used furthest in the future
                    neg, j = heap[0]
                    if cached[j] and due[j] == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= n:
                    continue  # every cached row is needed no later than this one
                heapq.heappop(heap)
                cached[j] = False
                size -= 1
            cached[i] = True
            due[i] = n
            heapq.heappush(heap, (-n, i))
            size += 1
        if len(heap) > 4 * cache_rows + 4096:  # drop the stale entries
            live = np.flatnonzero(cached)
            heap = list(zip((-due[live]).tolist(), live.tolist(), strict=True))
            heapq.heapify(heap)
    return read


def rows_read_belady_by_partition(
    sets: Sequence[np.ndarray], num_rows: int, cache_rows: int
) -> int:
    """Belady again, another way (a check on :func:`rows_read_belady`: the two must agree):
    after each batch, keep the ``cache_rows`` candidates of earliest next use by
    ``argpartition``; rows never used again are dropped. O(C + U) numpy per batch."""
    nexts = next_uses(sets)
    end = len(sets)
    due = np.zeros(num_rows, dtype=np.int64)
    cached = np.empty(0, dtype=np.int64)
    read = 0
    for u, nxt in zip(sets, nexts, strict=True):
        read += len(u) - int(np.isin(u, cached, assume_unique=True).sum())
        due[u] = nxt
        candidates = np.union1d(cached, u)
        candidates = candidates[due[candidates] < end]  # never used again: bypass
        if cache_rows == 0:
            candidates = candidates[:0]
        elif len(candidates) > cache_rows:
            candidates = candidates[np.argpartition(due[candidates], cache_rows - 1)[:cache_rows]]
        cached = candidates
    return read
