"""Token ids at the boundary: one check, one clear error, int64 numpy inside."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import IdOutOfRangeError, InvalidIdsError


def as_ids(ids: Any, num_rows: int, what: str = "ids") -> np.ndarray:
    """Validate ``ids`` (list, numpy or torch, any shape) and return them as int64 numpy.

    Raises :class:`InvalidIdsError` for non-integer or ragged input and
    :class:`IdOutOfRangeError` naming the first id outside ``[0, num_rows)`` and its position.
    """
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    try:
        array = np.asarray(ids)
    except ValueError as e:  # numpy refuses ragged nested lists
        raise InvalidIdsError(
            f"{what} must be a rectangular integer array, got a ragged one ({e})"
        ) from None
    if array.dtype == object:
        raise InvalidIdsError(
            f"{what} must be a rectangular integer array, got a ragged one: {ids!r:.80}"
        )
    if array.size == 0:
        return array.astype(np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise InvalidIdsError(
            f"{what} must be integers, got dtype {array.dtype} (e.g. {array.flat[0]!r}); "
            "pass token ids as an int64 tensor or array"
        )
    array = array.astype(np.int64, copy=False)
    if array.min() >= 0 and array.max() < num_rows:  # two passes, no temporary arrays
        return array
    bad = (array < 0) | (array >= num_rows)
    position = np.unravel_index(int(np.argmax(bad)), array.shape)
    where = position[0] if len(position) == 1 else tuple(int(p) for p in position)
    value = int(array[position])
    raise IdOutOfRangeError(
        f"{what}: id {value} at position {where} is out of range for a table of {num_rows} rows "
        f"(valid ids are 0..{num_rows - 1}); check that the tokenizer matches the table"
    )


#: Below this many table rows per id, :func:`unique_inverse` marks ids in a table-sized array
#: (O(num_rows)) rather than sorting them (O(n log n)): measured 30 us against 120 us for
#: 4,096 ids of a 30k-row table, and even at 60 rows per id.
DENSE_ROWS_PER_ID = 32


def unique_inverse(ids: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(unique_ids, inverse)`` of checked ``ids`` (int64, in range): the sorted distinct ids
    (U,) int64, and the position in ``unique_ids`` of every id (int64, shaped like ``ids``), as
    ``np.unique(ids, return_inverse=True)`` gives them, faster for tables of up to
    ``DENSE_ROWS_PER_ID`` rows per id."""
    flat = ids.reshape(-1)
    if num_rows > DENSE_ROWS_PER_ID * max(len(flat), 1):
        unique_ids, inverse = np.unique(flat, return_inverse=True)
        return unique_ids, inverse.reshape(ids.shape)
    seen = np.zeros(num_rows, dtype=bool)
    seen[flat] = True
    unique_ids = np.flatnonzero(seen)
    position = np.empty(num_rows, dtype=np.int64)  # only the seen entries are ever read
    position[unique_ids] = np.arange(len(unique_ids))
    return unique_ids.astype(np.int64, copy=False), position[flat].reshape(ids.shape)
