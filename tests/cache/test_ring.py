"""The batch ring: per-worker slots, and an overwritten slot detected instead of served."""

import numpy as np

from embedpipe.cache.ring import BatchRing


def test_rows_round_trip_and_overwrite_is_detected():
    ring = BatchRing(num_workers=2, depth=2, rows_per_slot=4, dim=3, dtype=np.float32)
    a = np.ones((2, 3), np.float32)
    slot_a, tag_a = ring.write(1, a)
    assert 2 <= slot_a < 4  # worker 1's slots
    np.testing.assert_array_equal(ring.read(slot_a, tag_a, 2), a)
    ring.write(1, a * 2)
    ring.write(1, a * 3)  # back to slot_a: depth 2
    assert ring.read(slot_a, tag_a, 2) is None


def test_rows_that_do_not_fit_are_refused():
    ring = BatchRing(num_workers=1, depth=2, rows_per_slot=4, dim=3, dtype=np.float32)
    assert ring.write(0, np.zeros((5, 3), np.float32)) is None


def test_two_writers_of_a_slot_never_share_tags():
    # Two iterators of one loader: two worker processes write worker 0's slots in turn.
    ring = BatchRing(num_workers=1, depth=2, rows_per_slot=4, dim=3, dtype=np.float32)
    slot, tag = ring.write(0, np.ones((1, 3), np.float32))
    ring._pid = -1  # the next write comes from a new process, with its own tag series
    slot2, tag2 = ring.write(0, np.zeros((1, 3), np.float32))
    assert slot == slot2 and tag != tag2
    assert ring.read(slot, tag, 1) is None  # overwritten by the other writer: detected
