"""Eviction and admission: LRU evicts the oldest, LFU keeps the hot rows through a flood of misses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.cache.policy import LFU, LRU, Lookahead, make_policy
from embedpipe.cache.rowcache import RowCache
from embedpipe.cache.sharedrows import SharedRows


def test_lru_frees_empty_slots_first_then_the_oldest():
    lru = LRU(cache_rows=3, num_rows=10)
    slot_ids = np.array([4, 5, -1])
    lru.record(np.array([4]), np.array([0]))
    lru.record(np.array([5]), np.array([1]))
    chosen, slots = lru.plan(np.array([7, 8]), keep=np.array([], dtype=np.int64), slot_ids=slot_ids)
    assert chosen.tolist() == [0, 1] and slots.tolist() == [2, 0]


def test_plan_never_frees_kept_slots():
    lru = LRU(cache_rows=2, num_rows=10)
    chosen, slots = lru.plan(np.array([1, 2, 3]), keep=np.array([0]), slot_ids=np.array([5, 6]))
    assert slots.tolist() == [1] and len(chosen) == 1


def test_lfu_admits_a_miss_only_if_it_is_used_more_than_the_row_it_would_evict():
    lfu = LFU(cache_rows=1, num_rows=10)
    for _ in range(3):
        lfu.record(np.array([4]), np.array([0]))  # row 4, cached in slot 0, used 3 times
    none = np.array([], dtype=np.int64)
    assert len(lfu.plan(np.array([7]), none, np.array([4]))[0]) == 0  # 7: used once, stays out
    for _ in range(3):
        lfu.record(np.array([7]), np.array([-1]))  # 7 missed three times
    chosen, slots = lfu.plan(np.array([7]), none, np.array([4]))
    assert chosen.tolist() == [0] and slots.tolist() == [0]  # 4 uses beat 3


def test_unknown_policy():
    with pytest.raises(ValueError, match="policy must be one of .* got 'mru'"):
        make_policy("mru", 4, 10)


def test_a_hot_row_stays_cached_when_each_batch_brings_more_misses_than_slots(tmp_path):
    # Each batch: two one-off ids and id 30. LRU keeps evicting 30; LFU keeps it.
    embedpipe.Table.create(tmp_path / "t.zarr", 64, 4).close()
    data = [{"input_ids": torch.tensor([2 * t, 2 * t + 1, 30])} for t in range(15)]
    read = {}
    for policy in ("lru", "lfu", "auto"):
        with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=2, policy=policy) as pipe:
            for _ in pipe.loader(data, batch_size=1):
                pass
            read[policy] = pipe.stats()["rows_read"]
            assert (pipe._owner.shared.slot_of[30] >= 0) == (policy != "lru")
    assert read["lfu"] == 2 * 15 + 2  # 30 read twice: at first it ties with one-offs
    # lookahead knows 30 comes back (once its reader has seen the batches: timing)
    assert 2 * 15 + 1 <= read["auto"] <= read["lfu"]
    assert read["lru"] > read["lfu"]


@pytest.mark.parametrize("name", ["lfu", "lookahead"])
def test_scores_kept_per_slot_equal_scores_computed_from_scratch(name):
    """NOTE [ Scores kept per slot ]: after every change (batches recorded and foreseen, the
    window moved and restarted, rows held and released, LFU's counts halved), each slot's kept
    score is its row's score."""
    rng = np.random.default_rng(0)
    shared = SharedRows(500, 40, 1, np.float32)
    cache = RowCache(
        shared,
        make_policy(name, 40, 500, window=5),
        lambda ids, _: np.zeros((len(ids), 1), np.float32),
        lambda ids, rows, _: None,
    )
    policy = cache.policy
    batches = [np.unique(rng.integers(0, 500, 30)) for _ in range(300)]
    for t in run_batches(cache, batches, restart_every=97):
        occupied = np.flatnonzero(shared.slot_id >= 0)
        expected = policy.row_score(shared.slot_id[occupied], occupied)
        assert np.array_equal(policy.score[occupied], expected), t
        assert (policy.score[shared.slot_id < 0] == -1).all()


def run_batches(cache: RowCache, batches: list[np.ndarray], restart_every: int):
    """Admit ``batches`` one by one, the lookahead policy's window moving (5 batches ahead,
    restarted now and then), training every other batch and rows held and released; yields
    each batch's number once it is admitted."""
    policy = cache.policy
    looks = isinstance(policy, Lookahead)
    for t, batch in enumerate(batches):
        if looks:
            if t % restart_every == 0:
                policy.restart()
            if t + 5 < len(batches):
                policy.foresee(batches[t + 5])
            policy.advance()
            policy.training = t % 2 == 0
        cache.admit(batch, np.zeros((len(batch), 1), np.float32))
        if looks and t % 3 == 0:
            policy.hold(batch)
        if looks and t % 7 == 0:
            policy.release()
        yield t


@pytest.mark.parametrize("name", ["lfu", "lookahead"])
def test_the_cold_pool_frees_what_a_partition_of_every_slot_would(name, monkeypatch):
    """NOTE [ The cold pool ]: at every plan, the slots freed have the scores that partitioning
    every slot gives, and the same missed rows are admitted (and so for the coldest dirty rows
    that the writeback cleans ahead); the pool is made again only every
    few plans (through the cache filling, LFU's halving, windows restarted, rows held)."""
    rng = np.random.default_rng(1)
    num_rows, cache_rows = 20_000, 2_000
    shared = SharedRows(num_rows, cache_rows, 1, np.float32)
    policy = make_policy(name, cache_rows, num_rows, window=5)
    cache = RowCache(
        shared,
        policy,
        lambda ids, _: np.zeros((len(ids), 1), np.float32),
        lambda ids, rows, _: None,
    )
    plans, pools = [], []
    real_plan, real_new_pool = policy.plan, policy._new_pool

    def plan(candidates, keep, slot_ids):
        _, scores = LRU._coldest(policy, len(candidates), keep, slot_ids)  # every slot
        expected = policy._choose(candidates, scores)
        chosen, freed = real_plan(candidates, keep, slot_ids)
        np.testing.assert_array_equal(chosen, expected)
        np.testing.assert_array_equal(policy.score[freed], scores[: len(chosen)])
        assert not np.isin(freed, keep).any()
        plans.append(len(chosen))
        return chosen, freed

    monkeypatch.setattr(policy, "plan", plan)
    monkeypatch.setattr(policy, "_new_pool", lambda *a: pools.append(1) or real_new_pool(*a))
    # zipf ids, 60-100 a batch: the cache fills within a few dozen batches, LFU halves at 666
    batches = [np.unique(rng.zipf(1.2, rng.integers(60, 100)) % num_rows) for _ in range(900)]
    for _ in run_batches(cache, batches, restart_every=211):  # and the rows cleaned ahead
        allowed = rng.random(cache_rows) < 0.5
        got = policy.coldest_of(100, allowed, shared.slot_id)
        every = LRU.coldest_of(policy, 100, allowed, shared.slot_id)
        np.testing.assert_array_equal(np.sort(policy.score[got]), np.sort(policy.score[every]))
        assert allowed[got].all()
    assert len(plans) == len(batches) and sum(plans) > 2 * cache_rows  # full, and evicting
    assert len(pools) < len(plans) / 3, (len(pools), len(plans))


def test_a_pool_left_half_updated_never_frees_a_slot_twice():
    """NOTE [ The cold pool ]: an interrupt between the pool's two records (a hand-off may be
    interrupted anywhere) can leave a slot in it twice; a plan then partitions every slot
    again rather than free that slot for two rows."""
    policy = LFU(80, 1000)
    slot_of, slot_id = np.full(1000, -1), np.arange(80)
    slot_of[:80] = slot_id
    policy.attach(slot_of, slot_id)
    for k in range(80):  # row i used i + 1 times: slot 0 is the coldest
        policy.record(np.arange(k, 80), np.arange(k, 80))
    none = np.empty(0, dtype=np.int64)
    policy.plan(np.array([500]), none, slot_id)  # a pool of the coldest slots, and its bar
    assert policy._bar > -np.inf and 0 in policy._pool
    policy._joined.append(np.array([0]))  # as an interrupt would leave it: slot 0 twice
    policy.uses[[500, 501]] = 50
    chosen, freed = policy.plan(np.array([500, 501]), none, slot_id)
    assert len(chosen) == 2 and sorted(freed) == [0, 1]
