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

A job of several ranks on this machine (``torchrun``) is served as ``job.py``'s owner process
serves one: rank 0's first request names the job and its number of ranks (:class:`ServiceJob`),
the others join it by that name as they connect, each served by a thread of its own. A rank
that is gone fails the job: every other rank's connection is ended, and the job is dropped.

NOTE [ Shard services ]
``embedpipe serve TABLE --shard i/S`` serves the rows of shard i of S (split at chunk
boundaries as ``ranks/shards.py`` splits them for S machines) to the ranks of machine i of a
job over S machines, as the owner process a job starts on each machine does (``rank.py``,
NOTE [ A shard a machine ]): the first shard's service holds the writer lock and commits every
shard's files; the others hold none (the first one's holds it for the job, whose rank 0 opens
it there before any other machine's rank opens its own) and give each job a handle of its own.

Each service writes only its shard's chunk files, so each takes only those back to the last
checkpoint after a job it drops (``checkpoints.shard_files``), the first one the metadata too.
The first one does it at once. A later shard's does it when the next job opens its table:
when a machine's rank dies, its service drops the job while the first shard's service may still
be committing a checkpoint for the job's other ranks, whose hard links would take some of the
files as they were and some as taken back; by the next job's open, the first shard's service
has served that job's rank 0, so the dropped job is over there. The same open takes back what
a job left when its service died, or when its last commit failed. The first shard's service
adds the state arrays a job's optimizer needs, every shard's chunks of them, while a later
shard's service may still be dropping a job that wrote its own: so a later shard fills its
chunks of the arrays added since the checkpoint again at the open, and removes its chunks of
arrays the table dropped (``shard.py``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import socket
import stat
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import TableLockedError
from ..store import checkpoints
from ..store.table import Table
from .address import default_address, listen, socket_path
from .channel import Channel, ChannelClosed, peer_of
from .job import Job, RankServer
from .server import Server
from .shard import ServedShard, check

_show_warning = warnings.showwarning
#: How long a refused connection gets to send its first request.
REFUSE_SECONDS = 10.0
#: How long a dropped job's ranks get to let go of its owner (a longer hold: a write hangs).
DROP_SECONDS = 30.0


class ServiceServer(Server):
    """One job's connection to a :class:`Service`: the service's table, its lock held."""

    def __init__(self, channel: Channel, service: Service | None = None) -> None:
        super().__init__(channel)
        self.service = service
        self.peer = 0  # the job's pid (its rank 0's)
        self.dropping = False  # gone, or a request it cannot read: the next job may queue

    @property
    def address(self) -> str:
        return self.service.address

    def open_table(self, m: dict[str, Any]) -> tuple[Table, bool]:
        service = self.service
        if os.path.realpath(m["path"]) != service.table.path:
            raise ValueError(
                f"the service at {self.address} serves table {service.table.path}, not "
                f"{m['path']}: connect to that table's service, or start one for it "
                "(embedpipe serve TABLE)"
            )
        if m["optimizer"] is None:  # frozen (the pipe runs its own owner: ``pipe/handle.py``)
            return Table._reader(m["path"], m["root"]), True
        check(service.shard, m.get("shard"), self.address, service.table.path)
        table = service.table
        if not service.locks:  # a later shard's: the rows of a job whose first shard's holds it
            table = Table._reader(m["path"], m["path"], "r+")
        if service.shard is not None:  # NOTE [ Shard services ]: its files at the checkpoint
            try:
                service.shard.settle(table, m["optimizer"].state_init())
            except BaseException:
                if table is not service.table:
                    table.close()
                raise
        return table, not service.locks

    def take_back(self, table: Table) -> None:
        """A dropped job: the first shard's service (or the whole table's) takes its files
        back now; a later shard's service when the next job opens them (NOTE [ Shard
        services ])."""
        if self.service.locks:
            table._roll_back(self.service.files())

    def do_open(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        super().do_open(m, arrays, fds)
        self.owner.releases_when_hung = False  # a write that hangs ends the service: its lock


class ServiceJob(Job):
    """The ranks of one ``torchrun`` job (on this machine) that a service serves, as the
    owner process ``job.py`` runs for its job: one owner their ranks share. Rank 0's request
    names the job (``token``); the other ranks join it by that name. A rank that is gone
    fails the job (:meth:`Service._fail`): the others' connections are ended, and the job is
    dropped as a job of one process that died."""

    def __init__(self, ranks: int, token: str) -> None:
        super().__init__(ranks)
        self.token = token
        self.servers: list[ServiceRankServer] = []  # rank 0's first, then as they join
        self.threads: list[threading.Thread] = []  # the joined ranks'

    def joining(self) -> bool:
        return not self.failed and len(self.servers) < self.ranks


class ServiceRankServer(RankServer, ServiceServer):
    """One rank's connection of a :class:`ServiceJob`."""

    def __init__(self, channel: Channel, job: ServiceJob, rank: int, service: Service) -> None:
        super().__init__(channel, job, rank)
        self.service = service


class Service:
    """The owner of the table at ``path``, served at ``address`` until :meth:`stop`;
    ``shard=(i, S)``: of its shard i of S, for the ranks of a job's machine i (NOTE [ Shard
    services ])."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        address: str | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        if shard is not None and shard[1] == 1:
            shard = None  # (0/1: the whole table)
        #: Whether this service holds the writer lock: the whole table's, or the first shard's
        self.locks = shard is None or shard[0] == 0
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise ValueError(f"--shard is i/S with 0 <= i < S, got {shard[0]}/{shard[1]}")
        if self.locks:
            self.table = Table.open(path, "r+")  # the lock, held while the service runs
        else:  # its path and shape (each job's own handle writes): the live arrays, unpinned
            opened = Table.open(path)
            self.table = Table._reader(opened.path, opened.path)
            opened.close()
        try:
            #: The shard it serves (None: the whole table)
            self.shard = ServedShard(self.table, *shard) if shard is not None else None
            self.address = address or default_address(self.table.path, shard)
            self.socket_path = socket_path(self.address)
            self.listener = listen(self.socket_path, self.address)
        except BaseException:
            self.table.close()
            raise
        self.serving: ServiceServer | None = None  # a job's rank 0, or its one process
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
            if (self.locks and self.table._lock is None) or any(
                t.name == "embedpipe-writeback" and t.is_alive() for t in threading.enumerate()
            ):
                _hung(self.table.path)
            raise
        finally:
            self.stop()
            if self.table._modified:  # a job's unfinished change: never commit it
                self.table._roll_back(self.files())
            self.table._release_claim()
            self.table.close()

    def files(self) -> Callable[[str], bool] | None:
        """The table's files this service writes (``checkpoints.recover``'s ``only``)."""
        return self.shard.files if self.shard is not None else None

    def describe(self) -> str:
        shard = f" {self.shard.describe()}" if self.shard is not None else ""
        return f"{self.table.path}{shard}"

    def _serve_job(self, sock: socket.socket) -> bool:
        """Serve one job until it closes its pipe or is gone (its steps since its last
        checkpoint are then dropped); False: a table write hangs. A job of several ranks
        (its first request says how many) is served as ``job.py`` serves one, the other
        ranks joining as they connect (``_accept``)."""
        server = ServiceServer(Channel(sock), self)
        server.peer = peer_of(sock)[0]
        with self.state:
            self.waiting -= 1
            self.serving = server
        job: ServiceJob | None = None
        try:
            if self.stopped.is_set():  # a signal before ``serving`` was set: it did not raise
                raise KeyboardInterrupt
            first = server.channel.receive()
            job = _job_of(first[0])
            if job is not None:
                rank_0 = ServiceRankServer(server.channel, job, 0, self)
                rank_0.peer = server.peer
                job.servers.append(rank_0)
                with self.state:
                    self.serving = server = rank_0
            server.run(first)
        except BaseException as e:  # the job is gone, or the service was told to stop
            if job is not None:
                self._fail(job)
            server.dropping = True  # before the close its peer sees: the next job may queue
            server.channel.close()
            if not _drop(server, job):
                return False
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if not isinstance(e, ChannelClosed):  # (a request it cannot read: another version's)
                sys.stderr.write(f"embedpipe serve: dropped the job of pid {server.peer}: {e!r}\n")
        finally:
            if job is not None:  # the other ranks' threads: ended by the close, or the failure
                for thread in job.threads:
                    thread.join(DROP_SECONDS)
                    if thread.is_alive():  # held in a write that hangs
                        _hung(self.table.path)
            with self.state:
                self.serving = None
            server.channel.close()
            warnings.showwarning = _show_warning  # let go of the job's server
            server.rings.clear()
        if server.owner is not None and not server.owner.closed and not _drop(server, job):
            return False  # (a job's ranks closed, and the last one's commit failed)
        owner, server.owner = server.owner, None
        if owner is not None and owner.writeback is not None and owner.writeback.alive:
            return False  # its close found a write hanging
        del owner, server
        gc.collect()  # the job's cache and rings (an owner's threads hold cycles)
        if self.locks:
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
                job = getattr(serving, "job", None)
                if job is not None and not serving.done and job.joining():
                    job.threads.append(
                        threading.Thread(target=self._join, args=(job, sock), daemon=True)
                    )
                    job.threads[-1].start()
                    continue
                free = (
                    serving is None
                    or serving.done
                    or serving.dropping
                    or not _alive(serving.peer)
                    or (job is not None and job.failed)  # being dropped: the next job waits
                )
                if free and self.waiting == 0:
                    self.waiting += 1
                    self.pending.put(sock)
                    continue
            threading.Thread(target=self._refuse, args=(sock,), daemon=True).start()

    def _join(self, job: ServiceJob, sock: socket.socket) -> None:
        """Serve a rank of ``job`` that connected: its first request must join that job (by
        its name), else it is refused as a second job; a rank that is gone fails the job."""
        server = ServiceRankServer(Channel(sock), job, -1, self)
        try:
            sock.settimeout(REFUSE_SECONDS)
            first = server.channel.receive()
            sock.settimeout(None)
        except (OSError, ChannelClosed):
            server.channel.close()
            return
        with job.lock:
            joins = first[0].get("op") == "join" and first[0].get("job") == job.token
            if joins and job.joining():
                job.servers.append(server)
        if server not in job.servers:
            self._refuse(sock, first)
            return
        if job.failed:  # (failed as it joined: ``_fail`` may have missed its connection)
            self._fail(job)
        try:
            server.run(first)
        except BaseException:
            self._fail(job)
        finally:
            server.rings.clear()
            server.channel.close()

    def _fail(self, job: ServiceJob) -> None:
        """A rank of ``job`` is gone (or the service stops): every other rank's connection
        ends and its wait with it, so the job is dropped (``_serve_job``) and its ranks raise.
        The connections end first: a rank's thread may hold the job's lock in a send to a rank
        that reads no more."""
        job.failed = True  # (before the notice below: no wait starts after it)
        for server in list(job.servers):
            with contextlib.suppress(OSError):
                server.channel.sock.shutdown(socket.SHUT_RDWR)
        if not job.lock.acquire(timeout=DROP_SECONDS):  # held in a write that hangs
            _hung(self.table.path)
        job.lock.notify_all()
        job.lock.release()

    def _refuse(self, sock: socket.socket, first: Any = None) -> None:
        serving = self.serving
        who = f"another job (pid {serving.peer})" if serving is not None else "another job"
        channel = Channel(sock)
        try:
            sock.settimeout(REFUSE_SECONDS)
            if first is None:
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
        except Exception as e:  # a request it cannot read (another version's): refused all the same
            sys.stderr.write(f"embedpipe serve: refused a request it cannot read: {e!r}\n")
        finally:
            channel.close()


def _job_of(first: Any) -> ServiceJob | None:
    """The job of several ranks a connection's first request opens (None: one process's)."""
    if not isinstance(first, dict):  # not a request of embedpipe's: as a job gone
        raise ChannelClosed(f"a first request that is not embedpipe's: {type(first).__name__}")
    if first.get("op") == "join":  # a rank of a job not served here (failed, or elsewhere)
        raise ChannelClosed(f"rank {first.get('rank')} joins a job this service does not serve")
    ranks, token = first.get("ranks", 1), first.get("job")
    if (
        first.get("op") == "open"
        and isinstance(ranks, int)
        and ranks > 1
        and isinstance(token, str)
    ):
        return ServiceJob(ranks, token)
    return None


def _drop(server: ServiceServer, job: ServiceJob | None) -> bool:
    """Drop a job gone without closing (``Server.abandon``), its ranks' threads out of the
    owner first; False: a table write hangs (the service must end)."""
    if job is None:
        return server.abandon()
    if not job.lock.acquire(timeout=DROP_SECONDS):  # a rank's thread holds it in a hung write
        return False
    try:
        return server.abandon()
    finally:
        job.lock.release()


def _hung(path: str) -> None:
    sys.stderr.write(
        f"embedpipe serve: a write to {path} hangs; the service ends (the table reopens at its "
        "last checkpoint)\n"
    )
    os._exit(1)  # with the writing thread: never release the lock under it


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


def main(
    path: str, address: str | None = None, shard: tuple[int, int] | None = None, *, say=print
) -> int:
    """Run a service until SIGINT or SIGTERM (``embedpipe serve``)."""
    service = Service(path, address, shard)

    def stop(signum: int, frame: Any) -> None:
        service.stopped.set()  # the loop ends even where the raise is swallowed (a finalizer)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    say(f"serving {service.describe()} at {service.address} (pid {os.getpid()})", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        service.serve()
    return 0
