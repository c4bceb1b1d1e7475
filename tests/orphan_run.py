"""A training process that the kill test SIGKILLs with batches in its workers' queue: it prints
its pid and its children's (the DataLoader workers, the foresight child), then trains slowly.

Run as ``python -m tests.orphan_run TABLE``.
"""

from __future__ import annotations

import os
import sys
import time

import psutil
import torch

import embedpipe


class Heavy(torch.utils.data.Dataset):
    """Samples with a 256 KiB field besides their ids: a few batches fill the queue's pipe."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.tensor([i % 500, (3 * i) % 500]), "blob": bytes(256 * 1024)}


def collate(samples: list[dict]) -> dict:
    return {
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "blob": [s["blob"] for s in samples],
    }


def main(path: str) -> None:
    with embedpipe.EmbeddingPipe(
        path, cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.1)
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
    main(sys.argv[1])
