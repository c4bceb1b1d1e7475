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

So a worker starts a daemon thread that looks at its parent every :data:`WATCH_SECONDS`; once
the parent is gone (the worker was re-parented), it SIGKILLs its own process: no exit hook runs
that could hang, and the kernel frees the worker's shared memory and sockets with it. A thread,
not ``PR_SET_PDEATHSIG``: that signal follows the thread that forked the worker, and a framework
may create a loader's iterator in a thread that ends before the training process does.

The watch starts as the worker starts (:class:`WatchParent` wraps the loader's
``worker_init_fn`` while its iterator makes the workers, and runs before the user's own), and
again at the first lookup for a loader a framework rebuilt without it. It watches the training process's pid as recorded there, not the worker's parent when the
watch starts: torch's own watch records the parent only after ``worker_init_fn`` returns, so a
trainer killed while its workers were still starting (a spawned worker imports torch for
seconds) left workers whose watch took pid 1 for their parent and waited for work forever
(found alive, idle in torch's worker loop, 19 minutes after a test run was killed).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

#: How often a worker looks for its parent.
WATCH_SECONDS = 0.25

_watching: int | None = None  # the pid of the process whose watcher runs


def exit_with_parent(trainer: int) -> None:
    """Start this process's watcher of ``trainer`` (the training process's pid, recorded there),
    once per process; SIGKILL this process now if ``trainer`` died before the watch began."""
    global _watching
    if _watching == os.getpid():
        return
    _watching = os.getpid()
    parent = os.getppid()
    if parent != trainer and not _alive(trainer):
        os.kill(os.getpid(), signal.SIGKILL)  # re-parented already: the trainer is gone
    # (a parent that is not ``trainer`` but lives: the loader was pickled to another process)
    threading.Thread(
        target=_watch, args=(parent,), name="embedpipe-parent-watch", daemon=True
    ).start()


class WatchParent:
    """A DataLoader ``worker_init_fn``: start the worker's watch of the training process, then
    call the user's ``worker_init_fn`` (if any). Made in the training process."""

    def __init__(self, then: Callable[[int], Any] | None) -> None:
        self.then = then
        self.trainer = os.getpid()

    def __call__(self, worker_id: int) -> None:
        exit_with_parent(self.trainer)
        if self.then is not None:
            self.then(worker_id)


def _alive(pid: int) -> bool:
    """``pid`` runs: not gone, and not a zombie (a trainer that died and is not reaped yet has
    already handed its children to pid 1)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process now holds the pid
            return True
        return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_reason(code: int) -> str:
    """A child process's exit code in words: "killed by SIGTERM", "exit status 1"; a SIGKILL
    with its usual cause (the kernel's OOM killer sends it)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        usual = ": out of memory is the usual cause" if name == "SIGKILL" else ""
        return f"killed by {name}{usual}"
    return f"exit status {code}"
