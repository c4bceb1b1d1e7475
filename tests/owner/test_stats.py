"""pipe.stats() against a hand count on a small trace."""

from __future__ import annotations

import numpy as np
import torch

import embedpipe
from embedpipe.pipe import EmbeddingPipe

# cache of 3 rows, LRU, one batch of ids per step (see the comments for the hand count)
TRACE = [[0], [1], [2], [0], [3], [1], [0, 3], [2]]
#        miss miss miss hit  miss     miss     hit hit miss
#                            evict 1  evict 2           evict 1


def _run(tmp_path, optimizer=None):
    weight = np.arange(40, dtype=np.float32).reshape(10, 4)
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", weight, chunk_rows=4).close()
    data = [{"input_ids": torch.tensor(ids)} for ids in TRACE]
    pipe = EmbeddingPipe(tmp_path / "t.zarr", cache_rows=3, policy="lru", optimizer=optimizer)
    with pipe:
        for batch in pipe.loader(data, batch_size=1, collate_fn=lambda s: s[0]):
            if optimizer is not None:
                (batch["inputs_embeds"] ** 2).sum().backward()
                pipe.step()
        during = pipe.stats()
    return during, pipe.stats()


def test_frozen_counts(tmp_path):
    stats, _ = _run(tmp_path)
    assert stats["batches"] == 8
    assert (stats["hits"], stats["misses"], stats["rows_read"]) == (3, 6, 6)
    assert (stats["evictions"], stats["rows_written"], stats["refreshed"]) == (3, 0, 0)
    assert (stats["steps"], stats["writeback_queue"], stats["cached_rows"]) == (0, 0, 3)


def test_training_counts(tmp_path):
    _, stats = _run(tmp_path, optimizer=embedpipe.optim.SGD(lr=0.1))
    assert (stats["hits"], stats["misses"], stats["rows_read"], stats["evictions"]) == (3, 6, 6, 3)
    # Every row used is updated, so each eviction writes one row, and close() writes the 3 cached:
    # 6 writes. The writeback thread may also write cold dirty rows ahead of their eviction; each
    # such write is extra, or saves the one at eviction.
    assert 6 <= stats["rows_written"] <= 6 + stats["cleaned_ahead"] and stats["dirty_rows"] == 0
    assert (stats["steps"], stats["writeback_queue"], stats["refreshed"]) == (8, 0, 0)
