"""Foreseeing the ids of the batches a loader will hand off next, for the lookahead policy.

A map-style dataset's order is its sampler's: ``batchorder.Foresight`` stands in the loader's
``batch_sampler`` place (the same batches, in the same order) and tells the :class:`Stream`
which batch the DataLoader dispatches to a worker, as it draws it. The ids of the batches after
it are read by a child forked at the epoch's first draw, from copies of the sampler's iterator
and of the dataset (``foresee.py``, NOTE [ Foresight without side effects ]): the training
process never calls the dataset nor draws the sampler before the DataLoader does, and no random
generator is drawn that would not be without lookahead. The stream hands each foreseen batch's
unique ids to the policy's window (``policy.py``, NOTE [ The lookahead window ]), at most
``window`` batches ahead of the last batch dispatched.

Foresight may be wrong (a dataset or sampler that draws at random): a claimed batch is matched to
the batches in flight by its ids, and each claim releases at least one of them, so wrong foresight
pins no row longer than its batch is in flight and grows no list. The pipe stops looking ahead (LFU
from then on), saying why once: with ``auto`` when most of the last :data:`JUDGED_BATCHES` claims
matched nothing foreseen, with any policy when the child fails or sends nothing in twice as many.
One stream owns the window at a time, the first loader iterated's (not an evaluation mid-epoch).

NOTE [ Misses read by the owner ]
With workers, ``prefetch_factor x num_workers`` batches are looked up before the first of them is
handed off, so a row that several of them use and the cache lacks would be read from disk by
each (measured: 1.2-1.5x the rows Belady's optimum reads, at 2-20% cache, 2 workers). So while a
stream runs, its loader's workers copy the cache's hits and leave the misses (a flag in shared
memory, ``PipeLoader._defer``); the reader thread reads the rows of each dispatched batch that
the cache lacks into a buffer, copying those an earlier batch in flight already read, and the
hand-off takes them from there (``reads.read_deferred``), or from the cache or the table if the
reader is late, then admits them as usual. Each row is read once for all the batches in flight,
and the reads run beside the loop, in a thread that mostly waits on the disk. A buffered row is
used only if no step changed it since it was read (its ``last_updated`` tick); the table has the
newest copy of every row the cache lacks (invariant 3). The buffers hold at most the batches in
flight. One thread reads for all the workers, so when it cannot keep up with the loop
(``Stream._keep_up``: a loop with no model to hide it), or when most rows of a batch it reads
come from the disk, not the page cache (a cold disk; the loader's later epochs start so), the
misses go back to the workers: their reads in parallel are what a cold disk needs, and the rows
batches in flight share are the popular ones, which the cache holds (cold disk, uniform ids,
10% cache: 0.7-0.8x lazy loading's batches/s reading all epoch, 0.9x handed back at once).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..cache.copies import Copy, from_copies
from ..cache.rowcache import RowCache
from ..cache.sharedrows import SharedRows
from ..cache.shm import SharedBlock
from ..store.layout import WEIGHT
from ..store.table import Table
from .batchorder import Ahead
from .foresee import IdsReader, can_fork, silent


class Owner(Protocol):
    """What foresight takes from the table's owner (``owner.py``, which makes the streams and
    imports this module): its lock and cache, the table, and the one stream it runs at a time."""

    lock: threading.Lock
    cache: RowCache
    shared: SharedRows
    table: Table
    padding_idx: int | None
    stream: Stream | None

    def start_stream(
        self, dataset: Any, ids_key: str, order: Ahead, source: Any, defer: SharedBlock | None
    ) -> Stream | None:
        """Foresee an epoch of a loader from ``order``'s first draw (None: foresight is off)."""

    def end_stream(self, stream: Stream) -> None:
        """``stream``'s epoch is over or left: stop it."""


#: Hand-offs over which the reader must have read at least half the batches' misses in time;
#: claims over which ``auto`` judges its foresight (it stops if most matched nothing foreseen).
KEEP_UP_BATCHES = JUDGED_BATCHES = 16
#: The share of a batch's misses read from the disk at which the reader hands them back.
COLD_SHARE = 0.5


class Stream:
    """One epoch of a loader, foreseen: a forked child reads the ids of the batches ahead
    (``foresee.IdsReader``), a receiver thread feeds them to the policy's window, and a reader
    thread reads the misses of the batches in flight (NOTE [ Misses read by the owner ])."""

    def __init__(
        self,
        owner: Owner,
        ids: IdsReader,
        first: int,
        source: Any,
        defer: SharedBlock | None = None,
        order: Ahead | None = None,
    ) -> None:
        """``ids``: the child reading the ids of the batches from number ``first`` (the next
        drawn); ``order``: the sampler's iterator as drawn here (owner process: :meth:`_drawn`)."""
        self.owner = owner
        self.source = source  # the loader's PipeSource: its hand-offs are this stream's batches
        self.policy = owner.cache.policy
        self.order = order
        #: the batches in the policy's window: (number, ids)
        self.foreseen: deque[tuple[int, np.ndarray]] = deque()
        #: foreseen batches dispatched and not claimed: (number, ids); each claim pops one or more
        self.in_flight_ids: deque[tuple[int, np.ndarray]] = deque()
        self.claimed = -1  # the last batch handed off (it starts at the epoch's first draw)
        #: rows read for dispatched batches whose workers left their misses to the owner:
        #: number -> (ids, rows, clock tick when read); ``ready``: the claimed batch's
        self.buffers: dict[int, Copy] = {}
        self.ready: Copy | None = None
        self.window = self.policy.window
        self.dispatched = first - 1  # the last batch the DataLoader drew (and dispatched)
        self.filled = first - 1  # the last dispatched batch whose misses were read
        self.filling: int | None = None  # the dispatched batch whose misses are being read
        self.first_received = self.last_received = -1  # the child's first batch, its latest
        self.started = time.monotonic()
        self.first_foreseen: int | None = None  # ... and of the first it sent in time
        self.ended, self.failure = False, None  # the child sent its last batch; its error
        #: per claim judged (foreseen in time, from ``judged_from``): it matched a foreseen one
        self.matched: deque[bool] = deque(maxlen=JUDGED_BATCHES)
        self.judged_from: int | None = None
        self.blind = False  # foresight kept missing (``auto``), or the child failed
        self.defer = defer
        #: per hand-off: its misses were read, when it began, how long it waited for the reader
        self._ready: deque[tuple[bool, float, float]] = deque(maxlen=KEEP_UP_BATCHES)
        self.handed_back, self.left_until = False, -1  # workers read misses after left_until
        self._table: Any = None
        self.wake = threading.Condition()
        self.stopped = False
        self.ids = ids
        self.ids.credit(self.window)
        if defer is not None:  # the workers leave their misses to the owner from now on ...
            self.handed_back = bool(defer["cold"][0])  # ... unless an epoch found the disk cold
            defer["misses"][0] = not self.handed_back
        if order is not None:
            order.on_draw = self._drawn
        with owner.lock:
            self.policy.restart()
        self.receiver = threading.Thread(
            target=self._receive, name="embedpipe-foresight", daemon=True
        )
        self.thread = threading.Thread(target=self._run, name="embedpipe-lookahead", daemon=True)
        self.receiver.start()
        self.thread.start()

    def _drawn(self, number: int) -> None:
        """The DataLoader dispatches batch ``number`` to a worker, whose lookup is that batch's
        use of its rows: the window moves past it, and its rows are held until it is claimed."""
        self.ids.credit(1)  # the child may read one batch further
        with self.owner.lock:
            self.dispatched = number
            while self.foreseen and self.foreseen[0][0] <= number:
                passed, ids = self.foreseen.popleft()
                self.policy.advance()
                self.policy.adjust_held(ids, 1)  # until its lookup is done
                self.in_flight_ids.append((passed, ids))
        with self.wake:
            self.wake.notify_all()  # a batch to fill, maybe

    def claim(self, ids: np.ndarray) -> None:
        """A batch of this stream's loader is being handed off, with unique ``ids``: find it among
        the batches in flight (the next in the DataLoader's order if it mostly shares its
        foreseen ids, else the first that does: a collate or a random sample may change a few),
        release it and every batch dispatched before it (one a framework skipped, say), and make
        its misses read ahead :attr:`ready` for the hand-off. A batch that matches none, or whose
        next in order was dispatched before foresight began, is taken to be that next: foresight
        that was wrong holds nothing longer than its batch is in flight, and a batch alike enough
        to another's ids (a small vocabulary) puts no later claim out of step."""
        with self.owner.lock:
            probe = ids[:: max(1, len(ids) // 64)]  # a sample: the test is about 64 ids
            following, in_flight, found = self.claimed + 1, self.in_flight_ids, None
            if in_flight and following >= in_flight[0][0]:  # else dispatched before foresight
                first = sorted(in_flight, key=lambda batch: batch[0] != following)  # it, then all
                found = next((n for n, f in first if np.isin(probe, f, True).mean() >= 0.5), None)
        began = time.monotonic()
        with self.wake:  # a read of its misses under way finishes first (not a later batch's)
            while found is not None and self.filling == found and not self.stopped:
                self.wake.wait()
        waited = time.monotonic() - began
        with self.owner.lock:  # (only this thread takes batches out of in_flight_ids)
            # the batch claimed: the one found, else the next in the DataLoader's order
            number = found if found is not None else self.claimed + 1
            if self.judged_from is None:  # the epoch's first prefetch races the child: not judged
                self.judged_from = self.dispatched + 1
            if self.first_received < 0 and number - self.judged_from >= 2 * JUDGED_BATCHES:
                self.failure = self.failure or silent(2 * JUDGED_BATCHES, self.started)
            if self.first_foreseen is not None:  # nor a batch dispatched before foresight began
                if number >= max(self.first_foreseen, self.judged_from):
                    self.matched.append(found is not None)
            elif self.last_received - self.first_received >= 2 * JUDGED_BATCHES:
                self.matched.append(False)  # the child never once got ahead: it cannot keep up
            while self.in_flight_ids and self.in_flight_ids[0][0] <= number:
                self.policy.adjust_held(self.in_flight_ids.popleft()[1], -1)
            self.ready = self.buffers.pop(number, None) if found is not None else None
            for done in [n for n in self.buffers if n < number]:
                del self.buffers[done]  # batches that were never handed off
            self.claimed = max(self.claimed, number)
            self._keep_up(self.ready is not None, began, waited)
            self.blind = self.failure is not None or self._gives_up()
        with self.wake:
            self.wake.notify_all()

    def _gives_up(self) -> bool:
        """``auto`` and most of the last :data:`JUDGED_BATCHES` claims matched nothing foreseen
        (the dataset's ids differ at each read, or the child cannot keep ahead)."""
        judged, gives_up = self.matched, getattr(self.policy, "gives_up", False)
        return gives_up and len(judged) == judged.maxlen and sum(judged) < len(judged) / 2

    def _keep_up(self, ready: bool, began: float, waited: float) -> None:
        """Hand the misses back if, over the last :data:`KEEP_UP_BATCHES` hand-offs, the loop
        waited for the reader a third of its time or found half the batches' misses unread."""
        if self.defer is None or self.handed_back:
            return
        self._ready.append((ready, began, waited))
        if len(self._ready) < self._ready.maxlen:
            return
        late, waited_all = sum(not r for r, _, _ in self._ready), sum(w for _, _, w in self._ready)
        if late > len(self._ready) / 2 or waited_all > (began - self._ready[0][1]) / 3:
            self._hand_back()

    def _hand_back(self, cold: bool = False) -> None:
        """The workers read their misses from their next lookup; the reader still reads those
        of the batches dispatched until the first hand-back (else their hand-offs would, one at
        a time). Under the owner's lock."""
        if self.defer is not None:
            self.defer["misses"][0] = 0
            self.defer["cold"][0] |= cold
        if not self.handed_back:
            self.left_until = self.dispatched
            self.handed_back = True

    def take(self, ids: np.ndarray, dim: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
        """For the hand-off of the batch just claimed: the rows of ``ids`` (its misses) that the
        reader read and no step changed since, as ``cache.from_copies`` gives them."""
        ready, self.ready = self.ready, None
        return from_copies([ready] if ready else [], ids, self.owner.cache.last_updated, dim, dtype)

    @property
    def caught_up(self) -> bool:
        """The child has sent every batch the window lets it read, and the reader thread has
        read the misses of every batch in flight (benchmarks and tests wait for this, so that
        rows read do not depend on how the machine schedules the child and the thread)."""
        foreseen = self.ended or self.last_received >= self.dispatched + self.window
        return foreseen and self.filling is None and self._next_fill() is None

    @property
    def finished(self) -> bool:
        """Stopped, or every batch drawn and claimed (a framework's loader never says it is
        done: the next epoch of any loader may take the window then)."""
        exhausted = self.order is None or self.order.exhausted
        return self.stopped or (exhausted and not self.in_flight_ids)

    def stop(self) -> None:
        """End the child and the threads, and forget the window (any thread but the stream's),
        once: a loader's own stop after the owner's must not clear another stream's window."""
        if self.stopped:
            return
        if self.defer is not None:
            self.defer["misses"][0] = 0
        self.ids.close()  # the receiver sees the end
        with self.wake:
            self.stopped = True
            self.wake.notify_all()
        with self.owner.lock:
            if self.owner.stream in (self, None):
                self.policy.restart()
            self.foreseen.clear()
            self.buffers.clear()
            while self.in_flight_ids:
                self.policy.adjust_held(self.in_flight_ids.popleft()[1], -1)
        for thread in (self.receiver, self.thread):
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        if not self.receiver.is_alive():
            self.ids.close_receiving()
        # no cycle through the order (Ahead.on_draw -> self -> order): without one the stream,
        # its reader's open chunk files and the loader's shared blocks go when the loop drops
        # them, not at the next full garbage collection (measured: +3 descriptors an epoch)
        if self.order is not None:
            self.order.on_draw = None

    # ------------------------------------------------------------------ the threads
    def _receive(self) -> None:
        """The receiver thread: the child's foreseen batches into the policy's window."""
        while True:
            got = self.ids.receive()
            if got is None:
                self.ended, self.failure = True, self.ids.failure
                return
            number, ids = got
            with self.owner.lock:
                if self.stopped:
                    return
                if self.first_received < 0:
                    self.first_received = number
                self.last_received = number
                if number > self.dispatched:  # else the DataLoader got there first
                    if self.first_foreseen is None:
                        self.first_foreseen = number
                    self.policy.foresee(ids)
                    self.foreseen.append((number, ids))

    def _run(self) -> None:
        """The reader thread: reads the misses of the batches in flight."""
        while True:
            with self.wake:
                while not self.stopped and (fill := self._next_fill()) is None:
                    self.wake.wait()
                if self.stopped:
                    return
            try:
                self._fill(*fill)
            except Exception:  # the worker or the hand-off reads them then; this just stops
                return

    def _next_fill(self) -> tuple[int, np.ndarray] | None:
        """The first dispatched, unclaimed batch whose misses its worker leaves to the owner and
        that are not read yet (after a hand-back: one dispatched before it)."""
        if self.defer is None:
            return None
        with self.owner.lock:
            for number, ids in self.in_flight_ids:  # a few batches: the ones in flight
                if self.handed_back and number > self.left_until:
                    return None
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
                reader = self._reader()
                waited = reader.rows_waited
                rows[todo] = reader.read(missing[todo])
                from_disk = reader.rows_waited - waited
                if reader.tells_page_cache and from_disk >= COLD_SHARE * todo.sum():
                    with self.owner.lock:  # most came from the disk: the next epochs too
                        self._hand_back(cold=True)
            with self.owner.lock:
                cache.count_read(int(todo.sum()))
                self.buffers[number] = (missing, rows, tick)
        finally:
            with self.wake:
                self.filling = None
                self.wake.notify_all()

    def _reader(self) -> Any:
        if self._table is None:  # its own handle: the owner's is used under the lock only,
            table = self.owner.table  # but it reads the chunks an owner process maps from there
            self._table = Table._reader(table.path, table.root)._array(WEIGHT)
            with self.owner.lock:
                self._table.mapped = getattr(table._array(WEIGHT), "mapped", None)
        return self._table


#: The policies that look ahead (with a window: ``make_policy``).
LOOKAHEAD = ("lookahead", "auto")


def start_stream(owner: Any, make: Callable[[], Any]) -> Any:
    """A loader's epoch whose order is known: ``make()``'s stream feeds the lookahead policy's
    window, unless another loader's epoch does, or foresight is off (then None). ``owner``: an
    :class:`~embedpipe.owner.owner.Owner`, or an owner process's client."""
    if owner.closed or owner.blind:
        return None
    if not can_fork():
        owner.look_blind("this platform has no fork() to read the batches ahead with")
        return None
    with owner.lock:
        if owner.stream is not None and not owner.stream.finished:
            return None
    if owner.stream is not None:
        owner.end_stream(owner.stream)
    try:
        stream = make()  # forks: not locked
    except OSError as e:  # fork refused (a pids limit, no memory): train on without it
        owner.look_blind(f"the foresight process could not start ({e.strerror or e})")
        return None
    with owner.lock:
        owner.stream = stream
    return stream


def look_blind(owner: Any, why: str) -> None:
    """Stop looking ahead for the rest of ``owner``'s pipe (LFU from here on); say why once."""
    if owner.blind:
        return
    owner.blind = True
    if owner.stream is not None:
        owner.end_stream(owner.stream)
    warnings.warn(
        f"embedpipe's lookahead policy stopped looking ahead: {why}; the cache runs as LFU "
        "from here on (training is unchanged; only rows read from disk can grow). Pass "
        "EmbeddingPipe(..., policy='lfu') to choose that from the start",
        RuntimeWarning,
        stacklevel=5,
    )
