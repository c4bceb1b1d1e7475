"""The DataLoader stage: a torch DataLoader whose collate does the lookup, and the claim.

``PipeLoader`` is a ``torch.utils.data.DataLoader`` over the user's dataset (checking each
sample's ids where its index is known) whose ``collate_fn`` is the worker-side
:class:`~embedpipe.worker.lookup.Lookup`. Each batch a worker returns is an unclaimed
:class:`~embedpipe.worker.batch.EmbeddedBatch`; ``PipeLoader`` claims it in the main process as
``next()`` yields it (``Owner.hand_off``, through the :class:`PipeSource` the batch names).

Because it is a DataLoader, and its batches claim themselves, frameworks that rebuild a loader
from its dataset and ``collate_fn`` get working batches too: Accelerate's ``prepare`` and
``skip_first_batches``, Trainer's resume. Their batches are claimed at the first ``.to(device)``
or read (NOTE [ Rows are final when the model first reads them ] in ``batch.py``).
Everything the DataLoader offers (workers, prefetching, persistent workers, pinned memory, the
start method) works as usual.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, default_convert

from ..cache import budget
from ..cache.ring import DEFAULT_RING_ROWS, BatchRing
from ..cache.shm import SharedBlock
from ..errors import WorkerDiedError
from ..owner.batchorder import Foresight
from ..worker.batch import EmbeddedBatch
from ..worker.collate import PadCollator
from ..worker.looked_up import LookedUp
from ..worker.lookup import CheckedDataset, Lookup
from ..worker.orphans import WatchParent, exit_reason
from . import defaults

if TYPE_CHECKING:
    from ..owner.owner import Owner

#: How long a broken connection to a worker waits for that worker's exit to be seen.
DEAD_WORKER_SECONDS = 5.0


class PipeSource:
    """The main-process side of a loader's lookups: claims its batches (``batch.py``)."""

    def __init__(self, owner: Owner, ring: BatchRing | None, pin: bool) -> None:
        self.owner = owner
        self.ring = ring
        self.pin = pin and torch.cuda.is_available()
        self._warned = False

    def claim(self, item: LookedUp, pin: bool) -> EmbeddedBatch:
        if item.slot < 0 and self.ring is not None and item.rows is not None and not self._warned:
            self._warned = True
            warnings.warn(
                f"a batch of {len(item.unique_ids):,} unique ids did not fit the workers' "
                f"ring ({self.ring.rows_per_slot:,} rows a slot) and came through torch's "
                "slower tensor path (correct, several times slower); pass "
                f"pipe.loader(..., ring_rows={len(item.unique_ids) * 2}) or more",
                RuntimeWarning,
                stacklevel=4,
            )
        stream = self.owner.stream
        if stream is not None and stream.source is self:  # one of the batches it foresaw
            stream.claim(item.unique_ids)
            if stream.blind:
                self.owner.look_blind(
                    stream.failure  # why its child stopped (``foresee._why``), if it did
                    or "the ids of most of the last batches differed from those a second read "
                    "of the dataset gave for the same indices (a dataset that draws at random), "
                    "or reading them ahead could not keep up with the loader"
                )
        return self.owner.claim(item, self.ring, self.pin or (pin and torch.cuda.is_available()))


class PipeLoader(DataLoader):
    """A DataLoader of :class:`EmbeddedBatch`; arguments as ``EmbeddingPipe.loader``, which
    passes itself as ``pipe`` (its owner looks the batches up; the loader keeps it alive)."""

    def __init__(
        self,
        pipe: Any,
        dataset: Dataset,
        *,
        batch_size: int | None,
        shuffle: bool | None = None,
        num_workers: int,
        collate_fn: Any,
        ids_key: str,
        ring_rows: int | None,
        **dataloader_kwargs: Any,
    ) -> None:
        owner = pipe._owner
        table = owner.table
        streamed = isinstance(dataset, IterableDataset)  # NOTE [ An iterable dataset as it is ]
        checked = dataset if streamed else CheckedDataset(dataset, ids_key, table.num_rows)
        ring = None
        if num_workers > 0 and owner.workers_read_shared:
            # one slot more than batches in flight, one more for a batch a framework holds
            # unclaimed one ahead (ring.py's NOTE)
            depth = (dataloader_kwargs.get("prefetch_factor") or 2) + 2
            rows = ring_rows or min(table.num_rows, DEFAULT_RING_ROWS)
            size = budget.pipe_memory(
                table.num_rows,
                table.dim,
                table.dtype,
                0,
                num_workers=num_workers,
                prefetch_factor=depth - 2,
                ring_rows=rows,
            )["ring"]
            budget.warn_if_too_big(size, f"the batch ring of {num_workers} workers", stacklevel=4)
            ring = BatchRing(num_workers, depth, rows, table.dim, table.dtype)
        remade = dict(  # the arguments, as given (NOTE [ A loader Lightning remakes ])
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate_fn,
            ids_key=ids_key,
            ring_rows=ring_rows,
            **dataloader_kwargs,
        )
        if collate_fn is None:  # as the DataLoader: no batching, no stacking, but pad ragged ids
            unbatched = batch_size is None and dataloader_kwargs.get("batch_sampler") is None
            collate_fn = default_convert if unbatched else PadCollator(owner.padding_idx, ids_key)
        source = PipeSource(owner, ring, bool(dataloader_kwargs.get("pin_memory")))
        shared = owner.shared if owner.workers_read_shared else None
        if num_workers == 0 and getattr(owner, "reads_rows_at_claim", False):
            shared = None  # an owner process reads them: this process never reads the table
        # set while a lookahead stream reads this loader's misses, and once a stream found the
        # table's disk cold (NOTE [ Misses read by the owner ])
        self._defer = (
            SharedBlock({"misses": ((1,), np.int8, 0), "cold": ((1,), np.int8, 0)})
            if ring is not None and owner.looks_ahead
            else None
        )
        mapped = defaults.maps_reads(table, pipe.optimizer)  # NOTE in pipe/defaults.py
        lookup = Lookup(
            collate_fn, ids_key, table, shared, ring, source, self._defer, owner.owned, streamed,
            mapped,
        )  # fmt: skip
        super().__init__(
            checked,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            collate_fn=lookup,
            **dataloader_kwargs,
        )
        self.pipe = pipe  # kept alive while the loader is
        self.ring = ring
        self.ids_key = ids_key
        if (
            owner.looks_ahead
            and not isinstance(dataset, IterableDataset)  # its "indices" are no order to read
            and type(self.batch_sampler) is BatchSampler  # the default: batch_size=, shuffle=
            and getattr(self, "in_order", True)
        ):
            # The batches' order is the batch sampler's: a Foresight in its place (the same
            # batches) lets the lookahead policy see it, in this loader and in the loaders
            # frameworks build from its batch sampler (Accelerate's prepare and
            # skip_first_batches). DataLoader refuses the attribute after __init__: set it anyway.
            sight = Foresight(self.batch_sampler, owner, dataset, ids_key, source, self._defer)
            object.__setattr__(self, "batch_sampler", sight)
        # NOTE [ A loader Lightning remakes ]
        # Lightning makes a loader anew to give it a sampler (DDP's DistributedSampler, when
        # ``use_distributed_sampler`` is on and the loader has none; an index wrapper around the
        # batch sampler in ``predict``), from the arguments its ``*_dataloader`` hooks record, or
        # else from the loader's attributes, which here are the wrapped dataset and the lookup.
        # So the arguments this loader was made with are recorded as those hooks would (all but
        # ``shuffle``, which Lightning then reads from the sampler, as for a DataLoader made
        # outside a hook): the loader it makes is the pipe's, over the same dataset and collate.
        # Lightning updates the keyword arguments it reads in place, so each read is a copy
        # (``__getattr__``): a loader remade once and used again is remade from its own. Its
        # batch sampler is remade as a BatchSampler is (``Foresight.__new__``), not from the
        # arguments a hook recorded for the Foresight (they have no ``sampler`` to replace).
        self._remade = remade
        self.__dict__.pop("__pl_saved_kwargs", None)  # a hook's record: ``__getattr__`` gives ours
        recorded = {
            "__pl_saved_args": (pipe, dataset),
            "__pl_saved_arg_names": ("pipe", "dataset"),
            "__pl_saved_default_kwargs": {},
            "__dataset": dataset,
        }
        for name, value in recorded.items():
            object.__setattr__(self, name, value)
        if isinstance(self.batch_sampler, Foresight):
            for name in (*recorded, "__pl_saved_kwargs"):
                self.batch_sampler.__dict__.pop(name, None)

    def __getattr__(self, name: str) -> Any:  # only for names the loader lacks
        remade = self.__dict__.get("_remade")  # NOTE [ A loader Lightning remakes ]
        if name == "__pl_saved_kwargs" and remade is not None:
            return dict(remade)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __iter__(self) -> Epoch:  # type: ignore[override]
        try:  # NOTE [ An epoch begins at iter() ]
            iterator = super().__iter__()
        except BaseException:  # (workers that prefetched may have begun the epoch's foresight)
            if isinstance(self.batch_sampler, Foresight):
                self.batch_sampler.stop()
            raise
        return Epoch(self, iterator)

    def _claimed(self, iterator: Any) -> Iterator[EmbeddedBatch | None]:
        """The epoch's batches, claimed as they come, after a first None: primed, the generator
        is inside its ``try``, so the window is freed however the epoch ends, even unstarted
        (unless a later epoch of the loader has begun: its window is not this one's)."""
        order = getattr(iterator, "_sampler_iter", None)  # this epoch's (a Foresight's Ahead)
        # looked at now: a generator left unfinished at exit may close after this module's names
        # are gone (the interpreter clears them), which ``isinstance(..., Foresight)`` would need
        sight = self.batch_sampler if isinstance(self.batch_sampler, Foresight) else None
        try:
            yield None
            for batch in self._batches(iterator):
                yield batch._claim()
        finally:
            if sight is not None:
                sight.stop(order)  # an epoch left early: the window is free again

    def _get_iterator(self) -> Any:
        """Torch's iterator, whose workers start their watch of the training process first
        (NOTE [ Workers die with the training process ]): ``worker_init_fn`` is wrapped only
        while the workers are made, so that the loader's own stays what the program set (Lightning
        seeds the workers only of a loader whose ``worker_init_fn`` is None)."""
        if self.num_workers == 0:
            return super()._get_iterator()
        init = self.worker_init_fn
        self.worker_init_fn = WatchParent(init)
        try:
            return super()._get_iterator()
        finally:
            self.worker_init_fn = init

    def _batches(self, iterator: Any) -> Iterator[EmbeddedBatch]:
        """The DataLoader's output, with a failed batch ending the epoch cleanly."""
        inline = self.num_workers == 0  # the lookup runs at next(), in this thread
        try:
            while True:
                if inline:  # exact mode: look up after the steps taken so far are applied
                    self.pipe._owner.before_lookup()
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                yield batch
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
                    f"DataLoader worker (pid {dead[0].pid}) died ({exit_reason(dead[0].exitcode)}) "
                    "while loading batches; see the worker's own output above for why"
                ) from e
            raise


# NOTE [ An epoch begins at iter() ]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A DataLoader makes its iterator at ``iter(loader)``: that draws the iterator's base seed from
# torch's global generator and, with workers, starts them and draws the sampler's order as they
# prefetch. The epoch here is made at the same moment, not at the first ``next()``: made later
# (a generator's body runs only then), any draw the loop made in between (``zip`` making a
# second loader's iterator, a dropout, a noise) came before the loader's, and the batches were
# other than a DataLoader's, with nothing said.


class Epoch:
    """``iter(loader)``: torch's iterator, made at once, whose batches are claimed as they come.
    ``len()`` is the iterator's, as a DataLoader's."""

    def __init__(self, loader: PipeLoader, iterator: Any) -> None:
        self._iterator = iterator
        self._claims = loader._claimed(iterator)
        next(self._claims)  # primed: see ``_claimed``

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> EmbeddedBatch:
        return next(self._claims)  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._iterator)

    def close(self) -> None:
        """End the epoch early, as a generator's ``close()`` does."""
        self._claims.close()


def _dead_workers(iterator: Any, wait: bool) -> list[Any]:
    """The iterator's workers that have exited with an error. A broken connection means one
    died mid-transfer, though its exit may not be reaped yet: then look again for a while."""
    deadline = time.monotonic() + (DEAD_WORKER_SECONDS if wait else 0)
    while True:
        dead = [w for w in getattr(iterator, "_workers", ()) if w.exitcode not in (None, 0)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)
