"""The ``embedpipe`` command: parses arguments and calls the library, nothing else.

Progress bars go to stderr; stdout carries only the command's result. A user error exits with
status 1 and one line on stderr, ``embedpipe: error: ...``; a usage error exits 2 (argparse).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import __version__
from .convert import DTYPES, ConvertedShard, convert
from .errors import EmbedpipeError
from .table import COMPRESSORS, Table
from .tensorfiles import export_table, import_table

#: Exceptions that mean "the input (or the disk) was wrong", reported in one line without a
#: traceback. OSError covers missing, existing and unwritable files, and a full disk.
USER_ERRORS = (EmbedpipeError, OSError, ValueError, KeyError)


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
    for name, value in info.items():
        if name == "checkpoints":
            value = "  ".join(f"step {c['step']} ({c['time']})" for c in value) or "none"
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
        for name, value in table_info(Table.open(path)).items():
            print(f"{name:<16}{value}")


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


def table_info(table: Table) -> dict[str, object]:
    """What ``embedpipe info`` prints, as a JSON-able dict."""
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
        "checkpoints": [
            {"step": c.step, "time": c.time, "path": c.path} for c in table.checkpoints
        ],
    }


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

    p = commands.add_parser("demo", help="create a table in a temporary folder and describe it")
    p.add_argument(
        "--rows", type=positive_int, default=30522, help="rows (default: BERT-base's vocabulary)"
    )
    p.add_argument("--dim", type=positive_int, default=128, help="row width")
    p.set_defaults(run=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except USER_ERRORS as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"embedpipe: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("embedpipe: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
