"""Soak: 20,000 steps at a 2% cache, a checkpoint every 500, 2 workers. What the training process
holds (resident memory, file descriptors, threads) and the machine's shared memory stay flat,
and the table equals nn.Embedding + torch Adagrad fed the same batches.

Slow (about 3 minutes on 2 cores): run with ``--run-slow``; ``.ci/run`` does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embedpipe

V, D, SEQ, BATCH = 5000, 16, 16, 8
STEPS, EVERY, SAMPLES = 20_000, 500, 4000  # epochs of 500 steps: 40 epochs, 40 sets of workers


def shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


def footprint(psutil) -> dict[str, int]:
    me = psutil.Process()
    return {
        "rss_mib": me.memory_info().rss >> 20,
        "fds": me.num_fds(),
        "threads": me.num_threads(),
        "shmem_mib": shmem_kib() >> 10,
    }


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_twenty_thousand_steps_hold_nothing_more_and_train_exactly(tmp_path):
    psutil = pytest.importorskip("psutil", reason="psutil reads the process's footprint")
    rng = np.random.default_rng(0)
    tokens = torch.from_numpy(np.minimum(rng.zipf(1.2, (SAMPLES, SEQ)), V) - 1)
    data = [{"input_ids": t} for t in tokens]
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(1))
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=256).close()

    embedding = torch.nn.Embedding(V, D, _weight=weight.clone())  # the reference, alongside
    reference = torch.optim.Adagrad(embedding.parameters(), lr=0.1)
    samples: list[dict[str, int]] = []
    with embedpipe.EmbeddingPipe(
        tmp_path / "t.zarr", cache_rows=V // 50, optimizer=embedpipe.optim.Adagrad(lr=0.1), keep=2
    ) as pipe:
        optimizer = torch.optim.Adagrad([pipe.parameter], lr=0.1)
        step = 0
        while step < STEPS:
            for batch in pipe.loader(data, batch_size=BATCH, num_workers=2):
                (embedding(batch["input_ids"]) ** 2).mean().backward()
                reference.step()
                reference.zero_grad()
                (batch["inputs_embeds"] ** 2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if step % EVERY == 0:
                    pipe.checkpoint()
                    samples.append(footprint(psutil))
                if step == STEPS:
                    break
    got = embedpipe.Table.open(tmp_path / "t.zarr").to_tensor()
    assert torch.equal(got, embedding.weight.detach())

    settled, last = samples[3], samples[-1]  # after the first 2,000 steps
    assert last["rss_mib"] - settled["rss_mib"] < 40, samples
    assert last["fds"] <= settled["fds"] + 4, samples
    assert last["threads"] <= settled["threads"] + 2, samples
    assert last["shmem_mib"] - settled["shmem_mib"] < 16, samples
