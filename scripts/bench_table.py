"""Benchmark random row reads and scattered row writes of an embedpipe Table, per chunk size.

For a ``rows x dim`` float32 table and each chunk size (``--chunks`` plus the library's default
from :func:`embedpipe.store.layout.default_chunk_rows`) it measures:

* random-row reads (rows/s) of uniformly random unique ids, per ``--batches`` size, from a warm
  page cache, through four paths on the same bytes:

  - ``memmap``: fancy indexing of a ``numpy.memmap`` of one flat file (the upper bound);
  - ``Table.read``: embedpipe's raw path for a local uncompressed table (``RawRows``);
  - ``zarr API``: ``get_orthogonal_selection`` of zarr-python on the same weight array, with the
    ids sorted (what you get without embedpipe's raw path);
  - ``Table zstd``: ``Table.read`` of a zstd-compressed copy of the table (``--compressor``),
    which goes through zarr's API;

* scattered writes (rows/s) of ``Table.write`` with unique random ids, ``--write-batch`` per call,
  on the uncompressed and the compressed table;
* bytes on disk of both tables.

Every measurement is repeated (``--repeats``, ``--write-repeats``) and the median is reported; one
repeat calls a path with fresh random ids until ``--min-time`` seconds are spent in it (once at
least). The paths take turns inside each repeat, so the ratios between them (which are what to
quote on a shared, noisy machine) compare numbers taken within the same few seconds.

Run it (with the defaults: about 100 s of CPU time, 2 to 3.5 minutes on a 2-core machine
depending on what else runs there)::

    python scripts/bench_table.py
    python scripts/bench_table.py --rows 1000000 --dim 768 --chunks 16 64 256 --json out.json
    PYTHONPATH=/path/to/other/checkout python scripts/bench_table.py   # measure another version

The tables are made in a fresh temporary folder (under ``--dir`` if given, to pick the
filesystem) that is deleted at the end. Results go to stdout, progress bars to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zarr
from tqdm.auto import tqdm

import embedpipe
from embedpipe.store.layout import CHUNK_BYTES, WEIGHT, default_chunk_rows
from embedpipe.store.rowstore import RawRows
from embedpipe.store.table import Table


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--rows", type=int, default=200_000, help="rows in the table")
    p.add_argument("--dim", type=int, default=128, help="floats per row (float32)")
    p.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[64, 256, 512, 2048, 8192],
        help="rows per chunk to measure; the library's default is always added",
    )
    p.add_argument(
        "--batches", type=int, nargs="+", default=[1000, 10000], help="ids per read call"
    )
    p.add_argument("--write-batch", type=int, default=1000, help="unique ids per write call")
    p.add_argument(
        "--min-time",
        type=float,
        default=0.1,
        help="seconds each path is timed per repeat (one call at least, fresh ids every call)",
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed repeats of reads; the median is reported"
    )
    # Writes take 0.2-5 s a call on small chunks (zstd), so fewer repeats keep the run short;
    # a call that long is not what timer noise moves.
    p.add_argument("--write-repeats", type=int, default=3, help="timed repeats of writes")
    p.add_argument(
        "--compressor",
        choices=("zstd", "blosc"),
        default="zstd",
        help="codec of the compressed table",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="make the temporary folder here (default: the system's tmp)")
    p.add_argument("--json", metavar="PATH", help="also write all results and samples as JSON")
    args = p.parse_args(argv)
    if args.write_batch > args.rows or max(args.batches) > args.rows:
        p.error("--batches and --write-batch must not exceed --rows (ids are unique per call)")
    return args


def chunk_sizes(args: argparse.Namespace) -> tuple[list[int], int]:
    """The chunk sizes to measure (sorted, at most ``rows``) and the library's default."""
    default = default_chunk_rows(args.rows, args.dim, "float32")
    sizes = sorted({min(c, args.rows) for c in args.chunks} | {default})
    return sizes, default


# ----------------------------------------------------------------------------- measuring
def unique_ids(rng: np.random.Generator, num_rows: int, count: int) -> np.ndarray:
    """``count`` distinct ids in random order: what a lookup sends after deduplication."""
    return rng.choice(num_rows, size=count, replace=False).astype(np.int64)


def time_calls(
    call: Callable[[Any], Any], make_input: Callable[[], Any], min_seconds: float
) -> tuple[int, float]:
    """Call ``call`` on fresh inputs until ``min_seconds`` have been spent in it (once at least).

    Only the calls are timed, not making their inputs. A fast path is called many times, so a
    repeat is not one call of a few hundred microseconds; a slow one is called once. Returns
    (calls, seconds).
    """
    calls, seconds = 0, 0.0
    while calls == 0 or seconds < min_seconds:
        x = make_input()
        start = time.perf_counter()
        call(x)
        seconds += time.perf_counter() - start
        calls += 1
    return calls, seconds


def summarize(per_call: int, samples: list[tuple[int, float]]) -> dict[str, Any]:
    """The median rate over repeats, with the rates and samples (calls, seconds) behind it."""
    rates = [calls * per_call / seconds for calls, seconds in samples]
    return {"rows_per_s": statistics.median(rates), "rates": rates, "samples": samples}


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Median over repeats of a's rate / b's rate in the same repeat.

    The two were timed back to back, so a load spike that slows a whole repeat cancels out,
    which a ratio of the two medians does not do.
    """
    return statistics.median(x / y for x, y in zip(a["rates"], b["rates"], strict=True))


def read_paths(
    flat: np.ndarray, table: Table, zarr_array: zarr.Array, compressed: Table
) -> dict[str, tuple[Callable[[np.ndarray], Any], Callable[[np.ndarray], Any]]]:
    """For each read path: (prepare ids, untimed; read rows, timed)."""
    keep = lambda ids: ids  # noqa: E731
    return {
        "memmap": (keep, lambda ids: flat[ids]),
        "table": (keep, table.read),
        # zarr's orthogonal selection wants sorted unique ids; sorting is not zarr's cost.
        "zarr": (np.sort, lambda ids: zarr_array.get_orthogonal_selection((ids, slice(None)))),
        "table_compressed": (keep, compressed.read),
    }


def check_same_rows(paths: dict, ids: np.ndarray) -> None:
    """All paths must return the same rows, or the comparison is meaningless."""
    expected = paths["memmap"][1](ids)
    for name, (prepare, read) in paths.items():
        got = np.asarray(read(prepare(ids)))
        want = expected[np.argsort(ids)] if name == "zarr" else expected
        if not np.array_equal(got, want):
            raise AssertionError(f"{name} returned different rows than the memmap")


def bench_reads(
    paths: dict, args: argparse.Namespace, batch: int, rng: np.random.Generator
) -> dict[str, dict[str, Any]]:
    """Median rows/s of reading ``batch`` random unique ids per call, per path.

    The paths take turns within each repeat, so a noisy neighbour slows them all alike.
    """
    samples: dict[str, list[tuple[int, float]]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, (prepare, read) in paths.items():
            make = lambda p=prepare: p(unique_ids(rng, args.rows, batch))  # noqa: E731
            samples[name].append(time_calls(read, make, args.min_time))
    return {name: summarize(batch, s) for name, s in samples.items()}


def bench_writes(
    tables: dict[str, Table], args: argparse.Namespace, rng: np.random.Generator
) -> dict[str, dict[str, Any]]:
    """Median rows/s of ``Table.write`` of ``--write-batch`` random unique ids per call."""
    batch = args.write_batch

    def make() -> tuple[np.ndarray, np.ndarray]:
        rows = rng.standard_normal((batch, args.dim), dtype=np.float32)
        return unique_ids(rng, args.rows, batch), rows

    samples: dict[str, list[tuple[int, float]]] = {name: [] for name in tables}
    for _ in range(args.write_repeats):
        for name, table in tables.items():
            write = lambda w, t=table: t.write(*w)  # noqa: E731
            samples[name].append(time_calls(write, make, args.min_time))
    return {name: summarize(batch, s) for name, s in samples.items()}


# ----------------------------------------------------------------------------- one chunk size
def make_tables(folder: str, args: argparse.Namespace, chunk_rows: int) -> tuple[str, str]:
    """An uncompressed and a compressed table with the same rows; returns their paths."""
    plain = os.path.join(folder, f"plain-{chunk_rows}.zarr")
    packed = os.path.join(folder, f"{args.compressor}-{chunk_rows}.zarr")
    for path, codec in ((plain, "none"), (packed, args.compressor)):
        Table.create(
            path, args.rows, args.dim, seed=args.seed, chunk_rows=chunk_rows, compressor=codec
        ).close()
    return plain, packed


def warm(table: Table) -> None:
    """Read the whole table once, so that the timed reads find it in the page cache."""
    for _ in table.iter_blocks():
        pass


def bench_chunk_size(
    folder: str, flat: np.ndarray, args: argparse.Namespace, chunk_rows: int, bar: tqdm
) -> dict[str, Any]:
    """Everything measured for one chunk size; its tables are deleted afterwards."""
    clock = time.perf_counter()
    plain_path, packed_path = make_tables(folder, args, chunk_rows)
    result: dict[str, Any] = {"chunk_rows": chunk_rows, "reads": {}, "seconds": {}}
    result["seconds"]["create"] = time.perf_counter() - clock
    rng = np.random.default_rng([args.seed, chunk_rows])
    with Table.open(plain_path) as plain, Table.open(packed_path) as packed:
        result["bytes"] = {"plain": plain.nbytes_on_disk(), "compressed": packed.nbytes_on_disk()}
        zarr_array = zarr.open_array(os.path.join(plain_path, WEIGHT), mode="r")
        # Table.read of an uncompressed local table must take the raw path, or we measure zarr.
        result["raw_path"] = RawRows.supports(zarr_array) is not None
        paths = read_paths(flat, plain, zarr_array, packed)
        clock = time.perf_counter()
        warm(plain)
        warm(packed)
        check_same_rows(paths, unique_ids(rng, args.rows, max(args.batches)))  # maps chunks too
        result["seconds"]["warm"] = time.perf_counter() - clock
        clock = time.perf_counter()
        for batch in args.batches:
            bar.set_postfix_str(f"chunk {chunk_rows}: reads of {batch}")
            result["reads"][batch] = bench_reads(paths, args, batch, rng)
    result["seconds"]["reads"] = time.perf_counter() - clock
    clock = time.perf_counter()
    bar.set_postfix_str(f"chunk {chunk_rows}: writes")
    with Table.open(plain_path, "r+") as plain, Table.open(packed_path, "r+") as packed:
        result["writes"] = bench_writes({"table": plain, "table_compressed": packed}, args, rng)
    result["seconds"]["writes"] = time.perf_counter() - clock
    shutil.rmtree(plain_path)
    shutil.rmtree(packed_path)
    return result


def make_flat(folder: str, args: argparse.Namespace) -> np.ndarray:
    """The table's rows as one flat file, mapped with numpy.memmap (the baseline)."""
    path = os.path.join(folder, "flat.f32")
    source = Table.create(os.path.join(folder, "source.zarr"), args.rows, args.dim, seed=args.seed)
    with source:
        source.read_range(0, args.rows).tofile(path)
    shutil.rmtree(source.path)
    flat = np.memmap(path, dtype=np.float32, mode="r", shape=(args.rows, args.dim))
    np.asarray(flat).sum()  # into the page cache
    return flat


# ----------------------------------------------------------------------------- reporting
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine() -> dict[str, Any]:
    """What the numbers depend on besides the code."""
    return {
        # the CPUs this process may run on, which is what nproc prints
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "embedpipe": getattr(embedpipe, "__version__", "?"),
        # which copy of the library was measured (PYTHONPATH can point at another checkout)
        "embedpipe_path": os.path.dirname(embedpipe.__file__),
    }


# Read paths in the order of the report's columns.
READ_COLUMNS = ("memmap", "table", "zarr", "table_compressed")


def rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    x = paired_ratio(a, b)
    return f"{x:.3f}x" if x < 0.1 else f"{x:.2f}x" if x < 10 else f"{x:.0f}x"


def format_report(run: dict[str, Any]) -> str:
    args, default, comp = run["args"], run["default_chunk_rows"], run["args"]["compressor"]
    m = run["machine"]
    lines = [
        f"embedpipe Table benchmark: {args['rows']:,} rows x dim {args['dim']} float32, "
        f"medians of {args['repeats']} read and {args['write_repeats']} write repeats",
        f"{m['cpus']} cpus ({m['cpu']}), python {m['python']}, numpy {m['numpy']}, "
        f"zarr {m['zarr']}; default chunk_rows = {default}",
        f"embedpipe from {m['embedpipe_path']}",
        "",
        "Random-row reads (rows/s, unique random ids, warm page cache)",
        _row(
            "chunk", "batch", "memmap", "Table.read", "zarr API", f"Table {comp}",
            "read/memmap", "read/zarr", f"{comp}/read", f"{comp}/zarr",
        ),
    ]  # fmt: skip
    for res in run["results"]:
        for batch, r in res["reads"].items():
            lines.append(
                _row(
                    _chunk_label(res, default), f"{int(batch):,}",
                    *(rate(r[name]["rows_per_s"]) for name in READ_COLUMNS),
                    ratio(r["table"], r["memmap"]), ratio(r["table"], r["zarr"]),
                    ratio(r["table_compressed"], r["table"]),
                    ratio(r["table_compressed"], r["zarr"]),
                )
            )  # fmt: skip
    lines += [
        "",
        f"Scattered writes (rows/s, {args['write_batch']:,} unique random ids per call) "
        "and bytes on disk",
        _row("chunk", "", "Table.write", f"{comp} write", f"{comp}/plain", "",
             "MiB plain", f"MiB {comp}", "saved"),
    ]  # fmt: skip
    for res in run["results"]:
        w, b = res["writes"], res["bytes"]
        lines.append(
            _row(
                _chunk_label(res, default), "",
                rate(w["table"]["rows_per_s"]), rate(w["table_compressed"]["rows_per_s"]),
                ratio(w["table_compressed"], w["table"]), "",
                f"{b['plain'] / 2**20:.1f}", f"{b['compressed'] / 2**20:.1f}",
                f"{1 - b['compressed'] / b['plain']:.1%}",
            )
        )  # fmt: skip
    return "\n".join(lines)


def _chunk_label(res: dict[str, Any], default: int) -> str:
    label = str(res["chunk_rows"]) + ("*" if res["chunk_rows"] == default else "")
    return label if res["raw_path"] else label + " (no raw path!)"


def _row(*cells: str) -> str:
    widths = (7, 7, 9, 11, 10, 11, 12, 10, 10, 10)
    return " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=False)).rstrip()


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes, default = chunk_sizes(args)
    folder = tempfile.mkdtemp(prefix="bench_table-", dir=args.dir)
    started = time.perf_counter()
    try:
        flat = make_flat(folder, args)
        with tqdm(sizes, desc="chunk sizes", unit="size", file=sys.stderr) as bar:
            results = [bench_chunk_size(folder, flat, args, c, bar) for c in bar]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    run = {
        "args": vars(args),
        "machine": machine(),
        "chunk_bytes": CHUNK_BYTES,
        "default_chunk_rows": default,
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    print(format_report(run))
    print(
        "\n* the library's default. Rates are medians over repeats; a ratio a/b is the median"
        "\nof a/b within each repeat (timed back to back), so it need not equal the quotient"
        f"\nof the two medians shown. Took {run['seconds']:.0f} s."
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
