"""EmbeddingPipe: owns the table, the shared cache and the writeback; builds loaders.

The pipe lives in the training process, the owner (invariant 1). Three kinds of code touch it:

- DataLoader workers run :class:`~embedpipe.worker.Lookup` against its shared arrays, read-only;
- the training loop runs :meth:`EmbeddingPipe._hand_off` for each batch (through the loader)
  and the gradient hook :meth:`EmbeddingPipe._on_grad` during backward;
- the writeback thread runs :meth:`EmbeddingPipe._apply`.

The hand-off and the writeback thread both change the cache; one lock serialises them.
How exact and bounded consistency follow from the hand-off is in ``docs/consistency.md``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .batch import EmbeddedBatch
from .cache import RowCache, SharedRows, Update
from .errors import NonFiniteGradientError
from .optim import RowOptimizer
from .policy import make_policy
from .table import Table
from .worker import LookedUp
from .writeback import Writeback, WritebackError

CONSISTENCY = ("exact", "bounded")


class EmbeddingPipe:
    """An embedding table on disk, looked up inside the DataLoader and trained by a sparse optimizer.

    Parameters
    ----------
    table:
        A :class:`Table` or its path. A path is opened ``"r+"`` when there is an optimizer.
    cache_rows:
        Rows held in the shared cache: 0 reads every row from disk (lazy loading), ``>= num_rows``
        keeps every row once read. Host memory: ``cache_rows x dim x itemsize`` shared, the same
        again per optimizer state array (owner only), 12 bytes per table row (8 with LRU), and
        the workers' ring (see ``loader``).
    policy:
        ``"lru"``, ``"lfu"`` or ``"auto"`` (the best measured policy, see ``embedpipe.policy``).
    optimizer:
        ``embedpipe.optim.SGD``, ``Adagrad`` or ``Adam``; ``None`` keeps the table frozen.
    consistency, max_staleness:
        ``"exact"`` (default): each batch sees every update of the steps before it.
        ``"bounded"``: a batch may miss the last ``max_staleness`` steps' updates, never more.
    padding_idx:
        An id whose row is looked up but never updated, as in ``nn.Embedding``.
    grad_accumulation:
        Batches whose gradients are summed into one optimizer step (see docs/training.md).
    check_finite:
        Raise :class:`~embedpipe.errors.NonFiniteGradientError` on a NaN/inf gradient (default).
    """

    def __init__(
        self,
        table: Table | str | os.PathLike[str],
        *,
        cache_rows: int,
        policy: str = "auto",
        optimizer: RowOptimizer | None = None,
        consistency: str = "exact",
        max_staleness: int | None = None,
        padding_idx: int | None = None,
        grad_accumulation: int = 1,
        check_finite: bool = True,
    ) -> None:
        _check_options(cache_rows, consistency, max_staleness, grad_accumulation)
        self._owns_table = not isinstance(table, Table)
        if isinstance(table, Table):
            if optimizer is not None and table.mode != "r+":
                raise ValueError(
                    f"the pipe updates {table.path}: open it with Table.open(path, mode='r+')"
                )
        else:
            table = Table.open(table, "r+" if optimizer is not None else "r")
        self.table = table
        if padding_idx is not None and not 0 <= padding_idx < table.num_rows:
            raise ValueError(f"padding_idx must be in [0, {table.num_rows}), got {padding_idx}")
        self.optimizer = optimizer
        self.consistency = consistency
        self.max_staleness = max_staleness or 0
        self.padding_idx = padding_idx
        self.grad_accumulation = grad_accumulation
        self.check_finite = check_finite

        state = tuple(optimizer.state_init()) if optimizer is not None else ()
        if optimizer is not None:
            for name, fill in optimizer.state_init().items():
                if name not in table.state_names:
                    table.add_state(name, fill)
            table.update_metadata(optimizer=optimizer.config())
        cache_rows = min(int(cache_rows), table.num_rows)
        dtype = getattr(torch, table.dtype.name)
        self.shared = SharedRows(table.num_rows, cache_rows, table.dim, dtype)
        self.cache = RowCache(
            self.shared,
            make_policy(policy, cache_rows, table.num_rows),
            fetch=lambda ids, name: table.read(ids, name),
            store=lambda ids, rows, name: table.write(ids, rows, name),
            state=state,
            step=table.step,
        )
        self._lock = threading.Lock()
        self._start_step = table.step
        self.writeback = (
            Writeback(self._apply, idle=self._clean_ahead, step=table.step)
            if optimizer is not None
            else None
        )
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # gradients being accumulated
        self._counts = dict.fromkeys(("batches", "hits", "misses", "refreshed", "ring_overruns"), 0)
        self._closed = False

    # ------------------------------------------------------------------------- public
    def loader(
        self,
        dataset: Dataset,
        *,
        batch_size: int | None = 1,
        shuffle: bool = False,
        num_workers: int = 0,
        collate_fn: Any = None,
        ids_key: str = "input_ids",
        ring_rows: int | None = None,
        **dataloader_kwargs: Any,
    ):
        """A DataLoader over ``dataset`` whose batches arrive with ``"inputs_embeds"``.

        Takes the arguments of ``torch.utils.data.DataLoader`` (``prefetch_factor``,
        ``persistent_workers``, ``pin_memory``, ``multiprocessing_context``...). ``collate_fn``
        must return a mapping with the token ids under ``ids_key``. ``ring_rows`` bounds the
        unique ids per batch that travel through shared memory (default ``min(num_rows, 2048)``);
        a batch with more is sent as a tensor, which is correct but slower.
        """
        from .loader import PipeLoader

        self._check_open()
        return PipeLoader(
            self,
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            collate_fn=collate_fn,
            ids_key=ids_key,
            ring_rows=ring_rows,
            **dataloader_kwargs,
        )

    def stats(self) -> dict[str, int]:
        """Counters since the pipe opened: hits, misses, rows_read, rows_written, evictions, ..."""
        cache = self.cache.counts
        return {
            **self._counts,
            "rows_read": self._counts["misses"] + cache["rows_read"],
            "rows_written": cache["rows_written"],
            "evictions": cache["evictions"],
            "cleaned_ahead": cache["cleaned_ahead"],
            "writeback_queue": self.writeback.pending if self.writeback else 0,
            "steps": (self.writeback.applied if self.writeback else self._start_step)
            - self._start_step,
            "cached_rows": int((self.shared.slot_id >= 0).sum()),
            "dirty_rows": int(self.cache.dirty.sum()),
        }

    def flush(self) -> None:
        """Apply every queued step and write every updated row and its state to the table.

        Gradients of an unfinished ``grad_accumulation`` group stay pending (as ``.grad`` does
        in torch across a checkpoint); ``close()`` applies them as a last step.
        """
        self._check_open()
        if self.writeback is None:
            return
        self.writeback.wait()
        self._write_dirty()

    def _write_dirty(self) -> None:
        """Every updated row and its state to the table, then the step they correspond to."""
        with self._lock:
            self.cache.flush()
            self.table.update_metadata(step=self.writeback.applied)

    def checkpoint(self) -> None:
        """Make the table on disk hold every update so far (``flush`` plus the step in metadata)."""
        self.flush()

    def close(self) -> None:
        """Apply what is queued, write every updated row to the table, stop the writeback thread
        and release the table (if the pipe opened it).

        If the writeback thread failed, the steps before the failure are still written (the
        table's ``step`` says which) and the error is raised after that.
        """
        self._close(raise_errors=True)

    def _close(self, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        error = None
        try:
            if self.writeback is not None:
                try:
                    if self._pending:
                        self._submit()
                except WritebackError as e:
                    error, self._pending = e, []
                try:
                    self.writeback.close()  # applies everything queued first
                except WritebackError as e:
                    error = e
                self._write_dirty()
        finally:
            if self._owns_table:
                self.table.close()
        if error is not None and raise_errors:
            raise error

    def __enter__(self) -> EmbeddingPipe:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._close(raise_errors=exc_type is None)  # don't hide the error already on its way

    # ------------------------------------------------------------------------- training loop
    def _hand_off(
        self, item: LookedUp, rows: np.ndarray | None, pin: bool = False
    ) -> EmbeddedBatch:
        """Turn a worker's lookup into the batch the loop sees (main thread).

        ``rows`` is the batch's copy of its unique rows, or None when its ring slot was
        overwritten; ``pin`` puts them in pinned memory (the loader's ``pin_memory``). Waits for
        the writeback as the consistency mode requires, re-reads the rows that changed since the
        lookup began, admits the misses into the cache.
        """
        self._check_open()
        ids = item.unique_ids
        if self.writeback is not None:
            self.writeback.wait(0 if self.consistency == "exact" else self.max_staleness)
        with self._lock:
            if rows is None:
                self._counts["ring_overruns"] += 1
                rows = self.cache.current(ids)
            else:
                stale = np.flatnonzero(self.cache.last_updated[ids] > item.lookup_step)
                if len(stale):
                    rows[stale] = self.cache.current(ids[stale])
                    self._counts["refreshed"] += len(stale)
            self.cache.admit(ids, rows)
        self._counts["batches"] += 1
        self._counts["hits"] += item.hits
        self._counts["misses"] += item.misses
        sink = self._on_grad if self.optimizer is not None else None
        return EmbeddedBatch(
            item.fields,
            torch.from_numpy(ids),
            torch.from_numpy(item.inverse),
            torch.from_numpy(rows).pin_memory() if pin else torch.from_numpy(rows),
            sink,
        )

    def _on_grad(self, unique_ids: torch.Tensor, grad: torch.Tensor) -> None:
        """The gradient hook: check, move to the CPU, and queue (runs inside backward)."""
        if self._closed:
            raise RuntimeError(
                "this EmbeddingPipe is closed: the embedding gradient of this batch cannot be applied"
            )
        if self.check_finite:
            bad = ~torch.isfinite(grad).all(dim=1)
            if self.padding_idx is not None:  # never applied, as in nn.Embedding
                bad &= (unique_ids != self.padding_idx).to(bad.device)
            if bool(bad.any()):
                where = bad.nonzero()[:, 0].cpu()
                ids = unique_ids[where].tolist()
                value = grad[where[0]][~torch.isfinite(grad[where[0]])][0].item()
                raise NonFiniteGradientError(
                    f"non-finite embedding gradient ({value}) for id {ids[0]}"
                    + (f" and {len(ids) - 1} more ids" if len(ids) > 1 else "")
                    + f" in step {self.writeback.submitted + 1}; nothing of this step was applied. "
                    "Lower the learning rate, clip gradients or check the loss; "
                    "check_finite=False skips this check"
                )
        self._pending.append(
            (unique_ids, grad.detach().to("cpu", self.shared.tensors["rows"].dtype))
        )
        if len(self._pending) >= self.grad_accumulation:
            self._submit()

    def _submit(self) -> None:
        """Sum the pending gradients per id and queue them as one optimizer step."""
        if len(self._pending) == 1:
            ids, grad = self._pending[0]
        else:  # the same order of sums as .grad accumulation over the batches
            ids, inverse = torch.unique(
                torch.cat([i for i, _ in self._pending]), return_inverse=True
            )
            grad = torch.zeros(len(ids), self.table.dim, dtype=self._pending[0][1].dtype)
            grad.index_add_(0, inverse, torch.cat([g for _, g in self._pending]))
        self._pending = []
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids, grad = ids[keep], grad[keep]
        self.writeback.submit(ids.numpy(), grad)

    # ------------------------------------------------------------------------- writeback thread
    def _apply(self, ids: np.ndarray, grad: torch.Tensor, step: int) -> None:
        """One optimizer step; the update itself runs outside the lock, so hand-offs go on."""
        with self._lock:
            work = self.cache.gather(ids)
        try:
            _update_in_float32(self.optimizer, work, grad, step)
            with self._lock:
                self.cache.scatter(work, step)
                self.shared.clock[0] = step  # published last: a lookup that saw it sees the rows
        except BaseException:
            with self._lock:
                self.cache.unpin(work)
            raise

    def _clean_ahead(self) -> None:
        """Writeback thread, queue empty: write cold dirty rows while the loop is elsewhere."""
        if self.shared.cache_rows:
            with self._lock:
                self.cache.clean_ahead()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this EmbeddingPipe is closed; make a new one")

    def __repr__(self) -> str:
        return (
            f"EmbeddingPipe({self.table.path!r}, cache_rows={self.shared.cache_rows}, "
            f"optimizer={self.optimizer}, consistency={self.consistency!r})"
        )


def _update_in_float32(
    optimizer: RowOptimizer, work: Update, grad: torch.Tensor, step: int
) -> None:
    """Run the optimizer on ``work`` in place; float16 rows are updated in float32 and rounded
    back, since an ``eps`` of 1e-8 and a squared gradient both vanish in float16."""
    rows = torch.from_numpy(work.rows)
    state = {name: torch.from_numpy(values) for name, values in work.state.items()}
    if rows.dtype in (torch.float32, torch.float64):
        optimizer.update(rows, grad, state, step)
        return
    wide = {name: values.float() for name, values in state.items()}
    wide_rows = rows.float()
    optimizer.update(wide_rows, grad.float(), wide, step)
    rows.copy_(wide_rows)
    for name, values in state.items():
        values.copy_(wide[name])


def _check_options(
    cache_rows: Any, consistency: str, max_staleness: Any, grad_accumulation: Any
) -> None:
    if (
        not isinstance(cache_rows, (int, np.integer))
        or isinstance(cache_rows, bool)
        or cache_rows < 0
    ):
        raise ValueError(
            f"cache_rows must be an integer >= 0 (0 reads every row from disk), got {cache_rows!r}"
        )
    if consistency not in CONSISTENCY:
        raise ValueError(f"consistency must be one of {CONSISTENCY}, got {consistency!r}")
    if consistency == "bounded" and (not isinstance(max_staleness, int) or max_staleness < 1):
        raise ValueError(
            f"consistency='bounded' needs max_staleness, an integer >= 1, got {max_staleness!r}"
        )
    if consistency == "exact" and max_staleness not in (None, 0):
        raise ValueError(f"max_staleness={max_staleness!r} needs consistency='bounded'")
    if not isinstance(grad_accumulation, int) or grad_accumulation < 1:
        raise ValueError(f"grad_accumulation must be an integer >= 1, got {grad_accumulation!r}")
