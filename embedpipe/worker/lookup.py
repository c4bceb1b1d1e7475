"""What runs in a DataLoader worker (or in the main process when ``num_workers=0``).

The worker collates the user's samples with the user's collate function, then looks up the
batch's embeddings: deduplicate the ids, copy hits out of the shared cache (seqlock-validated),
read the misses from the table through the worker's own read-only handle, and put the unique rows
into the worker's next ring slot. What goes back to the owner is an unclaimed
:class:`~embedpipe.worker.batch.EmbeddedBatch` holding a :class:`LookedUp`: the collated fields, the
unique ids, the inverse index and the slot number, never the (B, L, D) embeddings.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..cache.ring import BatchRing
from ..cache.sharedrows import SharedRows
from ..cache.shm import SharedBlock
from ..errors import IdOutOfRangeError
from ..ids import as_ids, unique_inverse
from ..store.layout import WEIGHT
from ..store.mapped import map_reads
from ..store.table import Table
from .batch import EmbeddedBatch, Source, register_source, version_of
from .looked_up import LookedUp
from .orphans import exit_with_parent


class Lookup:
    """The collate function the DataLoader runs: the user's collate, then the embedding lookup.

    Pickles as the table's path and the shared arrays; each process opens its own read-only
    handle on the arrays the owner writes. ``cache`` None: this CPU cannot order lock-free reads
    of shared memory (``ordering.py``), so the lookup stops at the unique ids and the owner reads
    the rows at hand-off.
    """

    def __init__(
        self,
        collate: Callable[[list[Any]], Any],
        ids_key: str,
        table: Table,
        cache: SharedRows | None,
        ring: BatchRing | None,
        source: Source,
        defer: SharedBlock | None = None,
        owned: tuple[int, int] | None = None,
        streamed: bool = False,
        maps_reads: bool = False,
    ) -> None:
        self.collate = collate
        #: The samples come from an iterable dataset, unwrapped: checked here, as they come
        #: (NOTE [ An iterable dataset as it is ]).
        self.streamed = streamed
        #: A sharded pipe: the rows [lo, hi) this rank reads (the others come from their
        #: owners, at the read); None: every row.
        self.owned = None if owned in (None, (0, table.num_rows)) else owned
        self.defer = defer  # defer["misses"][0] == 1: leave misses to the owner
        self.ids_key = ids_key
        self.table_path = table.path
        self.table_root = table.root
        self.num_rows = table.num_rows
        self.cache = cache
        self.ring = ring
        self._pid = os.getpid()
        self.trainer = os.getpid()  # the training process, which the workers watch
        # A forked worker reads through a handle opened here, in the parent: opening a zarr
        # group in a child forked from a process with threads at work (a process group's, the
        # writeback's) hung in zarr's I/O thread under torchrun. The handle reads raw chunk
        # files with pread, which processes sharing a file descriptor may do.
        self.maps_reads = maps_reads  # a checkpoint read through windows (store/mapped.py)
        self._inherited: Table | None = self._handle()
        self._table: Table | None = self._inherited if maps_reads else table
        self.key = uuid.uuid4().hex  # names the source to the batches, in this process only
        self._source = source  # kept alive with the loader (the registry is weak)
        register_source(self.key, source)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None, "_inherited": None, "_source": None}

    def table(self) -> Table:
        if self._table is None or self._pid != os.getpid():  # a new process: its own handle
            self._table = self._inherited or self._handle()
            self._pid = os.getpid()
        return self._table

    def _handle(self) -> Table:
        handle = Table._reader(self.table_path, self.table_root)
        if self.maps_reads and map_reads(handle):  # a checkpoint, whose files never change
            handle._array(WEIGHT)  # made here: a forked worker opens no zarr group (above)
        return handle

    def __call__(self, samples: list[Any]) -> EmbeddedBatch:
        if get_worker_info() is not None:
            exit_with_parent(self.trainer)  # NOTE [ Workers die with the training process ]
        if self.streamed:
            self._check_streamed(samples)
        fields = self.collate(samples)
        if not isinstance(fields, Mapping):
            raise TypeError(
                f"the collated batch must be a mapping with the ids under {self.ids_key!r}, got "
                f"a {type(fields).__name__}; give the loader a collate_fn that returns a dict"
            )
        if self.ids_key not in fields:
            raise TypeError(
                f"the collated batch has no ids under {self.ids_key!r} (its keys: "
                f"{list(fields)}); pass ids_key= the key of the token ids"
            )
        version = version_of(fields[self.ids_key])  # NOTE [ Ids edited in place ]
        ids = as_ids(fields[self.ids_key], self.num_rows, what="batch ids")
        unique_ids, inverse = unique_inverse(ids, self.num_rows)
        if self.cache is None:  # the owner reads the rows (lookup_step -1 says so)
            item = LookedUp(fields, unique_ids, inverse, -1, 0, None, -1, 0, 0)
            return EmbeddedBatch._looked_up(item, self.key, self.ids_key, version)
        defer = self.defer is not None and bool(self.defer["misses"][0])
        lookup_step = self.cache.applied_step  # before any row is read (invariant 4)
        rows, hit = self.cache.read(unique_ids)
        miss = np.flatnonzero(~hit)
        if self.owned is not None:  # the owners of the other rows send them (``shards.py``)
            lo, hi = self.owned
            missed = unique_ids[miss]
            miss = miss[(missed >= lo) & (missed < hi)]
        read, left = split_misses(self.cache, unique_ids, miss, defer)
        if len(read):
            rows[read] = self.table()._array(WEIGHT).read(unique_ids[read])  # the files as they are
        info = get_worker_info()
        placed = (
            self.ring.write(info.id, rows) if self.ring is not None and info is not None else None
        )
        item = LookedUp(
            fields=fields,
            unique_ids=unique_ids,
            inverse=inverse,
            slot=placed[0] if placed else -1,
            tag=placed[1] if placed else 0,
            rows=None if placed else rows,
            lookup_step=lookup_step,
            hits=int(hit.sum()),
            misses=len(miss),
            deferred=left,
        )
        return EmbeddedBatch._looked_up(item, self.key, self.ids_key, version)

    # NOTE [ An iterable dataset as it is ]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A map-style dataset is wrapped (``CheckedDataset``), to check each sample's ids naming its
    # index. An iterable dataset is given to the DataLoader as it is, because frameworks decide
    # from its type how to split it over processes: Accelerate (``prepare`` with
    # ``dispatch_batches=False``) gives each process a shard of its own of a Hugging Face
    # ``datasets.IterableDataset`` (``.shard()``: other files, when it has a file for each
    # process), and slices of each group of batches of any other. Wrapped, a Hugging Face
    # stream was split the second way: every process read other samples than it would have
    # without embedpipe, and nothing said so.
    # Its samples are checked here instead, as the collate receives them, each named by its
    # place in its batch and the process that collated it (a worker, or the training process).

    def _check_streamed(self, samples: Any) -> None:
        batch = samples if isinstance(samples, list) else [samples]  # batch_size=None: one
        info = get_worker_info()
        where = f"by worker {info.id}" if info is not None else "in the training process"
        names = (f"{n} of a batch collated {where}" for n in range(len(batch)))  # if needed
        check_samples(batch, names, self.ids_key, self.num_rows)


def split_misses(
    cache: SharedRows, ids: np.ndarray, miss: np.ndarray, defer: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """The misses (positions ``miss`` in ``ids``) the lookup reads from disk, and those it leaves
    to the owner (``LookedUp.deferred``; None: none): all of them while the owner reads the
    misses (``defer``), else the ones still cached, whose copy a write of the owner's overlapped
    (a step's rows put back, most often; NOTE [ Seqlock reads of the shared cache ]): the owner
    has them as the hand-off needs them. Measured with the whole table cached, 2 workers,
    training: 46-73 rows a batch were read from the table, then again at the hand-off, being
    newer than the lookup."""
    if defer:
        return miss[:0], miss
    cached = cache.slot_of[ids[miss]] >= 0
    return miss[~cached], miss[cached] if cached.any() else None


class CheckedDataset(Dataset):
    """The user's map-style dataset, with each sample's ids checked where the index is known.

    ``loader.dataset`` is this wrapper, so reading or setting an attribute it lacks reaches the
    user's dataset: a curriculum that sets ``loader.dataset.max_length`` reaches it, and
    Accelerate's ``set_epoch`` (which Trainer calls every epoch) finds the dataset's own. The
    wrapper's fields have names no dataset uses: a ``datasets.Dataset``'s ``num_rows``, a
    ``Subset``'s ``dataset``, read through it, are the user's. (An iterable dataset is not
    wrapped: NOTE [ An iterable dataset as it is ].)

    The DataLoader fetches a batch's samples through :meth:`__getitems__` (the user's own, if the
    dataset has one), which checks them together: one range check over the batch's ids costs
    what two per sample did (measured: 300 us a batch of 32 samples, against 30 us).
    """

    _OWN = frozenset({"_embedpipe_dataset", "_embedpipe_ids_key", "_embedpipe_num_rows"})

    def __init__(self, dataset: Any, ids_key: str, num_rows: int) -> None:
        self._embedpipe_dataset = dataset
        self._embedpipe_ids_key = ids_key
        self._embedpipe_num_rows = num_rows

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper itself lacks
        if name in self._OWN or name.startswith("__"):  # (unpickling: not yet set)
            raise AttributeError(name)
        return getattr(self._embedpipe_dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self._embedpipe_dataset, name, value)

    def __len__(self) -> int:  # the loader's len(), as the DataLoader's: the dataset's, or raises
        return len(self._embedpipe_dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return check_sample(
            self._embedpipe_dataset[index],
            self._embedpipe_ids_key,
            self._embedpipe_num_rows,
            f"sample {index}",
        )

    def __getitems__(self, indices: list[Any]) -> Any:
        getitems = getattr(self._embedpipe_dataset, "__getitems__", None)
        samples = (
            getitems(indices)
            if callable(getitems)
            else [self._embedpipe_dataset[i] for i in indices]
        )
        if isinstance(samples, list) and len(samples) == len(indices):
            check_samples(samples, indices, self._embedpipe_ids_key, self._embedpipe_num_rows)
        return samples  # anything else is checked as a batch, after the collate


def check_samples(samples: list[Any], indices: Iterable[Any], ids_key: str, num_rows: int) -> None:
    """Check every sample's ids as :func:`check_sample` does; when they are all integer tensors,
    with one range check over the batch, looking for the sample to name only if it fails."""
    # the fast path only returns early: anything it cannot check goes sample by sample (which
    # leaves samples that are no mappings, or lack the key, to the batch's check)
    ids = [s[ids_key] for s in samples if isinstance(s, Mapping) and ids_key in s]
    if (
        ids
        and len(ids) == len(samples)
        and all(
            isinstance(i, torch.Tensor) and i.dtype in _TENSOR_IDS and i.dim() == 1 and len(i)
            for i in ids
        )
    ):
        low, high = torch.aminmax(torch.cat(ids))
        if int(low) >= 0 and int(high) < num_rows:
            return
    for index, sample in zip(indices, samples):
        check_sample(sample, ids_key, num_rows, f"sample {index}")


_TENSOR_IDS = (torch.int64, torch.int32)


def check_sample(sample: Any, ids_key: str, num_rows: int, where: str) -> Any:
    """``sample`` unchanged, after checking its ids (when it is a mapping that has them)."""
    if isinstance(sample, Mapping) and ids_key in sample:
        ids = sample[ids_key]
        if (  # the common case, cheaply: an integer tensor in range
            isinstance(ids, torch.Tensor)
            and ids.dtype in (torch.int64, torch.int32)
            and ids.numel()
            and int(ids.min()) >= 0
            and int(ids.max()) < num_rows
        ):
            return sample
        try:
            as_ids(sample[ids_key], num_rows, what=f"{where}, {ids_key!r}")
        except IdOutOfRangeError as e:
            raise IdOutOfRangeError(f"{e}; fix or drop that sample") from None
    return sample
