"""A training run for the crash tests: run as a script, killed by the test, resumed by the test.

The run trains a small table through an EmbeddingPipe (Adagrad, a 5% cache, two workers, a
checkpoint every ``--every`` steps, two kept) and a dense projection ``P`` with SGD, over two
epochs of a shuffled Zipf corpus. It follows the resume recipe in docs/reliability.md: before each
``pipe.checkpoint()`` it saves the dense state of that step; started with ``--resume`` it opens
the table (which recovers its latest checkpoint), loads the dense state of ``table.step`` and
goes on from that position in the data order. ``reference()`` trains the same thing with
``nn.Embedding`` and ``torch.optim.Adagrad`` in memory.

``--die-at NAME:N`` makes the process SIGKILL itself at the N-th call of ``os.NAME`` once
training has started: inside a checkpoint commit (link, fsync, rename), a row write (pwrite) or
a chunk's copy-on-write (copy_file_range).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np
import torch

V, D, SEQ, BATCH, SAMPLES, EPOCHS = 3000, 16, 12, 8, 96, 2
STEPS_PER_EPOCH = SAMPLES // BATCH
STEPS = STEPS_PER_EPOCH * EPOCHS
LR_TABLE, LR_DENSE, SEED = 0.5, 0.1, 0


def corpus() -> list[dict]:
    rng = np.random.default_rng(SEED)
    ids = (rng.zipf(1.2, (SAMPLES, SEQ)) - 1) % V
    return [{"input_ids": torch.from_numpy(row.astype(np.int64))} for row in ids]


def order(epoch: int) -> list[int]:
    """The epoch's sample order: a permutation seeded by the epoch, as a sampler would draw it."""
    generator = torch.Generator().manual_seed(SEED + epoch)
    return torch.randperm(SAMPLES, generator=generator).tolist()


def initial_dense() -> torch.Tensor:
    return torch.randn(D, 4, generator=torch.Generator().manual_seed(1))


def loss_of(embeds: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    return torch.tanh(embeds @ dense).pow(2).mean()


def reference(weight: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(table, Adagrad sum, dense) after each step 0..STEPS, trained with nn.Embedding in memory."""
    data = corpus()
    embedding = torch.nn.Embedding(V, D, _weight=weight.clone())
    dense = torch.nn.Parameter(initial_dense())
    table_opt = torch.optim.Adagrad([embedding.weight], lr=LR_TABLE)
    dense_opt = torch.optim.SGD([dense], lr=LR_DENSE)
    states = [(embedding.weight.detach().clone(), torch.zeros(V, D), dense.detach().clone())]
    for epoch in range(EPOCHS):
        index = order(epoch)
        for b in range(STEPS_PER_EPOCH):
            batch = torch.stack([data[i]["input_ids"] for i in index[b * BATCH : (b + 1) * BATCH]])
            loss = loss_of(embedding(batch), dense)
            loss.backward()
            table_opt.step()
            dense_opt.step()
            table_opt.zero_grad()
            dense_opt.zero_grad()
            total = table_opt.state[embedding.weight]["sum"]
            states.append(
                (embedding.weight.detach().clone(), total.clone(), dense.detach().clone())
            )
    return states


def _die_at(name: str, count: int) -> None:
    original = getattr(os, name)
    calls = [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == count and os.getpid() == owner_pid:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    owner_pid = os.getpid()
    setattr(os, name, dying)


def train(path: str, every: int, resume: bool, die_at: str | None, owner: str) -> None:
    import embedpipe

    folder = os.path.dirname(path)
    # "r+" takes the table back to its latest checkpoint; a service (owner "unix:...") holds
    # the lock, and this process reads the latest checkpoint
    table = embedpipe.Table.open(path, "r" if owner.startswith("unix:") else "r+")
    start = table.step
    dense = torch.nn.Parameter(
        torch.load(os.path.join(folder, f"dense-{start}.pt")) if resume else initial_dense()
    )
    dense_opt = torch.optim.SGD([dense], lr=LR_DENSE)
    data = corpus()
    if die_at:
        name, count = die_at.split(":")
        _die_at(name, int(count))
    print("started", start, flush=True)
    optimizer = embedpipe.optim.Adagrad(lr=LR_TABLE)
    with embedpipe.EmbeddingPipe(
        table, cache_rows=V // 20, optimizer=optimizer, keep=2, owner=owner
    ) as pipe:
        step = start
        for epoch in range(start // STEPS_PER_EPOCH, EPOCHS):
            skip = (
                (start - epoch * STEPS_PER_EPOCH) * BATCH
                if epoch == start // STEPS_PER_EPOCH
                else 0
            )
            loader = pipe.loader(data, batch_size=BATCH, sampler=order(epoch)[skip:], num_workers=2)
            for batch in loader:
                loss_of(batch["inputs_embeds"], dense).backward()
                dense_opt.step()
                dense_opt.zero_grad()
                pipe.step()  # the table's step (dense_opt does not hold it)
                step += 1
                print("step", step, flush=True)
                if step % every == 0:
                    _save_dense(folder, step, dense)  # first the dense state, then the table
                    pipe.checkpoint()
                    print("checkpoint", step, flush=True)
    table.close()
    _save_dense(folder, step, dense)
    print("done", step, flush=True)


def _save_dense(folder: str, step: int, dense: torch.Tensor) -> None:
    target = os.path.join(folder, f"dense-{step}.pt")
    torch.save(dense.detach().clone(), target + ".tmp")
    os.replace(target + ".tmp", target)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-at")
    parser.add_argument("--owner", default="thread")
    args = parser.parse_args()
    sys.exit(train(args.path, args.every, args.resume, args.die_at, args.owner))
