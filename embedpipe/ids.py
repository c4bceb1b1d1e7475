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
    bad = (array < 0) | (array >= num_rows)
    if bad.any():
        position = np.unravel_index(int(np.argmax(bad)), array.shape)
        where = position[0] if len(position) == 1 else tuple(int(p) for p in position)
        value = int(array[position])
        raise IdOutOfRangeError(
            f"{what}: id {value} at position {where} is out of range for a table of {num_rows} rows "
            f"(valid ids are 0..{num_rows - 1}); check that the tokenizer matches the table"
        )
    return array


def unique_inverse(ids: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(unique_ids, inverse)`` of checked ``ids``: the sorted distinct ids (U,) int64, and the
    position in ``unique_ids`` of every id, shaped like ``ids``."""
    unique_ids, inverse = np.unique(ids, return_inverse=True)
    return unique_ids, inverse.reshape(ids.shape)
