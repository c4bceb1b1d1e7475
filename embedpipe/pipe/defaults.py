"""What ``"auto"`` means for a pipe outside a process group: its owner (a thread of the training
process or a process of its own) and, for a frozen pipe, whether its policy looks ahead."""

from __future__ import annotations

from typing import Any

from ..cache import budget
from ..owner.lookahead import LOOKAHEAD
from ..store.layout import WEIGHT
from ..store.rowstore import RawRows
from ..store.table import Table


def window(table: Table, policy: str, optimizer: Any, lookahead: int) -> int:
    """The batches ``policy`` sees ahead: ``lookahead``, or 0 (LFU) for a frozen ``"auto"`` pipe
    whose misses come from the page cache (NOTE [ A frozen table that fits in memory ])."""
    return 0 if policy == "auto" and optimizer is None and _in_memory(table) else lookahead


def maps_reads(table: Table, optimizer: Any) -> bool:
    """Whether a frozen pipe's lookups read the checkpoint they read through read-only windows
    (NOTE [ A frozen table that fits in memory ]; ``store/mapped.py``)."""
    return optimizer is None and _in_memory(table)


def _in_memory(table: Table) -> bool:
    """A local, uncompressed table (a miss is one ``pread``) that stays in the page cache."""
    if not isinstance(table._array(WEIGHT), RawRows):
        return False
    return budget.stays_in_page_cache(table.num_rows * table.dim * table.dtype.itemsize)


def owner(num_rows: int, cache_rows: int, optimizer: Any, policy: str, lookahead: int) -> str:
    """``owner="auto"`` (NOTE [ The default owner ]): a process where the owner has work beside
    the loop. A frozen pipe only reads, and has work only where it looks ahead."""
    looks_ahead = policy in LOOKAHEAD and lookahead > 0
    has_work = optimizer is not None or (cache_rows > 0 and looks_ahead)
    return "process" if has_work and cache_rows < num_rows else "thread"


# NOTE [ The default owner ]
# ms a batch beside a simulated accelerator step (T ms with the GIL released, 2 workers, D = 768,
# Adagrad: docs/service.md), owner thread / process: 5% cache, T = 10: 42.8 / 31.0; T = 20:
# 48-61 / 39-45; 0 workers: 41-42 / 32; frozen at 10%: 25 / 18-20 looking ahead, 15.0 / 17-17.6
# with LFU (T = 10, 2026-12-07); the whole table cached, T = 10: 19-19.6 / 20.4-22; T = 20:
# 29-32 / 32-34. With a cache smaller than the table, the owner's work (misses, admission,
# evictions and their writes, the step) takes the training process's GIL from the model; in a
# process it runs beside it. A frozen pipe that does not look ahead only reads its misses and
# admits them, which a thread does faster than a round trip to a process. With the whole table
# cached it has little to do, and the round trips cost more. Under a process group "auto" is a
# thread: each rank owns a shard (docs/scale-out.md). An owner process takes ~1.3 s to start the
# first time (an interpreter imports torch), 20-50 ms after (``service/zygote.py``). A frozen
# pipe given a service's address runs an owner process of its own (it needs no service).


# NOTE [ A frozen table that fits in memory ]
# The lookahead policy trades CPU for rows read: a forked child reads every sample a second time
# to foresee the batches' ids, one thread reads the misses of the batches in flight, and each
# batch dispatched, claimed and foreseen rescores its rows. Where a miss is read from the disk,
# that pays (rows read at Belady's optimum, up to 1.5x fewer than LFU). Where the table stays in
# the page cache, a miss is a copy of 1 KiB, and a frozen pipe has nothing else to do per batch:
# measured (D = 256, 10% cache, 2 workers, the table in the page cache), LFU ran 1.5-1.7x the
# batches a second of lookahead, with 28% more rows read (page-cache copies); 1.2x with no
# workers; 1.15-1.45x beside a 5 ms model step. A training pipe is not changed: its owner process
# hides the lookahead's work, and fewer misses are fewer rows written back. So a frozen pipe's
# ``policy="auto"`` is LFU when the table is local and uncompressed (a miss is one ``pread``; a
# compressed or remote chunk is decoded whole) and takes at most half the memory available when
# the pipe is made, and looks ahead otherwise (a table larger than memory: the small-device case).
# Such a pipe's lookups also read the checkpoint through read-only windows over its chunk files,
# a batch's misses one gather instead of a ``pread`` a row (NOTE [ A checkpoint read through a
# window ] in store/mapped.py; measured, 530 rows of 256 floats: 0.14 against 1.8 ms): the pages
# they touch then count in the reading processes' resident sets, which only a table that fits
# in memory may cost.
