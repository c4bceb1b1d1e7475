"""The transfer block beside an owner process's connection (NOTE [ Rows and gradients through
shared memory ]): a gradient slot is written again only once a reply said its step is computed,
and anything that does not fit goes through the socket."""

from __future__ import annotations

import os

import numpy as np
import torch

from embedpipe.service.transfer import SLOTS, Transfer


def test_a_gradient_slot_is_reused_only_after_a_reply_says_its_step_is_computed():
    sender = Transfer.make(4, np.float32)
    owner = Transfer.adopt(sender.layout(), _dup(sender))
    grads = {s: torch.full((3, 4), float(s)) for s in range(1, 6)}
    assert [sender.put_gradient(s, 0, grads[s]) for s in (1, 2)] == [1 % SLOTS, 2 % SLOTS]
    assert sender.put_gradient(3, 0, grads[3]) == -1  # step 1 not said to be computed: sent
    sender.replied(1, 0)
    assert sender.put_gradient(3, 0, grads[3]) == 3 % SLOTS
    assert torch.equal(owner.gradient(3 % SLOTS, 3), grads[3])  # the owner sees it in place
    assert torch.equal(owner.gradient(2 % SLOTS, 3), grads[2])  # the other slot is untouched
    assert sender.put_gradient(4, 0, grads[4]) == -1  # step 2: not yet
    assert sender.put_gradient(4, 1, grads[4]) == 4 % SLOTS  # a load in between drained it


def test_what_does_not_fit_is_sent():
    sender = Transfer.make(4, np.float32)
    too_many = sender.rows + 1
    assert sender.put_gradient(1, 0, torch.zeros(too_many, 4)) == -1
    assert sender.put_reply(np.zeros((too_many, 4), np.float32)) == -1
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert sender.put_reply(rows) == 3
    np.testing.assert_array_equal(sender.take_reply(3), rows)


def test_reply_rows_picked_into_the_block_and_taken_into_their_places():
    sender = Transfer.make(4, np.float32)
    rows = np.arange(20, dtype=np.float32).reshape(5, 4)
    picked = np.array([4, 1, 3])
    assert sender.put_reply(rows, picked) == 3
    into = np.full((6, 4), -1, np.float32)
    places = np.array([0, 2, 5])
    assert sender.take_reply(3, [places], into) is into
    np.testing.assert_array_equal(into[places], rows[picked])
    assert (np.delete(into, places, axis=0) == -1).all()


def test_wide_rows_get_fewer_rows_a_block():
    assert Transfer.make(1 << 16, np.float32).rows * (1 << 16) * 4 <= 64 << 20


def _dup(transfer: Transfer) -> int:
    return os.dup(transfer.block.fd)
