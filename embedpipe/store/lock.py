"""The one-writer lock of a table: an exclusive ``flock`` on the table's folder itself.

The lock goes with the process: the kernel drops it when the last descriptor of the locked file
closes, so a crashed or killed writer never leaves a stale lock. Two details keep that true:

- The lock is taken on the folder, not on a file in it: a ``writer.lock`` file was not part of
  the zarr hierarchy and made zarr-python warn whenever it listed the group's members.
- A forked child (a DataLoader worker with the fork start method) inherits the descriptor, and
  with it the lock: a trainer killed while its workers lived on kept its table locked. Every
  held lock's descriptor is closed in the child right after ``fork`` (``os.register_at_fork``);
  closing the child's copy does not release the parent's lock.

Who holds a lock is read from ``/proc/locks`` (Linux), so that a second writer's error names the
process.
"""

from __future__ import annotations

import fcntl
import os
import weakref

from ..errors import TableLockedError

_held: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_held):
        if lock.fd >= 0:
            os.close(lock.fd)
            lock.fd = -1


os.register_at_fork(after_in_child=_close_in_child)


class WriterLock:
    """An exclusive ``flock`` on ``folder``, held until :meth:`release` or the process ends."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(self.fd)
            os.close(self.fd)
            self.fd = -1
            raise TableLockedError(
                f"table {folder} is already open for writing by {holder}; close that handle "
                "(table.close() or pipe.close()) or open this one read-only (mode='r')"
            ) from None
        _held.add(self)

    @classmethod
    def borrowed(cls, folder: str, fd: int) -> WriterLock:
        """The lock another process holds and lent this one, as ``fd``: a descriptor of the same
        open file, which the ``flock`` belongs to. Releasing it only closes ``fd``: the lender
        holds the lock still (an owner process's lock, lent by the training process's ``Table``
        so that no other writer can take the table between the two)."""
        lock = cls.__new__(cls)
        lock.folder, lock.fd, lock.lent = folder, fd, True
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by this open file already: a no-op
        _held.add(lock)
        return lock

    def held(self) -> bool:
        """Whether this process holds the lock (a forked child's copy does not)."""
        return self.fd >= 0

    lent = False  # borrowed from another process: releasing leaves its lock alone

    def release(self) -> None:
        if self.fd >= 0:
            if not self.lent:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
        _held.discard(self)

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)  # the kernel drops the lock with the last descriptor


def lock_holder(fd: int) -> str:
    """Who holds an ``flock`` on the file open at ``fd``: "pid P (command)", or a vaguer phrase."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            pids = [int(line.split()[4]) for line in f if "FLOCK" in line and key in line.split()]
    except (OSError, ValueError, IndexError):
        pids = []
    if not pids:
        return "another process"
    pid = pids[0]
    if pid == os.getpid():
        return f"this process (pid {pid}), through another handle"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    return f"pid {pid} ({command[:80]})" if command else f"pid {pid}"
