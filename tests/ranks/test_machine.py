"""The gradient averaged through shared memory by ranks of one machine (``ranks/machine.py``),
in processes of a gloo group: the sums the gloo exchange gives, bit for bit, with no byte sent."""

from __future__ import annotations

import multiprocessing

import torch
import torch.distributed as dist

from embedpipe.ranks import machine
from embedpipe.ranks.shards import Shards

SIZE, ROWS, DIM = 3, 300, 5


def _rank(rank: int, init: str, rounds: list, refuse: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=SIZE)
    shards = Shards(dist.group.WORLD, timeout=60)
    if rank == refuse:  # this rank cannot open the others' memory (no /proc)

        def refused(pid: int, fd: int) -> int:
            raise PermissionError(f"/proc/{pid}/fd/{fd}")

        machine._open = refused
    try:
        shared = machine.MachineGradient.make(shards, ROWS, DIM)
        got = []
        for step, per_rank in enumerate(rounds):
            ids, grad = per_rank[rank]
            exchange = shared if shared is not None else shards
            union, total = exchange.gradient(step, 0, ids, grad)
            got.append((union, total, total.dtype))
        out[rank] = (shared is not None, got, dict(shards.bytes))
    finally:
        shards.close()
        dist.destroy_process_group()


def _launch(tmp_path, rounds: list, refuse: int = -1) -> dict:
    context = multiprocessing.get_context("spawn")
    out = context.Manager().dict()
    init = f"file://{tmp_path / f'rendezvous{refuse}'}"
    ranks = [
        context.Process(target=_rank, args=(r, init, rounds, refuse, out)) for r in range(SIZE)
    ]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(120)
        assert p.exitcode == 0
    return dict(out)


def _rounds() -> list:
    generator = torch.Generator().manual_seed(0)
    rounds = []
    for count, dtype in (((40, 0, 25), torch.float32), ((200, 210, 190), torch.float32),
                         ((30, 30, 30), torch.bfloat16), ((1, 2, 3), torch.float64)):  # fmt: skip
        per_rank = []
        for n in count:
            ids = torch.randperm(ROWS, generator=generator)[:n].sort().values
            per_rank.append((ids, torch.randn(n, DIM, generator=generator).to(dtype)))
        rounds.append(per_rank)
    return rounds


def test_ranks_of_one_machine_average_the_gradient_in_shared_memory_bit_for_bit(tmp_path):
    """Three ranks, passes of different sizes and dtypes (a rank with no rows; bfloat16 and
    float64 gradients): every rank gets what summing every rank's rows, each times 1/N, in rank
    order gives, and no byte crossed a socket."""
    rounds = _rounds()
    out = _launch(tmp_path, rounds)
    for step, per_rank in enumerate(rounds):
        every_id = torch.cat([ids for ids, _ in per_rank])
        every_grad = torch.cat([grad for _, grad in per_rank])
        union, where = torch.unique(every_id, return_inverse=True)
        expected = torch.zeros(len(union), DIM, dtype=every_grad.dtype)
        expected.index_add_(0, where, every_grad * (1.0 / SIZE))
        for rank in range(SIZE):
            shared, got, moved = out[rank]
            assert shared
            got_union, total, dtype = got[step]
            assert dtype == expected.dtype
            assert torch.equal(got_union, union) and torch.equal(total, expected)
            assert sum(moved.values()) == 0


def test_ranks_fall_back_to_the_gloo_exchange_together_when_one_cannot_share(tmp_path):
    rounds = _rounds()[:2]
    out = _launch(tmp_path, rounds, refuse=1)
    for rank in range(SIZE):
        shared, got, moved = out[rank]
        assert not shared and moved["gradient_sent_bytes"] > 0
        for step, per_rank in enumerate(rounds):
            every_id = torch.cat([ids for ids, _ in per_rank])
            assert torch.equal(got[step][0], torch.unique(every_id))
