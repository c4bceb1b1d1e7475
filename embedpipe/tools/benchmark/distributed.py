"""Scale-out on loopback: the row-sharded pipe on 1, 2 and 4 ranks against the same ranks holding
a replicated ``nn.Embedding`` whose gradient is all-reduced (``--distributed``; off by default).

This module runs in the benchmark's process: for each rank count of ``--dist-ranks`` it copies
the ``--vocab`` x ``--dim`` table, writes a config and launches that many ranks with ``python -m
torch.distributed.run`` (gloo, one torch thread per rank), which run ``distributed_rank.py`` (its
docstring says what each rank times); rank 0 writes every rank's per-step figures to a JSON file,
and :func:`summarise` turns them into per-rank medians over the timed steps:

- lookup: ``next(loader)`` plus reading ``inputs_embeds`` (for N > 1 this includes the rows
  exchange), as batches/s and unique rows/s;
- writeback: backward (with the gradient exchange) plus ``optimizer.step()`` and the wait for
  this rank's writeback to apply its rows, as rows/s of the step's averaged gradient (the union
  of every rank's batch: the rows the step updates, over the ranks together);
- steps/s; the exchanges' milliseconds; bytes per step per rank, from the counters and shapes.

Ratios: "vs replicated" is taken within each round (a block of pipe steps, then one of
replicated steps, on the same batches), median and quartiles over the rounds; "vs 1 rank" is the
rank's median steps/s over the 1-rank pipe's, from an earlier launch (not drift-cancelled).
There is no target for this section in the issue, so it adds none.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from typing import Any

from tqdm.auto import tqdm

from ...store.layout import default_chunk_rows
from ...store.table import Table
from . import report as md
from .distributed_rank import EXCHANGE_BYTES, PIPE_COLUMNS, REPLICATED_COLUMNS
from .options import fraction, integer

NAME = "distributed"
#: The driver runs this section only when the option of this name is set (``--distributed``).
OPT_IN = "distributed"
QUICK = {"dist_rounds": 3, "dist_block": 4, "dist_warmup": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scale-out (section 'distributed', only with --distributed)")
    g.add_argument(
        "--dist-ranks", type=integer(1), nargs="+", default=[1, 2, 4], help="rank counts"
    )
    g.add_argument("--dist-batches", type=integer(1), default=16, help="local batches, cycled")
    g.add_argument("--dist-warmup", type=integer(1), default=4, help="untimed steps of each loop")
    g.add_argument("--dist-rounds", type=integer(1), default=6, help="timed rounds")
    g.add_argument("--dist-block", type=integer(1), default=8, help="steps per loop per round")
    g.add_argument(
        "--dist-cache-frac", type=fraction, default=1.0, help="each rank's cache, of the table"
    )
    g.add_argument(
        "--dist-hot-first",
        action="store_true",
        help="relabel ids by frequency (0 the hottest): the hot rows all in rank 0's shard",
    )
    g.add_argument("--dist-timeout", type=float, default=900, help="seconds per launch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ranks: int, config_path: str, timeout: float) -> None:
    """``ranks`` processes of ``distributed_rank`` under torchrun on loopback; raises on failure."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command += ["-m", f"{__package__}.distributed_rank", config_path]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    # faulthandler: a rank that aborts (SIGABRT, SIGSEGV) prints every thread's Python stack.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} ranks failed ({done.returncode}):\n{done.stderr[-4000:]}")


def run(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Every rank count of ``--dist-ranks``, one launch each; see the module docstring."""
    source = os.path.join(workdir, "dist-table.zarr")
    # at least two chunks per shard of the most ranks (shards are whole chunks; the default
    # chunk of a small table would leave some ranks no rows at all)
    most = 2 * max(args.dist_ranks)
    chunk = max(1, min(default_chunk_rows(args.vocab, args.dim), args.vocab // most))
    Table.create(source, args.vocab, args.dim, seed=args.seed, chunk_rows=chunk).close()
    config = {
        "vocab": args.vocab,
        "dim": args.dim,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "zipf": args.zipf,
        "seed": args.seed,
        "batches": args.dist_batches,
        "warmup": args.dist_warmup,
        "rounds": args.dist_rounds,
        "block": args.dist_block,
        "cache_rows": max(1, round(args.dist_cache_frac * args.vocab)),
        "hot_first": args.dist_hot_first,
        "chunk_rows": chunk,
    }
    runs = {}
    for n in tqdm(args.dist_ranks, desc="distributed", unit="launch"):
        table = os.path.join(workdir, f"dist-{n}.zarr")  # trained: a copy per launch
        shutil.copytree(source, table)
        out, config_path = (os.path.join(workdir, f"dist-{n}.{e}") for e in ("out", "json"))
        with open(config_path, "w") as f:
            json.dump({**config, "table": table, "out": out}, f)
        launch(n, config_path, args.dist_timeout)
        with open(out) as f:
            runs[n] = summarise(json.load(f), args.vocab, args.dim)
        shutil.rmtree(table, ignore_errors=True)
    one = runs[1]["ranks"][0]["pipe"]["steps_per_s"] if 1 in runs else None
    for summary in runs.values():
        for r in summary["ranks"]:
            r["vs_one_rank"] = r["pipe"]["steps_per_s"] / one if one else None
    return {"config": config, "runs": {str(n): s for n, s in runs.items()}}


def _med(rows: list[list[float]], i: int) -> float:
    return statistics.median(row[i] for row in rows)


def _rates(rows: list[list[float]], rows_at: int, seconds_at: list[int]) -> float:
    """Median over steps of ``row[rows_at] / sum(row[j] for j in seconds_at)``."""
    return statistics.median(r[rows_at] / sum(r[j] for j in seconds_at) for r in rows)


def summarise(raw: dict[str, Any], vocab: int, dim: int) -> dict[str, Any]:
    """Per-rank medians of one launch's records (``distributed_rank``'s output); bytes per step
    from the pipe's counters of what its exchanges sent and received (ids, rows, gradients)."""
    n, ranks = raw["world"], raw["ranks"]
    p = {c: i for i, c in enumerate(PIPE_COLUMNS)}
    q = {c: i for i, c in enumerate(REPLICATED_COLUMNS)}
    unique, union = len(PIPE_COLUMNS), len(PIPE_COLUMNS) + 1  # after the seconds
    rep_unique = len(REPLICATED_COLUMNS)
    steps = len(ranks[0]["pipe"])
    ring = 2 * (n - 1) / n * vocab * dim * 4  # a ring all-reduce of the dense gradient
    out = []
    for r in ranks:
        pipe, rep, c = r["pipe"], r["replicated"], r["counters"]
        served, remote = c["served_rows"] / steps, c["remote_rows"] / steps
        moved = {k: c.get(k, 0) / steps for k in EXCHANGE_BYTES}
        i, j = p["rows_exchange"], p["gradient_exchange"]
        out.append(
            {
                "rank": r["rank"],
                "owned": r["owned"],
                "pipe": {
                    "lookup_batches_per_s": 1 / statistics.median(x[0] + x[1] for x in pipe),
                    "lookup_rows_per_s": _rates(pipe, unique, [p["load"], p["read"]]),
                    "writeback_rows_per_s": _rates(pipe, union, [p["backward"], p["step"]]),
                    "steps_per_s": 1 / _med(pipe, p["total"]),
                    "exchange_ms": 1e3 * statistics.median(x[i] + x[j] for x in pipe),
                    "rows_exchange_ms": 1e3 * _med(pipe, p["rows_exchange"]),
                    "gradient_exchange_ms": 1e3 * _med(pipe, p["gradient_exchange"]),
                    "sent_bytes": moved["rows_sent_bytes"] + moved["gradient_sent_bytes"],
                    "received_bytes": moved["rows_received_bytes"]
                    + moved["gradient_received_bytes"],
                    "gradient_sent_bytes": moved["gradient_sent_bytes"],
                    "remote_rows": remote,
                    "served_rows": served,
                    "union_rows": statistics.median(x[union] for x in pipe),
                },
                "replicated": {
                    "lookup_batches_per_s": 1 / statistics.median(x[0] + x[1] for x in rep),
                    "lookup_rows_per_s": _rates(rep, rep_unique, [q["load"], q["read"]]),
                    "writeback_rows_per_s": statistics.median(
                        u[union] / (x[q["backward"]] + x[q["all_reduce"]] + x[q["step"]])
                        for u, x in zip(pipe, rep, strict=True)  # the same batches in turn
                    ),
                    "steps_per_s": 1 / _med(rep, q["total"]),
                    "exchange_ms": 1e3 * _med(rep, q["all_reduce"]),
                    "sent_bytes": ring,
                    "received_bytes": ring,
                },
                "vs_replicated": md.quartiles(
                    [a / b for a, b in zip(r["pipe_rates"], r["rep_rates"], strict=True)]
                ),
            }
        )
    return {"world": n, "steps": steps, "ranks": out}


def _size(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _exchange(f: dict[str, Any]) -> str:
    """The pipe's rows + gradient exchange ms, or the replicated all-reduce's."""
    if "rows_exchange_ms" not in f:
        return f"{f['exchange_ms']:.1f}"
    return f"{f['rows_exchange_ms']:.1f} + {f['gradient_exchange_ms']:.1f}"


def _rows(r: dict[str, Any]) -> list[list[str]]:
    """A rank's two rows of its table: the pipe's, then the replicated nn.Embedding's."""
    lo, hi = r["owned"]
    one = f"{r['vs_one_rank']:.2f}x" if r["vs_one_rank"] is not None else "-"
    out = []
    for name, f in (("embedpipe", r["pipe"]), ("replicated", r["replicated"])):
        pipe = name == "embedpipe"
        out.append(
            [
                name,
                str(r["rank"]),
                f"{lo:,}-{hi:,}" if pipe else "all",
                f"{f['lookup_batches_per_s']:.1f}",
                f"{f['lookup_rows_per_s']:,.0f}",
                f"{f['writeback_rows_per_s']:,.0f}",
                f"{f['steps_per_s']:.1f}",
                md.ratio(r["vs_replicated"]) if pipe else "-",
                one if pipe else "-",
                _exchange(f),
                _size(f["sent_bytes"]),
                _size(f["received_bytes"]),
                f"{f['served_rows']:,.0f}" if pipe else "-",
            ]
        )
    return out


HEADER = ["variant", "rank", "rows owned", "lookup batches/s", "lookup rows/s"]
HEADER += ["writeback rows/s", "steps/s", "vs replicated", "vs 1 rank", "exchange ms"]
HEADER += ["sent/step", "received/step", "served rows/step"]


def report(result: dict[str, Any], args: argparse.Namespace) -> str:
    c = result["config"]
    ids = (
        "relabelled hottest first (rank 0's shard holds the hot rows)"
        if c["hot_first"]
        else ("permuted over the table (hot rows spread over every shard)")
    )
    parts = [
        f"### Scale-out on loopback: {c['vocab']:,} x {c['dim']} float32, local batches of "
        f"{c['batch_size']} x {c['seq_len']} tokens, Zipf s={c['zipf']} ({ids})\n\n"
        "One launch per rank count (torchrun, gloo, one torch thread per rank, num_workers=0, "
        f"cache {c['cache_rows']:,} rows per rank, SGD). Per rank, medians over "
        f"{c['rounds']} x {c['block']} timed steps after {c['warmup']} warm-up steps: lookup = "
        "next(loader) + reading inputs_embeds (the rows exchange); writeback = backward (the "
        "gradient exchange) + step + this rank's apply, as rows of the step's averaged gradient "
        "per second; exchange ms: rows + gradient exchange (replicated: all-reduce and / N); bytes "
        "per step per rank from the pipe's counters (replicated: a ring all-reduce of the "
        "dense gradient). vs replicated: steps/s over a dense nn.Embedding replicated on the "
        "same ranks, gradient all-reduced, torch SGD, taken per round (median, quartiles); vs 1 "
        "rank: steps/s over the 1-rank pipe's, from its own launch.\n"
    ]
    for n, summary in result["runs"].items():
        rows = [row for r in summary["ranks"] for row in _rows(r)]
        parts.append(f"{n} rank(s):\n\n" + md.md_table(HEADER, rows) + "\n")
    return "\n".join(parts)


def targets(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """None: the issue sets no numeric target for scale-out."""
    return []
