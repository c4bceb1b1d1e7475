"""The cache size for a memory budget: what ``embedpipe advise`` prints and draws.

:func:`advise` replays every policy and Belady's optimum over a range of cache sizes
(``simulate.miss_ratio_curve``), adds what the whole pipe costs in memory at each size
(``budget.pipe_memory``: cache, optimizer state, index, the workers' ring), and picks the largest
size that fits the budget, and the knee: the smallest size that reads within
:data:`KNEE_TOLERANCE` of it. :func:`plot_curve` draws the miss-ratio curve (matplotlib, the
``plot`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cache import budget
from ..ids import as_ids
from .simulate import Progress, miss_ratio_curve, rows_read

#: Cache sizes ``advise`` simulates by default, as fractions of the table (a 1-2-5 series).
ADVICE_FRACTIONS = (0.01, 0.02, 0.05, 0.10, 0.20, 0.50, 1.0)
#: The knee: the smallest cache whose rows read are within this of the recommended cache's.
KNEE_TOLERANCE = 0.05
#: The policy a pipe runs by default: the one ``advise`` recommends a size for.
DEFAULT_POLICY = "auto"


def load_trace(path: str | os.PathLike, num_rows: int) -> np.ndarray:
    """The token ids saved in the ``.npy`` file ``path`` ((samples, seq_len) or (samples,)),
    checked to be integers in ``[0, num_rows)``; memory-mapped, so only the ids are read."""
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"trace {os.fspath(path)} does not exist; save the token ids of an epoch with "
            "numpy.save('ids.npy', ids), one sample per row"
        ) from None
    except ValueError:  # (numpy's reason speaks of pickles: not ours to suggest)
        raise ValueError(
            f"trace {os.fspath(path)}: not a .npy array of token ids; save an epoch's ids with "
            "numpy.save('ids.npy', ids), one sample per row"
        ) from None
    if ids.ndim not in (1, 2) or ids.size == 0:
        raise ValueError(
            f"trace {os.fspath(path)} holds an array of shape {ids.shape}; it must hold "
            "(samples, seq_len) or (samples,) token ids, at least one"
        )
    return as_ids(ids, num_rows, what=f"trace {os.fspath(path)}")


def advice_sizes(num_rows: int, fractions: Sequence[float] = ADVICE_FRACTIONS) -> list[int]:
    """Cache sizes (rows) at ``fractions`` of a table of ``num_rows`` rows, each at least 1."""
    return sorted({max(1, min(num_rows, round(f * num_rows))) for f in fractions})


def advise(
    sets: Sequence[np.ndarray],
    num_rows: int,
    dim: int,
    dtype: Any,
    memory: int,
    *,
    cache_sizes: Sequence[int] | None = None,
    state_arrays: int = 0,
    workers: int = 2,
    window: int = 64,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The miss-ratio curve of the trace ``sets`` and the cache size to run with ``memory`` bytes.

    The recommended size is the largest whose whole pipe (:func:`budget.pipe_memory`: cache,
    optimizer state, index and the ring of ``workers`` workers, policy ``"auto"``) fits in
    ``memory``; the knee is the smallest size that reads within :data:`KNEE_TOLERANCE` of the
    rows the recommended size reads (found by bisection between the sizes simulated). Returns
    the curve (:func:`miss_ratio_curve`, at ``cache_sizes`` or :func:`advice_sizes`, plus the
    recommended size), the memory of each size, and ``"recommended"`` and ``"knee"``, each
    ``{"cache_rows", "rows_read", "memory"}`` (``"optimum"`` too for the recommended size).
    """
    options = {"state_arrays": state_arrays, "policy": DEFAULT_POLICY, "num_workers": workers}
    best = budget.largest_cache(memory, num_rows, dim, dtype, **options)
    sizes = sorted({*(cache_sizes or advice_sizes(num_rows)), best})
    curve = miss_ratio_curve(
        sets, num_rows, sizes, window=window, workers=workers, progress=progress
    )
    sizes = curve["cache_rows"]
    reads = dict(zip(sizes, curve["rows_read"][DEFAULT_POLICY], strict=True))

    def cost(cache_rows: int) -> int:
        if cache_rows not in reads:
            reads[cache_rows] = rows_read(sets, num_rows, cache_rows, DEFAULT_POLICY, window=window)
            if progress is not None:
                progress(DEFAULT_POLICY, cache_rows)
        return reads[cache_rows]

    def summary(cache_rows: int) -> dict[str, Any]:
        memory = budget.pipe_memory(num_rows, dim, dtype, cache_rows, **options)
        return {"cache_rows": cache_rows, "rows_read": cost(cache_rows), "memory": memory}

    enough = (1 + KNEE_TOLERANCE) * cost(best)
    below = [c for c in sizes if c < best]
    low = max([c for c in below if cost(c) > enough], default=0)  # too few rows...
    high = min([c for c in [*below, best] if c > low and cost(c) <= enough])  # ...enough
    while high - low > max(1, high // 200):  # to within half a percent of the size
        middle = (low + high) // 2
        low, high = (low, middle) if cost(middle) <= enough else (middle, high)
    if cost(low) <= enough:  # low == 0 reads what no cache reads: only a tiny trace gets here
        high = low
    recommended = summary(best)
    recommended["optimum"] = curve["rows_read"]["belady"][sizes.index(best)]
    return {
        "num_rows": num_rows,
        "dim": dim,
        "dtype": np.dtype(dtype).name,
        "memory_budget": memory,
        "workers": workers,
        "window": window,
        "state_arrays": state_arrays,
        "max_unique": max((len(u) for u in sets), default=0),  # ring_rows this trace needs
        "curve": curve,
        "memory": [budget.pipe_memory(num_rows, dim, dtype, c, **options)["total"] for c in sizes],
        "recommended": recommended,
        "knee": summary(high),
    }


def plot_curve(advice: dict[str, Any], path: str | os.PathLike) -> None:
    """Draw the miss-ratio curve of :func:`advise` (rows read / rows read with no cache, against
    the cache size) into the image file ``path``; needs matplotlib (``embedpipe[plot]``)."""
    figure, ticker = matplotlib()
    curve, num_rows = advice["curve"], advice["num_rows"]
    x = [100 * c / num_rows for c in curve["cache_rows"]]
    fig = figure.Figure(figsize=(7, 4.5))  # no pyplot: no window, no global state
    ax = fig.subplots()
    for name, reads in curve["rows_read"].items():
        style = {"color": "black", "linestyle": "--", "zorder": 3} if name == "belady" else {}
        label = "Belady (optimum)" if name == "belady" else name
        ax.plot(x, [r / curve["lazy"] for r in reads], marker="o", ms=3, label=label, **style)
    share = 100 * advice["recommended"]["cache_rows"] / num_rows
    ax.axvline(share, color="grey", linewidth=1)
    ax.annotate(
        f" fits {budget.format_bytes(advice['memory_budget'])} ",
        (share, 0.9),
        ha="right" if share > 10 else "left",
        fontsize=8,
    )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    ax.set_xlabel(f"cache size (share of the table's {num_rows:,} rows)")
    ax.set_ylabel("rows read / rows read with no cache")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Rows read from disk over {curve['batches']:,} batches")
    ax.grid(True, which="both", alpha=0.3)
    knee = 100 * advice["knee"]["cache_rows"] / num_rows
    if knee < share:
        ax.axvline(knee, color="grey", linewidth=1, linestyle=":")
        ax.annotate(" knee ", (knee, 0.8), ha="right", fontsize=8)
    ax.legend(fontsize=8, loc="lower left")  # up there the lazy curve runs at 1.0
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def matplotlib() -> tuple[Any, Any]:
    """``matplotlib.figure`` and ``matplotlib.ticker``, or an ImportError that says what to
    install (matplotlib is the optional extra ``embedpipe[plot]``)."""
    try:
        from matplotlib import figure, ticker
    except ImportError:
        raise ImportError(
            "drawing the miss-ratio curve needs matplotlib: pip install 'embedpipe[plot]'"
        ) from None
    return figure, ticker


def check_outputs(png: str | None, json_path: str | None) -> None:
    """Fail now, not after the simulation: matplotlib missing, or a file to write in a folder
    that does not exist."""
    if png:
        matplotlib()
    for path in (png, json_path):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"cannot write {path}: the folder it names does not exist")
