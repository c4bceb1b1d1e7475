"""The DataLoader stage: a torch DataLoader whose collate does the lookup, and the hand-off.

``PipeLoader`` wraps the user's dataset (checking each sample's ids where its index is known),
builds a ``torch.utils.data.DataLoader`` whose ``collate_fn`` is the worker-side
:class:`~embedpipe.worker.Lookup`, and turns each :class:`~embedpipe.worker.LookedUp` into an
:class:`~embedpipe.batch.EmbeddedBatch` in the main process (``EmbeddingPipe._hand_off``).
Everything the DataLoader offers (workers, prefetching, persistent workers, pinned memory, the
start method) works as usual, because this is a DataLoader.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from .batch import EmbeddedBatch
from .ring import BatchRing
from .worker import CheckedDataset, CheckedIterable, LookedUp, Lookup

if TYPE_CHECKING:
    from .pipe import EmbeddingPipe

DEFAULT_RING_ROWS = 2048


class PipeLoader:
    """An iterable of :class:`EmbeddedBatch`; ``len()`` as the DataLoader's."""

    def __init__(
        self,
        pipe: EmbeddingPipe,
        dataset: Dataset,
        *,
        batch_size: int | None,
        shuffle: bool,
        num_workers: int,
        collate_fn: Any,
        ids_key: str,
        ring_rows: int | None,
        **dataloader_kwargs: Any,
    ) -> None:
        table = pipe.table
        if isinstance(dataset, IterableDataset):
            checked: Dataset = CheckedIterable(dataset, ids_key, table.num_rows)
        else:
            checked = CheckedDataset(dataset, ids_key, table.num_rows)
        self.ring = None
        if num_workers > 0:
            depth = (dataloader_kwargs.get("prefetch_factor") or 2) + 1
            rows = ring_rows or min(table.num_rows, DEFAULT_RING_ROWS)
            self.ring = BatchRing(
                num_workers, depth, rows, table.dim, pipe.shared.tensors["rows"].dtype
            )
        lookup = Lookup(collate_fn or default_collate, ids_key, table, pipe.shared, self.ring)
        self.pipe = pipe
        # The DataLoader pins the fields; the rows are made at hand-off, so pin them there.
        self._pin = bool(dataloader_kwargs.get("pin_memory")) and torch.cuda.is_available()
        self.dataloader = DataLoader(
            checked,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            collate_fn=lookup,
            **dataloader_kwargs,
        )

    def __iter__(self) -> Iterator[EmbeddedBatch]:
        for item in self._lookups():
            if item.slot >= 0:
                rows = self.ring.read(item.slot, item.tag, len(item.unique_ids))
            else:
                rows = item.rows
            yield self.pipe._hand_off(item, rows, self._pin)

    def _lookups(self) -> Iterator[LookedUp]:
        """The DataLoader's output. Without workers the lookup runs in this thread at ``next()``:
        in exact mode, let the writeback finish first so that it reads current rows."""
        writeback = self.pipe.writeback
        if self.dataloader.num_workers > 0 or writeback is None or self.pipe.consistency != "exact":
            yield from self.dataloader
            return
        iterator = iter(self.dataloader)
        while True:
            writeback.wait()
            try:
                item = next(iterator)
            except StopIteration:
                return
            yield item

    def __len__(self) -> int:
        return len(self.dataloader)
