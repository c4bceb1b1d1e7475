"""CPU seconds a loop costs: the training process's own, and its whole tree's (``CpuMeter``).

A pipe's work is spread over processes: the training process, its DataLoader workers, the owner
process (``owner="process"``) and the lookahead's forked child. On a machine with few cores they
take CPU from one another, so batches/s alone does not say whether a variant is slow because
the training process does too much or because the whole tree does. A meter reads, at the start
and the end of a sample:

- the training process: ``getrusage(RUSAGE_SELF)`` (all of its threads);
- every descendant alive at either end: ``/proc/<pid>/stat`` (user + system ticks, its own and
  its reaped children's);
- the descendants reaped in between: ``getrusage(RUSAGE_CHILDREN)``, which holds their whole
  lives; a process alive at the start and reaped before the end is counted there, less what its
  start reading already counted.

Where ``/proc`` is missing (not Linux), :func:`tree_cpu` gives the training process and the reaped
children only. Ticks are 10 ms: a sample should run a second or more, or be summed over samples.
"""

from __future__ import annotations

import os
import resource

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid`` and of the children it reaped, or None if it is
    gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ...
    return int(fields[1]), sum(int(f) for f in fields[11:15]) / _TICK


def descendants(root: int) -> dict[int, float]:
    """CPU seconds of each living descendant of ``root`` (children, their children, ...)."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    stats = {pid: s for pid in pids if (s := _stat(pid)) is not None}
    found: dict[int, float] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in stats.items() if ppid in frontier} - found.keys()
        found.update({pid: stats[pid][1] for pid in frontier})
    return found


def _rusage(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


class CpuMeter:
    """CPU seconds of this process and of its whole tree between :meth:`start` and
    :meth:`stop`, added up over any number of samples."""

    def __init__(self) -> None:
        self.own = 0.0  # the training process
        self.tree = 0.0  # the training process and every process under it
        self._start: tuple[float, float, dict[int, float]] | None = None

    def start(self) -> None:
        self._start = (
            _rusage(resource.RUSAGE_SELF),
            _rusage(resource.RUSAGE_CHILDREN),
            descendants(os.getpid()),
        )

    def stop(self) -> None:
        own0, reaped0, living0 = self._start
        own = _rusage(resource.RUSAGE_SELF) - own0
        reaped = _rusage(resource.RUSAGE_CHILDREN) - reaped0
        living = descendants(os.getpid())
        # alive at the end: their ticks since the start (or since birth)
        tree = sum(cpu - living0.get(pid, 0.0) for pid, cpu in living.items())
        # gone by the end: their whole lives are in `reaped`, less what the start counted
        tree += reaped - sum(cpu for pid, cpu in living0.items() if pid not in living)
        self.own += own
        self.tree += own + max(tree, 0.0)
        self._start = None
