"""Reading the ids of the batches a loader will hand off next, for the lookahead policy.

A map-style dataset's order is its sampler's: :class:`Ahead` stands between the DataLoader and
the sampler's iterator, so a reader thread can draw batches of indices before the DataLoader
dispatches them, and the DataLoader then gets those same batches, in the same order. The reader
(:class:`Stream`) fetches each batch's samples from the dataset, keeps their ids (nothing else)
and hands the batch's unique ids to the policy's window (``policy.py``, NOTE [ The lookahead
window ]), at most ``window`` batches ahead of the last batch the DataLoader dispatched.

What it costs: each sample is fetched twice, once here for its ids and once by a worker, so a
dataset whose ``__getitem__`` is expensive (tokenizing on the fly) pays for it; pass
``EmbeddingPipe(..., lookahead=0)`` there. Only the ids are kept: memory is ``window`` batches of
unique ids. The policy only decides what is cached: a wrong guess (a collate that changes ids, a
sample that fails) costs rows read, never a wrong row, and a reader that fails just stops.

One stream owns the window at a time: the first loader iterated. Another loader iterated while it
runs (an evaluation loop in the middle of an epoch) has no lookahead; its batches are handed off
through the same cache and do not move the window.

NOTE [ Misses read by the owner ]
With workers, ``prefetch_factor x num_workers`` batches are looked up before the first of them is
handed off, so a row that several of them use and the cache lacks would be read from disk by
each (measured: 1.2-1.5x the rows Belady's optimum reads, at 2-20% cache, 2 workers). So while a
stream runs, its loader's workers copy the cache's hits and leave the misses (a flag in shared
memory, ``PipeLoader._defer``); the reader thread reads the rows of each dispatched batch that
the cache lacks into a buffer, copying those an earlier batch in flight already read, and the
hand-off takes them from there (``Owner._read_deferred``), or from the cache or the table if the
reader is late, then admits them as usual. Each row is read once for all the batches in flight,
and the reads run beside the loop, in a thread that mostly waits on the disk. A buffered row is
used only if no step changed it since it was read (its ``last_updated`` tick); the table has the
newest copy of every row the cache lacks (invariant 3). The buffers hold at most the batches in
flight. One thread reads for all the workers, so when it cannot keep up with the loop (a cold
disk, a loop with no model to hide it) the stream hands the misses back to the workers
(``Stream._keep_up``): reading in parallel beats reading each row once there.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import BatchSampler

from .cache import Copy, from_copies
from .shm import SharedBlock
from .table import WEIGHT, Table

if TYPE_CHECKING:
    from .owner import Owner


#: Hand-offs over which the reader must have read at least half the batches' misses in time.
KEEP_UP_BATCHES = 16


class Ahead:
    """The sampler's iterator, drawn from by the DataLoader and, ahead of it, by the reader.

    ``on_first()`` runs once the DataLoader has drawn the first batch (the reader starts only
    then: see :class:`Foresight`); ``on_draw(number)`` runs before the DataLoader gets batch
    ``number`` (to dispatch it to a worker): the stream moves its window past that batch there.
    """

    def __init__(self, inner: Iterator[Any], taken: int) -> None:
        self.inner = inner
        self.taken = taken  # batches drawn from ``inner`` so far (numbers of the stream)
        self.drawn = taken  # batches the DataLoader has drawn
        self.buffer: deque[Any] = deque()  # drawn by the reader, not yet by the DataLoader
        self.lock = threading.Lock()
        self.on_first: Callable[[], None] | None = None
        self.on_draw: Callable[[int], None] | None = None
        self.exhausted = False  # the DataLoader has drawn every batch

    def __iter__(self) -> Ahead:
        return self

    def __next__(self) -> Any:
        with self.lock:
            if self.buffer:
                item = self.buffer.popleft()
            else:
                try:
                    item = next(self.inner)
                except StopIteration:
                    self.exhausted = True
                    raise
                self.taken += 1
            number = self.drawn
            self.drawn += 1
        if self.on_draw is not None:
            self.on_draw(number)
        if self.on_first is not None:
            first, self.on_first = self.on_first, None
            first()
        return item

    def peek(self) -> tuple[int, Any]:
        """The next batch the DataLoader will draw, and its number; StopIteration at the end."""
        with self.lock:
            item = next(self.inner)
            self.taken += 1
            self.buffer.append(item)
            return self.taken - 1, item


class Foresight(BatchSampler):
    """The loader's batch sampler, the same batches in the same order, iterated through
    :class:`Ahead` with a :class:`Stream` reading ahead when the window is free (from the first
    batch the DataLoader draws on).

    Being the loader's ``batch_sampler`` (a ``BatchSampler``, whose ``sampler`` a framework may
    replace), it also serves the loaders that frameworks build from it: Accelerate's
    ``prepare`` and ``skip_first_batches``, and with them Trainer.
    """

    def __init__(
        self,
        batch_sampler: BatchSampler,
        owner: Owner,
        dataset: Any,
        ids_key: str,
        source: Any,
        defer: SharedBlock | None,
    ) -> None:
        super().__init__(batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last)
        self._owner, self._dataset, self._ids_key = owner, dataset, ids_key
        self._source, self._defer = source, defer
        self._stream: Stream | None = None

    def __iter__(self) -> Iterator[list[int]]:
        self.stop()  # a new epoch of this loader: its last one is over
        order = Ahead(super().__iter__(), 0)
        order.on_first = lambda: self._begin(order)
        return order

    def _begin(self, order: Ahead) -> None:
        """The DataLoader drew its first batch: the reader may go on from there. Not sooner: a
        sampler draws its order when first asked (``RandomSampler`` from torch's global
        generator, accelerate's ``SeedableRandomSampler`` from its epoch, which it counts up
        when exhausted), and torch makes an iterator it never draws from before the one it
        uses; so the sampler sees the calls it would without lookahead, in the same order, only
        the later ones sooner."""
        self._stream = self._owner.start_stream(
            self._dataset, self._ids_key, order, self._source, self._defer
        )

    def stop(self) -> None:
        if self._stream is not None:
            self._owner.end_stream(self._stream)
            self._stream = None


class Stream:
    """One epoch of a loader, foreseen: a reader thread feeds the policy's window and reads the
    misses of the batches in flight (NOTE [ Misses read by the owner ])."""

    def __init__(
        self,
        owner: Owner,
        dataset: Any,
        ids_key: str,
        order: Ahead,
        source: Any,
        defer: SharedBlock | None = None,
    ) -> None:
        self.owner = owner
        self.source = source  # the loader's PipeSource: its hand-offs are this stream's batches
        self.policy = owner.cache.policy
        self.dataset = dataset
        self.ids_key = ids_key
        self.order = order
        self.padding = owner.padding_idx
        self.num_rows = owner.table.num_rows
        #: the batches in the policy's window: (number, ids)
        self.foreseen: deque[tuple[int, np.ndarray]] = deque()
        self.in_flight_ids: deque[tuple[int, np.ndarray]] = deque()  # dispatched, not claimed
        self.claimed = order.drawn - 1
        #: rows read for dispatched batches whose workers left their misses to the owner:
        #: number -> (ids, rows, clock tick when read); ``ready``: the claimed batch's
        self.buffers: dict[int, Copy] = {}
        self.ready: Copy | None = None
        self.window = self.policy.window
        self.dispatched = order.drawn - 1  # the last batch the DataLoader drew (and dispatched)
        self.filled = order.drawn - 1  # the last dispatched batch whose misses were read
        self.filling: int | None = None  # the dispatched batch whose misses are being read
        self.defer = defer
        if defer is not None:  # the workers leave their misses to the owner from now on
            defer["misses"][0] = 1
        #: per hand-off: its misses were read, when it began, how long it waited for the reader
        self._ready: deque[tuple[bool, float, float]] = deque(maxlen=KEEP_UP_BATCHES)
        self.handed_back = False  # the reader could not keep up: the workers read misses again
        order.on_draw = self._drawn
        self._table: Any = None
        self.wake = threading.Condition()
        self.stopped = False
        self.policy.restart()
        self.thread = threading.Thread(target=self._run, name="embedpipe-lookahead", daemon=True)
        self.thread.start()

    def _drawn(self, number: int) -> None:
        """The DataLoader dispatches batch ``number`` to a worker, whose lookup is that batch's
        use of its rows: the window moves past it, and its rows are held until it is claimed."""
        with self.wake:
            self.dispatched = number
            self.wake.notify_all()  # the reader may go further ahead
        with self.owner.lock:
            while self.foreseen and self.foreseen[0][0] <= number:
                passed, ids = self.foreseen.popleft()
                self.policy.advance()
                self.policy.adjust_held(ids, 1)  # until its lookup is done
                self.in_flight_ids.append((passed, ids))

    def claim(self, ids: np.ndarray) -> None:
        """A batch of this stream's loader is being handed off, with unique ``ids``: find it among
        the batches in flight (the first whose foreseen ids it mostly shares: a collate may add
        or change a few), release it and every batch dispatched before it (one a framework
        skipped, say), and make its misses read ahead :attr:`ready` for the hand-off."""
        began = time.monotonic()
        with self.wake:  # a read of its misses under way finishes first
            while self.filling is not None and not self.stopped:
                self.wake.wait()
        waited = time.monotonic() - began
        with self.owner.lock:
            probe = ids[:: max(1, len(ids) // 64)]  # a sample: the test is about 64 ids
            found = next(
                (
                    n
                    for n, (_, had) in enumerate(self.in_flight_ids)
                    if np.isin(probe, had, assume_unique=True).mean() >= 0.5
                ),
                None,
            )
            if found is None:  # not foreseen (the reader is behind), or not this loader's order
                self.ready = None
                self._keep_up(False, began, waited)
                return
            for _ in range(found + 1):
                number, had = self.in_flight_ids.popleft()
                self.policy.adjust_held(had, -1)
            for done in [n for n in self.buffers if n < number]:
                del self.buffers[done]  # batches that were never handed off
            self.ready = self.buffers.pop(number, None)
            self.claimed = number
            self._keep_up(self.ready is not None, began, waited)
        with self.wake:
            self.wake.notify_all()

    def _keep_up(self, ready: bool, began: float, waited: float) -> None:
        """Hand the misses back to the workers if the reader does not keep up with the loop:
        over the last :data:`KEEP_UP_BATCHES` hand-offs, the loop waited for the reader more
        than a third of its time, or found fewer than half the batches' misses read (it then
        reads them itself). One thread's reads then pace the loop where the workers read in
        parallel (measured on a cold disk, 10% cache, uniform ids: 37-40 batches/s with the
        owner reading, 58-60 after handing back, 62-64 with the workers from the start). The
        rows read go up again where batches in flight share rows; the time goes down."""
        if self.defer is None or self.handed_back:
            return
        self._ready.append((ready, began, waited))
        if len(self._ready) < self._ready.maxlen:
            return
        elapsed = began - self._ready[0][1]
        late = sum(1 for r, _, _ in self._ready if not r)
        if late > len(self._ready) / 2 or sum(w for _, _, w in self._ready) > elapsed / 3:
            self.defer["misses"][0] = 0
            self.handed_back = True

    def take(self, ids: np.ndarray, dim: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
        """For the hand-off of the batch just claimed: the rows of ``ids`` (its misses) that the
        reader read and no step changed since, as ``cache.from_copies`` gives them."""
        ready, self.ready = self.ready, None
        return from_copies([ready] if ready else [], ids, self.owner.cache.last_updated, dim, dtype)

    @property
    def finished(self) -> bool:
        """Stopped, or every batch drawn and claimed (a framework's loader never says it is
        done: the next epoch of any loader may take the window then)."""
        return self.stopped or (self.order.exhausted and not self.in_flight_ids)

    def stop(self) -> None:
        if self.defer is not None:
            self.defer["misses"][0] = 0
        with self.wake:
            self.stopped = True
            self.wake.notify_all()
        with self.owner.lock:
            self.policy.restart()
            self.foreseen.clear()
            self.buffers.clear()
            while self.in_flight_ids:
                self.policy.adjust_held(self.in_flight_ids.popleft()[1], -1)

    # ------------------------------------------------------------------ the reader thread
    def _run(self) -> None:
        peeked: tuple[int, Any] | None = None
        while True:
            if peeked is None:
                try:
                    peeked = self.order.peek()
                except StopIteration:
                    peeked = (-1, None)  # the end: fill what is left
            with self.wake:
                while not self.stopped and not self._due(peeked[0]):
                    self.wake.wait()
                if self.stopped:
                    return
            fill = self._next_fill()
            try:
                if fill is not None:
                    self._fill(*fill)
                    continue
                number, indices = peeked
                peeked = None
                if number <= self.dispatched:
                    continue  # the DataLoader got there first
                ids = self._ids(indices)
            except Exception:  # the worker reports a bad sample, loudly; here it just stops
                return
            with self.owner.lock:
                if self.stopped:
                    return
                if number > self.dispatched:
                    self.policy.foresee(ids)
                    self.foreseen.append((number, ids))

    def _due(self, number: int) -> bool:
        """Work to do: a batch in flight to fill, or the peeked batch ``number`` within the window."""
        if self._next_fill() is not None:
            return True
        return 0 <= number <= self.dispatched + self.window

    def _next_fill(self) -> tuple[int, np.ndarray] | None:
        """The first dispatched, unclaimed batch whose misses its worker leaves to the owner and
        that are not read yet."""
        if self.defer is None or self.handed_back:
            return None  # (batches dispatched before a hand-back: their hand-offs read them)
        for number, ids in self.in_flight_ids:  # a few batches: the ones in flight
            if number > max(self.filled, self.claimed):
                return number, ids
        return None

    def _fill(self, number: int, ids: np.ndarray) -> None:
        """Read the rows of dispatched batch ``number`` that its worker left (the cache's
        misses) into a buffer its hand-off takes (:meth:`claim`); rows an earlier batch in
        flight has in its buffer are copied from there, not read again."""
        with self.wake:
            if number <= self.claimed:
                return
            self.filling = self.filled = number
        try:
            with self.owner.lock:
                if self.stopped:
                    return
                missing = ids[self.owner.shared.slot_of[ids] < 0]
                tick = self.owner.cache.clock
                earlier = list(self.buffers.values())
            table, cache = self.owner.table, self.owner.cache
            found, rows = from_copies(earlier, missing, cache.last_updated, table.dim, table.dtype)
            todo = ~found
            if todo.any():
                rows[todo] = self._reader().read(missing[todo])
            with self.owner.lock:
                cache.counts["rows_read"] += int(todo.sum())
                self.buffers[number] = (missing, rows, tick)
        finally:
            with self.wake:
                self.filling = None
                self.wake.notify_all()

    def _reader(self) -> Any:
        if self._table is None:  # its own handle: the owner's is used under the lock only
            table = self.owner.table
            self._table = Table._reader(table.path, table.root)._array(WEIGHT)
        return self._table

    def _ids(self, indices: list[int]) -> np.ndarray:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        parts = []
        for sample in samples:
            if not isinstance(sample, Mapping):
                raise TypeError("samples without ids")
            parts.append(np.asarray(sample[self.ids_key]).reshape(-1))
        if self.padding is not None:
            parts.append(np.array([self.padding]))
        ids = np.unique(np.concatenate(parts).astype(np.int64, copy=False))
        return ids[(ids >= 0) & (ids < self.num_rows)]
