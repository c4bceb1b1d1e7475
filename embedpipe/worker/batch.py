"""EmbeddedBatch: what the training loop receives from ``pipe.loader(...)``.

A read-only mapping of the user's collated fields plus ``"inputs_embeds"``. The (B, L, D)
embeddings are made where they are used, on the batch's device, from the unique rows::

    rows: (U, D) leaf, requires grad  --F.embedding(inverse: (B, L))-->  inputs_embeds: (B, L, D)

Embedding's backward sums the gradient of repeated ids, so the (U, D) gradient of the unique ids
arrives deduplicated on the device; a hook adds it to the table's pending gradient
(``gradient.py``).

NOTE [ Rows are final when the model first reads them ]
A batch goes through three moments, and frameworks separate them freely:

1. *looked up*, in a DataLoader worker: the fields, the unique ids, and the rows in a ring slot
   (this object, pickled back to the training process, "unclaimed");
2. *claimed*, in the training process, at the first ``next()`` that yields it from
   ``pipe.loader`` or, from a loader a framework rebuilt (Accelerate, Trainer's resume), at the
   first ``.to(device)`` or read of the rows: the rows are copied out of the ring and brought up
   to the steps applied so far (``Owner.hand_off``);
3. *read*: each ``batch["inputs_embeds"]`` (or ``batch.rows``). Here the rows are made final:
   the steps submitted since the claim (an optimizer step that ran while the batch waited one
   ahead in a prefetcher) are applied and the rows they changed are re-read
   (``Owner.refresh``); after ``pipe.load_checkpoint`` every row is.

So whatever a framework fetches ahead, the model sees the rows an ``nn.Embedding`` would give it
at that moment. A read after a later step (evaluating the same batch after training on it) is
made final again, as ``embedding(ids)`` would be. Iterating a batch yields the collated fields
only, so copying it field by field never reads the rows early. Each read makes a new
``(B, L, D)`` tensor from one leaf per version of the rows, so two forward passes over one batch
(R-Drop) are two graphs whose gradients add up, as with ``nn.Embedding``.

NOTE [ Ids edited in place ]
A loop may edit a batch's ids after it is handed out (masking tokens for MLM, word dropout):
``batch["input_ids"][mask] = mask_id``. ``nn.Embedding`` then embeds the edited ids, so the batch
does too: it keeps the ids tensor and its version counter as they were when its rows were looked
up (version 0 for a batch that crossed from a worker), and when the claim, ``.to(device)`` or a
read of the rows finds the counter moved and the ids different, the owner gathers the rows of
the new ids (``Owner.relookup``: the cache's or the table's newest, under the same waits as a
hand-off) and the batch's unique ids, inverse and rows become theirs, so the gradient goes to
the rows the model read. An edit costs one lookup in the training process; a batch never edited
costs a version check per read. Ids made under ``torch.inference_mode()`` have no version
counter (Lightning validates and predicts in it, and the workers it forks then make such
tensors too): their values are compared with the gathered ids at each read instead. A table
sharded over ranks refuses an edit (the other ranks would have to join the lookup): edit the
ids in the dataset or ``collate_fn`` there.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .looked_up import LookedUp

INPUTS_EMBEDS = "inputs_embeds"
#: The attribute of each ``inputs_embeds`` a batch makes: the ids it gathered, (B, L) when called
#: (NOTE [ What a model derives from input_ids ] in ``embedpipe/pipe/derived.py``).
GATHERED_IDS = "_embedpipe_ids"


def version_of(ids: Any) -> int:
    """The version counter of a batch's ids tensor (NOTE [ Ids edited in place ]); -1 for one
    made under ``torch.inference_mode()`` (Lightning's validation and prediction, and the
    workers it forks then), which has none: its values are compared with the gathered ids."""
    if not isinstance(ids, torch.Tensor):
        return 0
    return -1 if ids.is_inference() else ids._version


class _Gathered:
    """The ids a batch's ``inputs_embeds`` were gathered for, made only when asked for: on the
    host from the host's copies (no wait for the accelerator), then copied to ``device``."""

    def __init__(self, unique_ids: torch.Tensor, inverse: torch.Tensor, device: Any) -> None:
        self.unique_ids, self.inverse, self.device = unique_ids, inverse, torch.device(device)

    def __call__(self, on_device: bool = True) -> torch.Tensor:
        ids = self.unique_ids[self.inverse]
        if not on_device or self.device.type == "cpu":
            return ids
        if self.device.type == "cuda":  # from pinned memory: the copy does not wait either
            ids = ids.pin_memory()
        return ids.to(self.device, non_blocking=True)


def mark(tensor: torch.Tensor, name: str, value: Any) -> None:
    """Set attribute ``name`` of ``tensor``, and of its base if it is a view of all of it: a
    model's reshape of it (a multiple-choice model's ``view``) has that base, not ``tensor``."""
    base = tensor._base
    for marked in (tensor, base if base is not None and base.numel() == tensor.numel() else None):
        if marked is not None:
            setattr(marked, name, value)


def gathered_ids(embeds: Any, on_device: bool = True) -> torch.Tensor | None:
    """The (B, L) ids ``embeds`` were gathered for, if a batch of a pipe made them: on their
    device, or on the host (``on_device=False``). Also for a reshaped view of such a batch
    (a multiple-choice model views its (B, C, L, D) ``inputs_embeds`` as (B * C, L, D))."""
    if not isinstance(embeds, torch.Tensor):
        return None
    gathered = getattr(embeds, GATHERED_IDS, None)
    if gathered is not None:
        return gathered(on_device)
    base = embeds._base
    gathered = None if base is None else getattr(base, GATHERED_IDS, None)
    if gathered is None or not _reshaped(embeds, base):
        return None
    return gathered(on_device).reshape(embeds.shape[:-1])


def _reshaped(view: torch.Tensor, base: torch.Tensor) -> bool:
    """``view`` has ``base``'s rows in ``base``'s order: a reshape, not a slice or transpose."""
    return (
        view.numel() == base.numel()
        and view.shape[-1] == base.shape[-1]
        and view.is_contiguous()
        and base.is_contiguous()
        and view.data_ptr() == base.data_ptr()
    )


class Owner(Protocol):
    """What a claimed batch asks of the table's owner (``embedpipe/owner/owner.py``), in the
    training process: the owner sits in a layer above and hands itself down."""

    @property
    def trains_now(self) -> bool:
        """The table trains now: a read of the rows makes a leaf whose gradient goes here."""

    def on_grad(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """The gradient of the batch's unique rows, from one backward pass."""

    def refresh(self, batch: EmbeddedBatch) -> None:
        """Make the batch's rows final before the model first reads them."""

    def relookup(self, batch: EmbeddedBatch, ids: torch.Tensor) -> None:
        """The batch's ids were edited in place: gather the rows of the new ones."""

    def finish_embeds(self, embeds: torch.Tensor, ids: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The rows gathered for ``ids()`` as the model takes them: in its dtype, times its
        embedding's scale, through the hooks on its embedding."""


class Source(Protocol):
    """Where an unclaimed batch is claimed: the loader's side of the pipe (``loader.py``)."""

    def claim(self, item: LookedUp, pin: bool) -> EmbeddedBatch: ...


#: The sources of this process by key; a looked-up batch carries its source's key across.
_SOURCES: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register_source(key: str, source: Source) -> None:
    _SOURCES[key] = source


def _move(value: Any, device: torch.device | str, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        return {k: _move(v, device, non_blocking) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_move(v, device, non_blocking) for v in value)
    return value


class _GradHook:
    """Hands the rows' gradient to the owner and frees the leaf's ``.grad``. Holds no reference
    to the batch or the graph: a hook that did would make a reference cycle through the autograd
    graph, and every batch's (B, L, D) tensors would wait for the cyclic collector."""

    def __init__(self, unique_ids: torch.Tensor, owner: Owner) -> None:
        self.unique_ids = unique_ids
        self.owner = owner  # each backward pass that reaches the leaf calls this once

    def __call__(self, rows: torch.Tensor) -> None:
        grad, rows.grad = rows.grad, None
        self.owner.on_grad(self.unique_ids, grad)


class EmbeddedBatch(Mapping[str, Any]):
    """The collated fields plus ``inputs_embeds``; ``.to(device)`` moves the (U, D) rows, not (B, L, D).

    ``batch["inputs_embeds"]`` is read by key; iterating, ``len`` and ``dict(batch)`` see the
    collated fields only (see the NOTE).

    Attributes ``unique_ids`` (U,), ``inverse`` (shaped like the ids) and ``rows`` (U, D) are
    there for code that wants the compact form (e.g. a custom embedding layer). See the NOTE for
    when the rows are final.
    """

    def __init__(
        self,
        fields: Mapping[str, Any],
        unique_ids: torch.Tensor | None = None,
        inverse: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        owner: Owner | None = None,
        *,
        step: int = 0,
        tick: int = 0,
        generation: int = 0,
    ) -> None:
        if unique_ids is None or inverse is None or rows is None:
            raise TypeError(
                "an EmbeddedBatch cannot be rebuilt from its fields (Accelerate's "
                "DataLoaderDispatcher does this for iterable datasets): make it with pipe.loader "
                "and move it with .to(device); with Accelerate, pass "
                "DataLoaderConfiguration(dispatch_batches=False) or use a map-style dataset"
            )
        if INPUTS_EMBEDS in fields:
            raise KeyError(f"the collated batch already has a field {INPUTS_EMBEDS!r}; rename it")
        self.fields = fields
        self._item: LookedUp | None = None  # set while unclaimed
        self._source = ""
        self._pin = False
        self._claimed(unique_ids, inverse, rows, owner, step, tick, generation)

    def _claimed(
        self,
        unique_ids: torch.Tensor,
        inverse: torch.Tensor,
        rows: torch.Tensor,
        owner: Owner | None,
        step: int,
        tick: int,
        generation: int,
    ) -> None:
        self._unique_ids, self._inverse, self._rows = unique_ids, inverse, rows
        #: the host's copy of ``inverse``, for the ids an embeds carries (set by ``to()`` and
        #: ``_relooked`` when ``inverse`` is on an accelerator)
        self._inverse_host = inverse if inverse.device.type == "cpu" else None
        self._owner = owner
        self.step = step  # the rows hold every update of the table's steps up to this one
        self.tick = tick  # the same moment on the owner's cache clock (never goes back)
        self.generation = generation  # the owner's count of loaded snapshots at that moment
        self._leaf: torch.Tensor | None = None  # the rows as the gradient's leaf, at _leaf_tick
        self._leaf_tick = -1
        #: A sharded pipe: (step, generation) when the rows other ranks own were fetched.
        self.fetched = (-1, -1)
        self._ids_seen: tuple[str, Any, int] | None = None  # NOTE [ Ids edited in place ]

    def _watch_ids(self, key: str | None, version: int | None = None) -> None:
        """Note the ids field ``key`` as the rows were gathered for it, at ``version`` of its
        tensor (None: now): a later in-place change is seen by the version counter (NOTE [ Ids
        edited in place ])."""
        ids = self.fields.get(key) if key is not None and isinstance(self.fields, Mapping) else None
        if isinstance(ids, torch.Tensor):
            if version is None or ids.is_inference():  # (an inference tensor has none: -1)
                version = version_of(ids)
            self._ids_seen = (key, ids, version)

    def _ids_changed(self) -> torch.Tensor | None:
        """The ids field, if it was changed in place since the rows were gathered for it."""
        seen = self._ids_seen
        if seen is None:
            return None
        key, ids, version = seen
        if version >= 0 and ids._version == version:
            return None
        as_gathered = self._unique_ids.to(self._inverse.device)[self._inverse]
        if ids.shape == as_gathered.shape and torch.equal(ids.to(as_gathered.dtype), as_gathered):
            self._ids_seen = (key, ids, version_of(ids))  # written, but with the same ids
            return None
        return ids

    @classmethod
    def _handed_off(
        cls,
        item: LookedUp,
        rows: Any,
        owner: Owner,
        pin: bool,
        step: int,
        tick: int,
        generation: int,
    ) -> EmbeddedBatch:
        """The claimed batch of a worker's lookup, with its final ``rows`` (numpy, ``(U, D)``)."""
        tensor = torch.from_numpy(rows)
        return cls(
            item.fields,
            torch.from_numpy(item.unique_ids),
            torch.from_numpy(item.inverse),
            tensor.pin_memory() if pin else tensor,
            owner,
            step=step,
            tick=tick,
            generation=generation,
        )

    @classmethod
    def _looked_up(
        cls, item: LookedUp, source: str, ids_key: str | None = None, version: int = 0
    ) -> EmbeddedBatch:
        """A batch as a worker returns it: unclaimed (see the NOTE); its rows were looked up
        for the field ``ids_key`` at ``version`` of its tensor."""
        batch = cls.__new__(cls)
        batch.fields, batch._item, batch._source, batch._pin = item.fields, item, source, False
        batch._ids_key, batch._ids_version = ids_key, version
        return batch

    def __getstate__(self) -> dict[str, Any]:
        if self._item is None:
            raise TypeError("a claimed EmbeddedBatch cannot be pickled; pickle its fields")
        # the fields travel inside the item, once (as bytes: NOTE [ Fields travel as bytes ]
        # in worker/lookup.py)
        return {"_item": self._item, "_source": self._source, "_ids_key": self._ids_key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # unpickled tensors start at version 0, as the ids were when they were looked up
        self.__dict__.update(state, fields=state["_item"].fields, _pin=False, _ids_version=0)

    def _claim(self) -> EmbeddedBatch:
        """Claim an unclaimed batch in the training process (no-op once claimed)."""
        if self._item is None:
            return self
        source = _SOURCES.get(self._source)
        if source is None:
            raise RuntimeError(
                "this batch was looked up by an embedpipe loader that no longer exists in this "
                f"process (pid {os.getpid()}); use batches while their loader is alive"
            )
        item, self._item = self._item, None
        claimed = source.claim(item, pin=self._pin)
        self.fields = claimed.fields
        self._claimed(
            claimed._unique_ids,
            claimed._inverse,
            claimed._rows,
            claimed._owner,
            claimed.step,
            claimed.tick,
            claimed.generation,
        )
        self._watch_ids(self._ids_key, self._ids_version)
        self._follow_edits()  # ids edited before the claim (NOTE [ Ids edited in place ])
        return self

    @property
    def unique_ids(self) -> torch.Tensor:
        self._claim()._follow_edits()
        return self._unique_ids

    @property
    def inverse(self) -> torch.Tensor:
        self._claim()._follow_edits()
        return self._inverse

    def _follow_edits(self) -> None:
        if self._owner is not None and self._ids_seen is not None:
            edited = self._ids_changed()
            if edited is not None:
                self._owner.relookup(self, edited)  # raises: the edit is still seen next time
                key, ids, _ = self._ids_seen
                self._ids_seen = (key, ids, version_of(ids))

    @property
    def rows(self) -> torch.Tensor:
        """The unique rows (U, D), final (the NOTE's third moment). While the table trains (and
        grad is enabled), the leaf the gradient flows back to: a custom embedding layer may use
        ``F.embedding(batch.inverse, batch.rows)`` as ``inputs_embeds`` does."""
        self._claim()._finalize()
        owner = self._owner
        if owner is None or not owner.trains_now or not torch.is_grad_enabled():
            return self._rows
        if self._leaf is None or self._leaf_tick != self.tick:  # new rows, a new leaf
            rows = self._rows
            if rows.is_inference():  # refreshed under torch.inference_mode(): a normal copy
                with torch.inference_mode(False):
                    rows = rows.clone()
            self._leaf = rows.detach().requires_grad_()
            self._leaf.register_post_accumulate_grad_hook(_GradHook(self._unique_ids, owner))
            self._leaf_tick = self.tick
            gradient = getattr(owner, "gradient", None)  # (NOTE in owner/gradcheck.py)
            if gradient is not None:
                gradient.leaves += 1
        return self._leaf

    def _finalize(self) -> None:
        if self._owner is not None:
            self._follow_edits()
            self._owner.refresh(self)

    def _relooked(
        self, unique_ids: Any, inverse: Any, rows: Any, step: int, tick: int, generation: int
    ) -> None:
        """Owner: the ids were edited in place; these are the rows of the new ones (numpy)."""
        seen = self._ids_seen
        device = self._rows.device
        self._claimed(
            torch.from_numpy(unique_ids),
            torch.from_numpy(inverse).to(device),
            torch.from_numpy(rows).to(device),
            self._owner,
            step,
            tick,
            generation,
        )
        self._inverse_host = torch.from_numpy(inverse)
        self._ids_seen = seen

    def _refreshed(
        self, positions: torch.Tensor, fresh: torch.Tensor, step: int, tick: int, generation: int
    ) -> None:
        """Owner: the rows at ``positions`` changed since this batch's ``tick``; ``fresh`` holds them."""
        if len(positions):
            device = self._rows.device
            self._rows = self._rows.index_copy(0, positions.to(device), fresh.to(device))
        self.step, self.tick, self.generation = step, tick, generation

    def _fetched(
        self, positions: torch.Tensor, rows: torch.Tensor, step: int, generation: int
    ) -> None:
        """Owner of a sharded pipe: ``rows``, of the ids at ``positions``, from their owners."""
        if len(positions):
            device = self._rows.device
            self._rows = self._rows.index_copy(
                0, positions.to(device), rows.to(device, self._rows.dtype)
            )
            self._leaf = None  # new rows, a new leaf
        self.fetched = (step, generation)

    def __getitem__(self, key: str) -> Any:
        if key != INPUTS_EMBEDS:
            return self.fields[key]
        rows = self.rows  # first: follows an in-place edit of the ids (the NOTE)
        embeds = F.embedding(self._inverse, rows)  # (U, D) -> (B, L, D), a new graph each read
        gathered = _Gathered(self._unique_ids, self._inverse_host, self._inverse.device)
        # a model cast after offload, an embedding that scales its rows (Gemma, MBart...),
        # hooks on the model's embedding (NEFTune...)
        if self._owner is not None:
            embeds = self._owner.finish_embeds(embeds, gathered)
        mark(embeds, GATHERED_IDS, gathered)
        return embeds

    def __contains__(self, key: object) -> bool:
        return key == INPUTS_EMBEDS or key in self.fields

    def __iter__(self) -> Iterator[str]:
        """The collated fields only: ``inputs_embeds`` is read by its key, so code that copies a
        batch field by field (``dict(batch)``, ``**batch``, a prefetcher) never reads the rows
        before the model does."""
        yield from self.fields

    def __len__(self) -> int:
        return len(self.fields)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EmbeddedBatch:
        """The batch on ``device``; ``inputs_embeds`` is then made there (and made final there)."""
        self._claim()._follow_edits()  # ids edited before the move: the rows of the new ones
        moved = EmbeddedBatch(
            _move(self.fields, device, non_blocking),
            self._unique_ids,
            self._inverse.to(device, non_blocking=non_blocking),
            self._rows.to(device, non_blocking=non_blocking),
            self._owner,
            step=self.step,
            tick=self.tick,
            generation=self.generation,
        )
        moved.fetched = self.fetched
        moved._inverse_host = self._inverse_host
        if self._ids_seen is not None:
            moved._watch_ids(self._ids_seen[0])
        return moved

    def pin_memory(self) -> EmbeddedBatch:
        """Called by the DataLoader's pin-memory thread: pins the fields now (the rows are pinned
        when the batch is claimed, as they are copied out of the ring then)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        if self._item is None:
            return self  # claimed already: the rows were pinned then, if asked
        batch = EmbeddedBatch._looked_up(
            dataclasses.replace(self._item, fields=pin_memory(self.fields)),
            self._source,
            self._ids_key,
        )
        batch._pin = True
        return batch

    def __repr__(self) -> str:
        if self._item is not None:
            return f"EmbeddedBatch(keys={list(self)}, unique_ids={len(self._item.unique_ids)}, unclaimed)"
        return f"EmbeddedBatch(keys={list(self)}, unique_ids={len(self._unique_ids)}, device={self._rows.device})"
