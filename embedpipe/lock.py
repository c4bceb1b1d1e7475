"""The one-writer lock of a table: an exclusive ``flock`` on ``writer.lock`` in its folder.

The lock goes with the process (a crashed writer leaves none behind); the file records who holds
it, so that a second writer's error can name the holder.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

from .errors import TableLockedError

LOCK_FILE = "writer.lock"


class WriterLock:
    """An exclusive ``flock`` on ``writer.lock``; the file records who holds it."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK_FILE)
        self.pid = os.getpid()  # a forked child shares the lock and must never release it
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 512, 0).decode(errors="replace").strip() or "another handle"
            os.close(self.fd)
            raise TableLockedError(
                f"table {folder} is already open for writing by {holder}; close that handle "
                "(table.close() or pipe.close()) or open this one with mode='r'"
            ) from None
        os.ftruncate(self.fd, 0)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        os.pwrite(
            self.fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0
        )

    def release(self) -> None:
        if self.fd >= 0 and self.pid == os.getpid():
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1
