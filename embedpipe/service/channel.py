"""One end of the connection between a training process and its owner process.

A Unix socket carries messages of three parts: a small pickled header, raw array buffers (rows
and gradients travel as their bytes, never pickled) and file descriptors (a shared-memory block
crosses to the other process as its descriptor, ``SCM_RIGHTS``)::

    prefix: header bytes, descriptors (2 x uint64)  [+ the descriptors, as ancillary data]
    header: pickle of (message, [(shape, dtype) of each buffer])
    buffers: each array's bytes, in order

A peer that is gone (killed, exited) reads as :class:`ChannelClosed` on either side.
"""

from __future__ import annotations

import array
import contextlib
import os
import pickle
import select
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

_PREFIX = struct.Struct("!QQ")
#: How often a receive that waits for a message looks whether it should stop waiting.
POLL_SECONDS = 0.1
#: Socket buffers large enough for a batch's rows in a few system calls.
BUFFER_BYTES = 4 << 20
#: Requests sent without waiting for a reply: the owner never answers one; its error (or one
#: kept for the next request) is the next request's reply.
NO_REPLY = frozenset({"submit", "closing", "header", "drawn", "end_stream"})


class ChannelClosed(ConnectionError):
    """The process at the other end is gone."""


class Channel:
    """Messages over ``sock`` (one end of a connected ``AF_UNIX`` stream socket)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        #: Why the stream can no longer be read in step (a message half sent or half read),
        #: else None; every later send and receive raises :class:`ChannelClosed`.
        self.broken: str | None = None
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):  # a system's limit: more, smaller system calls
                sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket]:
        """A channel, and the other end's socket to hand to a child process."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(mine), theirs

    @classmethod
    def connect(cls, path: str) -> Channel:
        """A channel to the service listening at the socket file ``path``."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(
        self, message: Any, arrays: tuple[np.ndarray, ...] = (), fds: tuple[int, ...] = ()
    ) -> None:
        arrays = tuple(np.ascontiguousarray(a) for a in arrays)
        header = pickle.dumps((message, [(a.shape, a.dtype.str) for a in arrays]), protocol=5)
        prefix = _PREFIX.pack(len(header), len(fds))
        try:
            self._check()
            if fds:  # one system call: it sent the prefix's first bytes, or nothing
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                sent = self.sock.sendmsg([prefix], rights)
                self.broken = "interrupted while it sent a message"  # until the message is out
                if sent != len(prefix):
                    self.sock.sendall(prefix[sent:])
                self.sock.sendall(header)
            else:
                self.broken = "interrupted while it sent a message"
                self.sock.sendall(prefix + header)
            for a in arrays:
                if a.nbytes:
                    self.sock.sendall(memoryview(a.reshape(-1)).cast("B"))
            self.broken = None
        except (BrokenPipeError, ConnectionResetError) as e:
            self.broken = None  # not out of step: the other process is gone
            raise ChannelClosed(str(e)) from e

    def receive(
        self, waiting: Callable[[], None] | None = None
    ) -> tuple[Any, list[np.ndarray], list[int]]:
        """The next message, its arrays (each its own writable memory) and its descriptors.

        ``waiting()`` is called every :data:`POLL_SECONDS` while no byte of it has come (it may
        raise: a held Ctrl-C). An exception while it waits for the message's first byte leaves
        the stream whole; one after it leaves the channel :attr:`broken`."""
        self._check()
        if waiting is not None:
            poller = select.poll()  # not select.select: no limit on the descriptor's number
            poller.register(self.sock, select.POLLIN)
            while not poller.poll(POLL_SECONDS * 1000):
                waiting()
        prefix, fds = self._prefix()
        self.broken = "interrupted while it received a message"  # until the message is in
        header_size, _ = _PREFIX.unpack(prefix)
        message, specs = pickle.loads(self._exactly(header_size))
        arrays = []
        for shape, dtype in specs:
            out = np.empty(shape, dtype=np.dtype(dtype))
            if out.nbytes:
                self._into(memoryview(out.reshape(-1)).cast("B"))
            arrays.append(out)
        self.broken = None
        return message, arrays, fds

    def _check(self) -> None:
        if self.broken is not None:
            raise ChannelClosed(f"the connection was {self.broken}: its messages are out of step")

    def close(self) -> None:
        self.sock.close()

    # ----------------------------------------------------------------------------- internals
    def _prefix(self) -> tuple[bytes, list[int]]:
        fds: list[int] = []
        space = socket.CMSG_SPACE(16 * array.array("i").itemsize)
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(_PREFIX.size, space)
        except ConnectionResetError as e:
            raise ChannelClosed(str(e)) from e
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:  # the kernel dropped descriptors: out of step from here
            for fd in fds:
                os.close(fd)
            self.broken = "sent descriptors this process could not take"
            raise OSError(
                "descriptors sent to this process were dropped: it has as many files open as it "
                "may (raise the limit, `ulimit -n`, or open fewer)"
            )
        if not data:
            raise ChannelClosed("the other process closed the connection")
        if len(data) < _PREFIX.size:
            data += self._exactly(_PREFIX.size - len(data))
        for fd in fds:
            os.set_inheritable(fd, False)
        return data, fds

    def _exactly(self, size: int) -> bytes:
        out = bytearray(size)
        self._into(memoryview(out))
        return bytes(out)

    def _into(self, view: memoryview) -> None:
        while len(view):
            try:
                got = self.sock.recv_into(view)
            except ConnectionResetError as e:
                raise ChannelClosed(str(e)) from e
            if got == 0:
                raise ChannelClosed("the other process closed the connection mid-message")
            view = view[got:]


def peer_of(sock: socket.socket) -> tuple[int, int]:
    """The pid and the user of the process at the other end of ``sock`` (``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


@contextlib.contextmanager
def interrupts_held() -> Iterator[Callable[[], None] | None]:
    """Hold SIGINT back (in the main thread, under Python's own handler) while a message
    crosses, and SIGCHLD under a Python handler (the DataLoader's raises ``RuntimeError`` when
    a worker died: raised mid-message, it left the connection out of step, seen in CI); yields
    the check that raises what was held (called while nothing has crossed yet), and raises it
    at the end if it was not raised before."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield None
        return
    held: list[int] = []
    child = getattr(signal, "SIGCHLD", None)
    on_child = signal.getsignal(child) if child is not None else None
    if not callable(on_child):
        on_child = None

    def interrupted() -> None:
        if held:
            signals = set(held)
            held.clear()
            if signal.SIGINT in signals:
                raise KeyboardInterrupt
            if on_child is not None:
                on_child(child, None)  # as it would have run: raises if a worker died

    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    if on_child is not None:
        signal.signal(child, lambda signum, frame: held.append(signum))
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if on_child is not None:
            signal.signal(child, on_child)
    interrupted()
