"""The writeback queue and the thread that drains it (runs in the owner process).

The optimizer step that takes the table's gradient (``gradient.py``) hands each step's (U, D)
gradient to :meth:`Writeback.submit`; the thread applies the sparse optimizer to the rows through
``apply(ids, grad, step, lr)`` and publishes how many steps are applied; when the queue is empty
it runs ``idle()``, where the pipe writes the coldest dirty rows to the table so that the next
evictions find clean slots. The training loop waits on that count (:meth:`wait`) before a batch's
rows are used: for every step in exact mode, for all but ``max_staleness`` steps in bounded mode.

NOTE [ Writeback errors and shutdown ]
An exception in the thread is kept, with the step it happened at, and raised in the training
loop by the next :meth:`submit`, :meth:`wait` or :meth:`close`; the thread stops taking work. An
``OSError`` (a full disk) comes back as :class:`~embedpipe.errors.TableWriteError`, an
``OSError`` too. Every blocking call has a timeout and looks at the thread's health, so no call
waits forever on a thread that is gone, and :meth:`close` gives up on a thread that has made no
progress for ``stall_seconds`` (a hung disk) instead of joining it forever.

A signal (Ctrl-C in a notebook during optimizer.step()) can land between any two bytecodes of
:meth:`submit`. The count goes up first and the step is queued after, by one call of
``SimpleQueue.put`` (C code: done or not done); an interruption in between leaves a step counted
that never reaches the queue. :meth:`wait` notices, once the thread has found the queue empty
after the wait began, and takes the count back, with a warning, instead of waiting forever.

NOTE [ A step's writes wait for the hand-off after it ]
In exact mode the next batch's hand-off needs a step's new rows, not its writes (the owner's
NOTE [ A hand-off waits for the step's rows, not its writes ]). Written at once, the rows the
step takes out of the cache (put back into slots, written to the table for those not cached)
compete with that hand-off for the owner's GIL and for the CPUs, exactly while the training
process waits for it. So once ``apply`` has the rows computed it calls :meth:`Writeback.hold`,
which waits until a hand-off has taken them (:meth:`handed_off`), and not past the first of: a
step queued behind, a thread waiting for applied steps (:meth:`wait`: a checkpoint, a refresh,
close), or :data:`HOLD_SECONDS`. The writes then run while the model computes. Nothing else
changes: the step is applied in the same order, before the next one, with the same rows.
Measured with the early reads (NOTE in ``computed.py``) beside a simulated accelerator (2
cores, owner process, 5% cache): the next batch came 11.6-12.2 ms after the step, against
13.2-14.2 before (medians; docs/service.md).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import TableWriteError, WritebackError

POLL_SECONDS = 0.05
#: How long the idle thread blocks on the queue before it looks again (and counts an idle poll).
IDLE_SECONDS = 0.2
#: The longest a computed step's writes wait for the hand-off after it (NOTE above).
HOLD_SECONDS = 0.05
#: close() gives up on a thread that has applied nothing for this long.
STALL_SECONDS = 120.0

__all__ = ["GradBatch", "Stop", "Writeback", "WritebackError"]


@dataclass(frozen=True)
class GradBatch:
    """One optimizer step: ``grad`` (U, D) on the CPU for ``ids`` (U,) unique int64, at the
    learning rate ``lr`` (None: the row optimizer's own)."""

    ids: np.ndarray
    grad: torch.Tensor
    step: int
    lr: float | None = None


@dataclass(frozen=True)
class Stop:
    """Ask the thread to finish what is queued and exit."""


class Writeback:
    """A queue of :class:`GradBatch` and one thread that applies them in step order."""

    def __init__(
        self,
        apply: Callable[[np.ndarray, torch.Tensor, int, float | None], None],
        *,
        idle: Callable[[], None] | None = None,
        step: int = 0,
    ) -> None:
        """``apply(ids, grad, step, lr)`` runs one step; ``idle()`` runs after a step when nothing
        else is queued (the pipe writes cold dirty rows back ahead of need there)."""
        self._apply = apply
        self._idle = idle
        self._queue: queue.SimpleQueue[GradBatch | Stop] = queue.SimpleQueue()
        self._applied = threading.Condition()
        self.submitted = step  # steps handed to the queue (written by the training loop only)
        self.applied = step  # steps applied (written by the thread only)
        #: the step whose new rows are computed, not yet in the cache and the table (``apply``
        #: says so through :meth:`computed_now`; the owner's hand-off may take them from there)
        self.computed = step
        #: the last step whose rows a hand-off took (NOTE [ A step's writes wait for the
        #: hand-off after it ]), and the threads now waiting for applied steps
        self.handed = step
        self._waiting = 0
        self.stall_seconds = STALL_SECONDS
        self._idle_polls = 0  # times the thread found the queue empty for IDLE_SECONDS
        self._error: tuple[int, BaseException] | None = None
        self._warned_idle = False  # a failed idle write warned (once: it is retried anyway)
        self._dropping = False  # abandon(): what is queued is dropped, not applied
        self._thread = threading.Thread(target=self._run, name="embedpipe-writeback", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Gradient batches submitted and not yet applied."""
        return self.submitted - self.applied

    def submit(self, ids: np.ndarray, grad: torch.Tensor, lr: float | None = None) -> int:
        """Queue one optimizer step; returns its step number (see the NOTE on signals)."""
        self.raise_error()
        self.submitted += 1
        self._queue.put(GradBatch(ids, grad, self.submitted, lr))
        self._wake()  # a step held for a hand-off goes on: this one follows it
        return self.submitted

    def computed_now(self, step: int) -> None:
        """Called by ``apply`` (the thread) once ``step``'s new rows are computed: a wait with
        ``computed=True`` ends now, before they are written."""
        with self._applied:
            self.computed = step
            self._applied.notify_all()

    def handed_off(self, step: int) -> None:
        """A hand-off took the rows of ``step`` (and every step before): its writes may go on."""
        with self._applied:
            self.handed = max(self.handed, step)
            self._applied.notify_all()

    def hold(self, step: int) -> None:
        """Called by ``apply`` (the thread) once ``step``'s rows are computed, before they are
        written: wait for the hand-off that takes them (NOTE [ A step's writes wait for the
        hand-off after it ])."""
        deadline = time.monotonic() + HOLD_SECONDS
        with self._applied:
            while self.handed < step and not self._waiting and self._queue.empty():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._applied.wait(left)

    def _wake(self) -> None:
        with self._applied:
            self._applied.notify_all()

    def wait(self, behind: int = 0, timeout: float | None = None, computed: bool = False) -> None:
        """Block until at most ``behind`` submitted steps are unapplied (or raise the thread's
        error); ``computed``: until the last one is at least computed (every one before it is
        applied then: the thread applies them in order)."""
        target = self.submitted - behind
        waited = 0.0
        with self._applied:
            polls = self._idle_polls
            if not computed:  # a step held for a hand-off goes on now
                self._waiting += 1
                self._applied.notify_all()
            try:
                while self.applied < target and not (computed and self.computed >= target):
                    self.raise_error()
                    if not self._thread.is_alive():
                        raise WritebackError(
                            "the writeback thread has stopped; the pipe was closed"
                        )
                    if self._idle_polls > polls + 1 and self._queue.empty():
                        self._forget_unqueued()
                        return
                    if timeout is not None and waited >= timeout:
                        raise TimeoutError(
                            f"writeback still {self.applied}/{target} steps after {timeout}s"
                        )
                    self._applied.wait(POLL_SECONDS)
                    waited += POLL_SECONDS
            finally:
                if not computed:
                    self._waiting -= 1
        self.raise_error()

    def _forget_unqueued(self) -> None:
        """Every queued step is applied, yet the count says more were submitted: a submit was
        interrupted before its put (see the NOTE). Those steps were never queued."""
        lost = self.submitted - self.applied
        self.submitted = self.applied
        warnings.warn(
            f"{lost} embedding update(s) were interrupted before they were queued (a signal during "
            "the optimizer step?) and are not applied; training goes on from step "
            f"{self.applied}",
            RuntimeWarning,
            stacklevel=3,
        )

    def restart_at(self, step: int) -> None:
        """Number the steps from ``step`` on (the table was replaced); the queue must be empty."""
        self.wait()
        self.submitted = self.applied = self.computed = self.handed = step

    def raise_error(self) -> None:
        if self._error is not None:
            step, e = self._error
            if isinstance(e, TableWriteError):
                raise TableWriteError(e.errno, e.strerror) from e
            raise WritebackError(
                f"the writeback thread failed at step {step}: {type(e).__name__}: {e}"
            ) from e

    def close(self) -> None:
        """Apply everything queued, stop the thread, and raise its error if it had one.

        Raises :class:`WritebackError` if the thread applies nothing for ``stall_seconds``.
        """
        if self._thread.is_alive():
            self._queue.put(Stop())
            self._wake()
            last, since = self.applied, time.monotonic()
            while self._thread.is_alive():
                self._thread.join(POLL_SECONDS)
                if self.applied != last:
                    last, since = self.applied, time.monotonic()
                elif time.monotonic() - since > self.stall_seconds:
                    raise WritebackError(
                        f"the writeback thread applied nothing for {self.stall_seconds:.0f}s "
                        f"(at step {self.applied + 1} of {self.submitted}): a table write hangs; "
                        "the table on disk stays at its last checkpoint"
                    )
        self.raise_error()

    def abandon(self, seconds: float) -> bool:
        """Stop the thread without applying what is queued (its training process is gone: the
        steps since the last checkpoint are not kept); whether it stopped within ``seconds``
        (not: a table write hangs)."""
        self._dropping = True
        self._queue.put(Stop())
        self._wake()
        self._thread.join(seconds)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                with self._applied:  # a daemon thread: it dies with the process if never closed
                    self._idle_polls += 1
                    self._applied.notify_all()
                continue
            if isinstance(item, Stop):
                return
            if self._error is not None or self._dropping:
                continue  # after a failure, apply nothing more (later steps build on the lost one)
            try:
                self._apply(item.ids, item.grad, item.step, item.lr)
            except BaseException as e:  # carried to the training loop, see the NOTE
                self._error = (item.step, e)
            with self._applied:
                if self._error is None:
                    self.applied = item.step
                self._applied.notify_all()
            # Let a loop waiting for this step have the GIL now: else it waits for the idle
            # work below to give it up (up to sys.getswitchinterval(), 5 ms; measured: a fully
            # cached training step waited 5.5 ms for 1.1 ms of work).
            time.sleep(0)
            if self._idle is not None and self._error is None and self._queue.empty():
                self._run_idle(item.step)

    def _run_idle(self, step: int) -> None:
        """The idle work: writing rows ahead of need. A failed write loses nothing (the rows
        stay dirty in the cache, for the write that needs them), so it is no error of the
        thread's: it warns once and is tried again after the next step, so a disk that was full
        and has room again just works on."""
        try:
            self._idle()
        except OSError as e:
            if not self._warned_idle:
                self._warned_idle = True
                warnings.warn(
                    f"writing cold rows of the cache ahead of need failed after step {step} "
                    f"({e.strerror or e}): nothing is lost (they stay in the cache and are "
                    "tried again after the next step), but evictions and checkpoints must "
                    "write them: free space",
                    RuntimeWarning,
                    stacklevel=1,
                )
        except BaseException as e:
            self._error = (step, e)
