"""Owner processes forked from a process that has imported them already (a zygote): starting one
takes milliseconds, not the 1.3 s a new interpreter spends importing torch and embedpipe.

The first owner process a training process starts also starts its zygote, an interpreter like
the one ``reach.start_owner`` would start, which imports the owner process's modules and waits
on a Unix socket. Each request (a number, the owner's socket and the lent writer lock as
descriptors, the training process's working directory) is answered with a fork: the child
becomes the owner process (``server.serve``); the zygote closes its copies of the descriptors at
once (the lock's open file stays the training process's and its owner's alone) and answers with
the child's pid and a pidfd of it (taken before the child can be reaped, so it is that process
even once its pid is reused), then, once the child has ended, its exit status, by the request's
number: the training process is not its parent, so it cannot wait for it (:class:`Forked` stands
for ``subprocess.Popen`` there). A thread of the training process receives the answers.

The zygote ends with its training process: at once when its parent is no longer the process
that started it; at the end of its socket (the training process is gone, or gave up on it; a
forked DataLoader worker closes its copy) it takes no more requests and ends once the owner
processes it forked have. They end as one started directly does: at the end of their own
connection, and when their parent (the zygote) is gone. It holds no table, no thread and no
torch state, only the modules, so a fork copies nothing in use (a fork of a process with threads
may copy a lock some thread held). Without pidfds (Linux before 5.3, not Linux) owner processes
are started as new interpreters (``available``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable

from .channel import Channel, ChannelClosed, interrupts_held

#: How often the zygote reaps its children and looks at its parent.
POLL_SECONDS = 0.05
#: How long a training process waits for its zygote to fork an owner (its first start included).
FORK_SECONDS = 120.0
#: How long after an owner has ended its exit status may take to come from the zygote.
STATUS_SECONDS = 1.0


class NotSent(ChannelClosed):
    """The zygote was gone before the request reached it: no owner was forked for it."""


class Forked:
    """An owner process forked by the zygote, as much of ``subprocess.Popen`` as the training
    process uses: ``pid``, ``poll()``, ``wait(timeout)``, ``kill()``."""

    def __init__(self, zygote: Zygote, number: int, pid: int, pidfd: int) -> None:
        self.zygote, self.number, self.pid, self.pidfd = zygote, number, pid, pidfd
        self.returncode: int | None = None
        weakref.finalize(self, os.close, pidfd)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.number, self.pidfd, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.number, self.pidfd, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"owner process {self.pid}", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it has just ended
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


class Zygote:
    """The training process's side of its zygote: forks owner processes on request."""

    def __init__(self, process: subprocess.Popen, channel: Channel) -> None:
        self.process = process
        self.channel = channel
        self.sending = threading.Lock()  # one request on the connection at a time
        #: the answers; reentrant: a collection may close an unclosed pipe, which waits for its
        #: owner's exit, in the middle of a wait here
        self.state = threading.Condition(threading.RLock())
        self.forked: dict[int, tuple[int, int] | str] = {}  # number: (pid, pidfd), or an error
        self.exits: dict[int, int] = {}  # number: exit status, as Popen says it
        self.abandoned: set[int] = set()  # requests no one waits for (a Ctrl-C)
        self.gone = False  # no more answers: its connection ended
        self.numbers = itertools.count()
        self.receiver = threading.Thread(target=self._receive, name="embedpipe-zygote", daemon=True)
        self.receiver.start()

    def fork(self, fds: tuple[int, ...]) -> Forked:
        """A new owner process, given (copies of) ``fds``; its socket is ``fds[0]``."""
        number = next(self.numbers)
        try:
            cwd = os.getcwd()
        except FileNotFoundError:  # removed: the table's path is absolute
            cwd = "/"
        sent = False
        try:
            with self.sending, interrupts_held():  # a Ctrl-C waits until the request is out
                self.channel.send({"number": number, "cwd": cwd, "fds": fds}, fds=fds)
                sent = True
            return self._forked(number)
        except BaseException as e:
            if sent:
                self._abandon(number)
            elif isinstance(e, ChannelClosed):  # the zygote is gone (a send raises it only then)
                raise NotSent(str(e)) from None
            raise

    def _forked(self, number: int) -> Forked:
        deadline = time.monotonic() + FORK_SECONDS
        with self.state:
            while number not in self.forked:
                left = deadline - time.monotonic()
                if self.gone or left <= 0:
                    raise OSError(f"{self._describe()} forked no owner process {self._why()}")
                self.state.wait(left)
            answer = self.forked.pop(number)
        if isinstance(answer, str):
            raise OSError(answer)
        return Forked(self, number, *answer)

    def exit_code(self, number: int, pidfd: int, timeout: float | None) -> int | None:
        """The exit status of the owner forked for request ``number`` (waiting up to
        ``timeout``), else None. Its ``pidfd`` says whether it has ended; the zygote says how,
        within :data:`STATUS_SECONDS`, unless it is gone (or this is the thread that receives
        what it says: a collection there may close a pipe): then 1, as an owner process exits
        when re-parented."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ended_at = None
        while True:
            with self.state:
                if number in self.exits:
                    return self.exits.pop(number)
                told = not self.gone and threading.current_thread() is not self.receiver
            now = time.monotonic()
            left = None if deadline is None else max(0.0, deadline - now)
            if _ended(pidfd, 0.0):
                ended_at = now if ended_at is None else ended_at
                if not told or now - ended_at > STATUS_SECONDS:
                    return 1
            elif left == 0.0:
                return None
            if told:
                with self.state:
                    if number not in self.exits:
                        self.state.wait(POLL_SECONDS)
            elif not _ended(pidfd, left):
                return None

    def _receive(self) -> None:
        """The thread that receives the zygote's answers, until its connection ends."""
        try:
            while True:
                message, _, fds = self.channel.receive()
                with self.state:
                    number = message["number"]
                    if "exit" in message:
                        self.exits[number] = message["exit"]
                    elif fds:
                        self.forked[number] = (message["pid"], fds[0])
                    else:
                        self.forked[number] = message.get("error", "no pidfd with the answer")
                    self._drop_abandoned()
                    self.state.notify_all()
        except (ChannelClosed, OSError, ValueError):
            pass  # (what is said of the owners still running comes from their pidfds)
        finally:
            with self.state:
                self.gone = True
                self.state.notify_all()

    def _abandon(self, number: int) -> None:
        with self.state:
            self.abandoned.add(number)
            self._drop_abandoned()

    def _drop_abandoned(self) -> None:
        """Answers no one waits for: their owners are killed (the lent lock's file with them)."""
        for number in [n for n in self.abandoned if n in self.forked]:
            answer = self.forked.pop(number)
            if not isinstance(answer, str):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(answer[1], signal.SIGKILL)
                os.close(answer[1])
            self.abandoned.discard(number)

    def _describe(self) -> str:
        return f"the owner processes' zygote (pid {self.process.pid})"

    def _why(self) -> str:
        code = self.process.poll()
        if code is not None:
            return f"(it ended: exit status {code}; its error, if any, is above)"
        return "in time" if not self.gone else "(its connection ended)"

    def retire(self) -> None:
        """No more requests: the zygote ends once its owner processes have (they go on)."""
        with contextlib.suppress(OSError):
            self.channel.sock.shutdown(socket.SHUT_RDWR)  # ends it, and the receiving thread
        self.channel.close()

    def close(self) -> None:
        """At exit: retire it, and wait for it (its owners have closed by then)."""
        self.retire()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _ended(pidfd: int, timeout: float | None) -> bool:
    """Whether the process of ``pidfd`` has ended, waiting up to ``timeout`` seconds."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


_zygote: Zygote | None = None
_lock = threading.Lock()
_available: bool | None = None


def available() -> bool:
    """Whether owner processes can be forked by a zygote here: pidfds (Linux 5.3 and later,
    not blocked by a seccomp profile)."""
    global _available
    if _available is None:
        try:
            pidfd = os.pidfd_open(os.getpid())
            try:
                signal.pidfd_send_signal(pidfd, 0)  # (signal 0: only the right to send one)
            finally:
                os.close(pidfd)
            _available = True
        except (AttributeError, OSError):
            _available = False
    return _available


def fork_owner(
    fds: tuple[int, ...], start: Callable[[], tuple[subprocess.Popen, Channel]]
) -> Forked:
    """An owner process of this process's, forked by its zygote, which ``start()`` starts at the
    first call, and again if it was gone before the request reached it."""
    global _zygote
    for attempt in range(2):
        with _lock:
            if _zygote is None or _zygote.gone:
                if _zygote is not None:
                    _zygote.retire()
                _zygote = Zygote(*start())
            zygote = _zygote
        try:
            return zygote.fork(fds)
        except NotSent:
            zygote.gone = True
            if attempt:
                raise
    raise AssertionError("unreachable")


def _forget_in_child() -> None:
    """A fork of the training process (a DataLoader worker) does not share its zygote: it
    closes its copy of the socket (only its own: the zygote sees the training process's end)."""
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
    """``FD PARENT``: fork owner processes on the requests that come at the socket ``FD``; at
    its end, take no more and end once the owners forked have (or at once, re-parented)."""
    from . import server  # what every owner process imports: once, here

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the training process's
    channel = Channel(socket.socket(fileno=int(argv[0])))
    parent = int(argv[1])
    gc.freeze()  # the modules' objects: shared with every fork, never walked again
    children: dict[int, int] = {}  # pid: the number of the request it was forked for
    poller = select.poll()
    poller.register(channel.sock, select.POLLIN)
    taking = True
    while os.getppid() == parent and (taking or children):
        try:
            for pid, code in _reaped():
                number = children.pop(pid, None)
                if taking and number is not None:
                    channel.send({"number": number, "exit": code})
            if not taking:
                time.sleep(POLL_SECONDS)
            elif poller.poll(POLL_SECONDS * 1000):
                _fork(channel, children, server.serve)
        except ChannelClosed:
            taking = False  # the training process closed it, or is gone (its owners end then)
    return 0


def _fork(channel: Channel, children: dict[int, int], serve: Callable) -> None:
    """Receive a request and fork its owner process; say its pid and a pidfd of it."""
    request, _, fds = channel.receive()
    number, me = request["number"], os.getpid()
    try:
        pid = os.fork()
    except OSError as e:
        pid, error = -1, f"could not fork an owner process: {e}"
    if pid == 0:
        _become_owner(channel, request, fds, me, serve)
    for fd in fds:
        os.close(fd)
    if pid > 0:
        try:
            pidfd = os.pidfd_open(pid)  # before it can be reaped: this very process
        except OSError as e:
            os.kill(pid, signal.SIGKILL)
            pid, error = -1, f"could not open a pidfd of the owner process: {e}"
    if pid < 0:
        channel.send({"number": number, "error": error})
        return
    children[pid] = number
    try:
        channel.send({"number": number, "pid": pid}, fds=(pidfd,))
    finally:
        os.close(pidfd)


def _become_owner(
    channel: Channel, request: dict, fds: list[int], zygote: int, serve: Callable
) -> None:
    """The forked child: the owner process, which never returns to the zygote's loop; it ends
    when its parent is no longer ``zygote``."""
    code = 1
    try:
        channel.close()
        os.chdir(request["cwd"])
        code = serve(fds[0], zygote, dict(zip(request["fds"], fds, strict=True)))
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


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
