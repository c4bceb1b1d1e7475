"""Closing a pipe that the program never closed.

NOTE [ A pipe that is never closed ]
The writeback thread holds the owner, and nothing in the owner points back at this handle, so a
pipe the user drops (a re-run notebook cell, a function that returns without ``close()``) is
collected like any object. When it is, a ``weakref.finalize`` closes the owner, as an unclosed
file flushes: the applied steps and the cached rows are committed as a checkpoint and the table
is released, with a ``ResourceWarning``. The same finalizer runs at interpreter exit for a pipe
still alive then, from ``threading._register_atexit``: the hook ``concurrent.futures`` uses to
shut its executors down, which runs before ``atexit`` hooks and after ours (last registered,
first run), so a compressed table can still be written through zarr's executor. The commit of an
uncompressed table uses plain file calls only.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import Any


def close_when_collected(pipe: Any, owner: Any) -> weakref.finalize:
    """A finalizer that closes ``owner`` when ``pipe`` is collected, or at exit (the NOTE);
    ``pipe.close()`` detaches it."""
    finalizer = weakref.finalize(pipe, _close_unclosed, owner, repr(pipe))
    finalizer.atexit = False  # _close_all_at_exit does it, earlier
    _unclosed.difference_update([f for f in _unclosed if not f.alive])
    _unclosed.add(finalizer)
    return finalizer


#: Finalizers of the pipes made (a dead one, of a pipe closed or collected, does nothing).
#: A forked child (a DataLoader worker) starts with none: its copy of a pipe is not the owner.
_unclosed: set[weakref.finalize] = set()
os.register_at_fork(after_in_child=_unclosed.clear)


def _close_all_at_exit() -> None:
    for finalizer in list(_unclosed):
        finalizer()


try:
    threading._register_atexit(_close_all_at_exit)  # before concurrent.futures shuts down
except (AttributeError, RuntimeError):  # not CPython's threading, or already shutting down
    import atexit

    atexit.register(_close_all_at_exit)


def _close_unclosed(owner: Any, description: str) -> None:
    """The finalizer of a pipe dropped (or alive at exit) without close(); see the NOTE."""
    if owner.closed or owner.pid != os.getpid():  # a forked child's copy owns nothing
        return
    if threading.current_thread().name.startswith("embedpipe-"):
        # collected by a garbage collection that ran on one of embedpipe's threads (the
        # writeback, the zygote's answers): close() may wait for that very thread, so close
        # from a thread of its own
        threading.Thread(target=_close_unclosed, args=(owner, description)).start()
        return
    warnings.warn(
        f"{description} was not closed; closing it now (applied steps are committed). "
        "Use `with EmbeddingPipe(...)` or call close()",
        ResourceWarning,
        stacklevel=2,
    )
    try:
        owner.close()
    except Exception as e:  # nowhere to raise to: say it
        warnings.warn(f"closing {description} failed: {e}", RuntimeWarning, stacklevel=2)
