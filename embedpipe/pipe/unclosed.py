"""Closing a pipe that the program never closed, or closed on an error.

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

NOTE [ A rank that fails alone ]
A pipe whose table is shared by the ranks of a process group commits at ``close()`` only with
every rank: the ranks meet (a header on the pipe's own group) and commit together. A rank that
fails alone (an exception in its own forward, a bad sample, Ctrl-C that reaches one rank first)
closes its pipe on the way out, in ``with pipe:``'s exit or at interpreter exit, while the
other ranks wait for it in the model's collectives (DDP's all-reduce, its buffer broadcast), on
the default group: neither would ever reach the other's meeting, and the job would hang until
the groups' timeout (30 minutes). Without embedpipe the failed rank's process would end, its
sockets would close and the others' collectives would fail at once; with the owner in threads
the others mostly meet its close at their next batch, but the owner process of a machine
exchanges nothing between its ranks at a batch.

So a sharded pipe closed with an exception on its way (``__exit__``'s, the one being handled
in a ``finally`` or an ``except`` around ``close()``, the uncaught one at interpreter exit:
``sys.last_value``) leaves instead: it meets no rank, commits nothing, and releases the table,
which stays at its last checkpoint, as a crash leaves it (the other ranks raise
``PeerLostError`` as its connections end). A ``RuntimeWarning`` says so, as the steps since the
checkpoint are not kept even where every rank failed together. Not failures: ``sys.exit(0)``,
the end of a loop or a generator (``StopIteration``, ``GeneratorExit``), and the error of an
earlier ``close()`` (its retry, a full disk freed, commits). Not seen: ``sys.exit(1)`` at
interpreter exit (a ``SystemExit`` sets nothing that an exit hook can read), so a pipe left
open by a program that ends that way meets the other ranks; ``with pipe:`` sees it.
"""

from __future__ import annotations

import contextlib
import os
import sys
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


def close(
    owner: Any,
    finalizer: weakref.finalize,
    error: BaseException | None,
    raise_errors: bool,
    description: str,
) -> None:
    """The pipe's ``close()``, ``error`` on its way (NOTE [ A rank that fails alone ])."""
    left = leave_on(owner, error, description, stacklevel=4)
    try:
        owner.close(raise_errors=raise_errors and not left)
    except BaseException as e:
        with contextlib.suppress(Exception):  # (a close() again, its retry, commits)
            e._raised_by_close = id(owner)  # type: ignore[attr-defined]
        raise
    finally:
        if owner.closed:
            finalizer.detach()
            if not left:
                owner.correct(error)  # what the error on its way said of the table


def leave_on(owner: Any, error: BaseException | None, description: str, stacklevel: int) -> bool:
    """Whether the pipe's close leaves without a commit, ``error`` being on its way
    (NOTE [ A rank that fails alone ]); if so, its ranks are told and a warning says so."""
    shards = getattr(owner, "shards", None)
    if shards is None or owner.closed or not _failure(error, owner):
        return False
    shards.leave(error)
    warnings.warn(
        f"{description} closed with {type(error).__name__} on its way: "
        f"{shards.describe()} leaves the sharded table without meeting the other ranks and "
        "commits nothing; the table stays at its last checkpoint",
        RuntimeWarning,
        stacklevel=stacklevel,
    )
    return True


def _failure(error: BaseException | None, owner: Any) -> bool:
    """Whether ``error`` is a failure: not the end of a loop or a generator, a successful
    ``sys.exit``, nor the error of an earlier ``close()`` of this pipe that the program
    retries."""
    if error is None or isinstance(error, (GeneratorExit, StopIteration, StopAsyncIteration)):
        return False
    if isinstance(error, SystemExit) and error.code in (0, None):
        return False
    return getattr(error, "_raised_by_close", None) != id(owner)


#: The uncaught exception that ends the program, at exit (``sys.last_value``; not in an
#: interactive session, where it is the last error shown, however long ago).
_exit_error: list[BaseException | None] = [None]


def _close_all_at_exit() -> None:
    interactive = hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules
    _exit_error[0] = None if interactive else getattr(sys, "last_value", None)
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
    if leave_on(owner, _exit_error[0], description, stacklevel=2):
        owner.close(raise_errors=False)
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
