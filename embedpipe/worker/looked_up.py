"""What a worker sends the owner for each batch: :class:`LookedUp`, and how its fields travel.

The collated fields, the unique ids and their inverse, and where the unique rows are (a ring
slot, or an array when they did not fit); never the (B, L, D) embeddings. An unclaimed
:class:`~embedpipe.worker.batch.EmbeddedBatch` carries one from the worker to the training
process, where the owner's hand-off claims it.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class LookedUp:
    """One batch on its way from a worker to the owner.

    ``fields``: the user's collated batch; ``unique_ids`` (U,) int64 sorted; ``inverse`` the
    position in ``unique_ids`` of every id, shaped like the ids. Both are numpy: torch would move
    every tensor to new shared memory and pass a file descriptor per batch (measured 4x fewer
    batches/s with two workers), numpy arrays travel as bytes. The rows are in ring ``slot``
    with ``tag``, or in ``rows`` when they did not fit; ``lookup_step`` the applied step when the
    lookup began; ``hits``/``misses`` counted over unique ids. ``deferred``: the positions of
    the misses this lookup did not read, because the owner reads them (NOTE [ Misses read by
    the owner ] in ``lookahead.py``); None when it read them all.
    """

    fields: Mapping[str, Any]
    unique_ids: np.ndarray
    inverse: np.ndarray
    slot: int
    tag: int
    rows: np.ndarray | None
    lookup_step: int
    hits: int
    misses: int
    deferred: np.ndarray | None = None  # positions of misses left for the owner to read

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a worker sending it), the fields' CPU tensors travel as bytes (NOTE [ Fields
        travel as bytes ]); the rest as it is."""
        rest = tuple(getattr(self, f.name) for f in dataclasses.fields(self)[1:])
        buffer = io.BytesIO()
        _FieldsPickler(buffer).dump(self.fields)
        return _received, (buffer.getvalue(), rest)


def _received(fields: bytes, rest: tuple[Any, ...]) -> LookedUp:
    return LookedUp(pickle.loads(fields), *rest)


# NOTE [ Fields travel as bytes ]
# A torch tensor pickled by the DataLoader's queue is moved to shared memory and its file
# descriptor passed to the main process, which connects back to the worker to receive it:
# measured about 1 ms of the main process's time per batch for the collated ids alone, more
# than the whole lookup's share of it. A batch's fields are small (32 x 128 ids are 32 KiB), so
# copying their bytes through the pipe costs a few microseconds instead: a CPU tensor is pickled
# as its numpy array (bfloat16 and other dtypes numpy lacks as an integer view of the same size)
# and unpickled as a tensor over it, with the same dtype, shape and values (made contiguous).
# Anything else, including tensors that need grad or live on a device, keeps torch's own way.
class _FieldsPickler(ForkingPickler):
    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.requires_grad
            and not obj.is_quantized
        ):
            obj = obj.resolve_conj().resolve_neg()
            try:
                return _tensor, (obj.numpy(), None)
            except TypeError:  # a dtype numpy lacks
                same_size = _INTEGER_VIEWS[obj.element_size()]
                return _tensor, (obj.view(same_size).numpy(), str(obj.dtype).removeprefix("torch."))
        return NotImplemented


_INTEGER_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor(array: np.ndarray, dtype: str | None) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if dtype is None else tensor.view(getattr(torch, dtype))
