"""Benchmark embedpipe against the alternatives, side by side in one run: ``embedpipe bench``.

The benchmark lives in ``embedpipe/benchmark/``; ``--help`` lists its options, docs/benchmarks.md
says what it measures.
"""

from embedpipe.tools.benchmark import main

raise SystemExit(main())
