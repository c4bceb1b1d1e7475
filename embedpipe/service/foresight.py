"""The lookahead policy's foresight with the table's owner in a process of its own.

NOTE [ Foresight in an owner process ]
The lookahead policy lives with the cache, in the owner process; what it foresees is the
training process's: its loader's sampler and dataset (``owner/lookahead.py``, NOTE [ Foresight
without side effects ] in ``foresee.py``). So the work splits where the data is:

- the training process forks the child that reads the ids of the batches ahead, from copies of
  the sampler's iterator and of the dataset, as with the owner in threads (the child dies with
  the training process), and hands its two pipes to the owner process as descriptors, with the
  loader's flag that has the workers leave their misses to the owner;
- the owner process runs the :class:`~embedpipe.owner.lookahead.Stream` on them: the window fed
  by the child, the reader thread that reads the misses of the batches in flight, the matching
  of each claimed batch to the batches in flight;
- each batch the DataLoader draws is told to the owner process (``drawn``, no reply), ahead of
  that batch's claim on the same connection, as the thread's ``Ahead.on_draw`` tells its stream;
  a claim of the stream's loader says so (``foreseen``), and its reply says whether the stream
  gave up, and why if its child failed (then the training process stops looking ahead and says
  so once, as a thread does).

The stream ends with its epoch (``end_stream``): the owner process stops it and closes its
copies of the pipes, and the training process ends and reaps the child.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..cache.shm import SharedBlock
from ..owner.batchorder import Ahead
from ..owner.foresee import BatchIds, IdsReader


class RemoteStream:
    """One epoch of a loader, foreseen for an owner process (see the NOTE): what the loader
    and the pipe's client see of the stream that runs there."""

    def __init__(self, client: Any, source: Any, number: int, reader: IdsReader, order: Ahead):
        self.client = client
        self.source = source  # the loader's PipeSource
        self.number = number  # how the owner process knows that loader
        self.reader = reader  # the child, ended at stop()
        self.order = order
        self.blind = False  # the stream gave up, as the owner process said at a claim
        self.failure: str | None = None  # the child's error, if it failed (the same)
        self.claiming = False  # the next claim is of one of this stream's batches
        self.stopped = False
        order.on_draw = self._drawn

    @classmethod
    def start(
        cls,
        client: Any,
        dataset: Any,
        ids_key: str,
        order: Ahead,
        source: Any,
        defer: SharedBlock | None,
    ) -> RemoteStream:
        """Fork the child (here: it copies this process's sampler and dataset), hand its pipes
        to the owner process, which starts the stream on them."""
        table = client.table
        ids_of = BatchIds(dataset, ids_key, client.padding_idx, table.num_rows)
        reader = IdsReader(order.inner, ids_of, first=order.drawn)
        try:
            number = client._source_number(source)
            fds = reader.hand_over()
            layout = None
            if defer is not None:
                fds += (defer.fd,)
                layout = {n: (shape, dt.str) for n, (shape, dt) in defer.layout.items()}
            message = {"op": "stream", "source": number, "first": order.drawn, "defer": layout}
            client._request(message, fds=fds)
        except BaseException:
            reader.close()
            raise
        finally:
            reader.handed_over()
        return cls(client, source, number, reader, order)

    def _drawn(self, number: int) -> None:
        if not self.stopped:
            self.client._request(
                {"op": "drawn", "source": self.number, "number": number}, reply=False
            )

    def claim(self, ids: Any) -> None:
        """The loader is about to claim one of this stream's batches: the owner process
        matches it to the batches in flight when the claim reaches it."""
        self.claiming = True

    def take_claim(self) -> bool:
        claiming, self.claiming = self.claiming, False
        return claiming

    @property
    def caught_up(self) -> bool:
        """As ``Stream.caught_up``, asked of the owner process (benchmarks and tests wait)."""
        (done,), _, _ = self.client._request({"op": "caught_up"})
        return done

    @property
    def finished(self) -> bool:
        return self.stopped or self.order.exhausted

    def stop(self) -> None:
        """Stop the stream in the owner process, then end the child. Once."""
        if self.stopped:
            return
        self.stopped = True
        self.order.on_draw = None
        try:
            if not self.client.closed:
                with contextlib.suppress(Exception):  # an owner gone: raised by the next call
                    self.client._request({"op": "end_stream", "source": self.number}, reply=False)
        finally:
            self.reader.close()
