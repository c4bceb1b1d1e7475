"""The side-by-side benchmark: embedpipe against its alternatives, every figure a ratio to its
baseline measured in the same run (``embedpipe bench``, ``scripts/bench.py``).

The driver is a loop over sections, each a module of this package (see ``options.py`` for what a
section provides): ``rows`` (rows read per cache policy against Belady's optimum), ``throughput``
(the model-free loader loop against ``nn.Embedding`` in RAM), ``model`` (a small BERT's training
step), ``memory`` (bytes of each cache, from the shapes) and ``cold`` (a table larger than the
memory allowed, and the whole pipeline's peak memory), and, only with ``--distributed`` (it
launches processes), ``distributed`` (the row-sharded pipe on 1, 2 and 4 ranks). Each section runs in turn in one temporary
folder (under ``--dir``), deleted at the end; then the markdown goes to stdout, the Targets table
(issue 9's targets: measured, goal, met) first. Progress bars go to stderr. The main process uses
one torch thread, as DataLoader workers do: the workers and the main process share the cores.

Run it (``--quick`` is a smoke run of every section; ``--help`` lists each section's options)::

    python scripts/bench.py --quick
    python scripts/bench.py --json results.json --skip model cold
    python scripts/bench.py --distributed --skip rows throughput model memory cold
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import cachetools
import numpy as np
import torch
import zarr

from ... import __version__
from . import accelerator, distributed, handoff, memory, model, rows, throughput, tokenized
from .options import apply_quick, integer
from .report import target, targets_table

__all__ = ["main"]


def _cold() -> ModuleType | None:
    """The cold-disk section, where this checkout has it."""
    try:
        return importlib.import_module(f"{__name__}.cold")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.cold":
            raise
        return None


COLD = _cold()
SECTIONS: list[ModuleType] = [
    rows,
    handoff,
    throughput,
    tokenized,
    accelerator,
    model,
    memory,
    *([COLD] if COLD else []),
    distributed,
]
NAMES = [s.NAME for s in SECTIONS] + ([] if COLD else ["cold"])
#: The cold section's targets, shown as not measured when it does not run.
COLD_TARGETS = [
    target("cold disk: rows/s vs the device's queue-depth-16 rate", None, ">= 0.80x", None),
    target("cold disk (cache): batches/s vs lazy loading's", None, ">= 1.00x", None),
    target(
        "peak memory vs 1.2 x (cache + ring + index) + in-RAM contender without table",
        None,
        "<= 1.00x",
        None,
    ),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="embedpipe bench",
        description="embedpipe against its alternatives, side by side in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--vocab", type=integer(2), default=30_522, help="rows in the table")
    p.add_argument("--dim", type=integer(1), default=256, help="floats per row (float32)")
    p.add_argument("--batch-size", type=integer(1), default=32, help="sequences per batch")
    p.add_argument("--seq-len", type=integer(1), default=128, help="tokens per sequence")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the synthetic trace")
    p.add_argument("--workers", type=integer(1), default=2, help="DataLoader workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--torch-threads",
        type=integer(0),
        default=1,
        help="torch's intra-op threads in the training process, for every loop (0: torch's own "
        "default, one a core, whose pool spins after each parallel op and takes cores from "
        "the workers and an owner process)",
    )
    p.add_argument(
        "--quick", action="store_true", help="every section, smaller: under 10 minutes on 2 cores"
    )
    p.add_argument(
        "--skip", nargs="+", default=[], choices=NAMES, metavar="SECTION", help=f"of {NAMES}"
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="also run the 'distributed' section (launches 1, 2 and 4 ranks with torchrun); the "
        "other sections still run unless --skip names them",
    )
    p.add_argument("--dir", help="make the temporary folder here (none: the system's tmp)")
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    for section in SECTIONS:
        section.add_arguments(p)
    return p


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        # not platform.platform(): it runs `uname -p` in a child, which would count as a worker
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),  # the training process's (``--torch-threads``)
        "torch": torch.__version__,
        "numpy": np.__version__,
        "zarr": zarr.__version__,
        "cachetools": cachetools.__version__,
        "embedpipe": __version__,
    }


def all_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every section's rows of the Targets table; a section that did not run: not measured."""
    out = []
    for section in SECTIONS:
        out += section.targets(results["sections"].get(section.NAME))
    return out + ([] if COLD and COLD.NAME in results["sections"] else COLD_TARGETS)


def wanted(section: ModuleType, args: argparse.Namespace) -> bool:
    """Not skipped, and asked for if the section runs only when asked (``OPT_IN``)."""
    opt_in = getattr(section, "OPT_IN", None)
    return section.NAME not in args.skip and (opt_in is None or bool(getattr(args, opt_in)))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sections ``--skip`` leaves; markdown on stdout, ``--json`` every figure."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"cannot write {args.json}: the folder it names does not exist")
    if args.dir is not None and not os.path.isdir(args.dir):
        raise ValueError(f"--dir {args.dir}: no such folder; make it first, or leave --dir out")
    if args.quick:
        apply_quick(args, SECTIONS)
    started = time.perf_counter()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    results: dict[str, Any] = {"env": environment(), "args": vars(args), "sections": {}}
    results["peak_rss"], results["section_seconds"] = {}, {}
    workdir = tempfile.mkdtemp(prefix="embedpipe-bench-", dir=args.dir)
    try:
        for section in SECTIONS:
            if wanted(section, args):
                begun = time.perf_counter()
                results["sections"][section.NAME] = section.run(args, workdir)
                results["section_seconds"][section.NAME] = time.perf_counter() - begun
                results["peak_rss"][section.NAME] = memory.peak_rss()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    results["targets"] = all_targets(results)
    print(markdown(results, args, argv))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def markdown(results: dict[str, Any], args: argparse.Namespace, argv: list[str]) -> str:
    """The report: settings, the Targets table, each section's tables, peak RSS, total time."""
    parts = [
        f"## embedpipe benchmark\n\n`{json.dumps(results['env'])}`\n",
        f"args: `{' '.join(argv)}`\n",
        "### Targets\n",
        targets_table(results["targets"]) + "\n",
    ]
    for section in SECTIONS:
        if section.NAME in results["sections"]:
            text = section.report(results["sections"][section.NAME], args)
            parts.append(text.rstrip("\n") + "\n")
    phases = "; ".join(
        f"after {name}: main {r['main_mib']:.0f} MiB, largest child {r['worker_mib']:.0f} MiB"
        for name, r in results["peak_rss"].items()
    )
    if phases:
        parts.append(f"Peak RSS ({phases}); RSS counts shared memory in every process using it.\n")
    took = ", ".join(f"{k} {v:.0f} s" for k, v in results["section_seconds"].items())
    parts.append(f"Total time: {results['seconds']:.0f} s ({took})")
    return "\n".join(parts)
