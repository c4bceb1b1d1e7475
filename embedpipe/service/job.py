"""One owner process shared by the ranks of a ``torchrun`` job on one machine.

Rank 0's pipe starts the owner process (``server.py``'s ``main`` with a listening socket and the
number of ranks); every other rank's pipe connects to it and *joins* the owner rank 0 opened.
So there is one cache, one optimizer state and one writeback for the machine, in shared memory
that every rank's DataLoader workers read: no rank fetches rows from another.

Each rank's connection is served by a thread of its own (:class:`RankServer`), one request at a
time for the whole job (``Job.lock``), as an in-process owner serves one loop:

- **The steps.** Every rank holds the same averaged gradient (the ranks average it as DDP does,
  at backward: ``rank.py``), so the table steps once per optimizer step: rank 0 sends it; the
  other ranks count it. Every request carries the number of steps its rank has taken
  (``after``), and waits until rank 0 has sent that many before it is served: a rank's batch
  sees exactly the steps before it, whichever rank runs ahead.
- **Checkpoints, snapshots, loads** are asked by every rank at the same point of the loop (as
  frameworks do under DDP); the first request does the work at that step, the same request of
  the other ranks at the same step gets its result (``Job.once``). A snapshot is taken at rank
  0's request, the others' wait for it: rank 0 makes the folder it goes in (Trainer and
  Accelerate make a checkpoint's folder on the main process only), and another rank's request
  may come first.
- **Close** is a meeting: the last rank to close commits, and every rank's ``close()`` returns
  (or raises) after that commit.
- **A rank that is gone** (its connection ends without a close) ends this process at once,
  without a commit: the table stays at its last checkpoint, and every other rank raises
  :class:`~embedpipe.errors.OwnerDiedError` at its next request.

NOTE [ Ranks out of step in an owner process ]
A rank that took a step rank 0 did not (``pipe.step()`` on one rank only) asks for its next
batch after a step that rank 0 will not send: its request waits here. Rank 0 reads on, and at
its backward enters the gradient's header on embedpipe's gloo group, where it waits for that
rank: with the owner in threads the two would meet in a header and raise
``ShardMismatchError``; here each would wait for the other until the group's timeout. So rank
0 tells its owner process when it enters a header (``header``: how many it has entered, at
which step; no reply), and every request says how many headers its rank has entered. A request
that waits for a step rank 0 has not sent, while rank 0 waits in a header this rank has not
reached, at an earlier step, can never be served (rank 0 sends no step until the rank joins
it): it raises ``ShardMismatchError``, and the rank's pipe, closed on it, leaves, so rank 0's
header fails as the rank's connections end (NOTE [ A rank that fails alone ] in
``pipe/unclosed.py``). A request of a rank in step never meets that: a rank that has entered as
many headers as rank 0 took the same steps before the last of them (the header compares them;
a request's step count is read before its header count, so another thread's request, made
while its rank enters a header and steps, is never taken for one behind; and steps counted
before a snapshot's load are not compared with those counted after it).
Rank 0's close does the same (``closing``: it sends no more steps).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import ShardMismatchError
from ..ranks.shards import IN_STEP
from ..store.table import Table
from .channel import NO_REPLY, Channel, ChannelClosed, peer_of
from .server import Server, become_owner

#: Requests that do not wait for rank 0's steps.
UNWAITED = ("open", "join", *NO_REPLY)


class Job:
    """What the connections of one job share (see the module docstring)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.owner: Any = None
        self.lock = threading.Condition()
        self.closing = 0
        self.closed: tuple[str, Any] | None = None  # ("ok", stats) or ("error", exception)
        self.done: dict[tuple[Any, ...], tuple[int, bool, Any]] = {}  # recent collective
        # requests' outcomes: (how many times asked, ok, the result or the error)
        #: A rank is gone (a service's job, which outlives it: ``serve.py``): every other
        #: rank's wait ends, with ``ChannelClosed``
        self.failed = False
        #: Rank 0 closes its pipe after this many steps: a rank waiting for a later one raises
        #: (it would wait for good, while rank 0 waits for it at the close)
        self.final_steps: int | None = None
        #: (headers entered, step, snapshots loaded) at rank 0's last header (the NOTE)
        self.header: tuple[int, int, int] | None = None

    def wait_for(self, ready: Callable[[], bool]) -> None:
        """``lock.wait_for(ready)`` (with ``lock`` held), or ``ChannelClosed`` once the job
        failed."""
        self.lock.wait_for(lambda: self.failed or ready())
        if self.failed:
            raise ChannelClosed("another rank of the job is gone")

    def stranded(self, message: dict[str, Any]) -> str | None:
        """Why the request ``message``, waiting for a step rank 0 has not sent, never will be
        served (NOTE [ Ranks out of step in an owner process ]), or None."""
        if self.final_steps is not None:
            return f"rank 0 closed its pipe after step {self.final_steps}"
        entered = message.get("headers")
        if self.header is not None and entered is not None:
            headers, step, loaded = self.header  # (steps count again from a load's)
            if headers > entered and step < message["after"] and loaded == message["loaded"]:
                return (
                    f"rank 0 waits at step {step} in an exchange with the other ranks that "
                    f"this rank has not reached (rank 0's exchange {headers}, this rank's "
                    f"{entered + 1})"
                )
        return None

    def submitted(self) -> int:
        writeback = self.owner.writeback if self.owner is not None else None
        return writeback.submitted if writeback is not None else 1 << 62

    def once(self, key: tuple[Any, ...], nth: int, work: Callable[[], Any], *, does: bool) -> Any:
        """``work()``'s result (or error) for the ``nth`` request of ``key`` (an operation at a
        step) of each rank: the first rank to ask that ``does`` it, the others get the same,
        waiting for it if need be. ``key`` names the step and the table's generation, so the
        same operation at a later step is done again; ``nth`` counts a rank's requests of
        ``key``, so the same operation asked again at the same step (Trainer saving a step's
        checkpoint again, into a folder it emptied) is done again. Called with ``lock`` held."""
        if self.done.get(key, (0,))[0] < nth:
            if does:
                self.done.pop(key, None)  # the newest last, for the trim below
                try:
                    self.done[key] = (nth, True, work())
                except Exception as e:
                    self.done[key] = (nth, False, e)
                while len(self.done) > 64:  # a rank is at most a step or two behind rank 0
                    del self.done[next(iter(self.done))]
            else:
                self.wait_for(lambda: self.done.get(key, (0,))[0] >= nth)
        _, ok, value = self.done[key]
        if not ok:
            raise value
        return value


class RankServer(Server):
    """One rank's connection to the owner its job shares."""

    def __init__(self, channel: Channel, job: Job, rank: int) -> None:
        super().__init__(channel)
        self.job = job
        self.rank = rank
        self.asked: dict[tuple[Any, ...], int] = {}  # this rank's collective requests, by key

    def _once(self, key: tuple[Any, ...], work: Callable[[], Any], *, does: bool = True) -> Any:
        """``Job.once`` for this rank's next request of ``key``."""
        nth = self.asked[key] = self.asked.pop(key, 0) + 1
        while len(self.asked) > 64:
            del self.asked[next(iter(self.asked))]
        return self.job.once(key, nth, work, does=does)

    @property  # type: ignore[override]
    def owner(self) -> Any:
        return self.job.owner

    @owner.setter
    def owner(self, owner: Any) -> None:
        if owner is not None or getattr(self, "job", None) is not None:
            self.job.owner = owner

    def handle(self, op: str, message: dict[str, Any], arrays: list, fds: list) -> None:
        job = self.job
        with job.lock:
            after = message.get("after", 0)
            if op == "load":  # rank 0's steps up to ours; or another rank loaded (and restarted
                key = ("load", message["folder"], after)  # the count) at the same step
                nth = self.asked.get(key, 0) + 1
                job.wait_for(
                    lambda: (
                        job.submitted() >= after
                        or job.done.get(key, (0,))[0] >= nth
                        or job.stranded(message) is not None
                    )
                )
            elif op not in UNWAITED:  # rank 0's steps up to ours
                job.wait_for(lambda: job.submitted() >= after or job.stranded(message) is not None)
            waited = op not in UNWAITED and job.submitted() < after
            if waited and (op != "load" or job.done.get(key, (0,))[0] < nth):  # never served
                raise ShardMismatchError(
                    f"the ranks of the table {job.owner.table.path} are out of step: rank "
                    f"{self.rank}'s request ({op}) waits for step {after}, and "
                    f"{job.stranded(message)}. {IN_STEP}"
                )
            warnings.showwarning = self._keep_warning  # the owner's warnings go to this rank
            super().handle(op, message, arrays, fds)
            job.lock.notify_all()

    # ----------------------------------------------------------------------------- requests
    def do_open(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        if self.rank != 0 or m["optimizer"] is None:
            raise ValueError("only rank 0 opens the table of an owner its ranks share")
        super().do_open(m, arrays, fds)

    def do_join(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """Another rank's pipe (every rank checked that it made rank 0's: ``rank.py``)."""
        self.rank = m["rank"]
        if self.job.owner is None:
            raise RuntimeError("rank 0 has not opened the table yet")
        self.reply_opened()

    def do_submit(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} sent a step: only rank 0 sends the job's steps")
        self.job.final_steps = None  # (a close that failed, and training went on)
        super().do_submit(m, arrays, fds)

    def do_header(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """Rank 0 enters a header (no reply; NOTE [ Ranks out of step in an owner process ])."""
        if self.rank == 0:
            self.job.header = (m["headers"], m["step"], m["loaded"])

    def do_closing(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """A rank is about to close (no reply); rank 0: it sends no more steps."""
        if self.rank == 0:
            self.job.final_steps = self.job.submitted()

    def do_call(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """checkpoint and save: once for the job at a step (NOTE in the module docstring)."""
        name = m["name"]
        if name not in ("checkpoint", "save"):
            return super().do_call(m, arrays, fds)
        owner = self.owner
        key = (name, *m["args"], m["after"], owner.generation)
        does = name == "checkpoint" or self.rank == 0  # a snapshot: rank 0 made its folder
        self.reply(self._once(key, lambda: getattr(owner, name)(*m["args"]), does=does))

    def do_load(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        owner = self.owner

        def load() -> tuple[int, int]:
            owner.load(Table.open(m["folder"], "r"))
            return owner.generation, owner.applied_step

        self.reply(*self._once(("load", m["folder"], m["after"]), load))

    def do_close(self, m: dict[str, Any], arrays: list, fds: list) -> None:
        """The last rank to close commits; every rank's reply waits for that commit."""
        job = self.job
        job.closing += 1
        if job.closing == job.ranks:
            try:
                self.owner.close(m["raise_errors"])
                job.closed = ("ok", self.owner.stats())
            except BaseException as e:
                job.closed = ("error", e)
            job.lock.notify_all()
        job.wait_for(lambda: job.closed is not None)
        self.done = True
        kind, value = job.closed
        later, self.later = self.later, None  # rank 0's error of a step: said after the commit
        if kind == "ok" and later is not None and m["raise_errors"]:
            self.owner.correct(later)
            kind, value = "error", later
        if kind == "ok":
            self.reply(value)
        else:
            self.reply_error(value, closed=True)


def pipe_facts(m: dict[str, Any]) -> tuple[Any, ...]:
    """What every rank's pipe must agree on, from its opening request."""
    optimizer = m["optimizer"]
    return (
        os.path.realpath(m["path"]),
        m["cache_rows"],
        m["policy"],
        optimizer.config() if optimizer is not None else None,
        m["keep"],
        tuple(sorted(m["options"].items())),
    )


def serve_job(first: Channel, listener: socket.socket, ranks: int) -> None:
    """Serve rank 0 on ``first`` and the other ranks as they connect to ``listener``, each in a
    thread; return when every rank has closed its pipe. A rank that is gone without closing
    ends this process at once (NOTE in the module docstring)."""
    job = Job(ranks)
    threads = [_serve_rank(RankServer(first, job, 0))]
    while len(threads) < ranks:
        sock, _ = listener.accept()
        if peer_of(sock)[1] != os.getuid():
            sock.close()  # never read a pickle from another user
            continue
        threads.append(_serve_rank(RankServer(Channel(sock), job, -1)))  # its rank: at join
    listener.close()
    for thread in threads:
        thread.join()


def _serve_rank(server: RankServer) -> threading.Thread:
    def run() -> None:
        try:
            server.run()
        except BaseException:  # a rank is gone (ChannelClosed): the table stays at its checkpoint
            os._exit(1)

    thread = threading.Thread(target=run, name=f"embedpipe-rank-{server.rank}", daemon=True)
    thread.start()
    return thread


def main(argv: list[str]) -> int:
    """``FD PARENT LISTENER RANKS``: serve rank 0 at the socket ``FD`` and the other ranks of
    its job as they connect to ``LISTENER``."""
    first = become_owner(int(argv[0]), int(argv[1]))
    serve_job(first, socket.socket(fileno=int(argv[2])), int(argv[3]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
