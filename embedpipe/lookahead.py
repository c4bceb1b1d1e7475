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
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .table import WEIGHT, Table

if TYPE_CHECKING:
    from .owner import Owner


#: Batches after the next one to be dispatched whose rows are prefetched too: slack for a
#: reader thread that runs late.
PREFETCH_AHEAD = 2


class Ahead:
    """The sampler's iterator, drawn from by the DataLoader and, ahead of it, by the reader.

    ``on_draw(number)`` runs before the DataLoader gets batch ``number`` (to dispatch it to a
    worker): the stream finishes or drops its prefetch of that batch there.
    """

    def __init__(self, inner: Iterator[Any], taken: int) -> None:
        self.inner = inner
        self.taken = taken  # batches drawn from ``inner`` so far (numbers of the stream)
        self.drawn = taken  # batches the DataLoader has drawn
        self.buffer: deque[Any] = deque()  # drawn by the reader, not yet by the DataLoader
        self.lock = threading.Lock()
        self.on_draw: Callable[[int], None] | None = None

    def __iter__(self) -> Ahead:
        return self

    def __next__(self) -> Any:
        with self.lock:
            if self.buffer:
                item = self.buffer.popleft()
            else:
                item = next(self.inner)
                self.taken += 1
            number = self.drawn
            self.drawn += 1
        if self.on_draw is not None:
            self.on_draw(number)
        return item

    def peek(self) -> tuple[int, Any]:
        """The next batch the DataLoader will draw, and its number; StopIteration at the end."""
        with self.lock:
            item = next(self.inner)
            self.taken += 1
            self.buffer.append(item)
            return self.taken - 1, item


class Stream:
    """One epoch of a loader, foreseen: a reader thread feeds the policy's window."""

    def __init__(
        self,
        owner: Owner,
        dataset: Any,
        ids_key: str,
        order: Ahead,
        batched: bool,
        in_flight: int,
    ) -> None:
        self.owner = owner
        self.policy = owner.cache.policy
        self.dataset = dataset
        self.ids_key = ids_key
        self.order = order
        self.batched = batched
        self.padding = owner.padding_idx
        self.num_rows = owner.table.num_rows
        self.foreseen: deque[int] = deque()  # numbers of the batches in the policy's window
        self.ids_of: dict[int, np.ndarray] = {}  # their ids
        self.in_flight_ids: deque[tuple[int, np.ndarray]] = deque()  # dispatched, not claimed
        self.window = self.policy.window
        self.in_flight = in_flight
        self.prefetched = -1  # the last batch prefetched
        self.dispatched = order.drawn - 1  # the last batch the DataLoader drew (and dispatched)
        self.prefetching: int | None = None  # the batch whose rows are being read
        order.on_draw = self._drawn
        self._table: Any = None
        self.wake = threading.Condition()
        self.stopped = False
        self.policy.restart()
        self.thread = threading.Thread(target=self._run, name="embedpipe-lookahead", daemon=True)
        self.thread.start()

    def _drawn(self, number: int) -> None:
        """The DataLoader dispatches batch ``number`` to a worker, whose lookup is that batch's
        use of its rows: the window moves past it. A prefetch of its rows still reading
        finishes first (else the worker would read them too); none starts after."""
        with self.wake:
            self.dispatched = number
            self.wake.notify_all()  # the reader may go further ahead
            while self.prefetching is not None and self.prefetching <= number and not self.stopped:
                self.wake.wait()
        with self.owner.lock:
            while self.foreseen and self.foreseen[0] <= number:
                passed = self.foreseen.popleft()
                ids = self.ids_of.pop(passed)
                self.policy.advance()
                self.policy.held[ids] += 1  # until its lookup is done
                self.in_flight_ids.append((passed, ids))

    def claim(self, number: int) -> None:
        """The loop claims batch ``number``: its lookup is done, its rows need not stay."""
        with self.owner.lock:
            while self.in_flight_ids and self.in_flight_ids[0][0] <= number:
                self.policy.held[self.in_flight_ids.popleft()[1]] -= 1

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify_all()
        with self.owner.lock:
            self.policy.restart()
            self.foreseen.clear()
            self.ids_of.clear()
            while self.in_flight_ids:
                self.policy.held[self.in_flight_ids.popleft()[1]] -= 1

    # ------------------------------------------------------------------ the reader thread
    def _run(self) -> None:
        peeked: tuple[int, Any] | None = None
        while True:
            if peeked is None:
                try:
                    peeked = self.order.peek()
                except StopIteration:
                    peeked = (-1, None)  # the end: prefetch what is left
            with self.wake:
                while not self.stopped and not self._due(peeked[0]):
                    self.wake.wait()
                if self.stopped:
                    return
            fetch = self._next_prefetch()
            try:
                if fetch is not None:
                    self._prefetch(fetch)
                    continue
                number, indices = peeked
                peeked = None
                if number <= self.dispatched:
                    continue  # the DataLoader got there first
                ids = self._ids(indices if self.batched else [indices])
            except Exception:  # the worker reports a bad sample, loudly; here it just stops
                return
            with self.owner.lock:
                if self.stopped:
                    return
                if number > self.dispatched:
                    self.policy.foresee(ids)
                    self.foreseen.append(number)
                    self.ids_of[number] = ids

    def _due(self, number: int) -> bool:
        """Work to do: a batch to prefetch, or the peeked batch ``number`` within the window."""
        if self._next_prefetch() is not None:
            return True
        return 0 <= number <= self.dispatched + self.window

    def _next_prefetch(self) -> int | None:
        """The next batch whose rows to cache before a worker looks it up: the first one not
        dispatched yet, and up to :data:`PREFETCH_AHEAD` after it."""
        if not self.in_flight:
            return None  # no workers: each lookup runs after the hand-off before it
        first = self.dispatched + 1
        number = max(self.prefetched + 1, first)
        return number if number <= first + PREFETCH_AHEAD and number in self.ids_of else None

    def _prefetch(self, number: int) -> None:
        """Read the rows of batch ``number`` that the cache lacks and would admit, then cache
        them (``RowCache.prefetch``); rows a step changed meanwhile are left out."""
        with self.wake:
            if number <= self.dispatched:
                return  # too late: its worker reads them
            self.prefetching = self.prefetched = number
        try:
            with self.owner.lock:
                ids = self.ids_of.get(number)
                if ids is None:
                    return
                wanted, tick = self.owner.cache.worth_prefetching(ids)
            if len(wanted):
                rows = self._reader().read(wanted)
                with self.owner.lock:
                    if not self.stopped:
                        self.owner.cache.prefetch(wanted, rows, tick)
        finally:
            with self.wake:
                self.prefetching = None
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
