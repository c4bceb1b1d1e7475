"""The pipe's counters as the figures a training log shows: rates since the last log.

``pipe.stats()`` counts from the pipe's start; a log line wants what happened since the line
before it. :class:`PipeMeter` keeps the last counts and gives, at each call:

- ``embedpipe/hit_rate``: the share of looked-up rows the shared cache held;
- ``embedpipe/rows_read_per_step`` and ``embedpipe/rows_written_per_step``: disk traffic per
  optimizer step of the table;
- ``embedpipe/writeback_lag``: steps submitted and not yet applied (0 in exact mode at a batch's
  read; more means the writeback thread is behind the loop).

``embedpipe.hf.Trainer`` adds them to Trainer's training logs (so TensorBoard, W&B and the
progress bar get them) and ``embedpipe.lightning.PipeCallback`` to Lightning's ``log``.
"""

from __future__ import annotations

from typing import Any

#: The prefix of every figure's name in a log.
PREFIX = "embedpipe/"


class PipeMeter:
    """Rates of ``pipe.stats()`` between calls of :meth:`since_last`."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self._last: dict[str, int] = {}

    def since_last(self) -> dict[str, float]:
        """The figures since the last call (or the pipe's start); {} once the pipe is closed."""
        if self.pipe._owner.closed:
            return {}
        stats = self.pipe.stats()
        stats["submitted"] = stats["steps"] + stats["writeback_queue"]  # taken, maybe not applied
        names = ("hits", "misses", "rows_read", "rows_written", "submitted")
        delta = {k: stats[k] - self._last.get(k, 0) for k in names}
        self._last = {k: stats[k] for k in delta}
        out: dict[str, float] = {f"{PREFIX}writeback_lag": float(stats["writeback_queue"])}
        looked_up = delta["hits"] + delta["misses"]
        if looked_up:
            out[f"{PREFIX}hit_rate"] = delta["hits"] / looked_up
        if delta["submitted"] > 0:
            out[f"{PREFIX}rows_read_per_step"] = delta["rows_read"] / delta["submitted"]
            out[f"{PREFIX}rows_written_per_step"] = delta["rows_written"] / delta["submitted"]
        return out
