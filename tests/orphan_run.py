"""A training process that the kill test SIGKILLs with batches in its workers' queue: it prints
its pid and its children's (the DataLoader workers, the foresight child, the owner process
with ``ORPHAN_RUN_OWNER=process``), then trains slowly.

Run as ``python -m tests.orphan_run TABLE``; ``python -m tests.orphan_run TABLE starting``
starts 2 spawned workers whose ``worker_init_fn`` says it started (``TABLE.started-N``) and
takes 3 s, prints the pids as soon as the workers exist, and waits for the first batch: the test
kills it while the workers are in ``worker_init_fn``, before torch's own parent watch begins.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import psutil
import torch

import embedpipe


class Heavy(torch.utils.data.Dataset):
    """Samples with a 256 KiB field besides their ids: a few batches fill the queue's pipe."""

    def __init__(self, size: int = 10_000) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.tensor([i % 500, (3 * i) % 500]), "blob": bytes(256 * 1024)}


def collate(samples: list[dict]) -> dict:
    return {
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "blob": [s["blob"] for s in samples],
    }


def slow_start(worker_id: int) -> None:
    """Says it started (a file beside the table), then takes 3 s."""
    open(f"{os.environ['ORPHAN_RUN_TABLE']}.started-{worker_id}", "w").close()
    time.sleep(3)


def starting(path: str) -> None:
    os.environ["ORPHAN_RUN_TABLE"] = path  # the spawned workers inherit it
    # looking ahead, so an owner process and a foresight child (auto is LFU in a thread where
    # the table fits in memory: NOTE [ A frozen table that fits in memory ])
    with embedpipe.EmbeddingPipe(path, cache_rows=50, policy="lookahead") as pipe:
        loader = pipe.loader(
            Heavy(4),  # one batch: worker 1 never gets work, so never looks anything up
            batch_size=4,
            num_workers=2,
            collate_fn=collate,
            worker_init_fn=slow_start,
            multiprocessing_context="spawn",
        )
        threading.Thread(target=say_pids_once_started, args=(2,), daemon=True).start()
        next(iter(loader))  # the workers start here, and sleep in slow_start


def say_pids_once_started(workers: int) -> None:
    while len(children := psutil.Process().children(recursive=True)) < workers:
        time.sleep(0.05)
    print("pids", os.getpid(), *(c.pid for c in children), flush=True)


def main(path: str) -> None:
    with embedpipe.EmbeddingPipe(
        path,
        cache_rows=50,
        optimizer=embedpipe.optim.SGD(lr=0.1),
        owner=os.environ.get("ORPHAN_RUN_OWNER", "thread"),
    ) as pipe:
        loader = pipe.loader(Heavy(), batch_size=4, num_workers=2, collate_fn=collate)
        for n, batch in enumerate(loader):
            batch["inputs_embeds"].sum().backward()
            pipe.step()
            if n == 2:
                children = [c.pid for c in psutil.Process().children(recursive=True)]
                print("pids", os.getpid(), *children, flush=True)
            time.sleep(0.5)  # a slow step: the workers fill the queue meanwhile


if __name__ == "__main__":
    starting(sys.argv[1]) if sys.argv[2:] == ["starting"] else main(sys.argv[1])
