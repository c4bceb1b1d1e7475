"""The ranks layer in one process (the 2- and 3-rank launches are in test_distributed.py, in
the slow group): shard bounds, and the collectives on a process group of one rank."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

import embedpipe
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


def _sparse_all_reduce(rank: int, size: int, init: str, rounds: list, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    shards = Shards(dist.group.WORLD, timeout=60)
    try:
        got = []
        for step, per_rank in enumerate(rounds):
            ids, grad = per_rank[rank]
            before = dict(shards.bytes)
            union, total = shards.gradient(step, 0, ids, grad)
            moved = {k: v - before[k] for k, v in shards.bytes.items()}
            got.append((union, total, moved))
        out[rank] = got
    finally:
        shards.close()
        dist.destroy_process_group()


def test_the_sparse_all_reduce_sums_every_ranks_rows_in_rank_order_and_moves_few_bytes(tmp_path):
    """Four ranks (processes, gloo): every rank gets the union of the ranks' ids and, bit for
    bit, what summing every rank's gathered rows (each times 1/N, in rank order) gives, by a
    gather of every rank's rows or by the sparse all-reduce, whichever moves fewer rows (NOTE
    [ The gradient's sparse all-reduce ]); the bytes counted are that way's."""
    size, dim = 4, 6
    generator = torch.Generator().manual_seed(0)
    rounds = []
    for count in ([30, 50, 0, 40], [1, 1, 1, 1], [200, 180, 220, 190]):  # a rank with no rows
        per_rank = []
        for n in count:
            ids = torch.randint(0, 300, (n,), generator=generator)  # overlapping ids
            ids = ids if n == 30 else ids.unique()  # one rank's ids unsorted, with repeats
            per_rank.append((ids, torch.randn(len(ids), dim, generator=generator)))
        rounds.append(per_rank)
    manager = multiprocessing.get_context("spawn").Manager()
    out = manager.dict()
    context = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [
        context.Process(target=_sparse_all_reduce, args=(r, size, init, rounds, out))
        for r in range(size)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
        assert p.exitcode == 0
    paths = set()
    for step, per_rank in enumerate(rounds):
        every_id = torch.cat([ids for ids, _ in per_rank])
        every_grad = torch.cat([grad for _, grad in per_rank])
        union, where = torch.unique(every_id, return_inverse=True)
        expected = torch.zeros(len(union), dim).index_add_(0, where, every_grad * (1.0 / size))
        top = max(len(ids) for ids, _ in per_rank)
        # rows moved over every rank, by a gather and by the sparse all-reduce: the fewer wins
        gather = size * (size - 1) * top
        sparse = sum(int((ids % size != r).sum()) for r, (ids, _) in enumerate(per_rank))
        sparse += (size - 1) * len(union)
        paths.add(gather <= sparse)
        row = dim * 4
        for rank in range(size):
            got_union, total, moved = out[rank][step]
            assert torch.equal(got_union, union) and torch.equal(total, expected)
            sent = received = (size - 1) * top * 8  # the ids, to and from every other rank
            if gather <= sparse:  # this rank's rows (padded) to every other rank, and theirs
                sent += (size - 1) * top * row
                received += (size - 1) * top * row
            else:  # rows to the ranks that sum them, this rank's sums to every other rank
                ids = per_rank[rank][0]
                summed = int((union % size == rank).sum())
                to_me = sum(int((o[0] % size == rank).sum()) for o in per_rank)
                sent += int((ids % size != rank).sum()) * row + (size - 1) * summed * row
                received += (to_me - int((ids % size == rank).sum())) * row
                received += (len(union) - summed) * row
            assert moved["gradient_sent_bytes"] == sent
            assert moved["gradient_received_bytes"] == received
            assert moved["rows_sent_bytes"] == moved["rows_received_bytes"] == 0
    assert paths == {True, False}  # both ways were taken


def _rows_by_machine(rank: int, machines: list, init: str, out: dict) -> None:
    os.environ["GROUP_RANK"] = str(machines[rank])  # torchrun's node rank: the rank's machine
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=len(machines))
    shards = Shards(dist.group.WORLD, timeout=60)
    try:
        shards.by_machine()
        shards.plan(300, 10)
        lo, hi = shards.owned
        wanted = np.array([i for i in range(0, 300, 7) if not lo <= i < hi], dtype=np.int64)
        outside = []

        def serve(ids: np.ndarray) -> np.ndarray:  # row i is (i, i)
            outside.extend(int(i) for i in ids if not lo <= i < hi)
            return np.repeat(ids.astype(np.float32)[:, None], 2, axis=1)

        got = shards.rows(0, 0, wanted, serve, 2, np.dtype(np.float32))
        out[rank] = (
            shards.shard,
            shards.servers.tolist(),
            bool((got[:, 0] == wanted).all()),
            outside,
        )
    finally:
        shards.close()
        dist.destroy_process_group()


def test_rows_of_machines_whose_ranks_interleave_come_from_their_own_machine(tmp_path):
    """Five ranks on three machines dealt in turn (machines {0, 3}, {1, 4}, {2}, as a cyclic
    placement gives): each machine's shard is asked of a rank of that machine, which serves
    only ids of its shard, and every rank gets each id's own row (found wrong before: rank 3
    sent its requests in shard order to ranks in another order)."""
    machines = [0, 1, 2, 0, 1]
    context = multiprocessing.get_context("spawn")
    out = context.Manager().dict()
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [
        context.Process(target=_rows_by_machine, args=(r, machines, init, out))
        for r in range(len(machines))
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
        assert p.exitcode == 0
    assert [out[r][0] for r in range(5)] == machines  # each rank's shard: its machine's
    assert out[3][1] == [3, 4, 2]  # rank 3 asks the ranks at its place on each machine
    for rank in range(5):
        _, _, right, outside = out[rank]
        assert right and not outside, (rank, out[rank])


def _train_two_steps(path, owner: str, group, leave_with) -> None:
    """A checkpoint after one step, a second step, then ``leave_with`` leaves the pipe."""
    pipe = embedpipe.EmbeddingPipe(
        path, cache_rows=8, optimizer=embedpipe.optim.SGD(lr=1.0), process_group=group, owner=owner
    )
    batches = iter(pipe.loader([{"input_ids": torch.tensor([5, 20, 7])}] * 4, batch_size=1))
    for step in range(2):
        next(batches)["inputs_embeds"].sum().backward()
        pipe.step()
        if step == 0:
            pipe.checkpoint()
    leave_with(pipe)


def _raise_in_with(pipe) -> None:
    with pipe:
        raise ValueError("this rank fails")


def _raise_with_finally(pipe) -> None:
    try:
        raise ValueError("this rank fails")
    finally:
        pipe.close()


def _exit_0_in_with(pipe) -> None:
    with pipe:
        raise SystemExit(0)


def _close_a_generator_in_with(pipe) -> None:
    def steps():
        with pipe:
            yield

    generator = steps()
    next(generator)
    generator.close()  # GeneratorExit through the with


def _close_after_the_last_batch(pipe) -> None:
    batches = iter([])
    try:
        next(batches)
    except StopIteration:  # (review: a loop's end counted as a failure)
        pipe.close()


#: How the pipe is left, and the table's step after it (1: the checkpoint; 2: committed).
LEAVES = {
    _raise_in_with: 1,
    _raise_with_finally: 1,
    _exit_0_in_with: 2,
    _close_a_generator_in_with: 2,
    _close_after_the_last_batch: 2,
}


@pytest.mark.parametrize("leave_with", LEAVES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_sharded_pipe_closed_with_an_exception_on_its_way_commits_nothing(
    group, tmp_path, owner, leave_with
):
    """NOTE [ A rank that fails alone ]: a sharded pipe closed with a failure on its way leaves
    without meeting the other ranks (who may wait for it in the model's collectives), the table
    at its last checkpoint, and says so; sys.exit(0) and a closed generator close it as usual.
    The 2-rank launches are in test_distributed.py."""
    path = tmp_path / "t.zarr"
    with embedpipe.Table.create(path, 32, 4, chunk_rows=8) as created:
        row = created.read(np.array([5]))[0]
    leaves = LEAVES[leave_with] == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError) if leaves else contextlib.suppress(SystemExit):
            _train_two_steps(path, owner, group, leave_with)
    said = [str(w.message) for w in caught if "without meeting" in str(w.message)]
    assert len(said) == leaves, said
    table = embedpipe.Table.open(path)
    assert table.step == LEAVES[leave_with]
    for _ in range(LEAVES[leave_with]):
        row = row - np.float32(1.0)  # SGD at lr 1, the row once in each batch
    assert np.array_equal(table.read(np.array([5]))[0], row)
    embedpipe.Table.open(path, "r+").close()  # and the lock is free
