"""The DataLoader stage: a torch DataLoader whose collate does the lookup, and the hand-off.

``PipeLoader`` wraps the user's dataset (checking each sample's ids where its index is known),
builds a ``torch.utils.data.DataLoader`` whose ``collate_fn`` is the worker-side
:class:`~embedpipe.worker.Lookup`, and turns each :class:`~embedpipe.worker.LookedUp` into an
:class:`~embedpipe.batch.EmbeddedBatch` in the main process (``Owner.hand_off``). The loader
holds the pipe (a loop over it keeps the pipe alive) and asks the owner for two things only:
``before_lookup`` and ``hand_off``.
Everything the DataLoader offers (workers, prefetching, persistent workers, pinned memory, the
start method) works as usual, because this is a DataLoader.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, default_convert

from .batch import EmbeddedBatch
from .errors import WorkerDiedError
from .ring import BatchRing
from .worker import CheckedDataset, CheckedIterable, LookedUp, Lookup

if TYPE_CHECKING:
    from .pipe import EmbeddingPipe

DEFAULT_RING_ROWS = 2048
#: How long a broken connection to a worker waits for that worker's exit to be seen.
DEAD_WORKER_SECONDS = 5.0


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


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
        owner = pipe._owner
        table = owner.table
        if isinstance(dataset, IterableDataset):
            checked: Dataset = CheckedIterable(dataset, ids_key, table.num_rows)
        else:
            checked = CheckedDataset(dataset, ids_key, table.num_rows)
        self.ring = None
        if num_workers > 0 and owner.workers_read_shared:
            depth = (dataloader_kwargs.get("prefetch_factor") or 2) + 1
            rows = ring_rows or min(table.num_rows, DEFAULT_RING_ROWS)
            self.ring = BatchRing(num_workers, depth, rows, table.dim, table.dtype)
        if collate_fn is None:  # as the DataLoader: no batching, no stacking
            unbatched = batch_size is None and "batch_sampler" not in dataloader_kwargs
            collate_fn = default_convert if unbatched else default_collate
        shared = owner.shared if owner.workers_read_shared else None
        lookup = Lookup(collate_fn, ids_key, table, shared, self.ring)
        self.pipe = pipe  # kept alive while the loader is
        self.owner = owner
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
            if item.slot >= 0 and self.ring is not None:
                rows = self.ring.read(item.slot, item.tag, len(item.unique_ids))
            else:
                rows = item.rows
            yield self.owner.hand_off(item, rows, self._pin)

    def _lookups(self) -> Iterator[LookedUp]:
        """The DataLoader's output. Without workers the lookup runs in this thread at ``next()``:
        the owner may need the writeback to finish first (exact mode)."""
        inline = self.dataloader.num_workers == 0
        iterator = iter(self.dataloader)
        try:
            while True:
                if inline:
                    self.owner.before_lookup()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                yield item
        except Exception as e:
            # A failed batch (a dead worker, a bad sample) ends the epoch: stop the workers now
            # rather than when the traceback that references the iterator is collected. A dead
            # worker surfaces in torch as a RuntimeError or, mid-transfer, a ConnectionResetError:
            # name the worker either way.
            try:
                dead = _dead_workers(iterator, wait=isinstance(e, (ConnectionError, EOFError)))
            finally:  # torch's SIGCHLD handler may raise here too; shut down all the same
                shutdown = getattr(iterator, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
            if dead:
                raise WorkerDiedError(
                    f"DataLoader worker (pid {dead[0].pid}) died ({_exit_reason(dead[0].exitcode)}) "
                    "while loading batches; see the worker's own output above for why "
                    "(out of memory is the usual cause of a SIGKILL)"
                ) from e
            raise

    def __len__(self) -> int:
        return len(self.dataloader)


def _dead_workers(iterator: Any, wait: bool) -> list[Any]:
    """The iterator's workers that have exited with an error. A broken connection means one
    died mid-transfer, though its exit may not be reaped yet: then look again for a while."""
    deadline = time.monotonic() + (DEAD_WORKER_SECONDS if wait else 0)
    while True:
        dead = [w for w in getattr(iterator, "_workers", ()) if w.exitcode not in (None, 0)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)
