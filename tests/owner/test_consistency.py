"""Exact and bounded consistency, checked by counting versions.

Every batch looks up every row once and its loss is ``-inputs_embeds.sum()``, so SGD with lr 1
adds exactly 1 to every row per step: a row's value is the number of updates it has seen. When
batch k is handed out, k steps have been submitted; a batch that sees value v is k - v steps stale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.pipe import EmbeddingPipe

from ..helpers import slow

V, D, BATCHES = 40, 4, 60


@dataclass(frozen=True)
class SlowSGD(embedpipe.optim.SGD):
    """SGD whose update takes ``delay`` seconds: a writeback that lags behind the loop."""

    delay: float = 0.0

    def update(self, rows, grad, state, step, lr=None):
        time.sleep(self.delay)
        super().update(rows, grad, state, step, lr=lr)


def staleness(tmp_path, *, delay, num_workers, cache_rows, **options) -> list[int]:
    embedpipe.Table.create(tmp_path / "t.zarr", V, D, init="zeros", chunk_rows=8).close()
    data = [{"input_ids": torch.randperm(V)} for _ in range(BATCHES)]
    seen = []
    optimizer = SlowSGD(lr=1.0, delay=delay)
    with EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=cache_rows, optimizer=optimizer, **options
    ) as pipe:
        kwargs = {"prefetch_factor": 4} if num_workers else {}
        for k, batch in enumerate(
            pipe.loader(data, batch_size=1, num_workers=num_workers, **kwargs)
        ):
            embeds = batch["inputs_embeds"]  # (1, V, D)
            values = embeds[0, :, 0].detach()
            assert torch.equal(embeds[0].detach(), values[:, None].expand(V, D))  # whole rows
            seen.append(k - int(values.min()))  # the stalest row of the batch
            (-embeds).sum().backward()
            pipe.step()
    table = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.equal(table, torch.full((V, D), float(BATCHES)))  # nothing lost, nothing twice
    return seen


@pytest.mark.parametrize(
    ("num_workers", "cache_rows"),
    [(0, V), slow(2, V), (2, 10), slow(2, 0)],
)
def test_exact_mode_never_serves_a_stale_row(tmp_path, num_workers, cache_rows):
    assert (
        max(staleness(tmp_path, delay=0.005, num_workers=num_workers, cache_rows=cache_rows)) == 0
    )


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("cache_rows", [V, 24])
def test_a_cached_row_whose_copy_a_write_overlapped_comes_from_the_owner_not_the_table(
    tmp_path, monkeypatch, owner, cache_rows
):
    # A worker's copy of a cached row that an owner's write overlaps (a step putting its rows
    # back) reads as a miss. The owner has the row: the worker leaves it to the hand-off. Here
    # every even id's copy reads as overlapped (the forked workers inherit the patch), where no
    # write ran: the table's copy of such a dirty row is older, so a batch that sees every step
    # had its rows from the owner, and once every row is cached the table is read no more.
    from embedpipe.cache.sharedrows import SharedRows

    read = SharedRows.read

    def overlapped(self, ids):
        rows, hit = read(self, ids)
        return rows, hit & (ids % 2 == 1)

    monkeypatch.setattr(SharedRows, "read", overlapped)
    embedpipe.Table.create(tmp_path / "t.zarr", V, D, init="zeros", chunk_rows=8).close()
    data = [{"input_ids": torch.randperm(V)[:20]} for _ in range(BATCHES)]
    with EmbeddingPipe(
        tmp_path / "t.zarr",
        cache_rows=cache_rows,
        policy="lfu",
        optimizer=embedpipe.optim.SGD(lr=1.0),
        owner=owner,
    ) as pipe:
        counts, reads = np.zeros(V), []
        for batch in pipe.loader(data, batch_size=1, num_workers=2):
            ids, embeds = batch["input_ids"][0], batch["inputs_embeds"][0]
            assert torch.equal(
                embeds.detach(), torch.from_numpy(counts[ids]).float()[:, None].expand(-1, D)
            )
            counts[ids.numpy()] += 1
            (-embeds).sum().backward()
            pipe.step()
            reads.append(pipe.stats()["rows_read"])
    assert torch.equal(
        embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()[:, 0],
        torch.from_numpy(counts).float(),
    )
    if cache_rows == V:
        assert reads[-1] == reads[BATCHES // 2]


@pytest.mark.parametrize(
    ("max_staleness", "num_workers", "cache_rows"),
    [(1, 0, V), slow(3, 0, V), slow(1, 2, 10), (3, 2, 10)],
)
def test_bounded_mode_respects_and_reaches_the_bound(
    tmp_path, max_staleness, num_workers, cache_rows
):
    seen = staleness(
        tmp_path,
        delay=0.02,
        num_workers=num_workers,
        cache_rows=cache_rows,
        consistency="bounded",
        max_staleness=max_staleness,
    )
    assert max(seen) <= max_staleness  # never older than the bound...
    assert np.mean(np.array(seen) == max_staleness) > 0.5  # ...and under load, mostly at it


def test_bounded_mode_never_hands_out_a_row_its_step_is_half_way_through_writing(
    tmp_path, monkeypatch
):
    # A step writes its uncached rows in two halves with a pause between (a multi-KB row's
    # write can be seen part-way). In bounded mode a hand-off may run while the step is under
    # way, and must not see the half-written rows: every row counts its updates (SGD lr 1 on
    # -sum), so a batch's row must be one value along D.
    from embedpipe.cache.rowcache import RowCache

    write_uncached = RowCache.write_uncached

    def in_halves(self, update, before):
        rest = np.flatnonzero(update.slots < 0)
        if len(rest):
            half = before.rows.copy()
            half[:, : D // 2] = update.rows[rest, : D // 2]
            self._store(update.ids[rest], half, {})
            time.sleep(0.02)
        write_uncached(self, update, before)

    monkeypatch.setattr(RowCache, "write_uncached", in_halves)
    embedpipe.Table.create(tmp_path / "t.zarr", V, D, init="zeros", chunk_rows=8).close()
    data = [{"input_ids": torch.randperm(V)} for _ in range(30)]
    torn = 0
    with EmbeddingPipe(
        tmp_path / "t.zarr",
        cache_rows=10,
        optimizer=embedpipe.optim.SGD(lr=1.0),
        consistency="bounded",
        max_staleness=1,
        owner="thread",
    ) as pipe:
        for batch in pipe.loader(data, batch_size=1):
            rows = batch["inputs_embeds"][0].detach()
            torn += int(not torch.equal(rows, rows[:, :1].expand(V, D)))
            time.sleep(0.025)
            (-batch["inputs_embeds"]).sum().backward()
            pipe.step()
            time.sleep(0.005)
    assert torn == 0


def slow_table_writes(monkeypatch, seconds: float = 0.05) -> None:
    """Each step's table write waits ``seconds`` first: its rows stay computed, not applied."""
    from embedpipe.cache.rowcache import RowCache

    write = RowCache.write_uncached

    def slow_write(self, update, before):
        time.sleep(seconds)
        write(self, update, before)

    monkeypatch.setattr(RowCache, "write_uncached", slow_write)


def test_a_hand_off_that_a_later_step_overtakes_hands_out_that_steps_rows(tmp_path, monkeypatch):
    """A batch claimed on another thread than the steps: between its wait for step 1's computed
    rows and the owner's lock, step 2 is submitted and applied (made so here, in the wait). The
    batch must hold step 2's rows, not step 1's computed ones at a tick that says step 2."""
    from embedpipe.owner.owner import Owner

    embedpipe.Table.create(tmp_path / "t.zarr", V, D, init="zeros", chunk_rows=8).close()
    slow_table_writes(monkeypatch)  # step 1 stays computed, not applied, for a while
    data = [{"input_ids": torch.randperm(V)} for _ in range(2)]
    with EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=V, optimizer=embedpipe.optim.SGD(lr=1.0)
    ) as pipe:
        owner = pipe._owner
        wait = Owner._wait_for_rows
        overtaken = []

        def overtaking_wait(self):
            wait(self)
            computed = self._last_computed()
            if computed is not None and not overtaken:  # the other thread's step 2, applied
                overtaken.append(computed.step)
                self.submit(torch.arange(V), -torch.ones(V, D), None)
                self.writeback.wait(0)

        monkeypatch.setattr(Owner, "_wait_for_rows", overtaking_wait)
        batches = iter(pipe.loader(data, batch_size=1, num_workers=1))
        (-next(batches)["inputs_embeds"]).sum().backward()
        pipe.step()  # step 1: every row 1.0
        embeds = next(batches)["inputs_embeds"]
        assert overtaken == [1] and owner.applied_step == 2
        assert torch.equal(embeds.detach(), torch.full((1, V, D), 2.0))


@pytest.mark.parametrize("snapshot_step", [0, 1])
def test_a_hand_off_across_a_snapshot_load_hands_out_the_snapshots_rows(
    tmp_path, monkeypatch, snapshot_step
):
    """A snapshot (every row 5.0, at step 0 or 1) is loaded between a hand-off's wait for step
    1's computed rows and the owner's lock (another thread's load, made so here): the batch must
    hold the snapshot's rows, not step 1's of before the load, and the step after it start from
    them."""
    from embedpipe.owner.owner import Owner

    embedpipe.Table.create(tmp_path / "t.zarr", V, D, init="zeros", chunk_rows=8).close()
    sgd = embedpipe.optim.SGD(lr=1.0)
    if snapshot_step == 0:
        embedpipe.Table.from_tensor(
            tmp_path / "snapshot", torch.full((V, D), 5.0), chunk_rows=8
        ).close()
    else:
        embedpipe.Table.create(tmp_path / "s.zarr", V, D, init="zeros", chunk_rows=8).close()
        with EmbeddingPipe(tmp_path / "s.zarr", cache_rows=V, optimizer=sgd) as pipe:
            for batch in pipe.loader([{"input_ids": torch.arange(V)}], batch_size=1):
                (-5 * batch["inputs_embeds"]).sum().backward()
                pipe.step()
            pipe.save_checkpoint(tmp_path / "snapshot")
    slow_table_writes(monkeypatch)  # step 1 stays computed, not applied, for a while
    data = [{"input_ids": torch.randperm(V)} for _ in range(2)]
    with EmbeddingPipe(tmp_path / "t.zarr", cache_rows=V, optimizer=sgd) as pipe:
        wait = Owner._wait_for_rows
        loaded = []

        def loading_wait(self):
            wait(self)
            computed = self._last_computed()
            if computed is not None and not loaded:
                loaded.append(computed.step)
                pipe.load_checkpoint(tmp_path / "snapshot")

        monkeypatch.setattr(Owner, "_wait_for_rows", loading_wait)
        batches = iter(pipe.loader(data, batch_size=1, num_workers=1))
        (-next(batches)["inputs_embeds"]).sum().backward()
        pipe.step()
        embeds = next(batches)["inputs_embeds"]
        assert loaded == [1]
        assert torch.equal(embeds.detach(), torch.full((1, V, D), 5.0))
        (-embeds).sum().backward()
        pipe.step()
    table = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.equal(table, torch.full((V, D), 6.0))
