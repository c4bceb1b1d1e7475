"""Shared memory and the cache: what every process of a pipe shares, lock-free for readers.

- ``shm.py``: :class:`SharedBlock`, anonymous shared memory that dies with its processes;
- ``ordering.py``: the memory barrier the seqlock needs on this CPU;
- ``sharedrows.py``: :class:`SharedRows` (the rows, their seqlock versions and ``slot_of``,
  read by the workers);
- ``rowcache.py``: :class:`RowCache` (the owner's admission, eviction and dirty rows);
- ``copies.py``: the owner's copies of rows for a step (staged, read ahead, prepared);
- ``policy.py``: the eviction policies (LRU, LFU, lookahead);
- ``ring.py``: :class:`BatchRing`, the workers' slots for the rows of the batches in flight;
- ``budget.py``: what a pipe's cache, ring and index cost in host memory, and the budget check.

Takes rows from the table through a ``fetch`` callable the owner hands down.
"""

from .ring import BatchRing
from .rowcache import RowCache
from .sharedrows import SharedRows
from .shm import SharedBlock

__all__ = ["BatchRing", "RowCache", "SharedBlock", "SharedRows"]
