"""Owner processes forked from a process that has imported them already (a zygote): starting one
takes milliseconds, not the 1.3 s a new interpreter spends importing torch and embedpipe.

The first owner process a training process starts also starts its zygote, an interpreter like
the one ``reach.start_owner`` would start, which imports the owner process's modules and waits
on a Unix socket. Each request (the owner's socket and the lent writer lock as descriptors, the
training process's working directory) is answered with a fork: the child becomes the owner
process (``server.serve``); the zygote closes its copies of the descriptors at once (the lock's
open file stays the training process's and its owner's alone) and says the child's pid, then,
once the child has ended, its exit status: the training process is not its parent, so it cannot
wait for it (:class:`Forked` stands for ``subprocess.Popen`` there).

The zygote ends with its training process: at the end of its socket (the training process is
gone, or a fork of it that is not a DataLoader worker closed it), or when its parent is no
longer the process that started it. Its owner processes end as one started directly does: at
the end of their own connection, and when their parent (the zygote) is gone.

It holds no table, no thread and no torch state: only the modules, so a fork copies nothing
that is in use (a fork of a process with threads may copy a lock some thread held).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .channel import Channel, ChannelClosed

#: How often the zygote reaps its children and looks at its parent.
POLL_SECONDS = 0.05


class Forked:
    """An owner process forked by the zygote, as much of ``subprocess.Popen`` as the training
    process uses: ``pid``, ``poll()``, ``wait(timeout)``, ``kill()``."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.pid = pid
        self.zygote = zygote
        self.pidfd = os.pidfd_open(pid)  # signals reach this process even once its pid is reused
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, self.pidfd, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"owner process {self.pid}", timeout or 0.0)
            self.returncode = self.zygote.exit_code(self.pid, self.pidfd, left)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.pidfd)


class Zygote:
    """The training process's side of its zygote: forks owner processes on request."""

    def __init__(self, process: subprocess.Popen, channel: Channel) -> None:
        self.process = process
        self.channel = channel
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}  # pid: exit status, as the zygote said
        self.gone = False

    def fork(self, fds: tuple[int, ...]) -> Forked:
        """A new owner process, given (copies of) ``fds``; its socket is ``fds[0]``."""
        with self.lock:
            self.channel.send({"cwd": os.getcwd(), "fds": fds}, fds=fds)
            while True:
                reply = self._next(None)
                if "pid" in reply:
                    return Forked(self, reply["pid"])
                if "error" in reply:
                    raise OSError(reply["error"])

    def exit_code(self, pid: int, pidfd: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once the zygote has said it (waiting up to ``timeout``), else
        None; a process that has ended with a zygote that is gone: exit status 1 (re-parented,
        an owner ends with that)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self.gone:
                    ended, _, _ = select.select([pidfd], [], [], left)
                    return 1 if ended else None
                if self._next(left) is None:
                    return None
            return self.exits[pid]

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        """The zygote's next message (its exits kept in :attr:`exits`), or None after
        ``timeout`` seconds without one."""
        try:
            ready, _, _ = select.select([self.channel.sock], [], [], timeout)
            if not ready:
                return None
            message, _, _ = self.channel.receive()
        except (ChannelClosed, OSError, ValueError) as e:
            self.gone = True
            if timeout is not None:
                return None
            raise ChannelClosed(
                f"the owner processes' zygote (pid {self.process.pid}) is gone"
            ) from e
        if "exit" in message:
            self.exits[message["exit"]] = message["code"]
        return message

    def close(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


_zygote: Zygote | None = None
_lock = threading.Lock()


def fork_owner(
    fds: tuple[int, ...], start: Callable[[], tuple[subprocess.Popen, Channel]]
) -> Forked:
    """An owner process of this process's, forked by its zygote, which ``start()`` starts at the
    first call (and again if it is gone)."""
    global _zygote
    with _lock:
        for attempt in range(2):
            if _zygote is None or _zygote.gone:
                _zygote = Zygote(*start())
            try:
                return _zygote.fork(fds)
            except ChannelClosed:
                if attempt:
                    raise
        raise AssertionError("unreachable")


def _forget_in_child() -> None:
    """A fork of the training process (a DataLoader worker) does not share its zygote: it
    closes its copy of the socket, so that the zygote sees the end of the training process."""
    global _zygote, _lock
    if _zygote is not None:
        _zygote.channel.sock.close()
        _zygote = None
    _lock = threading.Lock()


def _close_at_exit() -> None:
    if _zygote is not None:
        _zygote.close()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(_close_at_exit)


# --------------------------------------------------------------------------------- the zygote
def main(argv: list[str]) -> int:
    """``FD PARENT``: fork owner processes on the requests that come at the socket ``FD``."""
    from . import server  # what every owner process imports: once, here

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the training process's
    channel = Channel(socket.socket(fileno=int(argv[0])))
    parent = int(argv[1])
    gc.freeze()  # the modules' objects: shared with every fork, never walked again
    while os.getppid() == parent:
        for pid, code in _reaped():
            channel.send({"exit": pid, "code": code})
        ready, _, _ = select.select([channel.sock], [], [], POLL_SECONDS)
        if not ready:
            continue
        try:
            request, _, fds = channel.receive()
        except ChannelClosed:
            return 0  # the training process is gone: its owners end with their connections
        try:
            pid = os.fork()
        except OSError as e:
            channel.send({"error": f"could not fork an owner process: {e}"})
            for fd in fds:
                os.close(fd)
            continue
        if pid == 0:  # the owner process, which never returns to the loop
            code = 1
            try:
                channel.close()
                os.chdir(request["cwd"])
                code = server.serve(
                    fds[0], os.getppid(), dict(zip(request["fds"], fds, strict=True))
                )
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        for fd in fds:
            os.close(fd)
        channel.send({"pid": pid})
    return 0


def _reaped() -> list[tuple[int, int]]:
    """The children that have ended since the last look: (pid, returncode as Popen says it)."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
