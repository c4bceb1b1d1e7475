"""Memory ordering between the owner and the workers, on every CPU.

Workers read the shared cache, the applied-step clock and the ring without locks (seqlocks, see
``sharedrows.py`` and ``ring.py``). A seqlock needs two orderings that numpy does not give by
itself: the writer's stores become visible in order (version odd, then rows, then version even),
and the reader's loads happen in order (version, rows, version). Between numpy calls that takes
a full memory barrier, :func:`fence`, at four places:

    owner:   version += 1 ; fence ; write rows ; fence ; version += 1
    worker:  v1 = version ; fence ; copy rows  ; fence ; v2 = version

and the same around the clock: the owner writes a step's rows, fences, then publishes the step;
a worker reads the step, fences, then reads rows.

- **x86-64** keeps stores in order and loads in order (total store order), and each numpy call is
  an opaque function call the compiler cannot move loads or stores across: :func:`fence` is a
  no-op there.
- **Other CPUs** (ARM: Graviton, Apple silicon, Jetson) reorder both. There :func:`fence` calls
  ``atomic_thread_fence(memory_order_seq_cst)`` from libatomic, GCC's runtime library (a
  ``dmb ish`` on ARMv8), through ctypes: a compiled barrier without compiling anything.
- **Where neither holds** (no libatomic), workers do not read shared memory at all: they collate
  and deduplicate, and the owner copies every row at hand-off (``MODE == "owner"``), which is
  correct on any CPU and slower, since the misses are read on the training thread.

``MODE`` is ``"tso"``, ``"fence"`` or ``"owner"``; the environment variable
``EMBEDPIPE_MEMORY_ORDER`` forces one (the tests use it to run each path on x86-64).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable

MODES = ("tso", "fence", "owner")
_SEQ_CST = 5  # memory_order_seq_cst in C11's enum

TSO_MACHINES = ("x86_64", "amd64", "i386", "i686", "x86")


def _libatomic_fence() -> Callable[[], None] | None:
    for name in ("libatomic.so.1", ctypes.util.find_library("atomic")):
        if not name:
            continue
        try:
            function = ctypes.CDLL(name).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_int]
        function.restype = None
        return lambda: function(_SEQ_CST)
    return None


def _no_fence() -> None:
    """x86-64: stores and loads already stay in program order (see the module docstring)."""


def choose_mode(forced: str | None = None) -> tuple[str, Callable[[], None]]:
    """The ordering mode for this machine (or ``forced``) and its fence function."""
    if forced is not None and forced not in MODES:
        raise ValueError(f"EMBEDPIPE_MEMORY_ORDER must be one of {MODES}, got {forced!r}")
    libatomic = _libatomic_fence()
    if forced == "fence" and libatomic is None:
        raise RuntimeError("EMBEDPIPE_MEMORY_ORDER=fence needs libatomic, which is not installed")
    if forced == "fence":
        return "fence", libatomic  # type: ignore[return-value]
    if forced in ("tso", "owner"):
        return forced, _no_fence
    if platform.machine().lower() in TSO_MACHINES:
        return "tso", _no_fence
    if libatomic is not None:
        return "fence", libatomic
    return "owner", _no_fence


MODE, fence = choose_mode(os.environ.get("EMBEDPIPE_MEMORY_ORDER") or None)
