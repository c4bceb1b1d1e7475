"""``embedpipe serve TABLE``: a table's owner as a service that outlives the jobs it serves.

A :class:`Service` takes the table's writer lock when it starts and holds it until it stops, so
no other process writes the table in between. It listens on a Unix socket (its *address*,
``unix:PATH``) and serves one training process at a time: a pipe made with
``EmbeddingPipe(table, ..., owner="unix:PATH")`` connects, and from then on the connection is
served exactly as an owner process started by the pipe (``server.py``): the same requests, the
same order, the same replies.

What the service adds is what happens between jobs:

- a job that closes its pipe commits, as always; the service then waits for the next one;
- a job that dies (``kill -9``, out of memory) ends its connection: the service drops every
  step since the job's last checkpoint (queued, or written to the live arrays) and takes the
  table back to that checkpoint, so the next job resumes from exactly what a crash of one
  process would have left (``Server.abandon``);
- a job that connects while another is served, or that asks for another table, is refused with
  an error naming what the service serves;
- a connection from another user is refused before anything is read from it (the header is a
  pickle: only the service's own user may send one).

Each job gets a fresh owner: its cache, policy and optimizer as the job asks for them. The
service ends on SIGINT or SIGTERM: a job it serves then sees its owner gone
(:class:`~embedpipe.errors.OwnerDiedError`), and the table stays at its last checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import queue
import signal
import socket
import stat
import sys
import tempfile
import threading
import warnings
from typing import Any

from ..errors import TableLockedError
from ..store import checkpoints
from ..store.table import Table
from .channel import Channel, ChannelClosed, peer_of
from .server import Server

#: The scheme of a service's address: ``unix:`` and the path of its socket.
SCHEME = "unix:"
_show_warning = warnings.showwarning
#: How long a refused connection gets to send its first request.
REFUSE_SECONDS = 10.0


def is_address(owner: object) -> bool:
    return isinstance(owner, str) and owner.startswith(SCHEME)


def socket_path(address: str) -> str:
    """The socket file of ``address`` (``unix:PATH``), checked to fit a Unix socket's name."""
    if not is_address(address) or len(address) == len(SCHEME):
        raise ValueError(f"a service's address is unix:PATH (a socket file), got {address!r}")
    path = os.path.abspath(os.path.expanduser(address[len(SCHEME) :]))
    if len(path.encode()) > 107:
        raise ValueError(
            f"the socket path {path} is {len(path.encode())} bytes: a Unix socket's is at most "
            "107; choose a shorter --address"
        )
    return path


def default_address(table_path: str) -> str:
    """The address ``embedpipe serve`` listens on without ``--address``: a socket of this user's
    in the temporary folder, named after the table's folder."""
    folder = os.path.join(tempfile.gettempdir(), f"embedpipe-{os.getuid()}")
    name = hashlib.sha1(os.path.realpath(table_path).encode()).hexdigest()[:16]
    return f"{SCHEME}{os.path.join(folder, name)}.sock"


class ServiceServer(Server):
    """One job's connection to a :class:`Service`: the service's table, its lock held."""

    def __init__(self, channel: Channel, table: Table, address: str) -> None:
        super().__init__(channel)
        self.table = table
        self.address = address
        self.peer = 0  # the job's pid

    def open_table(self, m: dict[str, Any]) -> tuple[Table, bool]:
        if os.path.realpath(m["path"]) != self.table.path:
            raise ValueError(
                f"the service at {self.address} serves table {self.table.path}, not "
                f"{m['path']}: connect to that table's service, or start one for it "
                "(embedpipe serve TABLE)"
            )
        if m["optimizer"] is None:  # frozen: the checkpoint the job's handle reads
            return Table._reader(m["path"], m["root"]), True
        return self.table, False

    def do_open(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        super().do_open(m, arrays, fds)
        self.owner.releases_when_hung = False  # a write that hangs ends the service: its lock


class Service:
    """The owner of the table at ``path``, served at ``address`` until :meth:`stop`."""

    def __init__(self, path: str | os.PathLike[str], address: str | None = None) -> None:
        self.table = Table.open(path, "r+")  # the lock, held while the service runs
        try:
            self.address = address or default_address(self.table.path)
            self.socket_path = socket_path(self.address)
            self.listener = _listen(self.socket_path, self.address)
        except BaseException:
            self.table.close()
            raise
        self.serving: ServiceServer | None = None
        self.waiting = 0  # jobs accepted and not yet served (at most one)
        self.state = threading.Lock()  # guards serving and waiting
        self.pending: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self.stopped = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="embedpipe-accept", daemon=True)

    def serve(self) -> None:
        """Serve jobs one after another until :meth:`stop` or a ``KeyboardInterrupt`` (the
        CLI's SIGINT and SIGTERM); then release the table. A job still served then is dropped
        as if it died: the table stays at its last checkpoint. A table write that hangs ends
        this process at once (its lock goes with it; a reopen recovers the checkpoint)."""
        self._acceptor.start()
        try:
            while not self.stopped.is_set():
                try:
                    sock = self.pending.get(timeout=0.2)
                except queue.Empty:
                    continue
                if not self._serve_job(sock):
                    _hung(self.table.path)
        except BaseException:
            if self.table._lock is None or any(t.name == "embedpipe-writeback" and t.is_alive()
                                               for t in threading.enumerate()):  # fmt: skip
                _hung(self.table.path)
            raise
        finally:
            self.stop()
            if self.table._modified:  # a job's unfinished change: never commit it
                self.table._roll_back()
            self.table._release_claim()
            self.table.close()

    def _serve_job(self, sock: socket.socket) -> bool:
        """Serve one job until it closes its pipe or is gone (its steps since its last
        checkpoint are then dropped); False: a table write hangs."""
        server = ServiceServer(Channel(sock), self.table, self.address)
        server.peer = peer_of(sock)[0]
        with self.state:
            self.waiting -= 1
            self.serving = server
        try:
            server.run()
        except BaseException as e:  # the job is gone, or the service was told to stop
            server.channel.close()
            if not server.abandon():
                return False
            if not isinstance(e, ChannelClosed):
                raise
        finally:
            with self.state:
                self.serving = None
            server.channel.close()
            warnings.showwarning = _show_warning  # let go of the job's server
            server.rings.clear()
        owner, server.owner = server.owner, None
        if owner is not None and owner.writeback is not None and owner.writeback.alive:
            return False  # its close found a write hanging
        del owner, server
        gc.collect()  # the job's cache and rings (an owner's threads hold cycles)
        checkpoints.finish_deleting(self.table.path)
        return True

    def stop(self) -> None:
        """Stop taking jobs: :meth:`serve` returns when the job it serves (if any) ends."""
        self.stopped.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                os.unlink(self.socket_path)

    def _accept(self) -> None:
        """Take connections: a job is served next if none is served (or the one served has
        closed its pipe, or died) and none is waiting; the others are refused."""
        while not self.stopped.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return  # stopped
            if peer_of(sock)[1] != os.getuid():
                sock.close()  # never read a pickle from another user
                continue
            with self.state:
                serving = self.serving
                free = serving is None or serving.done or not _alive(serving.peer)
                if free and self.waiting == 0:
                    self.waiting += 1
                    self.pending.put(sock)
                    continue
            threading.Thread(target=self._refuse, args=(sock,), daemon=True).start()

    def _refuse(self, sock: socket.socket) -> None:
        serving = self.serving
        who = f"another job (pid {serving.peer})" if serving is not None else "another job"
        channel = Channel(sock)
        try:
            sock.settimeout(REFUSE_SECONDS)
            channel.receive()
            channel.send(
                {
                    "error": TableLockedError(
                        f"the service at {self.address} (table {self.table.path}) is serving "
                        f"{who}: one job trains a table at a time; wait for it to close its "
                        "pipe, or train another table"
                    ),
                    "warnings": [],
                }
            )
        except (OSError, ChannelClosed):
            pass
        finally:
            channel.close()


def _hung(path: str) -> None:
    sys.stderr.write(
        f"embedpipe serve: a write to {path} hangs; the service ends (the table reopens at its "
        "last checkpoint)\n"
    )
    os._exit(1)  # with the writing thread: never release the lock under it


def _listen(path: str, address: str) -> socket.socket:
    """A listening socket at ``path``, reachable by this user only, in a folder no other user
    can replace it in; a socket file left by a service that died is replaced, a live
    service's is not, and nothing that is not a socket is touched."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or (st.st_uid != os.getuid() and not st.st_mode & stat.S_ISVTX):
        raise OSError(
            f"the folder of {address} is not a folder of this user's (owner uid {st.st_uid}): "
            "another user could replace the socket there; choose another --address"
        )
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket; choose another --address")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody listens: a dead service's socket
        else:
            raise OSError(f"{address} is in use by a running service; choose another --address")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(8)
    return listener


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie, not yet reaped by its parent
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def main(path: str, address: str | None = None, *, say=print) -> int:
    """Run a service until SIGINT or SIGTERM (``embedpipe serve``)."""
    service = Service(path, address)

    def stop(signum: int, frame: Any) -> None:
        service.stopped.set()  # the loop ends even where the raise is swallowed (a finalizer)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    say(f"serving {service.table.path} at {service.address} (pid {os.getpid()})", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        service.serve()
    return 0
