"""The memory cgroup and page-cache machinery of the ``cold`` section: :class:`MemoryCgroup` (a
cgroup v1 memory group for one child process: its limit, its memory, its OOM kills),
:func:`cgroup_problem` (why none can be made here), :func:`pss_tree` (a process tree's memory
without a cgroup) and :func:`drop_page_cache` (a set of files' pages dropped before a cold pass).
"""

from __future__ import annotations

import os
import time

CGROUP_ROOT = "/sys/fs/cgroup/memory"


def cgroup_problem() -> str | None:
    """Why no memory cgroup can be made here, or None when one can."""
    if not os.path.isdir(CGROUP_ROOT):
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (not root)"
    return None


class MemoryCgroup:
    """A cgroup v1 memory group for one child: its limit, its memory, its OOM kills; removed by
    ``close()`` (its processes have exited by then)."""

    def __init__(self, name: str, limit_bytes: int | None) -> None:
        self.path = os.path.join(CGROUP_ROOT, f"embedpipe-bench-{name}")
        os.mkdir(self.path)
        try:
            if limit_bytes is not None:
                self._write("memory.limit_in_bytes", str(limit_bytes))
        except BaseException:
            self.close()
            raise

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(text)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the group from its first instruction (its imports count)."""
        procs = os.path.join(self.path, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def used(self) -> int:
        """Anonymous and shared memory of the group's processes, shared pages counted once."""
        stat = dict(line.split() for line in self._read("memory.stat").splitlines())
        return int(stat["total_rss"]) + int(stat["total_shmem"])

    def pids(self) -> set[int]:
        return {int(pid) for pid in self._read("cgroup.procs").split()}

    def max_usage(self) -> int:
        return int(self._read("memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        for line in self._read("memory.oom_control").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        for _ in range(100):  # a worker may still be exiting
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)


def pss_tree(pid: int, seen: set[int]) -> int:
    """Sum of the proportional set sizes of ``pid`` and its descendants (no cgroup); adds their
    pids to ``seen``."""
    import psutil

    total = 0
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            seen.add(p.pid)
            total += p.memory_full_info().pss
    except psutil.Error:
        pass
    return total


def drop_page_cache(files: list[str]) -> None:
    """Drop the files' pages from the OS page cache (only theirs: others' work is left alone);
    written back first, as dirty pages cannot be dropped."""
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
