"""DataLoader workers that die with the training process, however it dies (runs in a worker).

NOTE [ Workers die with the training process ]
torch's worker loop looks for a dead parent only while idle (every 5 s), and then leaves through
multiprocessing's exit hooks, which join the result queue's feeder thread. When the training
process was killed with batches still in the queue's pipe (a batch's fields travel as bytes, so
its 64 KiB fill), that join waits for a reader that never comes; and no EPIPE ever tells the
writer, since every worker inherited the pipe's read end and holds it open. Measured before this
module: after a kill -9 of a trainer with 2 workers, 1-2 workers were still alive minutes later in
5 of 5 trials (about 388 MB RSS each, holding the cache's shared memory: 82 MiB against 9), and a
surviving rank under torchrun saw the dead one only when the workers' sockets closed.

So a worker, at its first lookup, starts a daemon thread that looks at its parent every
:data:`WATCH_SECONDS`; once the parent is gone (the worker was re-parented), it SIGKILLs its own
process: no exit hook runs that could hang, and the kernel frees the worker's shared memory and
sockets with it. A thread, not ``PR_SET_PDEATHSIG``: that signal follows the thread that forked
the worker, and a framework may create a loader's iterator in a thread that ends before the
training process does.
"""

from __future__ import annotations

import os
import signal
import threading
import time

#: How often a worker looks for its parent.
WATCH_SECONDS = 0.25

_watching: int | None = None  # the pid of the process whose watcher runs


def exit_with_parent() -> None:
    """Start this process's watcher, once per process (a no-op after the first call)."""
    global _watching
    if _watching == os.getpid():
        return
    _watching = os.getpid()
    parent = os.getppid()
    threading.Thread(
        target=_watch, args=(parent,), name="embedpipe-parent-watch", daemon=True
    ).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
