"""The ranks layer in one process (the 2- and 3-rank launches are in test_distributed.py, in
the slow group): shard bounds, and the collectives on a process group of one rank."""

from __future__ import annotations

import gc
import multiprocessing
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from embedpipe.ranks.shards import COMMIT, Shards, process_group, split


def test_shards_are_whole_chunks_and_cover_the_table():
    assert split(1000, 64, 2).tolist() == [0, 512, 1000]
    assert split(1000, 64, 3).tolist() == [0, 320, 640, 1000]
    assert split(100, 64, 3).tolist() == [0, 0, 64, 100]  # fewer chunks than ranks: one owns none


@pytest.fixture
def group():
    """A gloo process group of this process alone."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_owns_every_row_and_averages_its_own_gradient(group):
    assert process_group() is None  # one rank: a pipe trains alone
    shards = Shards(group, timeout=30)
    try:
        shards.plan(1000, 64)
        assert shards.owned == (0, 1000) and shards.leader
        assert shards.layout() == {"ranks": 1, "bounds": [0, 1000]}
        assert shards.owns(np.array([0, 999])).all()
        assert shards.describe() == "rank 0 of 1 (rows 0 to 1,000)"
        nothing = shards.rows(0, 0, np.empty(0, np.int64), lambda ids: None, 4, np.float32)
        assert nothing.shape == (0, 4)
        ids, grad = torch.tensor([7, 3, 7]), torch.ones(3, 4)
        union, total = shards.gradient(0, 0, ids, grad)
        assert union.tolist() == [3, 7] and total[:, 0].tolist() == [1.0, 2.0]
        shards.begin(COMMIT, 5, 0)
        assert shards.agree(None, "taking a checkpoint", result="done") == "done"
        with pytest.raises(OSError, match="disk full"):  # the rank that failed raises its error
            shards.agree(OSError("disk full"), "taking a checkpoint")
    finally:
        shards.close()


def _collect_and_exit() -> None:
    gc.collect()
    os._exit(0)


def test_a_forked_worker_never_frees_a_closed_pipes_process_group(group):
    """A DataLoader worker forked while a closed pipe's gloo group is cyclic garbage: its
    collector would free the group there and wait forever on threads it does not have (NOTE
    [ A fork never frees a process group ]; measured: hung every time before)."""

    class Pipe:  # a closed pipe, in a cycle with its Shards
        pass

    pipe = Pipe()
    pipe.shards, pipe.me = Shards(group, timeout=30), pipe
    pipe.shards.close()
    del pipe
    child = multiprocessing.get_context("fork").Process(target=_collect_and_exit)
    child.start()
    child.join(20)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, "the forked process hung freeing the group"
