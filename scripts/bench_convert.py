"""Benchmark ``embedpipe convert``: tokens/s against writing the same bytes with plain numpy.

For each width in ``--dims`` it makes a ``--rows x dim`` float32 table (BERT-base's vocabulary by
default) and a ``.npy`` shard of ``--shard-rows x --length`` token ids drawn from a Zipf-like
distribution (as a corpus is: a few ids very often, most rarely). Then, for each worker count in
``--workers``, it times:

* ``convert``: :func:`embedpipe.convert` of the shard (the pipe's DataLoader workers, its shared
  cache of ``--cache-rows`` rows, writes into a zarr group chunked by ``--batch-size``);
* ``numpy``: the same conversion done by hand in one process with the whole table in memory:
  ``weight[ids]`` per batch, appended with ``ndarray.tofile`` to one flat file. This is the cost of
  producing and writing the same bytes with nothing in between, the floor for convert.

Both write into the page cache (no fsync); each run is repeated ``--repeats`` times and the median
is reported. Tokens are positions written (rows x length).

Run it (about a minute on a 2-core machine with the defaults)::

    python scripts/bench_convert.py
    python scripts/bench_convert.py --dims 768 --workers 1 2 4 --shard-rows 8192 --json out.json

Files go to a fresh temporary folder (under ``--dir`` if given) that is deleted at the end.
Results go to stdout, progress bars to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import numpy as np
import torch

import embedpipe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=30522, help="table rows (default: 30522)")
    p.add_argument("--dims", type=int, nargs="+", default=[384, 768], help="table widths")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts")
    p.add_argument("--shard-rows", type=int, default=2048, help="rows of the shard")
    p.add_argument("--length", type=int, default=128, help="ids per row")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (and chunk)")
    p.add_argument("--cache-rows", type=int, default=8192, help="rows in the shared cache")
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (median kept)")
    p.add_argument("--dir", help="folder for the temporary files (picks the filesystem)")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args(argv)


def zipf_ids(rows: int, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Ids with Zipf-like frequencies (rank r drawn with weight 1/r), ranks shuffled over ids."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, rows + 1)
    ranks = rng.choice(rows, size=shape, p=weights / weights.sum())
    return rng.permutation(rows)[ranks].astype(np.int64)


def time_convert(folder: str, table: str, shard: str, workers: int, args) -> float:
    out = os.path.join(folder, "out.zarr")
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    embedpipe.convert(
        table,
        shard,
        out,
        batch_size=args.batch_size,
        workers=workers,
        cache_rows=args.cache_rows,
    )
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return seconds


def time_numpy(folder: str, weight: np.ndarray, ids: np.ndarray, batch_size: int) -> float:
    out = os.path.join(folder, "out.bin")
    start = time.perf_counter()
    with open(out, "wb") as f:
        for i in range(0, len(ids), batch_size):
            weight[ids[i : i + batch_size]].tofile(f)
    seconds = time.perf_counter() - start
    os.remove(out)
    return seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="bench-convert-", dir=args.dir)
    results = []
    try:
        ids = zipf_ids(args.rows, (args.shard_rows, args.length))
        shard = os.path.join(folder, "shard.npy")
        np.save(shard, ids)
        tokens = ids.size
        for dim in args.dims:
            weight = np.random.default_rng(1).standard_normal((args.rows, dim), dtype=np.float32)
            table = os.path.join(folder, f"table-{dim}.zarr")
            embedpipe.Table.from_tensor(table, weight).close()
            size = tokens * dim * 4
            plain = statistics.median(
                time_numpy(folder, weight, ids, args.batch_size) for _ in range(args.repeats)
            )
            for workers in args.workers:
                seconds = statistics.median(
                    time_convert(folder, table, shard, workers, args) for _ in range(args.repeats)
                )
                row = {
                    "dim": dim,
                    "workers": workers,
                    "tokens": tokens,
                    "output_mib": round(size / 2**20, 1),
                    "convert_tokens_per_s": round(tokens / seconds),
                    "numpy_tokens_per_s": round(tokens / plain),
                    "convert_mib_per_s": round(size / seconds / 2**20),
                    "numpy_mib_per_s": round(size / plain / 2**20),
                    "ratio": round(plain / seconds, 2),
                }
                results.append(row)
                print(
                    f"D={dim:<4} workers={workers}  convert {row['convert_tokens_per_s']:>9,} tok/s "
                    f"({row['convert_mib_per_s']} MiB/s)  numpy {row['numpy_tokens_per_s']:>9,} "
                    f"tok/s ({row['numpy_mib_per_s']} MiB/s)  convert/numpy {row['ratio']:.2f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    print(f"{args.shard_rows} rows x {args.length} ids, batch {args.batch_size}, {machine}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
