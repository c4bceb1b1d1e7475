"""The shared cache: seqlock-validated reads, admission and eviction, write-back before reuse."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

from embedpipe.cache.policy import LRU
from embedpipe.cache.rowcache import RowCache
from embedpipe.cache.sharedrows import SharedRows

V, D = 50, 8
WIDE = 4096


def make_cache(cache_rows=4):
    table = {"weight": np.arange(V * D, dtype=np.float32).reshape(V, D)}
    writes = []

    def fetch(ids, name):
        return table[name][ids].copy()

    def store(ids, rows, name):
        writes.append((name, ids.copy()))
        table[name][ids] = rows

    shared = SharedRows(V, cache_rows, D, np.float32)
    return RowCache(shared, LRU(cache_rows, V), fetch, store), table, writes


def test_read_misses_uncached_ids_and_hits_cached_ones():
    cache, table, _ = make_cache()
    ids = np.array([3, 7])
    cache.admit(ids, table["weight"][ids])
    rows, hit = cache.shared.read(np.array([3, 5, 7]))
    assert hit.tolist() == [True, False, True]
    np.testing.assert_array_equal(rows[[0, 2]], table["weight"][[3, 7]])


def test_a_slot_being_written_or_reassigned_reads_as_a_miss():
    cache, table, _ = make_cache()
    cache.admit(np.array([3]), table["weight"][[3]])
    slot = int(cache.shared.slot_of[3])
    cache.shared.version[slot] += 1  # the owner is inside its write
    assert not cache.shared.read(np.array([3]))[1][0]
    cache.shared.version[slot] += 1
    assert cache.shared.read(np.array([3]))[1][0]
    cache.shared.slot_id[slot] = 9  # the slot now holds another id
    assert not cache.shared.read(np.array([3]))[1][0]


def test_dirty_rows_are_written_back_before_their_slot_is_reused():
    cache, table, writes = make_cache(cache_rows=2)
    cache.admit(np.array([1, 2]), table["weight"][[1, 2]])
    work = cache.gather(np.array([1]))
    work.rows += 100
    cache.write_uncached(work, work.uncached())
    cache.put_back(work)
    assert not writes and table["weight"][1, 0] == 8  # still only in the cache
    cache.admit(np.array([4]), table["weight"][[4]])  # evicts the LRU row: 1, dirty
    assert writes == [("weight", np.array([1]))]
    assert table["weight"][1, 0] == 108
    assert cache.counts["evictions"] == 1 and cache.counts["rows_written"] == 1
    np.testing.assert_array_equal(cache.current(np.array([1])), table["weight"][[1]])


def test_rows_being_updated_are_pinned_and_late_admissions_get_the_update():
    cache, table, _ = make_cache(cache_rows=2)
    cache.admit(np.array([1, 2]), table["weight"][[1, 2]])
    work = cache.gather(np.array([1, 2, 30]))  # 30 is not cached: read from the table
    cache.admit(np.array([5, 30]), table["weight"][[5, 30]])  # nothing to evict: 1 and 2 pinned
    assert cache.shared.slot_of[[5, 30]].tolist() == [-1, -1]
    work.rows += 1
    cache.write_uncached(work, work.uncached())
    cache.put_back(work)
    assert table["weight"][30, 0] == 30 * D + 1  # the uncached row went to the table
    cache.admit(np.array([30]), table["weight"][[30]])
    work = cache.gather(np.array([30]))
    assert work.slots[0] >= 0
    assert cache.last_updated[[1, 2, 30, 5]].tolist() == [1, 1, 1, 0]


def _churn(shared: SharedRows, rounds: int, stop: Any = None) -> None:
    """The owner: keep moving ids between slots and rewriting rows; every row is filled with its id
    plus 100 times a counter (exact in float32), so a torn copy shows as a row whose values disagree.
    Runs ``rounds`` rounds, or until ``stop`` is set."""
    rng = np.random.default_rng(0)
    for n in range(rounds):
        if stop is not None and stop.is_set():
            return
        slots = np.sort(rng.choice(shared.cache_rows, 3, replace=False))
        old = shared.slot_id[slots]
        shared.clear(slots[old >= 0])
        ids = rng.choice(V, 3, replace=False)
        ids = ids[shared.slot_of[ids] < 0][: len(slots)]
        rows = (ids[:, None] + 100.0 * (n % 10000)) * np.ones(
            (len(ids), shared.rows.shape[1]), np.float32
        )
        shared.put(slots[: len(ids)], ids, rows)
        occupied = np.flatnonzero(shared.slot_id >= 0)
        shared.overwrite(
            occupied,
            (shared.slot_id[occupied, None] + 100.0 * (n % 10000))
            * np.ones((len(occupied), shared.rows.shape[1]), np.float32),
        )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_reads_never_return_a_torn_or_wrong_row():
    # Wide rows, so that copies take long enough to overlap the owner's writes.
    # The owner churns until the reader has checked enough rows (however the machine schedules
    # the two: a fixed number of rounds left a starved reader with too few).
    shared = SharedRows(V, 8, WIDE, np.float32)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    owner = ctx.Process(target=_churn, args=(shared, 10**9, stop))
    owner.start()
    hits, reads = 0, 0
    try:
        while owner.is_alive() and (hits < 2000 or reads < 5000):
            ids = np.arange(V)
            rows, hit = shared.read(ids)
            good = rows[hit]
            assert (good == good[:, :1]).all(), "torn row"
            np.testing.assert_array_equal(good[:, 0] % 100, ids[hit])  # the row of that id
            hits += int(hit.sum())
            reads += 1
    finally:
        stop.set()
        owner.join(timeout=60)
    assert owner.exitcode == 0 and hits >= 2000


@pytest.mark.parametrize("policy", ["lru", "lfu", "auto"])
def test_a_cache_of_the_whole_table_admits_every_row_and_never_evicts_one(policy):
    """Every row fits: each batch's new ids take free slots (no policy asked, none of its use
    counts kept), no row is evicted, and no dirty row is written ahead of an eviction."""
    from embedpipe.cache.policy import make_policy

    table = {"weight": np.arange(V * D, dtype=np.float32).reshape(V, D)}
    writes = []
    shared = SharedRows(V, V, D, np.float32)
    cache = RowCache(
        shared,
        make_policy(policy, V, V),
        lambda ids, name: table[name][ids].copy(),
        lambda ids, rows, name: writes.append(ids.copy()),
    )
    assert cache.holds_table
    rng = np.random.default_rng(0)
    for _ in range(40):
        ids = np.unique(rng.integers(0, V, 12))
        cache.admit(ids, table["weight"][ids])
        work = cache.gather(ids[:3])  # a step dirties some of them
        work.rows += 1
        cache.write_uncached(work, work.uncached())
        cache.put_back(work)
        table["weight"][ids[:3]] += 1
        assert cache.clean_ahead() == 0
    cached = np.flatnonzero(shared.slot_of >= 0)
    assert cache.counts["evictions"] == 0 and not writes
    rows, hit = shared.read(cached)
    assert hit.all()
    np.testing.assert_array_equal(rows, table["weight"][cached])
    assert len(cached) == len(np.unique(shared.slot_id[shared.slot_id >= 0]))
