"""The batch ring: per-worker slots, and an overwritten slot detected instead of served."""

import numpy as np
import torch

from embedpipe.ring import BatchRing


def test_rows_round_trip_and_overwrite_is_detected():
    ring = BatchRing(num_workers=2, depth=2, rows_per_slot=4, dim=3, dtype=torch.float32)
    a = np.ones((2, 3), np.float32)
    slot_a, tag_a = ring.write(1, a)
    assert 2 <= slot_a < 4  # worker 1's slots
    np.testing.assert_array_equal(ring.read(slot_a, tag_a, 2), a)
    ring.write(1, a * 2)
    ring.write(1, a * 3)  # back to slot_a: depth 2
    assert ring.read(slot_a, tag_a, 2) is None


def test_rows_that_do_not_fit_are_refused():
    ring = BatchRing(num_workers=1, depth=2, rows_per_slot=4, dim=3, dtype=torch.float32)
    assert ring.write(0, np.zeros((5, 3), np.float32)) is None
