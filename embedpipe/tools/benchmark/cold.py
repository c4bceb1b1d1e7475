"""A table larger than the memory allowed, read from a cold disk; and the whole pipeline's memory.

Two measurements, each loader in a child process of its own, inside a cgroup (v1 memory
controller) made for it and removed after:

(a) **Cold disk.** A table of ``4 x --cold-limit-mib`` (float32 rows of ``--cold-dim``), a cgroup
    limited to ``--cold-limit-mib``, the table's pages dropped from the page cache before every
    timed pass. In the child, side by side, pass after pass: the device's own random-row rate at
    queue depth 1 and 16 (``os.pread`` of one row at random offsets across the table's chunk
    files, one and 16 threads), then embedpipe's frozen loader (lazy, and a cache of
    ``--cold-cache-frac``) over fresh batches: rows read from the table per second, as a ratio to
    the queue-depth-16 rate of the same round (target >= 0.8x). The trace is uniform by default
    (``--cold-zipf 0``): popular rows of a Zipf trace would come from the page cache, not the disk,
    and count as disk reads.
(b) **Peak memory** of the whole pipeline (main process and workers) with no limit: embedpipe at a
    ``--cold-cache-frac`` cache against the in-RAM contender (a plain DataLoader of ids and
    ``nn.Embedding`` holding the whole table), same workers and batches. The target: embedpipe's
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
import glob
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
from .cgroup import MemoryCgroup, cgroup_problem, drop_page_cache, pss_tree
from .options import fraction, integer
from .report import target

NAME = "cold"
QUICK = {"cold_limit_mib": 640, "cold_batches": 40, "cold_reads": 6000, "cold_repeats": 3}
#: The in-RAM contender's memory without its table may grow by this much for embedpipe's pipe.
SLACK = 1.2
TABLE_FACTOR = 4  # the table is this many times the memory allowed
SAMPLE_S = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cold disk and peak memory (section 'cold')")
    g.add_argument(
        "--cold-limit-mib",
        type=integer(64),
        default=768,
        help=f"memory allowed (a cgroup's limit); the table is {TABLE_FACTOR}x this",
    )
    g.add_argument("--cold-dim", type=integer(1), default=256, help="floats per row (float32)")
    g.add_argument("--cold-cache-frac", type=fraction, default=0.10, help="embedpipe's cache")
    g.add_argument(
        "--cold-batch-size", type=integer(1), default=8, help="sequences of --seq-len per batch"
    )
    g.add_argument("--cold-batches", type=integer(1), default=60, help="batches per timed pass")
    g.add_argument(
        "--cold-zipf",
        type=float,
        default=0.0,
        help="Zipf exponent of the cold trace (0: uniform, every row as likely)",
    )
    g.add_argument(
        "--cold-reads", type=integer(16), default=20_000, help="row reads per device measurement"
    )
    g.add_argument("--cold-repeats", type=integer(1), default=3, help="timed passes per loader")


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
    }
    cold = {"device_reads": args.cold_reads, "repeats": args.cold_repeats}
    runs = {
        "lazy": ({**base, **cold, "kind": "embedpipe", "cache_rows": 0}, limit),
        "cache": ({**base, **cold, "kind": "embedpipe", "cache_rows": cache_rows}, limit),
        "memory embedpipe": ({**base, "kind": "embedpipe", "cache_rows": cache_rows}, None),
        "memory in RAM": ({**base, "kind": "in_ram"}, None),
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
        with tqdm(total=len(runs), desc="cold", unit="loader") as bar:
            for number, (name, (spec, limit_bytes)) in enumerate(runs.items()):
                bar.set_postfix_str(name)
                name_here = f"{os.getpid()}-{number}"
                result["runs"][name] = run_child(spec, limit_bytes, name_here, workdir)
                bar.update()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    problems = [r["cgroup_problem"] for r in result["runs"].values() if r["cgroup_problem"]]
    result["cgroup"] = problems[0] if problems else None
    return result


def run_child(
    spec: dict[str, Any], limit_bytes: int | None, name: str, workdir: str
) -> dict[str, Any]:
    """Run one loader in a child (in a cgroup where one can be made), sampling its memory.

    Its output goes to files, not pipes: a DataLoader worker orphaned by an out-of-memory kill
    of its parent would hold a pipe open, and whatever the child left running is killed here."""
    code = f"import json, sys; from {__name__} import child; print(json.dumps(child(json.loads(sys.argv[1]))))"
    argv = [sys.executable, "-c", code, json.dumps(spec)]
    group, problem = None, cgroup_problem()
    if problem is None:
        try:
            group = MemoryCgroup(name, limit_bytes)
        except OSError as e:  # a read-only cgroup file system, a limit refused...
            problem = f"cannot make a memory cgroup ({e})"
    out_path, err_path = (os.path.join(workdir, f"child-{name}.{e}") for e in ("out", "err"))
    seen: set[int] = set()  # the child's descendants (without a cgroup)
    try:
        with open(out_path, "w") as out, open(err_path, "w") as err:
            child = subprocess.Popen(group.command(argv) if group else argv, stdout=out, stderr=err)
        samples = []  # (time, bytes)
        try:
            while child.poll() is None:
                used = group.used() if group else pss_tree(child.pid, seen)
                samples.append((time.time(), used))
                time.sleep(SAMPLE_S)
        finally:
            child.kill()
            child.wait()
            left = group.pids() if group else seen
            kill(left - {child.pid})
        got: dict[str, Any] = {
            "limit_bytes": limit_bytes if group else None,
            "peak_bytes": max((used for _, used in samples), default=0),
            "measured_by": "cgroup rss+shmem" if group else "sum of PSS",
            "returncode": child.returncode,
            "cgroup_problem": problem,
        }
        if group:
            got["max_usage_bytes"] = group.max_usage()
            got["oom_kills"] = group.oom_kills()
        with open(out_path) as out, open(err_path) as err:
            stdout, stderr = out.read(), err.read()
        if child.returncode == 0:
            got.update(json.loads(stdout.strip().splitlines()[-1]))
            looping = [used for when, used in samples if when >= got["loop_started"]]
            got["loop_peak_bytes"] = max(looping, default=got["peak_bytes"])
        else:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            got["error"] = (
                "killed by the kernel (out of memory under the limit)"
                if got.get("oom_kills")
                else f"exit status {child.returncode}: {tail}"
            )
        return got
    finally:
        if group:
            group.close()


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


def against_lazy(result: dict[str, Any], per_device: bool = False) -> float | None:
    """The cached loader's median batches/s over lazy loading's, same batches. The two run one
    after the other, each in a child of its own, and the disk's own rate moves between them (by
    up to 1.3x here): ``per_device``, each pass's batches/s is taken per the queue-depth-16 rate
    measured just before it, as the rows/s ratio is (which over-corrects a loader that is partly
    CPU-bound); else as measured, the target's."""
    lazy, cache = (
        _per_device(result["runs"][name], result.get("batches"), per_device)
        for name in ("lazy", "cache")
    )
    return float(np.median(cache) / np.median(lazy)) if lazy and cache else None


def _per_device(run: dict[str, Any], batches: int | None, per_device: bool) -> list[float]:
    speed = batches_per_second(run, batches)
    return [s / d for s, d in zip(speed, run.get("qd16", []))] if per_device else speed


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
        "Each loader in a child process of its own; the table's pages dropped before each pass. "
        "Device: `os.pread` of one row at random offsets across the chunk files, 1 and 16 "
        "threads. embedpipe: rows read from the table per second by its frozen loader "
        f"({args.workers} workers, batches of {args.cold_batch_size} x {args.seq_len} ids, "
        f"{'uniform' if args.cold_zipf == 0 else f'Zipf s={args.cold_zipf}'}), as a ratio to "
        "the queue-depth-16 rate of the same pass; and batches per second, the cached loader's "
        "as a ratio to lazy loading's, and in brackets with each pass's taken per the "
        "queue-depth-16 rate measured before it (the two loaders run one after the other, and "
        "the disk's rate moves between them).\n"
    )
    header = ["loader", "QD1 rows/s", "QD16 rows/s", "embedpipe rows/s", "vs QD16", "batches/s"]
    header += ["vs lazy", "peak"]
    rows = []
    vs_lazy, per_device = against_lazy(result), against_lazy(result, per_device=True)
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
                "1.00x"
                if name == "lazy" or vs_lazy is None
                else f"{vs_lazy:.2f}x ({per_device:.2f}x)",
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


# ------------------------------------------------------------------------------- the child
def table_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "weight", "c", "*", "0")))


def device_rate(files: list[str], row_bytes: int, reads: int, depth: int, seed: int) -> float:
    """Random one-row reads per second at queue depth ``depth`` (that many threads of
    ``os.pread``, which releases the GIL), the files' pages dropped first."""
    fds = [os.open(name, os.O_RDONLY) for name in files]
    try:
        rows_per_file = os.fstat(fds[0]).st_size // row_bytes
        rng = np.random.default_rng(seed)
        which = rng.integers(0, len(fds), reads).tolist()
        offsets = (rng.integers(0, rows_per_file, reads) * row_bytes).tolist()
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # one page per read, as embedpipe
        drop_page_cache(files)

        def read(part: range) -> None:
            for k in part:
                os.pread(fds[which[k]], row_bytes, offsets[k])

        threads = [
            threading.Thread(target=read, args=(range(t, reads, depth),)) for t in range(depth)
        ]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return reads / (time.perf_counter() - started)
    finally:
        for fd in fds:
            os.close(fd)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One loader: a warm-up pass, then timed passes over fresh batches (see the docstring)."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Sampler

    from ...pipe.handle import EmbeddingPipe
    from ...store.table import Table
    from .traces import TraceDataset, zipf_trace

    torch.set_num_threads(1)
    table = Table.open(spec["path"])
    vocab, dim = table.num_rows, table.dim
    files = table_files(spec["path"])
    batches, repeats = spec["batches"], spec.get("repeats", 1)
    trace_args = argparse.Namespace(
        vocab=vocab,
        zipf=spec["zipf"],
        seed=spec["seed"],
        batch_size=spec["batch_size"],
        seq_len=spec["seq_len"],
    )
    trace = zipf_trace(trace_args, (1 + repeats) * batches)
    per_pass = batches * spec["batch_size"]

    class Passes(Sampler):
        """The sequences of pass ``number``: fresh ids every pass (pass 0 is the warm-up)."""

        number = 0

        def __len__(self) -> int:
            return per_pass

        def __iter__(self):
            return iter(range(self.number * per_pass, (self.number + 1) * per_pass))

    passes = Passes()
    kw = {
        "batch_size": spec["batch_size"],
        "sampler": passes,
        "num_workers": spec["workers"],
        "persistent_workers": spec["workers"] > 0,
    }
    dataset = TraceDataset(trace.ids)
    out: dict[str, Any] = {"qd1": [], "qd16": [], "rates": [], "seconds": []}
    if spec["kind"] == "in_ram":
        weight = table.to_tensor()
        table.close()
        embedding = nn.Embedding.from_pretrained(weight, freeze=True)
        out["loop_started"] = time.time()
        for batch in DataLoader(dataset, **kw):
            embedding(batch["input_ids"])
        return out
    table.close()
    out["loop_started"] = time.time()
    with EmbeddingPipe(  # a thread: the cache's bytes are counted from its objects here
        spec["path"], cache_rows=spec["cache_rows"], owner="thread"
    ) as pipe:
        loader = pipe.loader(dataset, **kw)
        for batch in loader:  # warm-up: workers started
            batch["inputs_embeds"]
        owner = pipe._owner
        out["ring_bytes"] = loader.ring.nbytes if loader.ring is not None else 0
        out["pipe_bytes"] = out["ring_bytes"] + cache_bytes(owner)
        for number in range(1, repeats + 1):
            if spec.get("device_reads"):
                for depth, key in ((1, "qd1"), (16, "qd16")):
                    rate = device_rate(files, dim * 4, spec["device_reads"], depth, number)
                    out[key].append(rate)
            passes.number = number
            drop_page_cache(files)
            before = pipe.stats()["rows_read"]
            started = time.perf_counter()
            for batch in loader:
                batch["inputs_embeds"]
            seconds = time.perf_counter() - started
            out["seconds"].append(seconds)
            out["rates"].append((pipe.stats()["rows_read"] - before) / seconds)
        del loader
    return out


def cache_bytes(owner: Any) -> int:
    """The cache's shared block (rows, slot ids, versions, the per-row ``slot_of``) and the
    owner's per-slot and per-row arrays (``last_updated``, the policy's counts)."""
    total = len(owner.shared.block.mmap)
    for part in (owner.cache, owner.cache.policy):
        for value in vars(part).values():
            if isinstance(value, np.ndarray):
                total += value.nbytes
    return total
