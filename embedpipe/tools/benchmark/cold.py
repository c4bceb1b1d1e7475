"""A table larger than the memory allowed, read from a cold disk; and the whole pipeline's memory.

Two measurements, each loader in a child process of its own (``cold_child.py``), inside a cgroup
(v1 memory controller) made for it and removed after:

(a) **Cold disk.** A table of ``4 x --cold-limit-mib`` (float32 rows of ``--cold-dim``), two
    children each in a cgroup limited to ``--cold-limit-mib``: embedpipe's frozen loader lazy
    (no cache) and with a cache of ``--cold-cache-frac``. They run side by side and take turns,
    pass by pass, over the same fresh batches (which goes first alternates), the table's pages
    dropped from the page cache before every pass; before each round, the device's own
    random-row rate at queue depth 1 and 16 (``os.pread`` of one row at random offsets across the
    table's chunk files, one and 16 threads). Reported: rows read from the table per second, as a
    ratio to the queue-depth-16 rate of the same round (target >= 0.8x); and the cached loader's
    batches per second over lazy loading's in the same round, the median over the rounds
    (target >= 1.0x). Each child first warms up over passes of its own until its cache is
    full (``fill_passes``): the speed and the memory measured are a full cache's, as for most of
    a training run, not a filling one's. The trace is uniform by default (``--cold-zipf 0``):
    popular rows of a Zipf trace would come from the page cache, not the disk, and count as disk
    reads.
(b) **Peak memory** of the whole pipeline (main process and workers) with no limit, after the
    same warm-up: embedpipe at a ``--cold-cache-frac`` cache against the in-RAM contender (a
    plain DataLoader of ids and ``nn.Embedding`` holding the whole table), same workers and
    batches. The target: embedpipe's
    peak <= 1.2 x (its cache + ring + index bytes, from the real objects) + (the contender's
    peak - its table's bytes).

Memory is the cgroup's anonymous and shared memory (``total_rss + total_shmem`` of
``memory.stat``), sampled every 20 ms; shared memory is counted once, however many workers map it.
Not ``memory.max_usage_in_bytes``, which also counts the page cache of every file read (the whole
table, for a contender that loads it; up to the limit, for a reader of a large table); it is
reported next to it. Without a cgroup (not root, no v1 memory controller) the section says so and
runs with no limit, summing the processes' proportional set sizes (PSS) instead.
The cgroup, the PSS sum and the page-cache drop are in ``cgroup.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from . import report as md
from .cgroup import MemoryCgroup, cgroup_problem, pss_tree
from .options import fraction, integer
from .report import target

NAME = "cold"
QUICK = {"cold_limit_mib": 640, "cold_batches": 40, "cold_reads": 6000, "cold_repeats": 3}
#: The in-RAM contender's memory without its table may grow by this much for embedpipe's pipe.
SLACK = 1.2
TABLE_FACTOR = 4  # the table is this many times the memory allowed
SAMPLE_S = 0.02
ANSWER_S = 900  # the longest a loader's child may take to answer (its warm-up, or a pass)
FILL_PASSES = 12  # the most warm-up passes a child makes to fill its cache (``fill_passes``)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cold disk and peak memory (section 'cold')")
    g.add_argument(
        "--cold-limit-mib",
        type=integer(64),
        default=768,
        help=f"memory allowed (a cgroup's limit); the table is {TABLE_FACTOR}x this",
    )
    g.add_argument("--cold-dim", type=integer(1), default=256, help="floats per row (float32)")
    g.add_argument(
        "--cold-cache-frac",
        type=fraction,
        default=0.05,
        help="embedpipe's cache (a share of the table; 10%% of a table 4x the limit outgrows "
        "the limit once full)",
    )
    g.add_argument(
        "--cold-batch-size", type=integer(1), default=8, help="sequences of --seq-len per batch"
    )
    g.add_argument("--cold-batches", type=integer(1), default=60, help="batches per timed pass")
    g.add_argument(
        "--cold-owner",
        default="thread",
        choices=("thread", "process", "auto"),
        help="the cold loaders' owner (the memory run's is a thread: its bytes are counted from "
        "its objects)",
    )
    g.add_argument(
        "--cold-zipf",
        type=float,
        default=0.0,
        help="Zipf exponent of the cold trace (0: uniform, every row as likely)",
    )
    g.add_argument(
        "--cold-reads", type=integer(16), default=20_000, help="row reads per device measurement"
    )
    g.add_argument("--cold-repeats", type=integer(1), default=5, help="timed passes per loader")


# ------------------------------------------------------------------------------- the parent
def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Make the table, then run (a) and (b), each loader in its own child and cgroup."""
    from tqdm.auto import tqdm

    from ...store.table import Table

    row_bytes = args.cold_dim * 4
    limit = args.cold_limit_mib * 2**20
    rows = TABLE_FACTOR * limit // row_bytes
    path = os.path.join(workdir, "cold.zarr")
    cache_rows = max(1, round(args.cold_cache_frac * rows))
    base = {
        "path": path,
        "workers": args.workers,
        "batch_size": args.cold_batch_size,
        "seq_len": args.seq_len,
        "zipf": args.cold_zipf,
        "seed": args.seed,
        "batches": args.cold_batches,
        "warmup": fill_passes(cache_rows, args.cold_batches * args.cold_batch_size * args.seq_len),
    }
    cold = {**base, "kind": "embedpipe", "device_reads": args.cold_reads, "owner": args.cold_owner}
    cold["repeats"] = args.cold_repeats
    paired = {"lazy": {**cold, "cache_rows": 0}, "cache": {**cold, "cache_rows": cache_rows}}
    alone = {
        "memory embedpipe": {**base, "kind": "embedpipe", "cache_rows": cache_rows},
        "memory in RAM": {**base, "kind": "in_ram"},
    }
    result: dict[str, Any] = {
        "table_bytes": rows * row_bytes,
        "batches": args.cold_batches,
        "rows": rows,
        "dim": args.cold_dim,
        "limit_bytes": limit,
        "cache_rows": cache_rows,
        "cgroup": None,  # or why no memory cgroup could be made (no limit then)
        "runs": {},
    }
    try:
        Table.create(path, rows, args.cold_dim, seed=args.seed).close()
        os.sync()  # dirty pages cannot be dropped from the page cache
        with tqdm(total=args.cold_repeats + len(alone), desc="cold", unit="pass") as bar:
            bar.set_postfix_str("lazy and cache")
            result["runs"].update(run_paired(paired, limit, str(os.getpid()), workdir, bar))
            for number, (name, spec) in enumerate(alone.items()):
                bar.set_postfix_str(name)
                result["runs"][name] = Child(spec, None, f"{os.getpid()}-{number}", workdir).end()
                bar.update()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    problems = [r["cgroup_problem"] for r in result["runs"].values() if r["cgroup_problem"]]
    result["cgroup"] = problems[0] if problems else None
    return result


def fill_passes(cache_rows: int, ids_per_pass: int) -> int:
    """Warm-up passes that fill a cache of ``cache_rows`` from uniform ids (nearly all of a
    pass's ids are rows not yet cached), and one more: the memory and the speed measured after
    them are those of a cache that evicts, as for most of a training run. Zipf ids fill it less;
    at most :data:`FILL_PASSES` (a cache larger than that many passes' ids is left part empty)."""
    return min(FILL_PASSES, -(-cache_rows // ids_per_pass) + 1)


def run_paired(specs: dict[str, Any], limit: int, name: str, workdir: str, bar: Any) -> dict:
    """The cold loaders side by side, taking turns pass by pass (the module docstring). A loader
    whose child ends early (killed out of memory) is reported so; the other goes on alone."""
    children: dict[str, Child] = {}
    passes: dict[str, dict[str, list[float]]] = {
        key: {"round": [], "qd1": [], "qd16": [], "rates": [], "seconds": []} for key in specs
    }
    alive: list[str] = []

    def ask(key: str, command: dict[str, int] | None) -> dict[str, float] | None:
        try:
            return children[key].ask(command)
        except ChildEnded:
            alive.remove(key)
            return None

    done = False
    try:
        for key, spec in specs.items():
            children[key] = Child({**spec, "serve": True}, limit, f"{name}-{key}", workdir)
        alive.extend(children)
        for key in list(alive):
            ask(key, None)  # ready: warmed up
        repeats = max(spec["repeats"] for spec in specs.values())
        for number in range(1, repeats + 1):
            device = None
            while alive and device is None:
                device = ask(alive[0], {"device": number})
            for key in list(alive) if number % 2 else alive[::-1]:  # copies: ask may remove
                got = ask(key, {"pass": number})
                if got is not None and device is not None:
                    got = {**device, "round": number, **got}
                    for part in ("round", "qd1", "qd16", "seconds"):
                        passes[key][part].append(got[part])
                    passes[key]["rates"].append(got["rate"])
            bar.update()
        done = True
    finally:
        ended, failed = {}, []
        for key, child in children.items():  # each ended, whatever another's end raises
            try:
                ended[key] = child.end(wait=done)
            except BaseException as e:
                failed.append(e)
        if failed and done:  # (else the section's own error goes on)
            raise failed[0]
    return {key: {**ended[key], **passes[key]} for key in specs}


class ChildEnded(Exception):
    """A loader's child ended before it answered."""


class Child:
    """One loader in a child process (in a cgroup where one can be made), its memory sampled.

    Its output goes to files, not pipes: a DataLoader worker orphaned by an out-of-memory kill of
    its parent would hold a pipe open. A serving child (``spec["serve"]``) reads its commands from
    a pipe to its stdin; whatever it left running is killed at :meth:`end`."""

    def __init__(self, spec: dict[str, Any], limit: int | None, name: str, workdir: str) -> None:
        code = (
            "import json, sys; from embedpipe.tools.benchmark.cold_child import child; "
            "print(json.dumps(child(json.loads(sys.argv[1]))))"
        )
        argv = [sys.executable, "-c", code, json.dumps(spec)]
        self.limit, self.group, self.problem = limit, None, cgroup_problem()
        if self.problem is None:
            try:
                self.group = MemoryCgroup(name, limit)
            except OSError as e:  # a read-only cgroup file system, a limit refused...
                self.problem = f"cannot make a memory cgroup ({e})"
        self.out_path, self.err_path = (
            os.path.join(workdir, f"child-{name}.{e}") for e in ("out", "err")
        )
        self.seen: set[int] = set()  # the child's descendants (without a cgroup)
        self.samples: list[tuple[float, int]] = []  # (time, bytes)
        self.answers = 0
        stdin = subprocess.PIPE if spec.get("serve") else subprocess.DEVNULL
        try:
            with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
                command = self.group.command(argv) if self.group else argv
                self.process = subprocess.Popen(command, stdin=stdin, stdout=out, stderr=err)
        except BaseException:
            if self.group:
                self.group.close()
            raise
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        while self.process.poll() is None:
            used = self.group.used() if self.group else pss_tree(self.process.pid, self.seen)
            self.samples.append((time.time(), used))
            time.sleep(SAMPLE_S)

    def _lines(self) -> list[str]:
        with open(self.out_path) as out:
            return out.read().split("\n")[:-1]  # whole lines only

    def ask(self, command: dict[str, int] | None) -> dict[str, Any]:
        """Send ``command`` (None: none) and return the child's next answer."""
        try:
            if command is not None:
                self.process.stdin.write(json.dumps(command).encode() + b"\n")
                self.process.stdin.flush()
        except BrokenPipeError as e:
            raise ChildEnded from e
        deadline = time.monotonic() + ANSWER_S
        while True:
            lines = self._lines()
            if len(lines) > self.answers:
                self.answers += 1
                return json.loads(lines[self.answers - 1])
            if time.monotonic() > deadline:
                self.process.kill()  # hung: reported as ended
            if self.process.poll() is not None:
                raise ChildEnded
            time.sleep(0.01)

    def end(self, wait: bool = True) -> dict[str, Any]:
        """Wait for the child (a serving one ends at the end of its stdin; ``wait`` False: not
        at all, the section failed), kill what is left, and return its last line with its
        memory, or why it failed."""
        try:
            if self.process.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    self.process.stdin.close()
            if wait:
                self.process.wait()
        finally:
            self.process.kill()
            self.process.wait()
            self.sampler.join()
            left = self.group.pids() if self.group else self.seen
            kill(left - {self.process.pid})
        try:
            return self._result()
        finally:
            if self.group:
                self.group.close()

    def _result(self) -> dict[str, Any]:
        got: dict[str, Any] = {
            "limit_bytes": self.limit if self.group else None,
            "peak_bytes": max((used for _, used in self.samples), default=0),
            "measured_by": "cgroup rss+shmem" if self.group else "sum of PSS",
            "returncode": self.process.returncode,
            "cgroup_problem": self.problem,
        }
        if self.group:
            got["max_usage_bytes"] = self.group.max_usage()
            got["oom_kills"] = self.group.oom_kills()
        if self.process.returncode == 0:
            got.update(json.loads(self._lines()[-1]))
            looping = [used for when, used in self.samples if when >= got["loop_started"]]
            got["loop_peak_bytes"] = max(looping, default=got["peak_bytes"])
        else:
            with open(self.err_path) as err:
                tail = " | ".join(err.read().strip().splitlines()[-3:])
            got["error"] = (
                "killed by the kernel (out of memory under the limit)"
                if got.get("oom_kills")
                else f"exit status {self.process.returncode}: {tail}"
            )
        return got


def kill(pids: set[int]) -> None:
    """SIGKILL each of ``pids`` (this section's own children's leftovers) that still runs."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------- the report
def ratios(run: dict[str, Any]) -> list[float]:
    """embedpipe's rows/s over the device's queue-depth-16 rate, pass by pass."""
    return [r / d for r, d in zip(run.get("rates", []), run.get("qd16", []))]


def batches_per_second(run: dict[str, Any], batches: int | None) -> list[float]:
    """The loader's batches per second, pass by pass (none for a result saved before the
    section recorded its batches a pass)."""
    return [batches / seconds for seconds in run.get("seconds", [])] if batches else []


def against_lazy(result: dict[str, Any]) -> float | None:
    """The cached loader's batches/s over lazy loading's in the same round (the same batches, one
    loader right after the other, the page cache dropped before each): the median over rounds."""
    lazy, cache = (
        dict(zip(result["runs"][name].get("round", []), result["runs"][name].get("seconds", [])))
        for name in ("lazy", "cache")
    )
    paired = [lazy[number] / cache[number] for number in lazy if number in cache]
    return float(np.median(paired)) if paired else None


def budget(result: dict[str, Any]) -> float | None:
    """1.2 x (cache + ring + index) + the contender's peak without its table."""
    pipe, ram = result["runs"]["memory embedpipe"], result["runs"]["memory in RAM"]
    if "pipe_bytes" not in pipe or "error" in ram:
        return None
    return SLACK * pipe["pipe_bytes"] + ram["loop_peak_bytes"] - result["table_bytes"]


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    runs = result["runs"]
    where = (
        f"a cgroup limited to {md.mib(result['limit_bytes'])}"
        if result["cgroup"] is None
        else f"no limit ({result['cgroup']})"
    )
    head = (
        f"### Cold disk (table {md.mib(result['table_bytes'])}: {result['rows']:,} x "
        f"{result['dim']} float32, under {where})\n\n"
        "The two loaders run side by side, each in a child process and cgroup of its own, and "
        "take turns pass by pass over the same batches (which goes first alternates); the "
        "table's pages are dropped before each pass. Device, before each round: `os.pread` of "
        "one row at random offsets across the chunk files, 1 and 16 threads. embedpipe: rows "
        "read from the table per second by its frozen loader "
        f"({args.workers} workers, owner={args.cold_owner!r}, batches of "
        f"{args.cold_batch_size} x {args.seq_len} ids, "
        f"{'uniform' if args.cold_zipf == 0 else f'Zipf s={args.cold_zipf}'}), as a ratio to "
        "the queue-depth-16 rate of the same round; and batches per second, the cached "
        "loader's as the median over the rounds of its ratio to lazy loading's in the round. "
        "Peak: each loader's own cgroup.\n"
    )
    header = ["loader", "QD1 rows/s", "QD16 rows/s", "embedpipe rows/s", "vs QD16", "batches/s"]
    header += ["vs lazy", "peak"]
    rows = []
    vs_lazy = against_lazy(result)
    for name, label in (("lazy", "lazy (cache 0)"), ("cache", f"cache {result['cache_rows']:,}")):
        r = runs[name]
        if "error" in r:
            rows.append([label, "-", "-", r["error"], "-", "-", "-", md.mib(r["peak_bytes"])])
            continue
        speed = batches_per_second(r, result.get("batches"))
        rows.append(
            [
                label,
                f"{np.median(r['qd1']):,.0f}",
                f"{np.median(r['qd16']):,.0f}",
                f"{np.median(r['rates']):,.0f}",
                md.ratio(md.quartiles(ratios(r))),
                f"{np.median(speed):,.1f}" if speed else "-",
                "1.00x" if name == "lazy" or vs_lazy is None else f"{vs_lazy:.2f}x",
                md.mib(r["peak_bytes"]),
            ]
        )
    text = head + "\n" + md.md_table(header, rows) + "\n"
    pipe, ram = runs["memory embedpipe"], runs["memory in RAM"]
    header = ["pipeline (no limit)", "peak", "peak in the loop", "max_usage (with page cache)"]
    rows = []
    for label, r in (
        (f"embedpipe, cache {result['cache_rows']:,}", pipe),
        ("in RAM: DataLoader + nn.Embedding", ram),
    ):
        peak = r["error"] if "error" in r else md.mib(r["peak_bytes"])
        loop = md.mib(r["loop_peak_bytes"]) if "loop_peak_bytes" in r else "-"
        usage = md.mib(r["max_usage_bytes"]) if "max_usage_bytes" in r else "-"
        rows.append([label, peak, loop, usage])
    text += (
        "\nPeak memory of the whole pipeline (main process and workers, same batches, no limit), "
        f"as {pipe['measured_by']}; max_usage also counts the page cache of the files read. "
        "The contender's budget counts its loop only, after the table is loaded; embedpipe's "
        "peak is its whole run.\n\n" + md.md_table(header, rows) + "\n"
    )
    goal = budget(result)
    if goal is not None:
        text += (
            f"\nembedpipe's cache + index {md.mib(pipe['pipe_bytes'] - pipe['ring_bytes'])}, "
            f"ring {md.mib(pipe['ring_bytes'])}; budget {SLACK} x "
            f"{md.mib(pipe['pipe_bytes'])} + ({md.mib(ram['loop_peak_bytes'])} - table "
            f"{md.mib(result['table_bytes'])}) = {md.mib(goal)}.\n"
        )
    return text


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Cold rows/s vs the device's QD16 rate (lazy and cached), peak memory vs its budget; none
    when the section did not run (the driver lists them as not measured)."""
    if result is None:
        return []
    out = []
    for name in ("lazy", "cache"):
        xs = ratios(result["runs"][name])
        x = float(np.median(xs)) if xs else None
        text = f"cold disk ({name}): rows/s vs the device's queue-depth-16 rate"
        out.append(target(text, x, ">= 0.80x", None if x is None else x >= 0.8))
    x = against_lazy(result)
    text = "cold disk (cache): batches/s vs lazy loading's"
    out.append(target(text, x, ">= 1.00x", None if x is None else x >= 1.0))
    goal = budget(result)
    x = result["runs"]["memory embedpipe"]["peak_bytes"] / goal if goal else None
    text = "peak memory vs 1.2 x (cache + ring + index) + in-RAM contender without table"
    out.append(target(text, x, "<= 1.00x", None if x is None else x <= 1.0))
    return out
