"""The rows-read simulator: a hand-computed trace, Belady two ways, and a real pipe agreeing."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.cache.policy import make_policy
from embedpipe.tools import simulate
from embedpipe.tools.simulate import POLICIES, batch_sets, miss_ratio_curve, rows_read

# A trace worked out by hand: ids 0..6, a cache of 2 rows, 2 workers for the per-worker LRU.
# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.

HAND_SETS = [np.array(s, dtype=np.int64) for s in ([0, 1, 2], [0, 3], [1, 2], [0, 4], [1, 5], [0, 2], [3, 6], [0, 1])]  # fmt: skip
HAND_ROWS, HAND_CACHE = 7, 2
# Next uses: 0 at batches 0,1,3,5,7; 1 at 0,2,4,7; 2 at 0,2,5; 3 at 1,6; 4 at 3; 5 at 4; 6 at 6.
#
# lazy: 3 + 7 x 2 = 17.
#
# belady (keep the 2 rows used soonest; never-again rows bypass):
#   b0 reads 0,1,2 (3); keeps 0 (next 1) and 1 (next 2; 2 ties at 2 and is bypassed)
#   b1 hit 0, reads 3 (4): 3 next at 6, later than 0 (3) and 1 (2): bypassed
#   b2 hit 1, reads 2 (5): 2 next at 5, later than 0 (3) and 1 (4): bypassed
#   b3 hit 0, reads 4 (6); b4 hit 1, reads 5 (7); b5 hit 0, reads 2 (8): never again, bypassed
#   b6 reads 3,6 (10): never again; b7 hits 0,1.                                       belady = 10
#
# lru (admit every miss that finds a slot, candidates in id order; evict least recently used):
#   b0 reads 0,1,2 (3): two empty slots take 0,1; b1 hit 0, reads 3 (4): 3 replaces 1 -> {0,3}
#   b2 reads 1,2 (6) -> {1,2}; b3 reads 0,4 (8) -> {0,4}; b4 reads 1,5 (10) -> {1,5};
#   b5 reads 0,2 (12) -> {0,2}; b6 reads 3,6 (14) -> {3,6}; b7 reads 0,1 (16).          lru = 16
#
# lfu (uses counted per batch after the hand-off; a slot scores uses + (last_used + 1)/(clock + 2),
# a miss is admitted only if its uses, this batch included, beat the coldest slot's score; no
# halving in 17 uses):
#   b0 reads 0,1,2 (3): empty slots take 0,1; uses 0:1 1:1 2:1, clock 1
#   b1 hit 0, reads 3 (4): 3 (1) vs slot of 1: 1 + 2/3 -> refused; uses 0:2 3:1, clock 2
#   b2 hit 1, reads 2 (5): 2 (2) vs 0: 2 + 3/4 -> refused; uses 1:2 2:2, clock 3
#   b3 hit 0, reads 4 (6): 4 (1) vs 1: 2 + 4/5 -> refused; uses 0:3 4:1, clock 4
#   b4 hit 1, reads 5 (7): 5 (1) vs 0: 3 + 5/6 -> refused; uses 1:3 5:1, clock 5
#   b5 hit 0, reads 2 (8): 2 (3) vs 1: 3 + 6/7 -> refused; uses 0:4 2:3, clock 6
#   b6 reads 3,6 (10): 3 (2) vs 1: 3 + 6/8 -> refused; b7 hits 0,1.                     lfu = 10
#
# worker_lru (cachetools LRU of 2 rows per worker; worker 0 takes b0 b2 b4 b6, worker 1 the rest):
#   w0: b0 reads 0,1,2 (3) -> {1,2}; b2 hits; b4 hit 1, reads 5 (4) -> {1,5}; b6 reads 3,6 (6)
#   w1: b1 reads 0,3 (2); b3 hit 0, reads 4 (3) -> {0,4}; b5 hit 0, reads 2 (4); b7 hit 0, reads 1 (5)
#                                                                                worker_lru = 11
# worker_lru_split (1 row per worker):
#   w0: b0 3 -> {2}; b2 hit 2, reads 1 (4) -> {1}; b4 hit 1, reads 5 (5); b6 reads 3,6 (7)
#   w1: b1 2, b3 2, b5 2, b7 2 (8: each batch shares nothing with the one row kept)
#                                                                          worker_lru_split = 15
# lookahead (the window, 64 batches, holds the whole trace): a slot scores by its row's next use
# (sooner is worth more), a miss is admitted only if it is used sooner than the slot's row:
#   b0 reads 0,1,2 (3): empty slots take 0 (next 1), 1 (next 2); 2 (next 2) finds no slot
#   b1 reads 3 (4): next 6, later than 1's (2); b2 reads 2 (5): next 5, later than 0's (3)
#   b3..b6 read 4, 5, 2, 3, 6 (10): none used sooner than 0 or 1 again; b7 hits.  lookahead = 10
HAND_EXPECTED = {
    "belady": 10,
    "lru": 16,
    "lfu": 10,
    "worker_lru": 11,
    "worker_lru_split": 15,
    "lazy": 17,
}
if "lookahead" in simulate.PIPE_POLICIES:  # the lookahead policy is being added to policy.py
    HAND_EXPECTED["lookahead"] = 10


@pytest.mark.parametrize("policy", sorted(HAND_EXPECTED))
def test_hand_computed_trace(policy):
    assert rows_read(HAND_SETS, HAND_ROWS, HAND_CACHE, policy, workers=2) == HAND_EXPECTED[policy]


def test_belady_two_ways_on_the_hand_trace():
    for cache_rows in range(HAND_ROWS + 1):
        heap = simulate.rows_read_belady(HAND_SETS, HAND_ROWS, cache_rows)
        partition = simulate.rows_read_belady_by_partition(HAND_SETS, HAND_ROWS, cache_rows)
        assert heap == partition


def zipf_ids(samples: int, seq_len: int, num_rows: int, seed: int = 0) -> np.ndarray:
    """Zipf-like token ids, popular rows spread over the table (as the benchmark's trace)."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, num_rows + 1, dtype=np.float64) ** -1.1
    ranks = rng.choice(num_rows, size=(samples, seq_len), p=p / p.sum())
    return rng.permutation(num_rows)[ranks]


@pytest.mark.parametrize("cache_rows", [0, 1, 17, 150, 600, 2000])
def test_belady_two_ways_and_below_every_policy(cache_rows):
    sets = batch_sets(zipf_ids(600, 32, 2000), 8)
    heap = simulate.rows_read_belady(sets, 2000, cache_rows)
    assert heap == simulate.rows_read_belady_by_partition(sets, 2000, cache_rows)
    for policy in POLICIES:
        assert rows_read(sets, 2000, cache_rows, policy) >= heap, policy


def test_belady_with_every_row_cached_reads_each_row_once():
    sets = batch_sets(zipf_ids(200, 16, 500), 4)
    distinct = len(np.unique(np.concatenate(sets)))
    assert rows_read(sets, 500, 500, "belady") == distinct
    assert rows_read(sets, 500, 10_000, "lru") == distinct  # clamped to the table, as the pipe


def test_batch_sets():
    ids = np.array([[3, 1, 3], [2, 2, 0], [5, 5, 5]])
    sets = batch_sets(ids, 2)
    assert [s.tolist() for s in sets] == [[0, 1, 2, 3], [5]]  # a short last batch is kept
    assert all(s.dtype == np.int64 for s in sets)
    assert [s.tolist() for s in batch_sets(np.array([4, 4, 1]), 2)] == [[4], [1]]
    with pytest.raises(ValueError, match="shape"):
        batch_sets(np.zeros((2, 2, 2), dtype=np.int64), 1)
    with pytest.raises(ValueError, match="batch_size"):
        batch_sets(ids, 0)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="belady"):
        rows_read(HAND_SETS, HAND_ROWS, 2, "fifo")
    with pytest.raises(ValueError, match="fifo"):
        miss_ratio_curve(HAND_SETS, HAND_ROWS, [2], ["lru", "fifo"])


def test_miss_ratio_curve():
    calls = []
    curve = miss_ratio_curve(
        HAND_SETS,
        HAND_ROWS,
        [0, 2, 99],
        ("belady", "lru", "lazy"),
        progress=lambda p, c: calls.append((p, c)),
    )
    assert curve["cache_rows"] == [0, 2, 7]
    assert curve["rows_read"]["belady"][1] == 10 and curve["rows_read"]["lru"][1] == 16
    assert curve["rows_read"]["lazy"] == [17, 17, 17] and curve["lazy"] == 17
    assert curve["rows_read"]["belady"][2] == 7  # every distinct row once
    assert curve["batches"] == len(HAND_SETS) and len(calls) == 9


class TraceDataset(torch.utils.data.Dataset):
    """One sequence of the trace per sample. Given the pipe's lookahead ``policy``, the loader's
    fetch of batch t (in the main thread: ``num_workers=0``) waits until the policy's reader (a
    thread of its own) has foreseen the next ``window`` batches, as the simulator assumes: a
    real pipe's reader thread may lag behind the loop (at the start, on a loaded machine), and
    then the pipe reads more rows than the simulation says (docs/tuning.md)."""

    def __init__(self, ids: np.ndarray, batch_size: int, policy: object = None) -> None:
        self.ids = torch.from_numpy(ids)
        self.batches = -(-len(ids) // batch_size)
        self.batch_size = batch_size
        self.policy = policy
        self.pid = os.getpid()  # the training process (the foresight child reads a copy)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        if self.policy is not None and os.getpid() == self.pid:
            ahead = min(self.policy.window, self.batches - 1 - indices[0] // self.batch_size)
            deadline = time.monotonic() + 60
            while self.policy.foreseen < ahead:  # batch t was drawn: the window is t+1 ..
                assert time.monotonic() < deadline, "the lookahead reader fell behind for good"
                time.sleep(0.001)
        return [self[i] for i in indices]


def pipe_rows_read(
    path, ids: np.ndarray, batch_size: int, cache_rows: int, policy: str, window: int
) -> int:
    """A real EmbeddingPipe (frozen, num_workers=0) over the trace: its ``stats()["rows_read"]``."""
    with embedpipe.EmbeddingPipe(
        path, cache_rows=cache_rows, policy=policy, lookahead=window, owner="thread"
    ) as pipe:
        owner = pipe._owner
        dataset = TraceDataset(ids, batch_size, owner.cache.policy if owner.looks_ahead else None)
        for batch in pipe.loader(dataset, batch_size=batch_size):
            batch["inputs_embeds"]
        return pipe.stats()["rows_read"]


LOOKS_AHEAD = [p for p in simulate.PIPE_POLICIES if hasattr(make_policy(p, 1, 1), "foresee")]


@pytest.mark.parametrize(
    "policy, window",
    [(p, 64) for p in simulate.PIPE_POLICIES] + [(p, 4) for p in LOOKS_AHEAD],  # 4: < the trace
)
def test_the_real_pipe_reads_what_the_simulator_says(tmp_path, policy, window):
    num_rows, batch_size, batches = 800, 4, 40
    ids = zipf_ids(batches * batch_size, 24, num_rows, seed=1)
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, num_rows, 4, chunk_rows=64).close()
    sets = batch_sets(ids, batch_size)
    for cache_rows in (0, 40, 200, num_rows):
        expected = rows_read(sets, num_rows, cache_rows, policy, window=window)
        got = pipe_rows_read(path, ids, batch_size, cache_rows, policy, window)
        assert got == expected, cache_rows
