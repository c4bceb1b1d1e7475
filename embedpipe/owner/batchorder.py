"""The order of a loader's batches, as the DataLoader draws it: :class:`Foresight` stands in the
loader's ``batch_sampler`` place (the same batches, in the same order) and iterates through
:class:`Ahead`, which tells the owner's ``lookahead.Stream`` each batch the DataLoader draws.

NOTE [ A batch sampler the program holds ]
A DataLoader reads its batch sampler's ``sampler``, ``batch_size`` and ``drop_last`` at each
epoch, so a program that holds the ``BatchSampler`` it passed as ``batch_sampler=`` may change
them between epochs (a curriculum doubling the batch size, a sampler swapped in) and the next
epoch has them. A Foresight stands in that object's place and keeps none of its own: the three
are read from, and set on, the batch sampler it stands for (first copied, a pipe's loader trained
on the old batch size, silently). Set through the loader (``loader.batch_sampler.batch_size``,
or by a framework that replaces the sampler) they reach that object, as with a DataLoader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from torch.utils.data import BatchSampler

from ..cache.shm import SharedBlock


class StreamOwner(Protocol):
    """What a Foresight takes from the table's owner: the stream of an epoch, started and ended."""

    def start_stream(
        self, dataset: Any, ids_key: str, order: Ahead, source: Any, defer: SharedBlock | None
    ) -> Any:
        """Foresee an epoch of a loader from ``order``'s first draw (None: foresight is off)."""

    def end_stream(self, stream: Any) -> None:
        """``stream``'s epoch is over or left: stop it."""


def _its(name: str) -> property:
    """A setting of the batch sampler a :class:`Foresight` stands for, read and set there (NOTE
    [ A batch sampler the program holds ])."""
    return property(
        lambda self: getattr(self._inner, name),
        lambda self, value: setattr(self._inner, name, value),
    )


class Ahead:
    """The sampler's iterator as the DataLoader draws it: ``on_first(self)`` runs once the
    DataLoader has drawn the first batch (the stream starts only then: see :class:`Foresight`);
    ``on_draw(number)`` runs before the DataLoader gets batch ``number`` (to dispatch it to a
    worker): the stream moves its window past that batch there."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self.inner = inner
        self.drawn = 0  # batches the DataLoader has drawn
        self.on_first: Callable[[Ahead], None] | None = None
        self.on_draw: Callable[[int], None] | None = None
        self.exhausted = False  # the DataLoader has drawn every batch

    def __iter__(self) -> Ahead:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self.inner)
        except StopIteration:
            self.exhausted = True
            raise
        number = self.drawn
        self.drawn += 1
        if self.on_draw is not None:
            self.on_draw(number)
        if self.on_first is not None:
            first, self.on_first = self.on_first, None
            first(self)
        return item


class Foresight(BatchSampler):
    """The loader's batch sampler, the same batches in the same order, iterated through
    :class:`Ahead` with a ``lookahead.Stream`` foreseeing from the first batch the DataLoader draws.

    Being the loader's ``batch_sampler`` (a ``BatchSampler``, whose ``sampler`` a framework may
    replace), it serves the loaders frameworks build from it too: Accelerate's ``prepare`` and
    ``skip_first_batches`` (Trainer). Made as a ``BatchSampler`` (Lightning's) it is one."""

    sampler = _its("sampler")
    batch_size = _its("batch_size")
    drop_last = _its("drop_last")

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return BatchSampler(*args, **kwargs) if "batch_size" in kwargs else super().__new__(cls)

    def __init__(
        self,
        batch_sampler: BatchSampler,
        owner: StreamOwner,
        dataset: Any,
        ids_key: str,
        source: Any,
        defer: SharedBlock | None,
    ) -> None:
        # No BatchSampler.__init__: the settings are the batch sampler's, which has them (set
        # through the properties, they would be set on it again, and a Lightning hook's record
        # of attributes set would land on the program's object)
        self._inner = batch_sampler
        self._owner, self._dataset, self._ids_key = owner, dataset, ids_key
        self._source, self._defer = source, defer
        self._stream: Any = None  # a lookahead.Stream
        self._order: Ahead | None = None  # the iterator of the epoch it foresees

    def __iter__(self) -> Iterator[list[int]]:
        self.stop()  # a new epoch of this loader: its last one is over
        order = Ahead(super().__iter__())
        order.on_first = self._begin  # (no closure over order: torch drops one unused each epoch)
        return order

    def _begin(self, order: Ahead) -> None:
        """The DataLoader drew its first batch: foresight may go on from there. Not sooner: a
        sampler draws its order when first asked (``RandomSampler`` from torch's global
        generator, accelerate's ``SeedableRandomSampler`` from its epoch), so the fork's copy of
        the iterator then holds the order this epoch will really have."""
        self.stop()  # an epoch begun before this one's first draw (zip(loader, loader))
        self._order = order
        self._stream = self._owner.start_stream(
            self._dataset, self._ids_key, order, self._source, self._defer
        )

    def stop(self, order: Ahead | None = None) -> None:  # given ``order``: if still its epoch's
        if self._stream is not None and order in (None, self._order):
            self._owner.end_stream(self._stream)
            self._stream = None
