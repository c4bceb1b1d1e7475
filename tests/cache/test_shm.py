"""Shared memory dies with the processes that use it, however they die, and crosses into
workers started with spawn as well as fork."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import embedpipe
from embedpipe.cache.shm import SharedBlock


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_owner_killed_while_its_cache_is_allocated_leaves_nothing_behind(tmp_path):
    # A 1.5 GB cache over a sparse table (no disk space): the owner is killed while it sets up.
    rows, dim = 1 << 22, 96
    embedpipe.Table.create(tmp_path / "big.zarr", rows, dim, init="zeros").close()
    script = textwrap.dedent(
        f"""
        import embedpipe
        print("allocating", flush=True)
        pipe = embedpipe.EmbeddingPipe({str(tmp_path / "big.zarr")!r}, cache_rows={rows},
                                       optimizer=embedpipe.optim.SGD(lr=0.1))
        print("allocated", flush=True)
        import time; time.sleep(60)
        """
    )
    before = _shm_entries()
    # Kill as soon as a segment shows in /dev/shm (torch's share_memory_ makes one, fills it,
    # and only then unlinks it), or after the delay: early in the set-up, or once it is done.
    for delay in (0.05, 0.3, 3.0):
        process = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
        )
        assert process.stdout.readline().strip() == "allocating"
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not (_shm_entries() - before):
            time.sleep(0.005)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        process.stdout.close()
        left = _left_behind(before)
        assert not left, f"shared-memory segments outlived their owner: {sorted(left)}"


def _left_behind(before: set[str], seconds: float = 5.0) -> set[str]:
    """The entries of /dev/shm found now beyond ``before`` that are still there after
    ``seconds``: none, unless one leaked (a killed process's leak never goes away). Another
    process's segment (pytest-xdist, a DataLoader elsewhere on the machine) is unlinked within
    moments; those made after this call are others' (the killed process makes no more). While
    other processes keep making short-lived ones, /dev/shm is never the same as ``before`` for
    long, but each of them goes."""
    left = _shm_entries() - before
    deadline = time.monotonic() + seconds
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left &= _shm_entries()
    return left


def _read_in_child(block, queue):
    block["a"][3] = 7.0  # written by the child, seen by the parent
    queue.put(float(block["b"].sum()))


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_a_block_is_shared_with_workers_started_either_way(method):
    block = SharedBlock({"a": ((5,), np.float32, 0), "b": ((2, 3), np.int64, 1)})
    context = mp.get_context(method)
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(block, queue))
    child.start()
    assert queue.get(timeout=60) == 6
    child.join(timeout=60)
    assert block["a"].tolist() == [0, 0, 0, 7, 0]
