"""Benchmark embedpipe's crash-consistent checkpoints against icechunk, on the same work.

Part 1, checkpoint cost. One float32 table (``--rows`` x ``--dim``, chunks of ``--chunk-rows``,
uncompressed zarr v3) is held twice: as an embedpipe ``Table`` and as an array in a local
icechunk repository, both starting from the same rows. For each dirty set (random distinct rows
for each of ``--fractions``; a Zipf(``--zipf-a``) trace of ``1%`` of the rows' worth of token
draws, deduplicated, once through a random permutation of the ids and once without one; one row,
the fixed cost of a commit; ``--small-writes`` calls of a few random rows each, which is how the
pipe's evictions reach the table) and each repeat, on both systems with the same ids and rows:

* embedpipe, right after a commit (every chunk file shared with the checkpoint):
  ``Table.write`` of the rows, which copies every chunk it touches first (copy-on-write), then
  ``Table.checkpoint()``. Then the in-place baseline: the same write on a table whose files no
  checkpoint shares (an untimed write copies them first, the caches are settled again, then the
  timed write goes in place), so ``COW / in place`` is the overhead of copy-on-write.
* icechunk: a writable session, the rows written through zarr (``--icechunk-write``), then
  ``session.commit()``. icechunk's local filesystem storage does not fsync anything (checked
  with strace on 1.1.21), so the script also times an fsync of every file the commit added and
  of their folders: what icechunk would pay to be as durable as embedpipe's commit.

Bytes: *new disk usage* is ``st_blocks * 512`` summed over the inodes (files and folders) that
exist after the commit and did not before, so space freed by pruning old checkpoints is not
subtracted; *write_bytes* is the delta of this process's ``/proc/self/io`` write_bytes (pages it
dirtied, including icechunk's Rust threads) over write + commit, read after an ``os.sync()``.

Part 2, training throughput between checkpoints: a model-free training loop on a smaller table
(``loss = (inputs_embeds * w).sum()``, then ``pipe.step()``: SGD on the table, Zipf token ids,
2 DataLoader workers, a cache of ``--train-cache`` of the rows) with ``pipe.checkpoint()`` every
N steps (``--train-every``; 0 = never). Each run starts from a freshly created (and so committed)
table.

Page cache: with ``--cold`` (the default when run as root) part 1 runs ``sync`` and drops the page
cache (``echo 3 > /proc/sys/vm/drop_caches``) before every timed write phase, so writes read
their chunks from disk. Part 2 is always warm (its table fits in memory). Medians over
``--repeats`` are reported; a ratio is the median of the per-repeat ratios (both systems are
measured back to back within a repeat, in alternating order).

    python scripts/bench_checkpoint.py                 # 1 GiB table, 3 repeats (6-8 minutes)
    python scripts/bench_checkpoint.py --quick         # 64 MiB table, 1 repeat (< 1 minute)
    python scripts/bench_checkpoint.py --warm --json out.json --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
import zarr

import embedpipe
from embedpipe.pipe import EmbeddingPipe
from embedpipe.store.table import Table

try:
    import icechunk
except ImportError:  # part 1 then measures embedpipe alone
    icechunk = None

MiB = 2**20


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="64 MiB table, 1 repeat, short training")
    p.add_argument("--rows", type=int, default=1 << 20, help="rows of the part-1 table")
    p.add_argument("--dim", type=int, default=256, help="float32 values per row")
    p.add_argument("--chunk-rows", type=int, default=1024, help="rows per chunk (1 MiB at dim 256)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1, 1.0])
    p.add_argument("--zipf-a", type=float, default=1.1, help="exponent of the Zipf dirty sets")
    p.add_argument(
        "--small-writes",
        type=int,
        nargs=2,
        default=[200, 16],
        metavar=("CALLS", "ROWS"),
        help="a dirty set written as CALLS calls of ROWS random rows each",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats of part 1")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--cold",
        dest="cold",
        action="store_true",
        default=None,
        help="drop the page cache before each timed write phase (needs root)",
    )
    cache.add_argument("--warm", dest="cold", action="store_false", help="never drop it")
    p.add_argument(
        "--icechunk-write",
        choices=("orthogonal", "chunks"),
        default="orthogonal",
        help="orthogonal: one zarr set_orthogonal_selection call (zarr reads and "
        "writes the chunks concurrently); chunks: read-modify-write chunk by chunk",
    )
    p.add_argument("--skip-icechunk", action="store_true")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--train-rows", type=int, default=250_000)
    p.add_argument("--train-dim", type=int, default=128)
    p.add_argument("--train-steps", type=int, default=300, help="steps per run, warm-up included")
    p.add_argument("--train-warmup", type=int, default=10, help="first steps not timed")
    p.add_argument(
        "--train-every",
        type=int,
        nargs="+",
        default=[10, 50, 0],
        help="checkpoint every N steps; 0 = never",
    )
    p.add_argument("--train-cache", type=float, default=0.05, help="cache, fraction of rows")
    p.add_argument("--train-batch", type=int, default=8, help="sequences of 128 ids per batch")
    p.add_argument("--train-repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="make the temporary folder here (default: the system's tmp)")
    p.add_argument("--json", metavar="PATH", help="also write every sample as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.repeats = 1 << 16, 1
        args.train_rows, args.train_steps, args.train_repeats = 50_000, 60, 1
    if args.cold is None:
        args.cold = os.geteuid() == 0
    elif args.cold and os.geteuid() != 0:
        p.error("--cold drops the page cache, which needs root; use --warm")
    return args


# ----------------------------------------------------------------------------- measuring
def settle(cold: bool) -> None:
    """Write out dirty pages; with ``cold``, also drop the page cache (and dentries/inodes)."""
    os.sync()
    if cold:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")


def write_bytes() -> int:
    """Bytes of page cache this process (all its threads) has dirtied so far."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes"))


def inodes(folder: str) -> dict[tuple[int, int], tuple[int, bool]]:
    """(dev, inode) -> (bytes allocated, is a folder) for everything under ``folder``."""
    found = {}
    for dirpath, subfolders, files in os.walk(folder):
        subfolders[:] = [d for d in subfolders if not d.startswith(".trash-")]  # being deleted
        for path in [dirpath, *(os.path.join(dirpath, name) for name in files)]:
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # a pruned checkpoint deleted while we walk
                continue
            found[(st.st_dev, st.st_ino)] = (st.st_blocks * 512, path == dirpath)
    return found


def new_usage(before: dict, after: dict) -> tuple[int, int]:
    """Bytes allocated to inodes in ``after`` that were not in ``before``: (all, folders only)."""
    new = [after[k] for k in after.keys() - before.keys()]
    return sum(b for b, _ in new), sum(b for b, d in new if d)


def new_files(folder: str, before: dict) -> list[str]:
    """The files under ``folder`` that are not in ``before``."""
    found = []
    for dirpath, subfolders, files in os.walk(folder):
        subfolders[:] = [d for d in subfolders if not d.startswith(".trash-")]
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if (st.st_dev, st.st_ino) not in before:
                found.append(os.path.join(dirpath, name))
    return found


def fsync_all(files: list[str]) -> None:
    """fsync each file, then each folder holding one (what makes a new file durable)."""
    for path in [*files, *sorted({os.path.dirname(f) for f in files})]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def timed(call, *a: Any) -> float:
    start = time.perf_counter()
    call(*a)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- dirty sets
def dirty_sets(args: argparse.Namespace) -> list[tuple[str, list[np.ndarray]]]:
    """(name, write calls) for each dirty set of part 1; a call is sorted distinct ids."""
    rng = np.random.default_rng(args.seed)
    n = args.rows
    sets = [("1 row", [rng.choice(n, 1)])]  # the fixed cost of a commit
    sets += [
        (f"uniform {f:.0%}", [np.sort(rng.choice(n, round(f * n), replace=False))])
        for f in args.fractions
    ]
    draws = (rng.zipf(args.zipf_a, round(0.01 * n)) - 1) % n  # a token trace: hot ids first
    permutation = rng.permutation(n)
    sets.append(("zipf 1% permuted", [np.unique(permutation[draws])]))
    sets.append(("zipf 1% unpermuted", [np.unique(draws)]))
    calls, size = args.small_writes
    sets.append(
        (
            f"{calls} calls x {size} rows",  # what the pipe's evictions look like
            [np.sort(rng.choice(n, size, replace=False)) for _ in range(calls)],
        )
    )
    return [(name, [ids.astype(np.int64) for ids in calls]) for name, calls in sets]


# ----------------------------------------------------------------------------- embedpipe
def chunk_inodes(table: Table) -> list[int]:
    weight = os.path.join(table.path, "weight", "c")
    chunks = -(-table.num_rows // table.chunk_rows)
    return [os.stat(os.path.join(weight, str(c), "0")).st_ino for c in range(chunks)]


def embedpipe_write(table: Table, calls: list[np.ndarray], rows: np.ndarray) -> None:
    for ids in calls:
        table.write(ids, rows[: len(ids)])


def embedpipe_repeat(table: Table, calls: list[np.ndarray], rows: np.ndarray, cold: bool) -> dict:
    """Write after a commit (copy-on-write) + checkpoint, then the same write in place."""
    other = rows + np.float32(1)
    before, chunks_before = inodes(table.path), chunk_inodes(table)
    settle(cold)
    io = write_bytes()
    cow = timed(embedpipe_write, table, calls, rows)
    copied = sum(a != b for a, b in zip(chunks_before, chunk_inodes(table)))
    commit = timed(table.checkpoint)
    os.sync()
    io = write_bytes() - io
    usage, folders = new_usage(before, inodes(table.path))
    embedpipe_write(table, calls, other)  # copies the chunks again: no checkpoint shares them
    unshared = chunk_inodes(table)
    settle(cold)
    io_in_place = write_bytes()
    in_place = timed(embedpipe_write, table, calls, rows)
    assert chunk_inodes(table) == unshared  # no chunk was replaced: the rows went in place
    os.sync()
    io_in_place = write_bytes() - io_in_place
    table.checkpoint()  # back to "just committed" for the next dirty set
    return dict(
        write=cow,
        commit=commit,
        in_place=in_place,
        chunks_copied=copied,
        new_bytes=usage,
        new_folder_bytes=folders,
        write_bytes=io,
        in_place_write_bytes=io_in_place,
    )


# ----------------------------------------------------------------------------- icechunk
def make_icechunk(folder: str, table: Table) -> Any:
    """A local icechunk repository whose array ``weight`` holds the table's rows."""
    icechunk.set_logs_filter("error")  # not its warning that local storage is single-writer
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(folder))
    session = repo.writable_session("main")
    array = zarr.group(store=session.store).create_array(
        "weight",
        shape=(table.num_rows, table.dim),
        chunks=(table.chunk_rows, table.dim),
        dtype="float32",
        compressors=None,
        fill_value=0.0,
    )
    start = 0
    for block in table.iter_blocks():
        array[start : start + len(block)] = block
        start += len(block)
    session.commit("the table")
    return repo


def icechunk_write(array: zarr.Array, calls: list[np.ndarray], rows: np.ndarray, how: str) -> None:
    for ids in calls:
        if how == "orthogonal":
            array.set_orthogonal_selection((ids, slice(None)), rows[: len(ids)])
        else:
            icechunk_write_chunks(array, ids, rows)


def icechunk_write_chunks(array: zarr.Array, ids: np.ndarray, rows: np.ndarray) -> None:
    """Read-modify-write of each chunk the (sorted) ids fall in, one after another."""
    size = array.chunks[0]
    chunk_of = ids // size
    bounds = np.r_[0, np.flatnonzero(np.diff(chunk_of)) + 1, len(ids)]
    for lo, hi in itertools.pairwise(bounds):
        first = int(chunk_of[lo]) * size
        block = array[first : first + size]
        block[ids[lo:hi] - first] = rows[lo:hi]
        array[first : first + size] = block


def icechunk_repeat(
    repo: Any, folder: str, calls: list[np.ndarray], rows: np.ndarray, cold: bool, how: str
) -> dict:
    before = inodes(folder)
    settle(cold)
    io = write_bytes()
    session = repo.writable_session("main")
    array = zarr.open_array(session.store, path="weight")
    write = timed(icechunk_write, array, calls, rows, how)
    commit = timed(session.commit, "dirty rows")
    durable = timed(fsync_all, new_files(folder, before))  # only the fsyncs are timed
    os.sync()
    io = write_bytes() - io
    usage, folders = new_usage(before, inodes(folder))
    return dict(
        write=write,
        commit=commit,
        fsync=durable,
        new_bytes=usage,
        new_folder_bytes=folders,
        write_bytes=io,
    )


def check_same(table: Table, repo: Any, ids: np.ndarray) -> None:
    """Both systems hold the same rows after the same writes (or the comparison is moot)."""
    array = zarr.open_array(repo.readonly_session("main").store, path="weight")
    sample = ids[:: max(1, len(ids) // 1000)]
    if not np.array_equal(
        table.read(sample), array.get_orthogonal_selection((sample, slice(None)))
    ):
        raise AssertionError("embedpipe and icechunk hold different rows")


# ----------------------------------------------------------------------------- part 1
def checkpoint_cost(args: argparse.Namespace, folder: str) -> list[dict]:
    table = Table.create(
        os.path.join(folder, "table.zarr"),
        args.rows,
        args.dim,
        chunk_rows=args.chunk_rows,
        seed=args.seed,
    )
    repo = None
    if icechunk is not None and not args.skip_icechunk:
        repo = make_icechunk(os.path.join(folder, "icechunk"), table)
    rng = np.random.default_rng(args.seed + 1)
    results = []
    for name, calls in dirty_sets(args):
        ids = np.unique(np.concatenate(calls))
        chunks = len(np.unique(ids // args.chunk_rows))
        longest = max(len(c) for c in calls)
        rows = rng.random((longest, args.dim), dtype=np.float32) + np.float32(0.5)
        result = dict(
            dirty=name, rows=sum(len(c) for c in calls), chunks=chunks, embedpipe=[], icechunk=[]
        )
        for rep in range(args.repeats):
            order = ["embedpipe", "icechunk"] if rep % 2 == 0 else ["icechunk", "embedpipe"]
            for system in order:
                if system == "embedpipe":
                    result[system].append(embedpipe_repeat(table, calls, rows, args.cold))
                elif repo is not None:
                    result[system].append(
                        icechunk_repeat(
                            repo,
                            os.path.join(folder, "icechunk"),
                            calls,
                            rows,
                            args.cold,
                            args.icechunk_write,
                        )
                    )
            print(
                f"  {name}, repeat {rep + 1}: {result['embedpipe'][-1]}"
                + (f" | {result['icechunk'][-1]}" if repo is not None else ""),
                file=sys.stderr,
            )
        if repo is not None:
            check_same(table, repo, ids)
        results.append(result)
    table.close()
    return results


# ----------------------------------------------------------------------------- part 2
class ZipfTokens(torch.utils.data.Dataset):
    """Sentences of 128 Zipf-distributed ids, spread over the table by a random permutation."""

    def __init__(self, n: int, rows: int, a: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.permutation = rng.permutation(rows)
        self.ids = (rng.zipf(a, (n, 128)) - 1) % rows

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.from_numpy(self.permutation[self.ids[i]])}


def train_run(args: argparse.Namespace, path: str, every: int) -> dict:
    Table.create(path, args.train_rows, args.train_dim, seed=args.seed, overwrite=True).close()
    os.sync()
    dataset = ZipfTokens(
        args.train_steps * args.train_batch, args.train_rows, args.zipf_a, args.seed
    )
    w = torch.randn(args.train_dim, generator=torch.Generator().manual_seed(args.seed))
    pipe = EmbeddingPipe(
        path,
        cache_rows=int(args.train_cache * args.train_rows),
        optimizer=embedpipe.optim.SGD(lr=0.1),
    )
    loader = pipe.loader(dataset, batch_size=args.train_batch, num_workers=2)
    checkpoint_times = []
    with pipe:
        for step, batch in enumerate(loader):
            if step == args.train_warmup:
                start, io = time.perf_counter(), write_bytes()
            (batch["inputs_embeds"] * w).sum().backward()
            pipe.step()  # backward only adds to the table's gradient: the step applies it
            if every and (step + 1) % every == 0:
                checkpoint_times.append(timed(pipe.checkpoint))
        seconds = time.perf_counter() - start
        io = write_bytes() - io
    timed_steps = args.train_steps - args.train_warmup
    return dict(
        every=every,
        steps_per_s=timed_steps / seconds,
        checkpoints=checkpoint_times,
        write_bytes=io,
        rows_written=pipe.stats()["rows_written"],
    )


def training_cost(args: argparse.Namespace, folder: str) -> list[dict]:
    path = os.path.join(folder, "train.zarr")
    runs = []
    for rep in range(args.train_repeats):
        shift = rep % len(args.train_every)  # rotate the order: no setting always goes first
        for every in args.train_every[shift:] + args.train_every[:shift]:
            runs.append({**train_run(args, path, every), "repeat": rep})
            print(
                f"  every {every or 'never'}, repeat {rep + 1}: "
                f"{runs[-1]['steps_per_s']:.1f} steps/s",
                file=sys.stderr,
            )
    return runs


# ----------------------------------------------------------------------------- report
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def med(samples: list[dict], key: str) -> float:
    return median([s[key] for s in samples])


def paired(a: list[dict], b: list[dict], key_a: Any, key_b: Any) -> float:
    """Median over repeats of a/b within the same repeat (keys are names or functions)."""

    def get(sample: dict, key: Any) -> float:
        return key(sample) if callable(key) else sample[key]

    return median([get(x, key_a) / get(y, key_b) for x, y in zip(a, b)])


def write_and_commit(sample: dict) -> float:
    return sample["write"] + sample["commit"]


def durable_commit(sample: dict) -> float:
    """icechunk's commit plus the fsync that would make it durable."""
    return sample["commit"] + sample["fsync"]


def durable_total(sample: dict) -> float:
    return sample["write"] + sample["commit"] + sample["fsync"]


def spread(samples: list[dict], key: str) -> str:
    """Median and range, for the phases that wait on the disk (fsync), the noisiest ones."""
    values = [s[key] for s in samples]
    return f"{median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def report_part1(results: list[dict], args: argparse.Namespace) -> str:
    cache = "cold (page cache dropped before each write phase)" if args.cold else "warm"
    size = args.rows * args.dim * 4
    lines = [
        f"### Checkpoint cost: {args.rows:,} x {args.dim} float32 ({mib(size)} MiB), chunks of "
        f"{args.chunk_rows} rows, {cache}, median of {args.repeats}",
        "",
        "Seconds. ep = embedpipe, ic = icechunk "
        f"(writes: {args.icechunk_write}); ic fsync = fsync of the files its commit added. "
        "(min-max) for the phases that wait on fsync.",
        "",
        "| dirty set | row writes | chunks touched | chunks copied | ep write (COW) | ep write in place"
        " | COW / in place | ep checkpoint | ic write | ic commit | ic fsync |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        ep, ic = r["embedpipe"], r["icechunk"]
        lines.append(
            f"| {r['dirty']} | {r['rows']:,} | {r['chunks']} | {med(ep, 'chunks_copied'):.0f} "
            f"| {med(ep, 'write'):.3f} | {med(ep, 'in_place'):.3f} "
            f"| {paired(ep, ep, 'write', 'in_place'):.1f}x | {spread(ep, 'commit')} "
            + (
                f"| {med(ic, 'write'):.3f} | {med(ic, 'commit'):.3f} | {spread(ic, 'fsync')} |"
                if ic
                else "| - | - | - |"
            )
        )
    if not any(r["icechunk"] for r in results):
        lines += ["", "icechunk: not measured (not installed, or --skip-icechunk)."]
    else:
        lines += [
            "",
            "Ratios embedpipe / icechunk (median of per-repeat ratios; > 1: embedpipe slower).",
            "",
            "| dirty set | write | commit | commit vs ic commit + fsync "
            "| write + commit vs ic write + commit + fsync |",
            "|---|--:|--:|--:|--:|",
        ]
        for r in results:
            ep, ic = r["embedpipe"], r["icechunk"]
            lines.append(
                f"| {r['dirty']} | {paired(ep, ic, 'write', 'write'):.2f} "
                f"| {paired(ep, ic, 'commit', 'commit'):.3g} "
                f"| {paired(ep, ic, 'commit', durable_commit):.2f} "
                f"| {paired(ep, ic, write_and_commit, durable_total):.2f} |"
            )
    lines += [
        "",
        "MiB. new disk usage = blocks of inodes that are new after the commit (folders "
        "included); write_bytes = /proc/self/io delta over write + commit, after os.sync().",
        "",
        "| dirty set | row writes x row size | ep new disk usage | of which link-tree folders "
        "| ep write_bytes | ep in-place write_bytes | ic new disk usage | ic write_bytes |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        ep, ic = r["embedpipe"], r["icechunk"]
        lines.append(
            f"| {r['dirty']} | {mib(r['rows'] * args.dim * 4)} | {mib(med(ep, 'new_bytes'))} "
            f"| {mib(med(ep, 'new_folder_bytes'))} | {mib(med(ep, 'write_bytes'))} "
            f"| {mib(med(ep, 'in_place_write_bytes'))} "
            + (
                f"| {mib(med(ic, 'new_bytes'))} | {mib(med(ic, 'write_bytes'))} |"
                if ic
                else "| - | - |"
            )
        )
    return "\n".join(lines)


def report_part2(runs: list[dict], args: argparse.Namespace) -> str:
    never = {r["repeat"]: r["steps_per_s"] for r in runs if not r["every"]}
    lines = [
        f"### Training between checkpoints: {args.train_rows:,} x {args.train_dim} float32, "
        f"cache {args.train_cache:.0%}, batch {args.train_batch} x 128 Zipf({args.zipf_a}) ids, "
        f"2 workers, SGD, {args.train_steps - args.train_warmup} timed steps, warm, "
        f"median of {args.train_repeats}",
        "",
        "vs never: median over repeats of steps/s divided by the same repeat's never run.",
        "",
        "| checkpoint every | steps/s | vs never | one checkpoint (s) | checkpoints per run "
        "| MiB written per run |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for every in args.train_every:
        mine = [r for r in runs if r["every"] == every]
        rate = median([r["steps_per_s"] for r in mine])
        times = [t for r in mine for t in r["checkpoints"]]
        vs_never = median([r["steps_per_s"] / never[r["repeat"]] for r in mine])
        lines.append(
            f"| {f'{every} steps' if every else 'never'} | {rate:.1f} | {vs_never:.2f} "
            f"| {f'{median(times):.3f}' if times else '-'} "
            f"| {len(mine[0]['checkpoints'])} | {mib(median([r['write_bytes'] for r in mine]))} |"
        )
    return "\n".join(lines)


def loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def machine(folder: str) -> dict[str, Any]:
    real = os.path.realpath(folder)
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    fs = max(
        (m for m in mounts if real.startswith(m[1].rstrip("/") + "/") or real == m[1]),
        key=lambda m: len(m[1]),
    )
    with open("/proc/meminfo") as f:
        mem = int(next(line.split()[1] for line in f if line.startswith("MemTotal"))) * 1024

    def git(*words: str) -> str:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", *words], capture_output=True, text=True, cwd=here).stdout

    commit = git("rev-parse", "--short", "HEAD").strip()
    if git("status", "--porcelain", "--", os.path.dirname(embedpipe.__file__)).strip():
        commit += " + uncommitted changes in embedpipe/"
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem / 2**30, 1),
        "filesystem": f"{fs[2]} on {fs[0]}",
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "torch": torch.__version__,
        "embedpipe": f"{embedpipe.__version__} ({commit})",
        "icechunk": getattr(icechunk, "__version__", "not installed"),
        "loadavg_start": loadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bench_checkpoint.", dir=args.dir)
    run: dict[str, Any] = {"args": vars(args), "machine": machine(folder)}
    print(f"machine: {run['machine']}", file=sys.stderr)
    if icechunk is None and not args.skip_icechunk:
        print(
            "icechunk is not installed (pip install icechunk): part 1 measures embedpipe alone",
            file=sys.stderr,
        )
    try:
        print("part 1: checkpoint cost", file=sys.stderr)
        run["checkpoint"] = checkpoint_cost(args, folder)
        if not args.skip_train:
            print("part 2: training between checkpoints", file=sys.stderr)
            run["training"] = training_cost(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    run["machine"]["loadavg_end"] = loadavg()
    print(f"machine: {json.dumps(run['machine'])}\n")
    print(report_part1(run["checkpoint"], args))
    if "training" in run:
        print()
        print(report_part2(run["training"], args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
