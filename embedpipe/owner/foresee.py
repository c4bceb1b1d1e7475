"""The ids of the batches ahead, read in a process of their own: a fork of the training process.

NOTE [ Foresight without side effects ]
The lookahead policy needs the ids of the batches a loader will hand off next. Reading them in
the training process calls the user's dataset there and draws the sampler early, and with them
numpy's, torch's and ``random``'s global generators and the sampler's own: the model then sees
other batches than without lookahead (measured before this module: 316 of 1,536 ids differed
with token dropout in ``__getitem__``, and two identical runs differed from each other). So the
reading runs in a child forked when the DataLoader draws an epoch's first batch. The child holds
copies of the batch sampler's iterator, of the dataset and of every generator; what it draws, it
draws from those copies, and nothing it does reaches the training process or its workers::

    training process                              foresight child (fork, one per epoch)
    DataLoader draws batch n ──── 1 credit ────►   next(batch sampler, copy) -> indices
                                                   dataset (copy)[i] -> the batch's unique ids
    receiver thread ◄──── (number, ids) ─────────  at most `window` batches past the dispatched

The copies foresee what the originals will give where the dataset and the sampler are
deterministic given their state at the fork. Where they draw at random (token dropout, random
crops, a sampler the loop feeds back) the foresight is partly wrong: that costs rows read, never
a wrong row, and ``auto`` stops looking ahead when it keeps missing (``lookahead.Stream``).

Cost: each sample is fetched twice, once by a worker and once here, on another core and off the
training process's GIL; the fork itself copies the training process's page tables (milliseconds
for a few GB), and while the child lives (until it has read the epoch's last batch, a window
before the loader) each page the training process writes is copied the first time
(copy-on-write): once per page an epoch, nothing over a training run's epoch of thousands of
batches, but measured 1,717 page faults and 2.6 ms of its CPU a batch over epochs of 30 batches
(docs/benchmarks.md, "Passes from one long epoch"). The child shares nothing it could change
with the program: its stdout and stderr are /dev/null, every file it inherited is reopened with
an offset of its own (a dataset that seeks a file it opened before would otherwise move the
parent's offset), every socket and pipe is /dev/null (it cannot take the parent's data), no
signal handler of the program runs in it and no garbage from before the fork is collected in it.
It may only read (:func:`_read_only`): every shared mapping it inherited is made read-only (a
dataset that counts in a ``multiprocessing.Value``, takes a ``multiprocessing.Lock`` or caches
samples in a tensor moved to shared memory would otherwise change what the program's own reads
see, or die holding the lock), and where the kernel has Landlock (Linux 5.13 and later) no file
can be opened for writing, made or removed (a dataset that caches samples on disk). A dataset
that writes makes the child fault or fail: the foresight stops, with a warning, and the loop
goes on exactly as without it.
It ends once it has sent the epoch's last batch, when its credits pipe closes, or when its parent
is gone (``PR_SET_PDEATHSIG``, and a look at its parent every second), and leaves with ``os._exit``: no exit hook of the training process
runs in it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import os
import random
import resource
import select
import signal
import stat
import struct
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

#: (batch number, number of ids) before each batch's ids; a number of -1 ends the stream.
_HEADER = struct.Struct("<qq")
_END = -1
_FAILED = -2  # then why the child stopped, in a line of UTF-8 (``_why``)


class NoIds(Exception):
    """The samples carry no ids (the loader's ``collate_fn`` makes them): nothing to foresee."""


_PR_SET_PDEATHSIG = 1


def can_fork() -> bool:
    """Foresight needs ``fork`` (copies of the sampler's iterator and of the generators):
    Linux. Elsewhere the lookahead policy has no window (it is LFU)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


class IdsReader:
    """A forked child that reads the ids of ``batches`` (an iterator of index lists, a copy of
    the loader's) one batch per credit, numbering them from ``first``; ``ids_of(indices)`` gives
    a batch's sorted unique ids (it runs in the child, on the dataset's copy)."""

    def __init__(
        self, batches: Iterator[Any], ids_of: Callable[[Any], np.ndarray], first: int
    ) -> None:
        credits_read, credits_write = os.pipe()
        ids_read, ids_write = os.pipe()
        # a child far behind must never block the DataLoader's draw: credits it has no room
        # for are dropped (it is a window behind already)
        os.set_blocking(credits_write, False)
        parent = os.getpid()
        state = random.getstate()  # CPython reseeds `random` in a forked child: keep the copy
        try:
            with warnings.catch_warnings():  # Python 3.12 warns of fork in a threaded process
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except OSError:  # no process to be had (a pids limit, no memory): no foresight
            for fd in (credits_read, credits_write, ids_read, ids_write):
                os.close(fd)
            raise
        if pid == 0:
            code = 1
            try:
                os.close(credits_write)
                os.close(ids_read)
                _leave_the_program(parent, keep=(credits_read, ids_write))
                random.setstate(state)
                _serve(batches, ids_of, first, credits_read, ids_write, parent)
                code = 0
            finally:
                os._exit(code)
        os.close(credits_read)
        os.close(ids_write)
        self.pid: int | None = pid
        self._credits: int | None = credits_write
        self._ids = ids_read
        #: Why the child stopped, if it failed (its exception in a line), once received.
        self.failure: str | None = None

    @classmethod
    def adopt(cls, ids: int, credits: int) -> IdsReader:
        """The reading end of a child another process forked and handed over (an owner
        process, given a training process's :meth:`hand_over`): no child to end here."""
        reader = cls.__new__(cls)
        reader.pid, reader._credits, reader._ids = None, credits, ids
        reader.failure = None
        return reader

    def hand_over(self) -> tuple[int, int]:
        """The ids and credits pipes, for another process to read (sent as descriptors, then
        closed here by :meth:`handed_over`); :meth:`close` still ends the child."""
        return self._ids, self._credits

    def handed_over(self) -> None:
        """Close this process's ends once sent; those :meth:`close` closed already (the hand-over
        failed: the owner process died, say) are not closed twice."""
        ends = (self._ids, self._credits)
        self._ids, self._credits = -1, None
        for fd in ends:
            if fd is not None and fd >= 0:
                os.close(fd)

    def credit(self, batches: int) -> None:
        """Let the child read ``batches`` more batches."""
        fd = self._credits
        if fd is not None and batches > 0:
            with contextlib.suppress(OSError):  # the child ended, or is far behind (EAGAIN)
                os.write(fd, b"\0" * batches)

    def receive(self) -> tuple[int, np.ndarray] | None:
        """The next batch's (number, ids), blocking; None when the child has no more (and
        :attr:`failure` says why, if it failed)."""
        if self._ids < 0:
            return None
        header = _read_exactly(self._ids, _HEADER.size)
        number, count = _HEADER.unpack(header) if header is not None else (_END, -1)
        if number == _FAILED:
            text = _read_exactly(self._ids, count)
            self.failure = "(unreadable)" if text is None else text.decode(errors="replace")
            return None
        payload = _read_exactly(self._ids, count * 8) if number != _END else None
        if payload is None:
            if count != 0:  # no end marker: the child was killed or crashed, or is stopped
                self.failure = _why(None)
            return None
        return number, np.frombuffer(payload, dtype=np.int64)

    def close(self) -> None:
        """End the child and reap it; :meth:`receive` then returns None. Idempotent."""
        if self._credits is not None:
            os.close(self._credits)
            self._credits = None
        pid, self.pid = self.pid, None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def close_receiving(self) -> None:
        """Close the ids pipe (after the thread that receives has stopped). Idempotent: a
        descriptor closed twice may by then be another file's."""
        fd, self._ids = self._ids, -1
        if fd >= 0:
            os.close(fd)


class BatchIds:
    """A batch's sorted unique ids from its sample indices, read from ``dataset`` (in the
    foresight child, on its copy): what :class:`IdsReader` sends for each batch."""

    def __init__(self, dataset: Any, ids_key: str, padding: int | None, num_rows: int) -> None:
        self.dataset, self.ids_key, self.padding, self.num_rows = (
            dataset,
            ids_key,
            padding,
            num_rows,
        )

    def __call__(self, indices: list[int]) -> np.ndarray:
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices) if getitems is not None else [self.dataset[i] for i in indices]
        parts = []
        for sample in samples:
            if not isinstance(sample, Mapping) or self.ids_key not in sample:
                raise NoIds(self.ids_key)
            parts.append(np.asarray(sample[self.ids_key]).reshape(-1))
        if self.padding is not None:
            parts.append(np.array([self.padding]))
        ids = np.unique(np.concatenate(parts).astype(np.int64, copy=False))
        return ids[(ids >= 0) & (ids < self.num_rows)]


# ---------------------------------------------------------------------------- in the child
def _leave_the_program(parent: int, keep: tuple[int, ...]) -> None:
    """Cut every tie through which the child could change what the program sees: die with the
    parent, run none of its signal handlers nor collect its garbage (a finalizer left over from
    before the fork could commit or delete something), write nowhere it writes, and share no
    file offset, socket or pipe with it (:func:`_own_descriptors`)."""
    gc.freeze()  # first: objects from before the fork are never collected here
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before prctl
        os._exit(0)
    torch.set_num_threads(1)  # as in a DataLoader worker: no thread pool forked half-way
    for number in signal.valid_signals():  # a SIGTERM handler that saves a checkpoint, say
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(number)):
                signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent ends the child
    _own_descriptors(keep)
    _read_only()


#: mprotect's protection for read-only memory.
_PROT_READ = 1
_PR_SET_NO_NEW_PRIVS = 38
#: landlock_create_ruleset, landlock_restrict_self: the same numbers on every architecture.
_LANDLOCK_CREATE_RULESET, _LANDLOCK_RESTRICT_SELF = 444, 446
#: Landlock's file-system rights that write: a file opened for writing, every kind of file
#: made, a file or folder removed (ABI 1), linked or renamed across folders (2), truncated (3).
_LANDLOCK_WRITES = {1: 0b1_1111_1111_0010, 2: 0b11_1111_1111_0010, 3: 0b111_1111_1111_0010}


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def landlock_abi(libc: ctypes.CDLL | None = None) -> int:
    """The kernel's Landlock ABI version; 0 or less where there is none."""
    libc = libc or _libc()
    return int(libc.syscall(_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def _read_only() -> None:
    """Let the child write to no memory and no file the program could see (NOTE [ Foresight
    without side effects ]): each shared writable mapping becomes read-only, and with Landlock
    no file opens for writing, is made or is removed. A fault then ends the child: no core."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = _libc()
    with open("/proc/self/maps") as maps:
        spans = [line.split()[:2] for line in maps]
    for span, perms in spans:
        if perms[1] == "w" and perms[3] == "s":
            start, end = (int(x, 16) for x in span.split("-"))
            libc.mprotect(start, end - start, _PROT_READ)
    abi = landlock_abi(libc)
    if abi < 1 or libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return  # no Landlock here: shared memory is read-only, files are not
    handled = ctypes.c_uint64(_LANDLOCK_WRITES[min(abi, 3)])  # rights no rule grants: denied
    ruleset = libc.syscall(
        _LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.c_size_t(8), ctypes.c_uint32(0)
    )
    if ruleset >= 0:
        libc.syscall(_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
        os.close(ruleset)


def _own_descriptors(keep: tuple[int, ...]) -> None:
    """After ``fork`` the child shares each open file description with the parent: a dataset
    that seeks and reads a file it opened before the fork would move the parent's offset, and
    one that reads a socket or pipe would take the parent's data. So each regular file is
    reopened as a description of the child's own at the same offset, and every other
    descriptor (sockets, pipes, terminals, folders: a folder's lock would outlive the parent's
    release of it) but ``keep`` becomes /dev/null: a dataset that reads them fails here, which
    ends the foresight (``_serve`` sends the error, and the pipe warns with it). Nothing stays
    writable: a file opened for writing only (a log) becomes /dev/null, one opened for reading
    and writing is reopened read-only, and stdin, stdout and stderr are /dev/null."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep or fd == null:
            continue
        try:
            mode = os.fstat(fd).st_mode
        except OSError:  # the descriptor listdir itself used
            continue
        readable = fd > 2 and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_WRONLY
        if stat.S_ISREG(mode) and readable:
            with contextlib.suppress(OSError):
                own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
                os.lseek(own, os.lseek(fd, 0, os.SEEK_CUR), os.SEEK_SET)
                os.dup2(own, fd, inheritable=os.get_inheritable(fd))
                os.close(own)
                continue
        os.dup2(null, fd, inheritable=os.get_inheritable(fd))
    os.close(null)


def _serve(
    batches: Iterator[Any],
    ids_of: Callable[[Any], np.ndarray],
    number: int,
    credits: int,
    out: int,
    parent: int,
) -> None:
    try:
        for indices in batches:
            if not _wait_for_credit(credits, parent):
                return
            ids = np.ascontiguousarray(ids_of(indices), dtype=np.int64)
            _write_all(out, _HEADER.pack(number, len(ids)) + ids.tobytes())
            number += 1
    except Exception as e:  # a bad sample, or a dataset that cannot run in a fork: say which
        text = _why(e).encode(errors="replace")
        with contextlib.suppress(OSError):
            _write_all(out, _HEADER.pack(_FAILED, len(text)) + text)
    with contextlib.suppress(OSError):
        _write_all(out, _HEADER.pack(_END, 0))


#: A child silent while the loop claims its batches is stuck only after this long, too: on a
#: busy host, tiny batches are claimed faster than a forked child starts (seen in the tests).
SILENT_SECONDS = 1.0


def silent(batches: int, since: float) -> str | None:
    """Why a stream stops whose child, started at ``since`` (``time.monotonic``), sent no batch
    while the loop claimed ``batches``, once :data:`SILENT_SECONDS` have passed too (None
    before): a child stuck in the dataset would keep the policy waiting for foresight without a
    word (seen: a torch thread pool forked while it ran hung the child at its first parallel
    op)."""
    if time.monotonic() - since < SILENT_SECONDS:
        return None
    return (
        f"the process that reads the batches ahead sent none while the loop took {batches} "
        "batches or more, over a second or more (is the dataset blocked in a process forked "
        "from this one? a lock, a thread pool or a connection may not survive fork())"
    )


def _why(error: BaseException | None) -> str:
    """Why foresight stopped, for the pipe's warning: ``error`` raised in the child, or None for
    a child that ended without a word."""
    if isinstance(error, NoIds):
        return (
            f"the samples carry no {error.args[0]!r} before the loader's collate_fn makes it, so "
            "the ids of the batches ahead cannot be read"
        )
    if error is None:
        told = "ended without a word (killed, or it crashed)"
    else:
        try:
            told = f"failed: {type(error).__name__}: {error}".splitlines()[0][:300]
        except Exception:  # an exception whose str() raises
            told = f"failed: {type(error).__name__}"
    return (
        f"the process that reads the batches' ids ahead (a fork of the training process) {told}; "
        "a dataset that cannot run in a forked child (one holding a CUDA context, a socket or "
        "a pipe) fails there, and so does one that writes: the child may only read (a file, "
        "shared memory, a multiprocessing lock)"
    )


def _wait_for_credit(credits: int, parent: int) -> bool:
    poller = select.poll()  # not select.select: it refuses descriptors above 1023
    poller.register(credits, select.POLLIN)
    while True:
        if poller.poll(1000):
            return bool(os.read(credits, 1))  # b"": the parent closed the pipe
        if os.getppid() != parent:
            return False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exactly(fd: int, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        try:
            part = os.read(fd, left)
        except OSError:
            return None
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)
