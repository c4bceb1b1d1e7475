"""Repeat the README's demo and the kill/resume test under CPU load: every run must end the same.

Training through embedpipe is deterministic: a run of ``scripts/train_bert.py`` with its default
seed ends at one loss whatever the machine does meanwhile, and a run killed with SIGKILL and
resumed ends bit for bit where the uninterrupted run ends (``tests/store/test_crash.py``). This script
runs each ``--repeats`` times while ``--load`` busy processes compete for the cores, and prints
every result and whether they all agree; it exits 1 if they do not::

    python scripts/stress.py --repeats 20 --load 2

The busy processes die with this script however it ends (they poll for their parent).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parent.parent
BUSY = (
    "import os, time\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    end = time.monotonic() + 0.5\n"
    "    while time.monotonic() < end: pass\n"
)
DONE = re.compile(r"loss \S+ -> (\S+); held-out loss (\S+) acc (\S+)")


def demo() -> str:
    """The README's demo; its result line (final loss, held-out loss and accuracy)."""
    out = subprocess.run(
        [sys.executable, "scripts/train_bert.py"], cwd=ROOT, capture_output=True, text=True
    )
    found = DONE.search(out.stdout)
    if out.returncode or found is None:
        return f"FAILED (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}"
    return "loss {} held-out loss {} acc {}".format(*found.groups())


def crash() -> str:
    """The kill/resume test: killed at five points, resumed, compared bit for bit."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/store/test_crash.py::test_kills_at_five_points_reopen_at_the_last_checkpoint_and_resume_exactly"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    return "bit for bit" if out.returncode == 0 else f"FAILED: {out.stdout.strip()[-300:]}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20, help="runs of each (default 20)")
    p.add_argument("--load", type=int, default=2, help="busy processes beside them (default 2)")
    p.add_argument("--only", choices=["demo", "crash"], help="run one of the two")
    args = p.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
    agree = True
    try:
        for name, run in (("demo", demo), ("crash", crash)):
            if args.only not in (None, name):
                continue
            results = collections.Counter()
            started = time.perf_counter()
            for _ in tqdm(range(args.repeats), desc=name, unit="run"):
                results[run()] += 1
            took = time.perf_counter() - started
            same = len(results) == 1 and "FAILED" not in next(iter(results))
            agree &= same
            print(f"{name}: {args.repeats} runs in {took:.0f} s under {args.load} busy processes: "
                  f"{'all the same' if same else 'DIFFERENT'}")  # fmt: skip
            for result, count in results.most_common():
                print(f"  {count:3d} x {result}")
    finally:
        for b in busy:
            b.kill()
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
