"""A step's working copy prepared at its batch's hand-off (NOTE [ A step prepared at its batch's
hand-off ] in ``cache/copies.py``): each step of the usual loop takes the copy its batch's
hand-off made, any other step falls back to reading, and both train as nn.Embedding + torch
Adagrad do, bit for bit, weights and Adagrad's sum."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import embedpipe

from ..helpers import (
    PARITY,
    VOCAB,
    dense_optimizer,
    initial_table,
    tiny_model,
    train_offloaded,
    train_reference,
    zipf_dataset,
)

# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.


def assert_trained_as_the_reference(weight, table, reference) -> None:
    expected, _, state = reference
    assert torch.equal(weight, expected)
    assert torch.equal(torch.from_numpy(table.read(np.arange(VOCAB), "sum")), state["sum"])


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_each_step_takes_the_copy_its_batch_prepared_and_trains_bit_for_bit(
    tmp_path, owner, padded
):
    """Padded: the step lacks the padding row, so it takes a subset of its batch's copy."""
    data = zipf_dataset(8 * 10, seed=3, padded=padded)
    options = {**PARITY, "owner": owner} | ({"padding_idx": 0} if padded else {})
    weight, _, stats, table = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", **options
    )
    assert stats["steps"] == 10 and stats["prepared"] == 10
    assert_trained_as_the_reference(weight, table, train_reference(data, "adagrad", lr=0.5))


def test_a_step_of_two_batches_falls_back_to_their_staged_copies(tmp_path):
    data = zipf_dataset(4 * 16, seed=4)
    weight, _, stats, table = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", batch_size=4, accumulate=2,
        cache_rows=VOCAB // 20,
    )  # fmt: skip
    assert stats["steps"] == 8 and stats["prepared"] < 8 and stats["staged"] > 0
    reference = train_reference(data, "adagrad", lr=0.5, batch_size=4, accumulate=2)
    assert_trained_as_the_reference(weight, table, reference)


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_batches_claimed_ahead_of_several_steps_are_not_prepared_for_them(tmp_path, owner):
    """Every batch is claimed before the first step: each copy is of step 0, so no later step
    takes one as its working copy, and the rows steps changed since are read again."""
    data = zipf_dataset(8 * 6, seed=5)
    path = tmp_path / "t.zarr"
    initial_table(path)
    model = tiny_model()
    dense = dense_optimizer(model)
    optimizer = embedpipe.optim.Adagrad(lr=0.5)
    with embedpipe.EmbeddingPipe(
        path, cache_rows=VOCAB // 20, optimizer=optimizer, owner=owner
    ) as pipe:
        batches = list(pipe.loader(data, batch_size=8))
        for batch in batches:
            model(
                **{k: batch[k] for k in ("inputs_embeds", "attention_mask", "labels")}
            ).loss.backward()
            dense.step()
            dense.zero_grad()
            pipe.step()
    stats = pipe.stats()
    assert stats["steps"] == 6 and stats["prepared"] <= 1
    table = embedpipe.Table.open(path)
    assert_trained_as_the_reference(
        table.to_tensor(), table, train_reference(data, "adagrad", lr=0.5)
    )


def test_bounded_mode_prepares_no_step(tmp_path):
    data = zipf_dataset(8 * 4, seed=6)
    *_, stats, _ = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", consistency="bounded", max_staleness=1
    )
    assert stats["steps"] == 4 and stats["prepared"] == 0


def test_a_hand_off_before_the_last_step_is_put_back_prepares_that_steps_rows(
    tmp_path, monkeypatch
):
    """The step's table write is slowed, so each hand-off (2 workers: the lookup ran ahead)
    comes while the cache still holds the rows before it: the copy must take that step's."""
    from embedpipe.cache.rowcache import RowCache

    write = RowCache.write_uncached

    def slow_write(self, update, before):
        time.sleep(0.01)
        write(self, update, before)

    monkeypatch.setattr(RowCache, "write_uncached", slow_write)
    data = zipf_dataset(8 * 8, seed=7)
    weight, _, stats, table = train_offloaded(
        data, "adagrad", lr=0.5, path=tmp_path / "t.zarr", **PARITY, owner="thread"
    )
    assert stats["steps"] == 8 and stats["prepared"] == 8
    assert_trained_as_the_reference(weight, table, train_reference(data, "adagrad", lr=0.5))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_prepared_step_trains_as_one_that_gathers(tmp_path, monkeypatch, optimizer):
    """SGD (no state) and Adam (two state arrays): the same table with and without the copy."""
    from embedpipe.cache.rowcache import RowCache

    data = zipf_dataset(8 * 8, seed=8)
    lr = 0.5 if optimizer == "sgd" else 0.1
    prepared, _, stats, _ = train_offloaded(
        data, optimizer, lr=lr, path=tmp_path / "a.zarr", owner="thread", **PARITY
    )
    assert stats["prepared"] == 8
    stage = RowCache.stage
    monkeypatch.setattr(RowCache, "stage", lambda self, ids, rows, *_: stage(self, ids, rows))
    gathered, _, stats, _ = train_offloaded(
        data, optimizer, lr=lr, path=tmp_path / "b.zarr", owner="thread", **PARITY
    )
    assert stats["prepared"] == 0
    assert torch.equal(prepared, gathered)


def test_a_copy_prepared_after_another_step_is_not_taken_as_is():
    """The key: a copy made after step 1 is the working copy of step 2, not of step 3."""
    from embedpipe.cache.policy import LRU
    from embedpipe.cache.rowcache import RowCache
    from embedpipe.cache.sharedrows import SharedRows

    table = {"weight": np.arange(40 * 4, dtype=np.float32).reshape(40, 4)}
    fetch = lambda i, n: table[n][i].copy()  # noqa: E731
    ids = np.array([1, 2, 3])
    for key, taken in (((0, 1), True), ((0, 2), False)):
        cache = RowCache(SharedRows(40, 4, 4, np.float32), LRU(4, 40), fetch, None)
        cache.stage(ids, table["weight"][ids] + 1, (0, 1))  # not the rows the table holds
        pinned = cache.pin(ids, key)
        assert (pinned.prepared is not None) == taken and len(pinned.staged) == (not taken)
        if taken:
            assert pinned.at is None
            rows = cache.gather(ids, pinned).rows
            np.testing.assert_array_equal(rows, table["weight"][ids] + 1)
        assert cache.counts["prepared"] == taken


def test_after_a_copy_no_step_could_take_the_next_steps_prepare_none_for_a_while():
    """Two batches a step: the first step's copy goes unused, so the next PREPARE_RETRY steps
    stage only the rows the cache lacks; then a copy is tried again."""
    from embedpipe.cache.copies import PREPARE_RETRY
    from embedpipe.cache.policy import LRU
    from embedpipe.cache.rowcache import RowCache
    from embedpipe.cache.sharedrows import SharedRows

    table = {"weight": np.arange(40 * 4, dtype=np.float32).reshape(40, 4)}
    fetch = lambda i, n: table[n][i].copy()  # noqa: E731
    cache = RowCache(SharedRows(40, 4, 4, np.float32), LRU(4, 40), fetch, None)
    one, two = np.array([1, 2]), np.array([3, 4])
    step = 0
    for _ in range(PREPARE_RETRY + 1):
        cache.stage(one, table["weight"][one], (0, step))
        cache.stage(two, table["weight"][two], (0, step))
        assert (cache.prepared is not None) == (step == 0)
        cache.pin(np.concatenate([one, two]), (0, step))
        step += 1
    cache.stage(one, table["weight"][one], (0, step))
    assert cache.prepared is not None
    assert cache.pin(one, (0, step)).prepared is not None


@pytest.mark.parametrize("evicted", [False, True], ids=["as_made", "a_row_evicted_since"])
def test_a_failed_table_write_puts_back_the_uncached_rows_and_state_the_copy_held(evicted):
    """The uncached rows and state a step puts back if its table write fails are the ones its
    copy held before the step: kept at the copy's making, with the rows and state the last step
    changed (not yet in the table) overlaid; taken from the copy itself where a row the copy
    found cached was evicted since."""
    import errno

    from embedpipe.cache.policy import LRU
    from embedpipe.cache.rowcache import RowCache
    from embedpipe.cache.sharedrows import SharedRows

    table = {
        "weight": np.arange(40 * 4, dtype=np.float32).reshape(40, 4),
        "sum": np.full((40, 4), 0.5, dtype=np.float32),
    }
    fails = []

    def store(ids, rows, name):
        if name == "sum" and not fails:  # the weights are written, the state is not
            fails.append(name)
            raise OSError(errno.ENOSPC, "No space left on device")
        table[name][ids] = rows

    fetch = lambda i, n: table[n][i].copy()  # noqa: E731
    cache = RowCache(SharedRows(40, 2, 4, np.float32), LRU(2, 40), fetch, store, state=("sum",))
    ids = np.array([1, 2, 3, 5])
    cache.admit(ids[:1], table["weight"][ids[:1]])  # id 1 cached, the others not
    rows = table["weight"][ids] + 1  # the rows as handed out
    changed = np.array([False, True, False, True])  # the last step's rows: 2 and 5
    stepped_sum = np.full((2, 4), 7.0, dtype=np.float32)
    cache.stage(ids, rows, (0, 1), (changed, {"sum": stepped_sum}))
    if evicted:
        cache.admit(np.array([30, 31]), table["weight"][[30, 31]])  # the cache holds 2: 1 goes
    uncached = np.flatnonzero(cache.shared.slot_of[ids] < 0)
    assert len(uncached) == 3 + evicted

    work = cache.gather(ids, cache.pin(ids, (0, 1)))
    before = work.uncached()
    assert (work.before is None) == evicted  # then copied from the copy at the step
    expected_rows = rows[uncached]
    expected_sum = np.where(changed[:, None], np.float32(7.0), np.full((4, 4), 0.5, np.float32))
    expected_sum = expected_sum[uncached]
    if evicted:
        expected_rows[0] = table["weight"][1]  # the cached row, as the cache held it
    np.testing.assert_array_equal(before.rows, expected_rows)
    np.testing.assert_array_equal(before.state["sum"], expected_sum)

    work.rows += 100  # the step, in place
    work.state["sum"] += 100
    with pytest.raises(OSError, match="No space"):
        cache.write_uncached(work, before)
    assert cache.broken is None
    np.testing.assert_array_equal(table["weight"][ids[uncached]], expected_rows)
    np.testing.assert_array_equal(table["sum"][ids[uncached]], expected_sum)
