"""Memory accounting: what a pipe of a given cache size costs, and what this process may use.

:func:`pipe_memory` adds up the host memory of a pipe from the shapes of the structures it
allocates (``sharedrows.py``, ``rowcache.py``, ``policy.py``, ``ring.py``);
:func:`available_memory` reads how much this process may still allocate (its cgroup's limit
and the kernel's ``MemAvailable``); :func:`warn_if_too_big` compares the two and warns before
the kernel's OOM killer acts (measured in the benchmark: a 20% cache under a 600 MB memory limit
was killed without a word).

The cgroup files are read, never written; on a system without them (macOS, a container without
a memory controller) only ``MemAvailable`` counts, and without that, nothing is known (None).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from . import policy as policies
from .ring import DEFAULT_RING_ROWS

#: A cgroup v1 "no limit" is the largest page-aligned int64 (9223372036854771712); above this
#: a limit means none.
_NO_LIMIT = 2**60
#: Size suffixes: SI ones are powers of 1000, IEC ones and single letters (as docker, ulimit) 1024.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


class MemoryBudgetWarning(RuntimeWarning):
    """A pipe (or its loader's ring) asks for more memory than this process has available."""


# NOTE [ A cache that fills past the memory ]
# The check at the pipe's making compares its arrays with the room left then. The cache's
# pages are taken as it fills, and meanwhile the DataLoader's workers, the lookahead's child and
# the model take their own: a 10% cache of a 3 GiB table fitted a 768 MiB cgroup when made and
# was killed by the kernel, with no word, as it filled (docs/benchmarks.md). So while the cache
# fills, the owner compares what it will still take (its shared block's pages not yet touched,
# and as large a share of its optimizer state) with the room left, every few hand-offs where
# the cache took pages since the last look, and warns once before the kernel kills the job. A
# cache that takes no more (every row its batches use is in it: a whole table cached) is not
# looked at again: a look reads 11 files (0.6 ms), 1.5% of such a training batch.


# ----------------------------------------------------------------------------- what a pipe costs
def pipe_memory(
    num_rows: int,
    dim: int,
    dtype: Any,
    cache_rows: int,
    *,
    state_arrays: int = 0,
    policy: str = "auto",
    num_workers: int = 0,
    prefetch_factor: int = 2,
    ring_rows: int | None = None,
) -> dict[str, int]:
    """Host bytes of an ``EmbeddingPipe`` over a ``num_rows x dim`` table of ``dtype``.

    ``cache_rows`` is clamped to the table, as the pipe clamps it; ``state_arrays``: the
    optimizer's state arrays (SGD 0, Adagrad 1, Adam 2); ``num_workers``, ``prefetch_factor`` and
    ``ring_rows`` as given to ``pipe.loader``. Returns bytes by part:

    - ``cache``: the cached rows (shared memory, ``cache_rows x dim x itemsize``);
    - ``state``: the optimizer state of the cached rows (owner memory, as much again per array);
    - ``slots``: per-slot bookkeeping (id, seqlock version, dirty/loaded/pinned flags, the
      policy's own per-slot arrays);
    - ``index``: per-table-row arrays (the shared ``slot_of``, ``last_updated``, the policy's)
      and the shared clock: paid whatever the cache size;
    - ``ring``: the workers' batch buffers (``num_workers x (prefetch_factor + 2)`` slots of
      ``ring_rows`` rows, default ``min(num_rows, 2048)``); 0 without workers;
    - ``total``: their sum.

    Not counted: the table's own handles and read buffers, a batch's rows while it is used, the
    copies the owner keeps of a training batch's rows and optimizer state for its step (the
    staged rows the cache lacks, and one batch's whole working copy: ``copies.py``), the
    writeback queue, the lookahead window's ids (``window`` batches of unique ids), and an owner
    process's own memory (an interpreter with torch; docs/tuning.md).
    """
    itemsize = np.dtype(dtype).itemsize
    cache_rows = min(int(cache_rows), int(num_rows))
    policy_class = type(policies.make_policy(policy, 0, 0))
    slot_bytes = 8 + 8 + 3  # slot_id, version (SharedRows); dirty, state_loaded, pinned (RowCache)
    row_bytes = 4 + 4  # slot_of (SharedRows), last_updated (RowCache)
    ring = 0
    if num_workers > 0:
        rows_per_slot = ring_rows or min(int(num_rows), DEFAULT_RING_ROWS)
        slots = num_workers * (prefetch_factor + 2)  # loader.py: one more than in flight, + one
        ring = slots * (rows_per_slot * dim * itemsize + 8)  # buffers and their tags
    parts = {
        "cache": cache_rows * dim * itemsize,
        "state": state_arrays * cache_rows * dim * itemsize,
        "slots": cache_rows * (slot_bytes + getattr(policy_class, "slot_bytes", 8)),
        "index": num_rows * (row_bytes + getattr(policy_class, "row_bytes", 4)) + 8,  # and clock
        "ring": ring,
    }
    return {**parts, "total": sum(parts.values())}


def fixed_memory(num_rows: int, dim: int, dtype: Any, **options: Any) -> int:
    """Bytes a pipe costs whatever its cache size (the index and the ring)."""
    return pipe_memory(num_rows, dim, dtype, 0, **options)["total"]


def largest_cache(budget: int, num_rows: int, dim: int, dtype: Any, **options: Any) -> int:
    """The most ``cache_rows`` whose :func:`pipe_memory` total fits in ``budget`` bytes
    (``num_rows`` if the whole table does); ``options`` as :func:`pipe_memory` takes them.

    Raises ValueError if not even an empty cache fits (the index and the ring).
    """
    fixed = fixed_memory(num_rows, dim, dtype, **options)
    if budget < fixed:
        workers = options.get("num_workers", 0)
        raise ValueError(
            f"a memory budget of {format_bytes(budget)} cannot hold even what a pipe over "
            f"{num_rows:,} rows costs at any cache size ({format_bytes(fixed)}: the per-row "
            f"index and the ring of {workers} workers); give it more memory or fewer workers"
        )
    per_row = pipe_memory(num_rows, dim, dtype, 1, **options)["total"] - fixed
    return min(int(num_rows), (budget - fixed) // per_row)


# ----------------------------------------------------------------------------- what there is
def available_memory() -> int | None:
    """Bytes this process can still allocate: the smallest of its memory cgroup's room (limit
    minus usage, at every level up to the root; v1 and v2) and the kernel's ``MemAvailable``.
    None when neither can be read.

    Usage counts the working set: the cgroup's inactive page cache is left out, since the kernel
    reclaims it before it kills anything (as ``docker stats`` and the kubelet count).
    """
    rooms = [room for room in (_cgroup_room(), _meminfo_available()) if room is not None]
    return min(rooms) if rooms else None


def stays_in_page_cache(table_bytes: int) -> bool:
    """Whether a table of ``table_bytes`` takes at most half the memory this process may still
    use, so that its rows, once read, are read from the page cache, not the disk (NOTE [ A
    frozen table that fits in memory ] in ``pipe/defaults.py``). False where that is not known."""
    room = available_memory()
    return room is not None and table_bytes <= room // 2


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def _cgroup_room() -> int | None:
    """The room left under this process's memory cgroup limits, or None if there are none."""
    rooms = [cgroup_room(mount, folder, version) for version, mount, folder in memory_cgroups()]
    rooms = [room for room in rooms if room is not None]
    return min(rooms) if rooms else None


def memory_cgroups() -> list[tuple[int, Path, Path]]:
    """(cgroup version, mount point, this process's folder) of each memory hierarchy mounted
    (v1's memory controller, v2's unified tree); empty where there are none."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for version, mount, root in _memory_mounts(mounts):
        path = _own_cgroup(groups, version)
        if path is not None:
            relative = path[len(root) :] if path.startswith(root) else ""  # outside: the mount
            found.append((version, Path(mount), Path(mount + relative.rstrip("/"))))
    return found


def _memory_mounts(mountinfo: list[str]) -> list[tuple[int, str, str]]:
    """(cgroup version, mount point, root inside the hierarchy) of the memory hierarchies."""
    found = []
    for line in mountinfo:
        before, _, after = line.partition(" - ")
        fields, kind = before.split(), after.split()
        if len(fields) < 5 or len(kind) < 3:
            continue
        root, mount = fields[3], fields[4]
        if kind[0] == "cgroup2":
            found.append((2, mount, root.rstrip("/")))
        elif kind[0] == "cgroup" and "memory" in kind[2].split(","):
            found.append((1, mount, root.rstrip("/")))
    return found


def _own_cgroup(groups: list[str], version: int) -> str | None:
    """This process's cgroup path in the v1 memory hierarchy or in the v2 one."""
    for line in groups:
        number, controllers, path = line.split(":", 2)
        if version == 2 and number == "0" and controllers == "":
            return path
        if version == 1 and "memory" in controllers.split(","):
            return path
    return None


def cgroup_room(mount: Path, folder: Path, version: int) -> int | None:
    """The least room (limit minus working set) over ``folder`` and its parents up to the
    hierarchy's ``mount``; None if no level has a limit."""
    limit_file, usage_file, inactive = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        if version == 1
        else ("memory.max", "memory.current", "inactive_file")
    )
    rooms = []
    while True:
        limit = _read_int(folder / limit_file)
        usage = _read_int(folder / usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            usage -= _stat(folder / "memory.stat").get(inactive, 0)
            rooms.append(max(0, limit - usage))
        if folder == mount or mount not in folder.parents:
            break
        folder = folder.parent
    return min(rooms) if rooms else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    pairs = (line.split() for line in lines)
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


# ----------------------------------------------------------------------------- warning, units
def warn_if_too_big(needed_bytes: int, what: str, *, stacklevel: int = 3) -> None:
    """Warn (:class:`MemoryBudgetWarning`) if ``what`` needs more than :func:`available_memory`.

    ``stacklevel`` 3 points at the caller of the function that calls this one (the user's
    ``EmbeddingPipe(...)``).
    """
    available = available_memory()
    if available is None or needed_bytes <= available:
        return
    warnings.warn(
        f"{what} needs {format_bytes(needed_bytes)} but this process has "
        f"{format_bytes(available)} of memory available (cgroup limit or free RAM): the kernel "
        "may kill it. Pass a smaller cache_rows; `embedpipe advise --trace ids.npy` finds the "
        "largest cache that fits and what it costs in rows read",
        MemoryBudgetWarning,
        stacklevel=stacklevel,
    )


def warn_if_fill_will_not_fit(unfilled_bytes: int, cache_rows: int) -> bool:
    """Warn (:class:`MemoryBudgetWarning`) if a cache still filling will take more memory than
    :func:`available_memory` leaves (NOTE [ A cache that fills past the memory ]). Returns
    whether to look again later: False once the cache is full or the warning given."""
    if unfilled_bytes <= 0:
        return False
    available = available_memory()
    if available is None:  # nothing to compare with here
        return False
    if unfilled_bytes <= available:
        return True
    warnings.warn(
        f"the cache of {cache_rows:,} rows is filling and will take "
        f"{format_bytes(unfilled_bytes)} more, but this process has {format_bytes(available)} "
        "of memory available (cgroup limit or free RAM; the DataLoader's workers and the rest "
        "of the job took the rest since the pipe was made): the kernel will kill the job if "
        "the cache fills. Pass a smaller cache_rows (`embedpipe advise --memory` finds the "
        "largest that fits; leave room for the processes) or give the job more memory",
        MemoryBudgetWarning,
        stacklevel=2,
    )
    return False


def parse_bytes(text: str) -> int:
    """``"512MB"``, ``"1.5GiB"``, ``"2g"``, ``"1000000"`` as bytes (see ``_UNITS``)."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size; write a number and a unit, as 512MB, "
            "1.5GiB or 2G (kB/MB/GB are powers of 1000, KiB/MiB/GiB and K/M/G of 1024)"
        )
    return int(float(found.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``n`` bytes for a person: ``"1.5 GiB"``, ``"312.0 MiB"``, ``"16 B"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
