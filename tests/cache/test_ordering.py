"""Memory ordering: where fences stand in the seqlock and the ring, how the mode is chosen for a
CPU, and training stays exact in each mode."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from embedpipe.cache import ordering, ring
from embedpipe.cache import sharedrows as cache
from embedpipe.cache.ring import BatchRing
from embedpipe.cache.sharedrows import SharedRows


@pytest.fixture
def trace(monkeypatch):
    """Records each fence and each access to the seqlock's arrays, in order."""
    events = []
    monkeypatch.setattr(cache, "fence", lambda: events.append("fence"))
    monkeypatch.setattr(ring, "fence", lambda: events.append("fence"))
    take_rows = cache.take_rows  # copies the rows with torch, not through the array's [ ]

    def recorded_take_rows(rows, index):
        events.append("read rows")
        return take_rows(rows, index)

    monkeypatch.setattr(cache, "take_rows", recorded_take_rows)
    return events


class Recorded(np.ndarray):
    """An array that logs reads and writes of itself to ``log`` as ``name``."""

    def __getitem__(self, key):
        self.log.append(f"read {self.name}")
        return np.ndarray.__getitem__(self, key)

    def __setitem__(self, key, value):
        self.log.append(f"write {self.name}")
        np.ndarray.__setitem__(self, key, value)


def _record(shared, names, log):
    for name in names:
        array = getattr(shared, name).view(Recorded)
        array.log, array.name = log, name
        setattr(shared, name, array)


def _between(events, first, fence_then):
    """True if every ``first`` event is followed by a fence before the next ``fence_then``."""
    i = events.index(first)
    j = events.index(fence_then, i)
    return "fence" in events[i:j]


def test_seqlock_reads_and_writes_are_fenced(trace):
    shared = SharedRows(10, 4, 3, np.float32)
    _record(shared, ("rows", "version"), trace)
    shared.put(np.array([0, 1]), np.array([5, 6]), np.ones((2, 3), np.float32))
    # owner: version odd | fence | rows | fence | version even
    assert _between(trace, "write version", "write rows")
    writes = [i for i, e in enumerate(trace) if e == "write version"]
    assert "fence" in trace[trace.index("write rows") : writes[-1]]
    trace.clear()
    shared.read(np.array([5, 6]))
    # worker: version | fence | rows | fence | version
    reads = [i for i, e in enumerate(trace) if e == "read version"]
    assert "fence" in trace[reads[0] : trace.index("read rows")]
    assert "fence" in trace[trace.index("read rows") : reads[-1]]


def test_the_clock_is_published_after_a_fence_and_read_before_one(trace):
    shared = SharedRows(10, 4, 3, np.float32)
    _record(shared, ("clock",), trace)
    shared.publish(3)
    assert trace == ["fence", "write clock"]
    trace.clear()
    assert shared.applied_step == 3
    assert trace == ["read clock", "fence"]


def test_ring_slots_are_fenced(trace):
    batch_ring = BatchRing(1, 2, 4, 3, np.float32)
    slot, tag = batch_ring.write(0, np.ones((2, 3), np.float32))
    assert trace.count("fence") == 2
    assert batch_ring.read(slot, tag, 2) is not None
    assert trace.count("fence") == 4


@pytest.mark.parametrize(
    ("machine", "libatomic", "mode"),
    [
        ("x86_64", True, "tso"),
        ("aarch64", True, "fence"),
        ("aarch64", False, "owner"),
        ("riscv64", False, "owner"),
    ],
)
def test_the_mode_follows_the_cpu(monkeypatch, machine, libatomic, mode):
    monkeypatch.setattr(ordering.platform, "machine", lambda: machine)
    monkeypatch.setattr(ordering, "_libatomic_fence", lambda: (lambda: None) if libatomic else None)
    assert ordering.choose_mode()[0] == mode


def test_the_libatomic_fence_runs_here():
    fence = ordering._libatomic_fence()
    if fence is None:
        pytest.skip("libatomic is not installed")
    fence()  # a real full barrier (mfence here, dmb ish on ARM)
    assert ordering.choose_mode("fence")[0] == "fence"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["fence", "owner"])
def test_training_is_exact_in_each_mode(tmp_path, mode):
    if mode == "fence" and ordering._libatomic_fence() is None:
        pytest.skip("libatomic is not installed")
    script = textwrap.dedent(
        f"""
        import torch, embedpipe
        from embedpipe.cache import ordering
        from tests.helpers import zipf_dataset, train_reference, train_offloaded
        assert ordering.MODE == {mode!r}, ordering.MODE
        data = zipf_dataset(12 * 8)
        reference, _, _ = train_reference(data, "adagrad", lr=0.5)
        table, _, stats, _ = train_offloaded(data, "adagrad", lr=0.5, path={str(tmp_path / "t.zarr")!r},
                                             cache_rows=50, num_workers=2, prefetch_factor=4)
        assert stats["steps"] == 12 and torch.equal(table, reference)
        print(stats)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "EMBEDPIPE_MEMORY_ORDER": mode},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    if mode == "owner":  # the workers read nothing shared: every row came through the owner
        assert "'refreshed': 0" in result.stdout and "'ring_overruns': 0" in result.stdout
