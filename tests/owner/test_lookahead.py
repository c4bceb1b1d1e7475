"""The lookahead policy and the stream that feeds it: the window's bookkeeping, rows read against
Belady's optimum, rows that handed-out and in-flight batches need, and exact training."""

from __future__ import annotations

import os
import re
import time
import warnings

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.cache.policy import NEVER, Lookahead, make_policy
from embedpipe.cache.rowcache import RowCache
from embedpipe.cache.sharedrows import SharedRows
from embedpipe.owner import foresee
from embedpipe.owner.batchorder import Ahead
from embedpipe.tools import simulate

from ..helpers import VOCAB, train_offloaded, train_reference, zipf_dataset

# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def test_the_window_tracks_each_rows_next_use():
    policy = Lookahead(cache_rows=2, num_rows=8, window=4)
    for batch in (ids(1, 2), ids(2, 3), ids(1, 4)):  # batches 0, 1, 2
        policy.foresee(batch)
    assert policy.next_use[[1, 2, 3, 4, 5]].tolist() == [0, 0, 1, 2, NEVER]
    policy.advance()  # batch 0 handed off: 1 is next used by batch 2, 2 by batch 1
    assert policy.next_use[[1, 2, 3, 4]].tolist() == [2, 1, 1, 2]
    policy.advance()
    assert policy.next_use[[1, 2, 3, 4]].tolist() == [2, NEVER, NEVER, 2]
    policy.foresee(ids(2))  # batch 3
    assert policy.next_use[2] == 3
    policy.restart()
    assert (policy.next_use == NEVER).all() and policy.foreseen == 0
    policy.foresee(ids(4))  # after a restart, entries of the old window do not link to it
    policy.advance()
    assert policy.next_use[4] == NEVER


def test_the_window_survives_growing_its_entry_buffer():
    rng = np.random.default_rng(0)
    policy = Lookahead(cache_rows=10, num_rows=5000, window=8)
    window = []
    for _ in range(300):
        batch = np.unique(rng.integers(0, 5000, 600))
        policy.foresee(batch)
        window.append(batch)
        if len(window) > 8:
            policy.advance()
            window.pop(0)
        expected = np.full(5000, NEVER)
        for n in range(len(window) - 1, -1, -1):
            expected[window[n]] = policy._foreseen - len(window) + n
        assert np.array_equal(policy.next_use, expected)


@pytest.mark.parametrize("trace", ["zipf", "scan"])
def test_lookahead_reads_as_few_rows_as_beladys_optimum(trace):
    rng = np.random.default_rng(1)
    if trace == "zipf":
        tokens = np.minimum(rng.zipf(1.1, size=(60 * 16, 32)), 3000) - 1
    else:  # a scan larger than the cache, over and over: LRU and LFU read every row
        tokens = np.tile(np.arange(3000).reshape(-1, 50), (3, 1))
    sets = simulate.batch_sets(tokens, 16)
    for cache_rows in (30, 150, 600):
        optimum = simulate.rows_read(sets, 3000, cache_rows, "belady")
        lookahead = simulate.rows_read(sets, 3000, cache_rows, "auto")
        lfu = simulate.rows_read(sets, 3000, cache_rows, "lfu")
        assert lookahead <= 1.01 * optimum, (cache_rows, lookahead, optimum)
        assert lookahead <= lfu


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_real_loader_feeds_the_window_and_reads_the_optimum(tmp_path, num_workers, owner):
    """With workers, the batches in flight leave their misses to the owner, which reads each
    row once for all of them (NOTE [ Misses read by the owner ]): still the optimum. The same
    with the owner in a process of its own (NOTE [ Foresight in an owner process ])."""
    rng = np.random.default_rng(2)
    tokens = np.minimum(rng.zipf(1.1, size=(40 * 8, 16)), 2000) - 1
    sets = simulate.batch_sets(tokens, 8)
    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    data = [{"input_ids": torch.from_numpy(row)} for row in tokens]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=100, owner=owner) as pipe:
        loader = pipe.loader(data, batch_size=8, num_workers=num_workers)
        first = True
        for batch in loader:
            if first:  # let the child fill the window: rows read do not depend on timing
                deadline = time.monotonic() + 10
                while not pipe._owner.stream.caught_up and time.monotonic() < deadline:
                    time.sleep(0.01)
                first = False
            batch["inputs_embeds"]
            time.sleep(0.01)  # a model's step: time for the reader, which keeps the misses
        stats = pipe.stats()
        read = stats["rows_read"]
        assert pipe._owner.stream is None  # the epoch's stream ended with it
        # (an owner process reads every row itself without workers: counted as deferred)
        assert (stats["deferred"] > 0) == (num_workers > 0 or owner == "process")
    optimum = simulate.rows_read(sets, 2000, 100, "belady")
    # with workers, the batches dispatched before the epoch's order was read are looked up blind
    assert read <= (1.05 if num_workers else 1.01) * optimum, (read, optimum)
    assert read < simulate.rows_read(sets, 2000, 100, "lfu")


def test_rows_of_a_training_batch_stay_cached_until_its_step():
    shared = SharedRows(100, 4, 1, np.float32)
    cache = RowCache(shared, make_policy("auto", 4, 100), lambda i, n: None, lambda i, r, n: None)
    policy = cache.policy
    policy.training = True
    batch = ids(1, 2, 3)
    cache.admit(batch, np.zeros((3, 1), np.float32))
    policy.hold(batch)
    for other in (ids(10, 11, 12), ids(20, 21, 22, 23)):  # later batches, no step yet
        cache.admit(other, np.zeros((len(other), 1), np.float32))
        assert (shared.slot_of[batch] >= 0).all()
    policy.release()  # the step gathered them: they may go now
    cache.admit(ids(30, 31, 32, 33), np.zeros((4, 1), np.float32))
    assert (shared.slot_of[batch] < 0).any()


def test_rows_of_dispatched_batches_stay_cached_until_they_are_claimed(tmp_path):
    embedpipe.Table.create(tmp_path / "t.zarr", 100, 2).close()
    samples = [{"input_ids": torch.tensor([i, i + 1])} for i in range(0, 60, 2)]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", owner="thread", cache_rows=4) as pipe:
        owner = pipe._owner
        order = Ahead(iter([[n] for n in range(len(samples))]))
        stream = owner.start_stream(samples, "input_ids", order, source=None, defer=None)
        try:
            deadline = time.monotonic() + 10
            while owner.cache.policy.foreseen < 10 and time.monotonic() < deadline:
                time.sleep(0.01)
            dispatched = [next(order), next(order)]  # batches 0 and 1 go to workers
            rows = ids(0, 1, 2, 3)
            with owner.lock:
                owner.cache.admit(rows, np.zeros((4, 2), np.float32))
                owner.cache.admit(ids(40, 41, 42, 43), np.zeros((4, 2), np.float32))
            assert dispatched == [[0], [1]] and (owner.shared.slot_of[rows] >= 0).all()
            stream.claim(ids(0, 1))
            stream.claim(ids(2, 3))  # both looked up: their rows are no longer needed soon
            with owner.lock:
                owner.cache.admit(ids(40, 41, 42, 43), np.zeros((4, 2), np.float32))
            assert (owner.shared.slot_of[rows] < 0).all()
        finally:
            owner.end_stream(stream)


@pytest.mark.parametrize(
    ("policy", "num_workers"),
    [("lru", 2), ("lfu", 2), ("lookahead", 0), ("lookahead", 2), ("auto", 2)],
)
def test_training_through_every_policy_is_bit_exact(tmp_path, policy, num_workers):
    data = zipf_dataset(16 * 8)
    reference, _, _ = train_reference(data, "adagrad", lr=0.5)
    table, _, stats, _ = train_offloaded(
        data,
        "adagrad",
        lr=0.5,
        path=tmp_path / "t.zarr",
        cache_rows=VOCAB // 20,
        num_workers=num_workers,
        policy=policy,
    )
    assert stats["evictions"] > 0
    if policy in ("lookahead", "auto") and num_workers:  # misses read by the owner, ahead
        assert stats["deferred"] > 0
    assert torch.equal(table, reference)


def test_an_evaluation_loader_inside_an_epoch_leaves_the_window_alone(tmp_path):
    embedpipe.Table.create(tmp_path / "t.zarr", 50, 2).close()
    samples = [{"input_ids": torch.tensor([i % 50, (i * 7) % 50])} for i in range(40)]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=10) as pipe:
        for n, batch in enumerate(pipe.loader(samples, batch_size=4)):
            assert pipe._owner.stream is not None
            owner_stream = pipe._owner.stream
            if n == 2:
                for inner in pipe.loader(samples[:8], batch_size=4):
                    assert torch.equal(inner["inputs_embeds"], inner["inputs_embeds"])
                assert pipe._owner.stream is owner_stream
            batch["inputs_embeds"]
        assert pipe._owner.stream is None
        for n, _ in enumerate(pipe.loader(samples, batch_size=4)):  # a new epoch after a break
            if n == 1:
                break
        assert pipe._owner.stream is None


def test_an_epoch_dropped_after_the_next_began_leaves_its_foresight_alone(tmp_path):
    """``epoch = iter(loader)`` again mid-epoch: the earlier epoch's iterator goes after the new
    one has drawn (its workers prefetch), and ends only its own epoch's foresight."""
    embedpipe.Table.create(tmp_path / "t.zarr", 50, 2).close()
    samples = [{"input_ids": torch.tensor([i % 50, (i * 7) % 50])} for i in range(40)]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=10) as pipe:
        loader = pipe.loader(samples, batch_size=4, num_workers=2)
        epoch = iter(loader)
        next(epoch)["inputs_embeds"]
        epoch = iter(loader)
        assert pipe._owner.stream is not None
        for batch in epoch:
            batch["inputs_embeds"]
        assert pipe._owner.stream is None


class _BreaksAtItsThirdBatch(torch.utils.data.Sampler):
    def __len__(self) -> int:
        return 40

    def __iter__(self):
        for i in range(40):
            if i == 8:
                raise RuntimeError("the sampler broke")
            yield i


@pytest.mark.filterwarnings("ignore:embedpipe's lookahead policy stopped looking ahead")
@pytest.mark.parametrize("workers", [0, 2])
def test_no_foresight_outlives_its_epochs(tmp_path, workers):
    """Two iterators of one loader zipped (the second's first draw begins its foresight over
    the first's), and an iter() that raises after the workers' prefetch began one: when they
    are over, no foresight runs that no loader could stop."""
    embedpipe.Table.create(tmp_path / "t.zarr", 50, 2).close()
    samples = [{"input_ids": torch.tensor([i % 50, (i * 7) % 50])} for i in range(40)]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=10) as pipe:
        loader = pipe.loader(samples, batch_size=4, num_workers=workers)
        for pair in zip(loader, loader):
            for batch in pair:
                batch["inputs_embeds"]
        assert pipe._owner.stream is None
        broken = pipe.loader(
            samples, batch_size=4, num_workers=workers, sampler=_BreaksAtItsThirdBatch()
        )
        with pytest.raises(RuntimeError, match="the sampler broke"):
            for batch in broken:
                batch["inputs_embeds"]
        assert pipe._owner.stream is None


def test_lookahead_must_be_a_count():
    with pytest.raises(ValueError, match="lookahead must be an integer >= 0"):
        embedpipe.EmbeddingPipe("nowhere", cache_rows=1, lookahead=-1)


@pytest.mark.parametrize("policy", ["lfu", "auto"])
def test_a_step_does_not_read_again_the_rows_its_batch_was_handed(tmp_path, policy):
    """Rows a training batch used that the cache does not keep are staged for its step: with SGD
    (no state to read), every row read from disk is a lookup's miss (the owner process reads
    them all with num_workers=0: deferred)."""
    data = zipf_dataset(12 * 8)
    _, _, stats, _ = train_offloaded(
        data, "sgd", lr=0.5, path=tmp_path / "t.zarr", cache_rows=VOCAB // 50, policy=policy
    )
    assert stats["staged"] > 0
    assert stats["rows_read"] == stats["misses"]


class SlowInTheMainProcess(torch.utils.data.Dataset):
    """Fast in the workers, slow where the foresight child reads it (outside the workers)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = torch.from_numpy(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        if torch.utils.data.get_worker_info() is None:
            time.sleep(0.005)
        return {"input_ids": self.tokens[i]}


def test_a_reader_that_cannot_keep_up_hands_the_misses_back_to_the_workers(tmp_path):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 2000, size=(60 * 8, 16))
    weight = torch.randn(2000, 4)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight).close()
    handed_back = []
    with embedpipe.EmbeddingPipe(
        tmp_path / "t.zarr", owner="thread", cache_rows=100, policy="lookahead"
    ) as pipe:
        loader = pipe.loader(SlowInTheMainProcess(tokens), batch_size=8, num_workers=2)
        for batch in loader:
            assert torch.equal(batch["inputs_embeds"], weight[batch["input_ids"]])
            stream = pipe._owner.stream
            handed_back.append(stream is not None and stream.handed_back)
        stats = pipe.stats()
    assert any(handed_back) and stats["deferred"] < stats["misses"]


def test_a_cold_disk_hands_the_misses_back_to_the_workers_at_once(tmp_path):
    """NOTE [ Misses read by the owner ]: the reader's first batch comes from the disk, not the
    page cache, so the workers read the misses from then on, in parallel; the rows stay right."""
    from embedpipe.tools.benchmark.cgroup import drop_page_cache
    from embedpipe.tools.benchmark.cold_child import table_files

    path = tmp_path / "t.zarr"
    weight = torch.randn(8000, 256)
    embedpipe.Table.from_tensor(path, weight).close()
    drop_page_cache(table_files(str(path)))
    probe = embedpipe.Table.open(path, "r")
    probe.read(np.arange(0, 8000, 97))
    if probe._array("weight").rows_waited == 0:
        pytest.skip("this file system keeps the table's pages in memory: no cold read to make")
    probe.close()
    drop_page_cache(table_files(str(path)))
    tokens = np.random.default_rng(4).integers(0, 8000, size=(80 * 8, 16))
    handed_back = []
    with embedpipe.EmbeddingPipe(path, owner="thread", cache_rows=400, policy="lookahead") as pipe:
        data = [{"input_ids": torch.from_numpy(t)} for t in tokens]
        loader = pipe.loader(data, batch_size=8, num_workers=2)
        for batch in loader:
            assert torch.equal(batch["inputs_embeds"], weight[batch["input_ids"]])
            handed_back.append(pipe._owner.stream.handed_back)
        stats = pipe.stats()
        for batch in loader:  # a second epoch: the workers read the misses from its start
            assert torch.equal(batch["inputs_embeds"], weight[batch["input_ids"]])
        again = pipe.stats()
    first = handed_back.index(True)  # once the child foresaw a batch and the reader read it
    assert all(handed_back[first:]) and 0 < stats["deferred"] < stats["misses"] / 2, stats
    # (a cached row whose copy an admission overlapped is still left to the owner, which has it)
    overlapped = again["deferred"] - stats["deferred"]
    assert overlapped <= 0.01 * stats["misses"] and again["misses"] > 2 * stats["misses"] - 500


def test_reads_that_cannot_tell_the_page_cache_never_make_a_disk_cold(tmp_path, monkeypatch):
    """Without ``RWF_NOWAIT`` (another OS, some file systems) every row takes the blocking pass,
    as a row from the disk does: the reader must not take a warm table for a cold disk."""
    from embedpipe.store import rowstore

    monkeypatch.setattr(rowstore, "_NOWAIT", 0)
    weight = torch.randn(2000, 8)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight).close()
    tokens = np.random.default_rng(5).integers(0, 2000, size=(40 * 8, 16))
    data = [{"input_ids": torch.from_numpy(t)} for t in tokens]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=100, policy="lookahead") as pipe:
        loader = pipe.loader(data, batch_size=8, num_workers=2)
        for batch in loader:
            assert torch.equal(batch["inputs_embeds"], weight[batch["input_ids"]])
            time.sleep(0.01)  # a model's step: the reader reads ahead of the hand-offs
        assert loader._defer["cold"][0] == 0 and pipe.stats()["filled_ahead"] > 0


def test_training_stays_exact_when_the_misses_go_back_to_the_workers(tmp_path, monkeypatch):
    """Misses read by the owner, then handed back mid-epoch (forced at batch 20: when the reader
    falls behind depends on the machine's load): every row the model and the steps see is still
    the newest, as nn.Embedding + Adagrad trains it."""
    from embedpipe.owner.lookahead import Stream

    keep_up = Stream._keep_up

    def hand_back_at_20(self, ready, began, waited):
        if self.claimed >= 20 and not self.handed_back:
            self._hand_back()  # the reader still reads the batches dispatched before
        return keep_up(self, ready, began, waited)

    monkeypatch.setattr(Stream, "_keep_up", hand_back_at_20)
    data = zipf_dataset(40 * 8)
    reference, _, _ = train_reference(data, "adagrad", lr=0.5)
    table, _, stats, _ = train_offloaded(
        data,
        "adagrad",
        lr=0.5,
        path=tmp_path / "t.zarr",
        cache_rows=VOCAB // 20,
        num_workers=2,
        policy="lookahead",
        owner="thread",
    )
    assert 0 < stats["deferred"] < stats["misses"]  # some misses left to the owner, not all
    assert stats["staged"] > 0
    assert torch.equal(table, reference)


class RandomIds(torch.utils.data.Dataset):
    """Every read gives other ids: foresight is wrong for every batch."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.randint(0, 2000, (16,))}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_wrong_foresight_pins_no_row_and_grows_no_list(tmp_path, num_workers):
    """policy="lookahead" keeps looking ahead however wrong it is: what it holds stays bounded
    by the batches in flight (before, the batches in flight grew all epoch, each pinning its
    rows, and every hand-off scanned them)."""
    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    with embedpipe.EmbeddingPipe(
        tmp_path / "t.zarr", owner="thread", cache_rows=100, policy="lookahead"
    ) as pipe:
        loader = pipe.loader(RandomIds(), batch_size=8, num_workers=num_workers)
        in_flight, held = [], []
        for n, batch in enumerate(loader):
            batch["inputs_embeds"]
            stream = pipe._owner.stream
            in_flight.append(len(stream.in_flight_ids))
            held.append(int(pipe._owner.cache.policy.held.max()))
            if n == 400:
                break
    assert max(in_flight) <= 6, max(in_flight)  # prefetch_factor x workers, plus one
    assert max(held[100:]) <= max(held[:100]) <= 6


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_batches_dispatched_before_foresight_began_do_not_make_auto_give_up(tmp_path, owner):
    """A deep prefetch (16 batches looked up before the first is handed off, all before the
    foresight child's first) and foresight right for every batch after: lookahead stays on. It
    gave up when those batches were judged as misses once the child had got far ahead (the
    README's demo with an owner process: 9 of 16 judged claims, and twice the rows written)."""
    embedpipe.Table.create(tmp_path / "t.zarr", VOCAB, 4).close()
    data = zipf_dataset(8 * 60, seed=3)
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=VOCAB // 20, owner=owner) as pipe:
        loader = pipe.loader(data, batch_size=8, num_workers=2, prefetch_factor=8)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*stopped looking ahead")
            for n, batch in enumerate(loader):
                batch["inputs_embeds"]
                if n == 0:
                    time.sleep(1)  # the child gets far ahead
        assert not pipe._owner.blind


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_auto_stops_looking_ahead_when_foresight_keeps_missing(tmp_path, owner):
    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=100, owner=owner) as pipe:
        with pytest.warns(RuntimeWarning, match="stopped looking ahead"):
            # until it gives up (16 claims judged; on a loaded machine the foresight child may
            # start late, and claims before its first batch are not judged), at most 1,000
            for n, batch in enumerate(pipe.loader(RandomIds(), batch_size=8, num_workers=2)):
                batch["inputs_embeds"]
                if pipe._owner.blind or n == 1000:
                    break
        assert pipe._owner.blind and pipe._owner.stream is None
        for n, _ in enumerate(pipe.loader(RandomIds(), batch_size=8)):  # no stream, no warning
            assert pipe._owner.stream is None
            if n == 3:
                break


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_an_iterable_dataset_gets_no_foresight(tmp_path, owner):
    # Before, its loader's default batch sampler got a Foresight whose child read dataset[None]
    # and ended at the first batch, without a word.
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return ({"input_ids": torch.tensor([i % 97])} for i in range(64))

    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=100, owner=owner) as pipe:
        for batch in pipe.loader(Stream(), batch_size=8):
            batch["inputs_embeds"]
            assert pipe._owner.stream is None
        assert not pipe._owner.blind


class InAForkOnly(torch.utils.data.Dataset):
    """Samples of ids below 97, or of ``key``'s; in any process but the one that made it (the
    foresight child) a sample does ``fail()``, as a dataset that holds a CUDA context does."""

    def __init__(self, fail, key: str = "input_ids") -> None:
        self.pid, self.fail, self.key = os.getpid(), fail, key

    def __len__(self) -> int:
        return 2000

    def __getitem__(self, i: int) -> dict:
        if os.getpid() != self.pid:
            self.fail()
        return {self.key: torch.tensor([i % 97, (7 * i) % 97])}


def raise_as_cuda():
    raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")


def crash():
    os._exit(1)


@pytest.mark.parametrize(
    "owner, dataset, collate, told",
    [
        ("thread", InAForkOnly(raise_as_cuda), None, "failed: RuntimeError: Cannot re-init"),
        ("process", InAForkOnly(raise_as_cuda), None, "failed: RuntimeError: Cannot re-init"),
        ("thread", InAForkOnly(crash), None, "ended without a word"),
        ("thread", InAForkOnly(lambda: None, key="words"),
         lambda samples: {"input_ids": torch.stack([s["words"] for s in samples])},
         "samples carry no 'input_ids' before the loader's collate_fn makes it"),
    ],
)  # fmt: skip
def test_foresight_that_ends_early_says_why(tmp_path, owner, dataset, collate, told):
    # Before, the child ended its foresight without a word: the policy ran with no window and
    # said nothing, or said later that foresight could not keep up.
    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=100, owner=owner) as pipe:
        with pytest.warns(RuntimeWarning, match=re.escape(told)):
            for batch in pipe.loader(dataset, batch_size=8, collate_fn=collate):
                assert batch["inputs_embeds"].shape == (8, 2, 4)  # the loop is unaffected
                if pipe._owner.blind:
                    break
                time.sleep(0.01)  # the child's word arrives meanwhile
        assert pipe._owner.blind


def test_the_foresight_child_ends_with_its_epoch(tmp_path):
    import os

    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    # more batches than the window (64): the child waits for the loop there, so it is still
    # alive at the first batch however late that comes (with 16 batches, on a loaded host it
    # had read the whole epoch and ended by then)
    samples = [{"input_ids": torch.tensor([i % 1999, i % 1999 + 1])} for i in range(1024)]
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", owner="thread", cache_rows=10) as pipe:
        for n, _ in enumerate(pipe.loader(samples, batch_size=4)):
            if n == 0:
                child = pipe._owner.stream.ids.pid
                assert os.waitpid(child, os.WNOHANG) == (0, 0)  # alive, reading ahead
            if n == 5:
                break  # an epoch left early
        with pytest.raises(ChildProcessError):  # reaped
            os.waitpid(child, os.WNOHANG)


class SeekAndRead(torch.utils.data.Dataset):
    """Reads each sample's ids through one file handle opened in the training process, with
    seek then read (not thread-safe, and with num_workers=0 nothing else reads it)."""

    def __init__(self, path, n: int) -> None:
        self.file = open(path, "rb", buffering=0)  # noqa: SIM115 (held for the dataset's life)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.file.seek(i * 16 * 8)
        time.sleep(0.0005)  # (the child seeks and reads meanwhile)
        data = self.file.read(16 * 8)
        return {"input_ids": torch.from_numpy(np.frombuffer(data, dtype=np.int64).copy())}


def test_the_foresight_child_shares_no_file_offset_with_the_dataset(tmp_path):
    """The child reads its own copy of the dataset: a file the dataset opened before the fork is
    reopened there with its own offset, so the samples the loop gets are the file's."""
    tokens = np.random.default_rng(4).integers(0, 2000, size=(200, 16)).astype(np.int64)
    tokens.tofile(tmp_path / "tokens.bin")
    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    dataset = SeekAndRead(tmp_path / "tokens.bin", len(tokens))
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=100) as pipe:
        for n, batch in enumerate(pipe.loader(dataset, batch_size=4)):
            assert torch.equal(batch["input_ids"], torch.from_numpy(tokens[n * 4 : n * 4 + 4]))
            time.sleep(0.01)  # a model's step: the child reads ahead meanwhile
        assert not pipe._owner.blind  # the child read the file right too
    dataset.file.close()


class WritesWhatItReads(torch.utils.data.Dataset):
    """A dataset with side effects people write: each first read of a sample draws its masking
    and keeps it (in a tensor moved to shared memory, or in a file), and counts its reads in
    shared memory: its workers and its later epochs see the same masks, and the count."""

    def __init__(self, tokens: np.ndarray, kind: str, folder) -> None:
        self.tokens, self.kind, self.folder = tokens, kind, folder
        self.kept = torch.full(tokens.shape, -1, dtype=torch.int64).share_memory_()
        self.reads = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.lock = torch.multiprocessing.Lock()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        if self.kind == "memory":
            with self.lock:
                self.reads += 1
        file = self.folder / f"{i}.npy"
        if self.kind == "file" and file.exists():
            return {"input_ids": torch.from_numpy(np.load(file))}
        if self.kind == "memory" and self.kept[i, 0] >= 0:
            return {"input_ids": self.kept[i].clone()}
        ids = torch.from_numpy(self.tokens[i].copy())
        ids[torch.rand(len(ids)) < 0.3] = 1  # the mask, drawn once
        if self.kind == "file":
            np.save(file, ids.numpy())
        else:
            self.kept[i] = ids
        return {"input_ids": ids}


@pytest.mark.filterwarnings("ignore:embedpipe's lookahead policy stopped looking ahead")
@pytest.mark.parametrize("kind", ["memory", "file"])
def test_the_foresight_child_writes_nothing_the_dataset_keeps(tmp_path, kind):
    """The child may only read: a dataset that writes what it draws (in shared memory and
    counts its reads under a lock, or in a file: Landlock) cannot let the child's reads change
    the program's; it stops the foresight instead. The batches are those of a DataLoader."""
    if kind == "file" and foresee.landlock_abi() < 1:
        pytest.skip("the kernel has no Landlock: a file the child writes is not stopped")
    tokens = np.random.default_rng(4).integers(2, 2000, size=(64, 16)).astype(np.int64)
    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()

    def batches(make_loader, folder) -> list[torch.Tensor]:
        folder.mkdir()
        torch.manual_seed(0)
        dataset = WritesWhatItReads(tokens, kind, folder)
        seen = []
        for _ in range(2):
            for batch in make_loader(dataset, batch_size=4, shuffle=True):
                seen.append(batch["input_ids"].clone())
                time.sleep(0.005)  # a model's step: the child reads ahead meanwhile
        if kind == "memory":
            assert int(dataset.reads) == 2 * len(tokens)  # the loop's own reads, no more
        return seen

    expected = batches(torch.utils.data.DataLoader, tmp_path / "plain")
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", cache_rows=100) as pipe:
        got = batches(pipe.loader, tmp_path / "piped")
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class RandomIndices(torch.utils.data.Sampler):
    """Draws each index from ``random`` as the DataLoader asks for it (CPython reseeds
    ``random`` in a forked child: the child must get the parent's state back)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        import random

        for _ in range(self.n):
            yield random.randrange(self.n)


def test_foresight_draws_a_lazy_sampler_from_the_parents_random_state(tmp_path):
    embedpipe.Table.create(tmp_path / "t.zarr", 2000, 4).close()
    tokens = np.random.default_rng(5).integers(0, 2000, size=(400, 16))
    data = [{"input_ids": torch.from_numpy(t)} for t in tokens]
    matched: list[bool] = []
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", owner="thread", cache_rows=100) as pipe:
        for batch in pipe.loader(data, batch_size=8, sampler=RandomIndices(400)):
            batch["inputs_embeds"]
            time.sleep(0.005)  # a model's step: the child reads ahead meanwhile
            stream = pipe._owner.stream
            matched = list(stream.matched) if stream is not None else matched
        assert not pipe._owner.blind and sum(matched) == len(matched) > 0


def in_foresight_child(parent: int) -> bool:
    """Whether this call runs in the lookahead's foresight child: forked from ``parent`` (the
    training process), and no DataLoader worker."""
    return os.getpid() != parent and torch.utils.data.get_worker_info() is None


class SumsABigTensor(torch.utils.data.Dataset):
    """A dataset doing tensor work in __getitem__ (an augmentation, a feature): a reduction
    large enough for torch to split over its intra-op threads. Each call outside the training
    process and its DataLoader workers (the foresight child's) adds a line to ``calls``."""

    def __init__(self, tokens: np.ndarray, calls: str) -> None:
        self.tokens, self.calls, self.parent = tokens, calls, os.getpid()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        scale = torch.ones(1 << 17).sum()  # 131,072 elements: past torch's grain of 32,768
        if in_foresight_child(self.parent):
            with open(self.calls, "a") as f:
                f.write(f"{i}\n")
        return {"input_ids": torch.from_numpy(self.tokens[i]) * (scale > 0)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_training_process_with_a_running_thread_pool_forks_its_foresight_safely(
    tmp_path, owner, monkeypatch
):
    """The suite runs torch on one thread (conftest.py); a program runs it on many, and a child
    forked while torch's OpenMP pool runs hangs at its first parallel op unless it drops to one
    thread first (foresee.py, as DataLoader workers do). Here the pool runs (2 threads) and the
    foresight child calls a dataset that reduces a big tensor: it reads the epochs ahead (a
    child that hangs leaves the loop without foresight, silently), and the table trains as
    without foresight (allclose: with 2 threads torch's own arithmetic may vary)."""
    tokens = np.minimum(np.random.default_rng(4).zipf(1.2, (64, 8)), 299).astype(np.int64)
    monkeypatch.setattr(foresee, "_read_only", lambda: None)  # the child writes its calls
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.ones(1 << 20).sum()  # the pool is started
        tables = []
        for policy in ("lookahead", "lfu"):
            embedpipe.Table.create(tmp_path / f"{policy}.zarr", 300, 8, seed=0).close()
            with embedpipe.EmbeddingPipe(
                tmp_path / f"{policy}.zarr", cache_rows=30, policy=policy, owner=owner,
                optimizer=embedpipe.optim.Adagrad(lr=0.1),
            ) as pipe:  # fmt: skip
                for _ in range(2):
                    data = SumsABigTensor(tokens, str(tmp_path / f"{policy}.calls"))
                    for batch in pipe.loader(data, batch_size=8, num_workers=2):
                        (batch["inputs_embeds"] ** 2).sum().backward()
                        pipe.step()
                assert pipe.stats()["steps"] + pipe.stats()["writeback_queue"] == 16
                pipe.flush()
                tables.append(pipe.table.to_tensor())
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(tables[0], tables[1], rtol=1e-5, atol=1e-6)
    foreseen = (tmp_path / "lookahead.calls").read_text().split()
    assert len(foreseen) >= 64  # of 2 epochs of 64 samples (a hung child: 1 an epoch)


class HangsWhenForeseen(torch.utils.data.Dataset):
    """Blocks for good when called in the foresight child (as a lock held at the fork, or a
    thread pool forked while it ran, would); answers in the training process and its workers."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens, self.parent = tokens, os.getpid()

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        if in_foresight_child(self.parent):
            time.sleep(3600)
        return {"input_ids": torch.from_numpy(self.tokens[i])}


@pytest.mark.parametrize("owner", ["thread", "process"])
def test_a_foresight_child_stuck_in_the_dataset_is_ended_and_named(tmp_path, owner):
    """A child that sends nothing while the loop takes 32 batches, and for a second, is stuck
    (a busy host can take tiny batches faster than a fork starts): the pipe ends it,
    warns once why, runs as LFU, and trains exactly (the lookahead policy, which never gives up
    on wrong foresight, included): the table as a pipe with ``lfu`` from the start trains it."""
    tokens = np.minimum(np.random.default_rng(5).zipf(1.2, (80 * 8, 8)), 299).astype(np.int64)
    tables, said = [], []
    for policy in ("lookahead", "lfu"):
        embedpipe.Table.create(tmp_path / f"{policy}.zarr", 300, 8, seed=0).close()
        with embedpipe.EmbeddingPipe(
            tmp_path / f"{policy}.zarr", cache_rows=30, policy=policy, owner=owner,
            optimizer=embedpipe.optim.SGD(lr=0.1),
        ) as pipe, warnings.catch_warnings(record=True) as caught:  # fmt: skip
            warnings.simplefilter("always")
            for batch in pipe.loader(HangsWhenForeseen(tokens), batch_size=8, num_workers=2):
                (batch["inputs_embeds"] ** 2).sum().backward()
                pipe.step()
                time.sleep(0.02)  # 80 batches over more than the second a silent child gets
            assert pipe.stats()["batches"] == 80
            pipe.flush()
            tables.append(pipe.table.to_tensor())
        said += [str(w.message) for w in caught if "stopped looking ahead" in str(w.message)]
    assert len(said) == 1 and "sent none while the loop took 32" in said[0], said
    assert torch.equal(tables[0], tables[1])
