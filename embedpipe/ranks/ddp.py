"""The table's gradient averaged over the ranks when DDP averages its own.

NOTE [ The gradient averaged as DDP averages .grad ]
DDP averages a parameter's gradient at each backward pass that syncs: its reducer takes the
whole ``.grad`` (what earlier passes left there, plus this pass's), multiplies it by 1/N and sums
it over the ranks. Under ``model.no_sync()`` (gradient accumulation in Accelerate, HF Trainer and
Lightning) it leaves ``.grad`` to add up on each rank, unaveraged. The table's gradient does the
same, so that accumulated steps are bit for bit DDP's (with two ranks; more sum in their own
order, see docs/scale-out.md): a pass adds its rows to the pending gradient first; under
``no_sync`` that is all; a pass that syncs then averages the whole pending gradient over the
ranks and holds the average. The DDP module is the one whose model holds ``pipe.parameter``,
found (a walk of the objects the garbage collector tracks) at the first backward pass, and again
after it is gone; with none then (a wrapper other than DDP), every pass syncs.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

#: Every rank's (ids, rows) averaged: ``Shards.gradient`` or ``MachineGradient.gradient``.
Exchange = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SyncedGradient:
    """Adds a backward pass's rows to ``gradient`` (a :class:`TableGradient`) as DDP adds to and
    averages ``.grad`` (see the NOTE)."""

    def __init__(self, gradient: Any) -> None:
        self.gradient = gradient
        self._ddp: Callable[[], DistributedDataParallel | None] | None = None

    def add(self, ids: torch.Tensor, grad: torch.Tensor, exchange: Exchange) -> None:
        self.gradient.add(ids, grad)  # this rank's sum, as .grad accumulates
        ddp = self._module()
        if ddp is not None and not ddp.require_backward_grad_sync:
            return  # no_sync: averaged at the pass that syncs
        union, total = exchange(self.gradient.ids, self.gradient.parameter.grad)
        self.gradient.replace(union, total)

    def _module(self) -> DistributedDataParallel | None:
        """The DDP module, found at the first pass (and again if it is gone: a model wrapped
        anew); None if there was none then."""
        ddp = None if self._ddp is None else self._ddp()
        if ddp is None and (self._ddp is None or isinstance(self._ddp, weakref.ref)):
            ddp = _wrapping(self.gradient.parameter)
            self._ddp = (lambda: None) if ddp is None else weakref.ref(ddp)
        return ddp


def _wrapping(parameter: torch.nn.Parameter) -> DistributedDataParallel | None:
    """The DDP module whose model holds ``parameter``, if one does."""
    for candidate in gc.get_objects():
        if isinstance(candidate, DistributedDataParallel) and any(
            p is parameter for p in candidate.module.parameters()
        ):
            return candidate
    return None
