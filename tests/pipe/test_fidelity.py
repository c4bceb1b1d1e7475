"""The pipe never changes what the model sees: with any policy, cache size and worker count, a
loader feeds the same batches, in the same order, from the same random draws as a plain
DataLoader, and the table trains as nn.Embedding + torch Adagrad fed those batches, bit for bit.

The datasets and samplers here draw at random as people's do (token dropout from numpy's, torch's
and ``random``'s global generators, a sampler the loop feeds back, ``set_epoch``), and the loop
draws its own dropout: the lookahead policy reads ahead in a forked child
(NOTE [ Foresight without side effects ]) and must change none of those draws.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import embedpipe

from ..helpers import slow

V, D, SEQ, BATCH = 500, 8, 16, 8


# owner="thread" where a test looks at or patches the owner's objects (its cache, policy,
# writeback, RowCache): they are in this process only when the owner is a thread.


def seed_everything(seed: int = 0) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class NoisyTokens(Dataset):
    """Zipf token ids with word dropout drawn from every global generator: numpy's picks the
    tokens to replace, torch's the replacements, ``random``'s whether to reverse the sample."""

    def __init__(self, n: int = 96, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.tokens = np.minimum(rng.zipf(1.2, (n, SEQ)), V - 1).astype(np.int64)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens[i].copy()
        drop = np.random.random(SEQ) < 0.15
        ids[drop] = torch.randint(1, V, (int(drop.sum()),)).numpy()
        if random.random() < 0.5:
            ids = ids[::-1].copy()
        return {"input_ids": torch.from_numpy(ids)}


def loop(loader, embed, step, between=None) -> tuple[list, list]:
    """A training loop with a dropout of its own, over 2 epochs: the batches' ids and the loop's
    draws; ``between(loader)``: 3 epochs, and it runs before the second and the third."""
    batches, draws = [], []
    for epoch in range(2 if between is None else 3):
        if epoch and between is not None:
            between(loader)
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for batch in loader:
            if hasattr(sampler, "trained"):
                sampler.trained(batch["input_ids"])
            batches.append(batch["input_ids"].clone())
            embeds = embed(batch)  # (B, L, D)
            keep = torch.rand(embeds.shape[:2]) > 0.2  # the loop's own dropout
            draws.append(keep)
            ((embeds * keep[..., None]) ** 2).sum().backward()
            step()
    return batches, draws


def batched(options: dict) -> dict:
    return options if "batch_sampler" in options else {"batch_size": BATCH, **options}


def reference(dataset, weight: torch.Tensor, num_workers: int, between=None, **loader_options):
    """nn.Embedding + torch Adagrad fed by a plain DataLoader."""
    embedding = torch.nn.Embedding(V, D, _weight=weight.clone())
    optimizer = torch.optim.Adagrad(embedding.parameters(), lr=0.3)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    seed_everything()
    loader = DataLoader(dataset, num_workers=num_workers, **batched(loader_options))
    batches, draws = loop(loader, lambda b: embedding(b["input_ids"]), step, between=between)
    return embedding.weight.detach(), batches, draws


def offloaded(
    dataset,
    path,
    weight,
    num_workers,
    cache_rows,
    policy,
    owner="thread",
    between=None,
    **loader_options,
):
    """The same loop through an EmbeddingPipe, the table stepped by a torch optimizer."""
    embedpipe.Table.from_tensor(path, weight, chunk_rows=32).close()
    with embedpipe.EmbeddingPipe(
        path,
        cache_rows=cache_rows,
        policy=policy,
        optimizer=embedpipe.optim.Adagrad(lr=0.3),
        owner=owner,
    ) as pipe:
        optimizer = torch.optim.Adagrad([pipe.parameter], lr=0.3)

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad()

        seed_everything()
        loader = pipe.loader(dataset, num_workers=num_workers, **batched(loader_options))
        batches, draws = loop(loader, lambda b: b["inputs_embeds"], step, between=between)
        stats = pipe.stats()
    return embedpipe.Table.open(path).to_tensor(), batches, draws, stats


def same_runs(a: tuple, b: tuple) -> None:
    (_, batches_a, draws_a), (_, batches_b, draws_b) = a[:3], b[:3]
    assert len(batches_a) == len(batches_b)
    for n, (x, y) in enumerate(zip(batches_a, batches_b)):
        assert torch.equal(x, y), f"batch {n} differs in {int((x != y).sum())} ids"
    for n, (x, y) in enumerate(zip(draws_a, draws_b)):
        assert torch.equal(x, y), f"the loop's draws differ at batch {n}"


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def references(weight):
    return {n: reference(NoisyTokens(), weight, n, shuffle=True) for n in (0, 2)}


@pytest.mark.parametrize(
    ("policy", "cache", "num_workers"),
    [  # every policy at 5%, with and without workers; the rest of the grid in the slow group
        (p, c, w) if c == 0.05 else slow(p, c, w)
        for p in ["lru", "lfu", "lookahead", "auto"]
        for c in [0.02, 0.05, 1.0]
        for w in [0, 2]
    ],
)
def test_random_samples_train_as_nn_embedding_with_every_policy(
    tmp_path, weight, references, policy, cache, num_workers
):
    trains_as_nn_embedding(tmp_path, references, weight, num_workers, cache, policy, "thread")


@pytest.mark.parametrize(("cache", "num_workers"), [(0.05, 2), slow(0.05, 0), slow(1.0, 2)])
def test_random_samples_train_as_nn_embedding_with_an_owner_process(
    tmp_path, weight, references, cache, num_workers
):
    """The same with the owner in a process of its own: the workers still call the dataset,
    and the owner process draws from no generator of the program's."""
    stats = trains_as_nn_embedding(
        tmp_path, references, weight, num_workers, cache, "auto", "process"
    )
    assert stats["read_ahead"] == 0  # no batch is the one foreseen: each is read at its claim


def trains_as_nn_embedding(tmp_path, references, weight, num_workers, cache, policy, owner):
    expected = references[num_workers]
    got = offloaded(
        NoisyTokens(),
        tmp_path / "t.zarr",
        weight,
        num_workers,
        int(V * cache),
        policy,
        owner=owner,
        shuffle=True,
    )
    same_runs(got, expected)
    assert torch.equal(got[0], expected[0])
    return got[3]


class Count(Dataset):
    """Sample i is the ids (i, i + 1): which samples a loop trained on is plain to see."""

    def __init__(self, n: int = 200) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.tensor([i % V, (i + 1) % V])}


class SkipDone(Sampler):
    """A sampler fed back by the loop: it skips samples the loop has marked done (here the loop
    marks the two samples after each one it trains). Drawn ahead of the DataLoader, it would
    hand out samples the loop has since marked."""

    def __init__(self, n: int) -> None:
        self.n, self.done = n, set()

    def __len__(self) -> int:
        return self.n

    def trained(self, ids: torch.Tensor) -> None:
        for i in ids[:, 0].tolist():
            self.done.update((i + 1, i + 2))

    def __iter__(self):
        return (i for i in range(self.n) if i not in self.done)


class EpochShuffle(Sampler):
    """Shuffles from its epoch, as DistributedSampler does; the loop calls set_epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(
            torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        )


class PairBatches(Sampler):
    """A custom batch sampler: odd-sized batches drawn from torch's global generator."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n // 5

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        for start in range(0, self.n - 4, 5):
            yield order[start : start + int(torch.randint(3, 6, ()))]


class NoisyStream(IterableDataset):
    def __iter__(self):
        for _ in range(96):
            yield {"input_ids": (torch.randint(0, V, (SEQ,)) + int(np.random.randint(3))) % V}


class Sentences(Dataset):
    """Sequences of lengths 3 to SEQ, cut shorter at random (numpy's global generator): a
    collate_fn pads each batch to its longest, as people's do for text."""

    def __init__(self, n: int = 96) -> None:
        rng = np.random.default_rng(4)
        self.tokens = [
            np.minimum(rng.zipf(1.2, rng.integers(3, SEQ + 1)), V - 1).astype(np.int64)
            for _ in range(n)
        ]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens[i][: max(2, len(self.tokens[i]) - np.random.randint(3))]
        return {"input_ids": torch.from_numpy(ids)}


def pad_to_longest(samples: list[dict]) -> dict:
    ids = [s["input_ids"] for s in samples]
    padded = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=0)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(i) for i in ids], batch_first=True)
    return {"input_ids": padded, "attention_mask": mask}


def hf_dataset():
    datasets = pytest.importorskip("datasets", reason="HF datasets is an optional extra")
    rng = np.random.default_rng(3)
    tokens = np.minimum(rng.zipf(1.2, (96, SEQ)), V - 1).tolist()
    ds = datasets.Dataset.from_dict({"input_ids": tokens})

    def mask(batch: dict) -> dict:  # random masking, as a data collator does, on the fly
        out = []
        for ids in batch["input_ids"]:
            ids = torch.tensor(ids)
            ids[torch.rand(len(ids)) < 0.15] = 3
            out.append(ids)
        return {"input_ids": out}

    ds.set_transform(mask)
    return ds


def masked_lm_collator():
    """Hugging Face's DataCollatorForLanguageModeling: it pads and masks each batch at random
    (torch's global generator, in whichever process collates), as masked-LM pretraining does."""
    transformers = pytest.importorskip("transformers", reason="an optional extra")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(V - 5)]
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(words)})
    return transformers.DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)


CASES = {
    "sampler fed back": lambda: (Count(), {"sampler": SkipDone(200)}),
    "set_epoch": lambda: (Count(), {"sampler": EpochShuffle(200)}),
    "custom batch sampler": lambda: (Count(), {"batch_sampler": PairBatches(200)}),
    "weighted sampler": lambda: (  # torch's global generator, at each epoch's start
        Count(),
        {"sampler": WeightedRandomSampler(torch.arange(1.0, 201.0), 120)},
    ),
    "subset sampler": lambda: (Count(), {"sampler": SubsetRandomSampler(range(0, 200, 2))}),
    "iterable": lambda: (NoisyStream(), {}),
    "HF datasets with set_transform": lambda: (hf_dataset(), {"shuffle": True}),
    "padded to each batch's longest": lambda: (
        Sentences(),
        {"shuffle": True, "collate_fn": pad_to_longest},
    ),
    "HF masked-LM collator": lambda: (
        Sentences(),
        {"shuffle": True, "collate_fn": masked_lm_collator()},
    ),
}


@pytest.mark.parametrize("owner", ["thread", "process"])  # (the default: a process here)
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", list(CASES))
def test_datasets_and_samplers_people_write_see_the_same_batches(
    tmp_path, weight, case, num_workers, owner
):
    dataset, options = CASES[case]()
    expected = reference(dataset, weight, num_workers, **options)
    dataset, options = CASES[case]()  # fresh samplers: their state is part of the run
    got = offloaded(dataset, tmp_path / "t.zarr", weight, num_workers, 20, "auto", owner, **options)
    same_runs(got, expected)
    assert torch.equal(got[0], expected[0])


# A BatchSampler the program holds and changes between epochs (a curriculum): a DataLoader reads
# its settings at each epoch (NOTE [ A batch sampler the program holds ] in owner/batchorder.py).
CHANGES = {
    "batch size doubled": lambda held, loader: setattr(held, "batch_size", held.batch_size * 2),
    "drop_last set": lambda held, loader: setattr(held, "drop_last", True),
    "sampler swapped": lambda held, loader: setattr(
        held, "sampler", SubsetRandomSampler(range(0, 62, 2))
    ),
    "batch size set through the loader": lambda held, loader: setattr(
        loader.batch_sampler, "batch_size", 6
    ),
}


@pytest.mark.parametrize("owner", ["thread", "process"])
@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_batch_sampler_changed_between_epochs_gives_the_next_epoch_its_batches(
    tmp_path, weight, change, num_workers, owner
):
    held = {}

    def run(train):
        held["sampler"] = BatchSampler(RandomSampler(Count(62)), 4, drop_last=False)
        return train(
            Count(62),
            between=lambda loader: CHANGES[change](held["sampler"], loader),
            batch_sampler=held["sampler"],
        )

    expected = run(lambda *a, **k: reference(*a, weight, num_workers, **k))
    got = run(
        lambda *a, **k: offloaded(
            *a, tmp_path / "t.zarr", weight, num_workers, 20, "auto", owner, **k
        )
    )
    same_runs(got, expected)
    assert torch.equal(got[0], expected[0])
    if change == "batch size set through the loader":  # it reached the program's object
        assert held["sampler"].batch_size == 6


class Where(Dataset):
    """Counts its calls in the process that made it (the training process) in shared memory."""

    def __init__(self, n: int = 64) -> None:
        self.n, self.pid = n, os.getpid()
        self.calls_here = torch.zeros(1, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if os.getpid() == self.pid:
            self.calls_here += 1
        return {"input_ids": torch.tensor([i % V, (7 * i) % V])}


def test_with_workers_the_dataset_is_never_called_in_the_training_process(tmp_path, weight):
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=32).close()
    dataset = Where()
    with embedpipe.EmbeddingPipe(tmp_path / "t.zarr", owner="thread", cache_rows=20) as pipe:
        for _ in pipe.loader(dataset, batch_size=4, shuffle=True, num_workers=2):
            pass
        assert pipe._owner.cache.policy.name == "lookahead"
    assert int(dataset.calls_here) == 0
