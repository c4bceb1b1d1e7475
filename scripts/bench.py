"""Benchmark embedpipe against the alternatives, side by side in one run: ``embedpipe bench``.

The benchmark lives in ``embedpipe/tools/benchmark/``; ``--help`` lists its options,
docs/benchmarks.md says what it measures. Run through the command line's entry point, so that a
wrong argument (a ``--dir`` that does not exist) is one line on stderr, not a traceback.
"""

import sys

from embedpipe.tools.cli import main

raise SystemExit(main(["bench", *sys.argv[1:]]))
