"""The ``embedpipe`` command: parses arguments and calls the library, nothing else.

Progress bars go to stderr; stdout carries only the command's result. A user error exits with
status 1 and one line on stderr, ``embedpipe: error: ...``; a usage error exits 2 (argparse).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from .. import __version__
from ..cache import budget
from ..errors import EmbedpipeError
from ..optim import Adagrad, Adam
from ..store.layout import COMPRESSORS, WEIGHT
from ..store.table import Table
from ..store.transfer import export_table, import_table
from . import advice as advising
from . import simulate
from .convert import DTYPES, convert
from .converted import ConvertedShard

#: Exceptions that mean "the input (or the disk) was wrong", reported in one line: OSError for
#: missing, existing and unwritable files, and a full disk; ImportError for an optional extra not
#: installed (the message names it); ArithmeticError, MemoryError for a size too large.
USER_ERRORS = (EmbedpipeError, OSError, ValueError, KeyError, ImportError,
               ArithmeticError, MemoryError)  # fmt: skip
#: Optimizer state arrays per table row (embedpipe.optim), for the memory a pipe costs.
STATE_ARRAYS = {
    "sgd": 0,
    "adagrad": len(Adagrad(lr=1.0).state_init()),
    "adam": len(Adam().state_init()),
}


def cmd_import(args: argparse.Namespace) -> None:
    table = import_table(
        args.src,
        args.dst,
        key=args.key,
        dtype=args.dtype,
        chunk_rows=args.chunk_rows,
        compressor=args.compressor,
        overwrite=args.force,
        progress=True,
    )
    with table:
        print(
            f"imported {table.metadata['source']['key']} [{table.num_rows}, {table.dim}] "
            f"{table.dtype.name} into {table.path}"
        )


def cmd_export(args: argparse.Namespace) -> None:
    table = Table.open(args.src, "r", step=args.step)
    out = export_table(table, args.dst, key=args.key, overwrite=args.force, progress=True)
    print(f"exported {args.src} at step {table.step} to {out}")


def cmd_info(args: argparse.Namespace) -> None:
    info = table_info(Table.open(args.path, "r", step=args.step))
    if args.json:
        print(json.dumps(info, indent=2))
        return
    print_info(info)


def print_info(info: dict[str, Any]) -> None:
    for name, value in info.items():
        if name == "checkpoints":
            # by commit: two can hold one step (a metadata change commits the same step again)
            value = "  ".join(f"#{c['seq']} step {c['step']} ({c['time']})" for c in value)
            value = value or "none"
        elif name == "shards":
            value = describe_shards(value)
        print(f"{name:<16}{value}")


def cmd_demo(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="embedpipe-demo-") as folder:
        path = Path(folder) / "table.zarr"
        with Table.create(path, args.rows, args.dim, progress=True) as table:
            first = table.read([0, args.rows - 1])
            print(
                f"created a {table.num_rows} x {table.dim} table at {path}; "
                f"row 0 starts {first[0, :3].round(4).tolist()}"
            )
        print_info(table_info(Table.open(path)))


def cmd_convert(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    out = convert(
        args.table,
        args.shard,
        args.out,
        ids_key=args.ids_key,
        dtype=args.dtype,
        max_length=args.max_length,
        pad_id=args.pad_id,
        batch_size=args.batch_size,
        workers=args.workers,
        cache_rows=args.cache_rows,
        resume=args.resume,
        full_embedding_block=args.full_embedding_block,
        progress=True,
    )
    shard = ConvertedShard(out, check_table=False)
    r = shard.record
    seconds = time.perf_counter() - started
    print(
        f"converted {args.shard} into {out}: inputs_embeds [{r['num_rows']}, {r['length']}, "
        f"{r['dim']}] {r['dtype']} in {seconds:.1f} s"
    )


def cmd_advise(args: argparse.Namespace) -> None:
    if args.table is not None:
        with Table.open(args.table, "r") as table:
            num_rows, dim, dtype = table.num_rows, table.dim, table.dtype
    elif args.num_rows is None or args.dim is None:
        raise ValueError("give the table's shape: --table PATH, or --num-rows N and --dim D")
    else:
        num_rows, dim, dtype = args.num_rows, args.dim, args.dtype
    if args.workers < 0:
        raise ValueError(f"--workers must be 0 or more, got {args.workers}")
    memory = budget.parse_bytes(args.memory) if args.memory else budget.available_memory()
    if memory is None:
        raise ValueError("cannot tell how much memory this machine has; pass --memory (as 512MB)")
    advising.check_outputs(args.png, args.json)  # now, not after the simulation
    ids = advising.load_trace(args.trace, num_rows)
    sets = simulate.batch_sets(ids, args.batch_size)
    sizes = [parse_cache_size(text, num_rows) for text in args.sizes] if args.sizes else None
    state_arrays = STATE_ARRAYS[args.optimizer]
    best = budget.largest_cache(
        memory, num_rows, dim, dtype, state_arrays=state_arrays, num_workers=args.workers
    )
    replays = len({*(sizes or advising.advice_sizes(num_rows)), best}) * len(simulate.POLICIES)
    with tqdm(total=replays + 8, desc="simulating", unit="run") as bar:  # + 8: the knee's

        def progress(policy: str, cache_rows: int) -> None:
            bar.set_postfix_str(f"{policy} at {cache_rows:,} rows")
            bar.update()

        advice = advising.advise(
            sets,
            num_rows,
            dim,
            dtype,
            memory,
            cache_sizes=sizes,
            state_arrays=state_arrays,
            workers=args.workers,
            window=args.window,
            progress=progress,
        )
        bar.total = bar.n  # the knee took fewer, or more
    print(format_advice(advice, args))
    if args.png:
        advising.plot_curve(advice, args.png)
        print(f"\nmiss-ratio curve drawn in {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(advice, f, indent=1)


def format_advice(advice: dict, args: argparse.Namespace) -> str:
    """What ``embedpipe advise`` prints: the curve as a table, then the recommendation."""
    curve, num_rows, fmt = advice["curve"], advice["num_rows"], budget.format_bytes
    best, knee = advice["recommended"], advice["knee"]
    policies = list(curve["rows_read"])
    header = ["cache rows", "% of table", "memory", *policies]
    rows = []
    for i, size in enumerate(curve["cache_rows"]):
        optimum = max(1, curve["rows_read"]["belady"][i])
        cells = [
            f"{size:,}" + (" *" if size == best["cache_rows"] else ""),
            f"{100 * size / num_rows:.1f}%",
            fmt(advice["memory"][i]),
        ]
        cells += [f"{r[i]:,} ({r[i] / optimum:.2f}x)" for r in curve["rows_read"].values()]
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [
        f"{curve['batches']:,} batches of {args.batch_size} samples from {args.trace} (at most "
        f"{advice['max_unique']:,} unique ids a batch): "
        f"{curve['lazy']:,} rows read with no cache. Rows read from disk over the trace (one "
        f"epoch, cold cache) per policy, and the ratio to the optimum (belady); memory: the "
        f"whole pipe with {advice['workers']} workers and {args.optimizer} ({advice['dtype']} "
        f"rows of {advice['dim']}).",
        "",
        "  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)),
        *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows),
        "",
    ]
    parts = ", ".join(f"{k} {fmt(v)}" for k, v in best["memory"].items() if k != "total")
    saved = 1 - best["rows_read"] / max(1, curve["lazy"])
    lines.append(
        f"recommended (*): cache_rows={best['cache_rows']:,} "
        f"({100 * best['cache_rows'] / num_rows:.1f}% of {num_rows:,} rows), the largest that fits "
        f"{fmt(advice['memory_budget'])} ({advice['memory_budget']:,} bytes): "
        f"{fmt(best['memory']['total'])} ({parts}); "
        f"{advising.DEFAULT_POLICY} reads {best['rows_read']:,} rows, "
        f"{best['rows_read'] / max(1, best['optimum']):.2f}x the optimum, {saved:.0%} fewer than "
        "no cache"
    )
    within = f"within {advising.KNEE_TOLERANCE:.0%} of that ({knee['rows_read']:,} rows)"
    if knee["cache_rows"] < best["cache_rows"]:
        smaller = best["cache_rows"] / max(1, knee["cache_rows"])
        lines.append(
            f"knee: cache_rows={knee['cache_rows']:,} "
            f"({fmt(knee['memory']['total'])}), {smaller:.0f}x smaller than the recommended, "
            f"already reads {within}: more memory than that buys few rows; take the knee to "
            "leave the memory to the rest of the job"
        )
    else:
        lines.append(f"knee: no smaller cache reads {within}: more memory still pays")
    if best["cache_rows"] < num_rows:
        lines.append(
            'not counted: an owner process, about 150 MiB (owner="auto", the default, starts one '
            'for a cache smaller than the table); pass owner="thread" where this budget is all'
        )
    return "\n".join(lines)


def parse_cache_size(text: str, num_rows: int) -> int:
    """``--sizes`` items: a row count (``3000``) or a share of the table (``5%``)."""
    try:
        share = text.endswith("%")
        value = round(float(text[:-1]) / 100 * num_rows) if share else int(text)
    except (ValueError, OverflowError):  # not a number, or inf
        value = -1
    if value < 0:
        raise ValueError(
            f"--sizes: cannot read {text!r} as a cache size; write rows (3000) or a share (5%)"
        )
    return min(value, num_rows)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..service import serve
    from ..service.shard import shard_of

    return serve.main(args.table, args.address, shard_of(args.shard))


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from .benchmark import main as bench_main
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("embedpipe"):
            raise
        raise ImportError(
            "embedpipe bench needs the embedpipe.tools.benchmark package, which this installation lacks; "
            "run python scripts/bench.py from a checkout"
        ) from None
    return bench_main(args.args)


def table_info(table: Table) -> dict[str, Any]:
    """What ``embedpipe info`` prints, as a JSON-able dict; raises ``CorruptTableError`` for a
    chunk file that is missing or of the wrong size."""
    for name in [WEIGHT, *table.state_names]:
        table._array(name).check()
    meta = table.metadata
    chunk_bytes = table.chunk_rows * table.dim * table.dtype.itemsize
    return {
        "path": table.path,
        "shape": [table.num_rows, table.dim],
        "dtype": table.dtype.name,
        "chunks": f"{table.chunk_rows} rows x {table.dim} ({chunk_bytes} bytes)",
        "compressor": meta.get("compressor", "none"),
        "bytes_on_disk": table.nbytes_on_disk(),
        "optimizer": meta.get("optimizer") or "none",
        "state": ", ".join(table.state_names) or "none",
        "step": table.step,
        "source": (meta.get("source") or {}).get("key", "-"),
        "keep": meta.get("keep", "-"),
        "shards": meta.get("shards"),  # {"ranks", "bounds"}, or None: trained by one process
        "checkpoints": [
            {"seq": c.seq, "step": c.step, "time": c.time, "path": c.path}
            for c in table.checkpoints
        ],
    }


def describe_shards(shards: dict | None) -> str:
    """How the last pipe that trained the table split it over ranks (``shards.py``)."""
    if not shards:
        return "none (trained by one process)"
    bounds = shards["bounds"]
    ranges = ", ".join(
        f"rank {r}: rows {lo:,}-{hi - 1:,}" if hi > lo else f"rank {r}: none"
        for r, (lo, hi) in enumerate(itertools.pairwise(bounds))
    )
    return f"{shards['ranks']} ranks ({ranges})"


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedpipe", description="Embedding tables on disk, looked up inside the DataLoader."
    )
    parser.add_argument("--version", action="version", version=f"embedpipe {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "import", help="make a table from .safetensors, .pt/.bin, .npy or a model folder"
    )
    p.add_argument("src", help="file or Hugging Face model folder holding the embedding tensor")
    p.add_argument("dst", help="folder of the new table (a zarr v3 group)")
    p.add_argument(
        "--key", help="name of the tensor (default: the word-embedding tensor, found by name)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "float64"],
        help="cast the rows (bfloat16 sources need one)",
    )
    p.add_argument("--chunk-rows", type=int, help="rows per chunk (default: about 1 MiB of rows)")
    p.add_argument(
        "--compressor",
        choices=COMPRESSORS,
        default="none",
        help="chunk compression (default: none)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing table at DST")
    p.set_defaults(run=cmd_import)

    p = commands.add_parser("export", help="write a table's weights to .safetensors or .npy")
    p.add_argument("src", help="table folder")
    p.add_argument("dst", help="output file; the suffix picks the format")
    p.add_argument(
        "--key", default="weight", help="tensor name in a .safetensors file (default: weight)"
    )
    p.add_argument(
        "--step", type=int, help="export the checkpoint at this step (default: the latest)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing file at DST")
    p.set_defaults(run=cmd_export)

    p = commands.add_parser(
        "info", help="shape, dtype, chunking, bytes, optimizer state and step of a table"
    )
    p.add_argument("path", help="table folder")
    p.add_argument("--step", type=int, help="describe the checkpoint at this step")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=cmd_info)

    p = commands.add_parser(
        "convert", help="pre-convert a shard of token ids into embeddings (a zarr group)"
    )
    p.add_argument("table", help="table folder (read only; the table stays frozen)")
    p.add_argument("shard", help=".npy [N, L] ids, .jsonl, .parquet or a datasets folder")
    p.add_argument("out", help="folder of the converted shard (a zarr v3 group); must not exist")
    p.add_argument("--ids-key", default="input_ids", help="field of the token ids")
    p.add_argument("--dtype", choices=DTYPES, help="dtype of the embeddings (default: the table's)")
    p.add_argument(
        "--max-length", type=positive_int, help="pad every row to this length (default: longest)"
    )
    p.add_argument(
        "--pad-id", type=int, help="id that pads ragged rows (default: the table's padding_idx)"
    )
    p.add_argument("--batch-size", type=positive_int, default=64, help="rows per batch and chunk")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default: 2)")
    p.add_argument(
        "--cache-rows", type=int, default=32768, help="rows in the shared cache (default: 32768)"
    )
    p.add_argument("--resume", action="store_true", help="continue a half-done conversion at OUT")
    p.add_argument(
        "--full-embedding-block",
        metavar="HF_MODEL_DIR",
        help="write the model's embedding block output (word + position + token type, LayerNorm)",
    )
    p.set_defaults(run=cmd_convert)

    p = commands.add_parser(
        "advise",
        help="rows read per cache size and policy on a trace, and the cache size for a memory budget",
    )
    p.add_argument(
        "--trace", required=True, help=".npy of token ids, (samples, seq_len) or (samples,)"
    )
    p.add_argument("--table", help="table folder (gives the rows, width and dtype)")
    p.add_argument("--num-rows", type=positive_int, help="rows in the table (without --table)")
    p.add_argument("--dim", type=positive_int, help="row width (without --table)")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "float64"],
        default="float32",
        help="row dtype (without --table; default float32)",
    )
    p.add_argument(
        "--memory",
        help="memory budget, as 512MB or 2GiB (default: what this process has available)",
    )
    p.add_argument("--batch-size", type=positive_int, default=32, help="samples per batch")
    p.add_argument(
        "--workers", type=int, default=2, help="DataLoader workers (the ring, the LRU baselines)"
    )
    p.add_argument(
        "--optimizer",
        choices=list(STATE_ARRAYS),
        default="sgd",
        help="the table's optimizer, for its state's memory (sgd, or a frozen table: none)",
    )
    p.add_argument(
        "--window", type=positive_int, default=64, help="batches the lookahead policy sees ahead"
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        metavar="SIZE",
        help="cache sizes to simulate, rows (3000) or shares (5%%) (default: 1-2-5%% up to 100%%)",
    )
    p.add_argument("--png", help="also draw the miss-ratio curve into this image file")
    p.add_argument("--json", help="also write the curve and the advice as JSON to this file")
    p.set_defaults(run=cmd_advise)

    p = commands.add_parser(
        "bench",
        help="the side-by-side benchmark (embedpipe bench --help lists its options)",
        add_help=False,  # --help goes to the benchmark
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's arguments")
    p.set_defaults(run=cmd_bench)

    p = commands.add_parser(
        "serve",
        help="run the table's owner as a service that training jobs connect to",
        description="Hold the table's writer lock and serve one training job at a time: a "
        "pipe made with EmbeddingPipe(TABLE, ..., owner=ADDRESS) connects; under torchrun, "
        "every rank of the machine makes it so, and they share the service. A job that dies "
        "leaves the table at its last checkpoint and the service running. Stop it with "
        "Ctrl-C or SIGTERM. The first line on stdout names the address.",
    )
    p.add_argument("table", help="the table's folder")
    p.add_argument(
        "--address",
        help="unix:PATH, the socket to listen on (default: one in the temporary folder, "
        "named after the table)",
    )
    p.add_argument(
        "--shard",
        metavar="i/S",
        help="serve only shard i of S (rows split at chunk boundaries) to the ranks of machine "
        "i of a job over S machines; the service of shard 0 holds the writer lock",
    )
    p.set_defaults(run=cmd_serve)

    p = commands.add_parser("demo", help="create a table in a temporary folder and describe it")
    p.add_argument(
        "--rows", type=positive_int, default=30522, help="rows (default: BERT-base's vocabulary)"
    )
    p.add_argument("--dim", type=positive_int, default=128, help="row width")
    p.set_defaults(run=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":  # every option, --help too, is the benchmark's
        args.args = extra + args.args
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = args.run(args)
    except USER_ERRORS as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"embedpipe: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("embedpipe: interrupted", file=sys.stderr)
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
