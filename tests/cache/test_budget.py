"""Memory accounting against the real structures, and the memory available under a real cgroup."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest

from embedpipe.cache import budget
from embedpipe.cache.budget import (
    MemoryBudgetWarning,
    available_memory,
    format_bytes,
    largest_cache,
    parse_bytes,
    pipe_memory,
    stays_in_page_cache,
    warn_if_too_big,
)
from embedpipe.cache.policy import POLICIES, make_policy
from embedpipe.cache.ring import DEFAULT_RING_ROWS, BatchRing
from embedpipe.cache.rowcache import RowCache
from embedpipe.cache.sharedrows import SharedRows


def arrays_of(obj: object) -> list[np.ndarray]:
    return [v for v in vars(obj).values() if isinstance(v, np.ndarray)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pipe_memory_is_what_the_real_structures_allocate(policy, dtype):
    num_rows, cache_rows, dim, state = 5000, 300, 24, ("exp_avg", "exp_avg_sq")
    shared = SharedRows(num_rows, cache_rows, dim, dtype)
    cache = RowCache(
        shared, make_policy(policy, cache_rows, num_rows), fetch=None, store=None, state=state
    )
    ring = BatchRing(3, 5 + 2, DEFAULT_RING_ROWS, dim, dtype)  # loader.py: prefetch_factor + 2
    got = pipe_memory(
        num_rows, dim, dtype, cache_rows, state_arrays=2, policy=policy, num_workers=3,
        prefetch_factor=5,
    )  # fmt: skip

    everything = [*(shared.block[name] for name in shared.block.layout), *arrays_of(cache)]
    everything += [*cache.state.values(), *arrays_of(cache.policy)]
    by_length = {cache_rows: 0, num_rows: 0}
    for array in everything:
        if array.ndim == 1 and len(array) in by_length:  # per slot, per table row
            by_length[len(array)] += array.nbytes
    assert got["cache"] == shared.rows.nbytes
    assert got["state"] == sum(a.nbytes for a in cache.state.values())
    assert got["slots"] == by_length[cache_rows]
    assert got["index"] == by_length[num_rows] + shared.clock.nbytes
    assert got["ring"] == sum(ring.block[name].nbytes for name in ring.block.layout)
    assert got["total"] == sum(v for k, v in got.items() if k != "total")


def test_pipe_memory_clamps_and_counts_no_ring_without_workers():
    small = pipe_memory(100, 8, "float32", 10**6)
    assert small["cache"] == 100 * 8 * 4 and small["ring"] == 0
    ring = pipe_memory(100, 8, "float32", 0, num_workers=1)["ring"]
    assert ring == (2 + 2) * (100 * 8 * 4 + 8)  # ring_rows: at most the table
    assert pipe_memory(100, 8, "float32", 0, num_workers=1, ring_rows=7)["ring"] == 4 * (7 * 32 + 8)


def test_largest_cache_fits_and_one_more_row_does_not():
    options = dict(state_arrays=1, num_workers=2)
    fixed = pipe_memory(30522, 128, "float32", 0, **options)["total"]
    for budget_bytes in (fixed + 1, fixed + 10**6, 50 * 10**6):
        c = largest_cache(budget_bytes, 30522, 128, "float32", **options)
        assert pipe_memory(30522, 128, "float32", c, **options)["total"] <= budget_bytes
        if c < 30522:
            assert pipe_memory(30522, 128, "float32", c + 1, **options)["total"] > budget_bytes
    assert largest_cache(fixed, 30522, 128, "float32", **options) == 0
    with pytest.raises(ValueError, match="cannot hold even what a pipe over 30,522 rows costs"):
        largest_cache(fixed - 1, 30522, 128, "float32", **options)
    assert largest_cache(10**12, 30522, 128, "float32", **options) == 30522


def test_parse_and_format_bytes():
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("2g") == 2 * 2**30 and parse_bytes(" 64 KiB ") == 2**16
    assert parse_bytes("1000") == 1000
    for bad in ("12XB", "", "MB", "-5MB", "1e9"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    assert format_bytes(3 * 2**29) == "1.5 GiB" and format_bytes(16) == "16 B"


def test_a_table_stays_in_the_page_cache_where_it_takes_at_most_half_the_memory_left(
    monkeypatch,
):
    # (the real function: conftest's fixture replaces the module's, not this name)
    monkeypatch.setattr(budget, "available_memory", lambda: 1000)
    assert stays_in_page_cache(500) and not stays_in_page_cache(501)
    monkeypatch.setattr(budget, "available_memory", lambda: None)
    assert not stays_in_page_cache(1)  # not known: as for a table larger than memory


def test_available_memory_is_at_most_what_the_kernel_says():
    available = available_memory()
    meminfo = budget._meminfo_available()
    if meminfo is None:
        pytest.skip("no /proc/meminfo here")
    assert available is not None and 0 < available <= meminfo


def test_cgroup_v2_files_with_a_limit_above(tmp_path):
    """A v2 tree as the kernel lays it out: the tighter limit of the parent counts, ``max`` is
    no limit, and inactive page cache is not counted as used."""
    parent, child = tmp_path / "job", tmp_path / "job" / "step"
    child.mkdir(parents=True)
    (parent / "memory.max").write_text("1000000\n")
    (parent / "memory.current").write_text("600000\n")
    (parent / "memory.stat").write_text("anon 500000\ninactive_file 100000\n")
    (child / "memory.max").write_text("max\n")
    (child / "memory.current").write_text("300000\n")
    assert budget.cgroup_room(tmp_path, child, 2) == 1000000 - 500000
    (child / "memory.max").write_text("350000\n")
    assert budget.cgroup_room(tmp_path, child, 2) == 50000
    assert budget.cgroup_room(tmp_path, tmp_path, 2) is None  # no files: no limit


def test_warn_if_too_big_names_the_bytes_and_the_remedy():
    available = available_memory()
    if available is None:
        pytest.skip("no memory figure on this system")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_too_big(1, "a one-byte cache")  # fits: no warning
    with pytest.warns(MemoryBudgetWarning) as caught:
        warn_if_too_big(available + 2**40, "a cache of 9,999 rows")
    message = str(caught[0].message)
    assert "a cache of 9,999 rows needs" in message and format_bytes(available + 2**40) in message
    assert "cache_rows" in message and "embedpipe advise" in message


CHILD = """
import warnings
from embedpipe.cache.budget import available_memory, warn_if_too_big, MemoryBudgetWarning
print(available_memory())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    warn_if_too_big(2**30, "a 1 GiB cache")
    warn_if_too_big(10 * 2**20, "a 10 MiB cache")
print(len(caught), caught[0].category.__name__, caught[0].message)
"""


@pytest.fixture
def memory_cgroup():
    """A fresh v1 memory cgroup of 512 MiB (importing torch takes about 240), inside this process's own, removed afterwards."""
    own = [(mount, folder) for version, mount, folder in budget.memory_cgroups() if version == 1]
    if not own or not (own[0][1] / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller here")
    folder = own[0][1] / f"embedpipe-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
        (folder / "memory.limit_in_bytes").write_text(str(512 * 2**20))
    except OSError as e:
        if folder.exists():
            folder.rmdir()
        pytest.skip(f"cannot make a memory cgroup here ({e}); needs root and a writable cgroupfs")
    yield folder
    folder.rmdir()  # the child has exited: the cgroup is empty


@pytest.mark.slow
def test_a_process_under_a_memory_cgroup_sees_its_limit(memory_cgroup: Path):
    enter = f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$0" -c "$1"'
    result = subprocess.run(
        ["sh", "-c", enter, sys.executable, CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    available = int(first)
    assert 0 < available < 512 * 2**20  # the limit, less what the child already uses
    count, kind, message = second.split(" ", 2)
    assert (count, kind) == ("1", "MemoryBudgetWarning")  # 1 GiB does not fit, 10 MiB does
    assert message.startswith("a 1 GiB cache needs 1.0 GiB but this process has")
