"""The table's gradient averaged over the ranks when DDP averages its own.

NOTE [ The gradient averaged as DDP averages .grad ]
DDP averages a parameter's gradient at each backward pass that syncs (whose forward ran outside
``no_sync``: the forward decides, ``require_forward_param_sync``): its reducer takes the
whole ``.grad`` (what earlier passes left there, plus this pass's), multiplies it by 1/N and sums
it over the ranks. Under ``model.no_sync()`` (gradient accumulation in Accelerate, HF Trainer and
Lightning) it leaves ``.grad`` to add up on each rank, unaveraged. The table's gradient does the
same, so that accumulated steps are bit for bit DDP's (with two ranks; more sum in their own
order, see docs/scale-out.md): a pass adds its rows to the pending gradient first; under
``no_sync`` that is all; a pass that syncs then averages the whole pending gradient over the
ranks and holds the average. The DDP module is the one whose model holds ``pipe.parameter``,
found (a walk of the objects the garbage collector tracks) at the first backward pass, and again
after it is gone; with none then (a wrapper other than DDP), every pass syncs. A step of a
gradient that passes under ``no_sync`` left unaveraged raises: each rank would step its rows
with its own gradient (a loop that steps on the last micro-batches of an epoch, all in
``no_sync``).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import DistributedNotSupportedError

#: Every rank's (ids, rows) averaged: ``Shards.gradient`` or ``MachineGradient.gradient``.
Exchange = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class SyncedGradient:
    """Adds a backward pass's rows to ``gradient`` (a :class:`TableGradient`) as DDP adds to and
    averages ``.grad`` (see the NOTE)."""

    def __init__(self, gradient: Any) -> None:
        self.gradient = gradient
        self.unsynced = False  # the pending gradient holds passes that no_sync left local
        self._ddp: Callable[[], DistributedDataParallel | None] | None = None

    def add(self, ids: torch.Tensor, grad: torch.Tensor, exchange: Exchange) -> None:
        if not self.gradient.live():
            self.unsynced = False  # (what a pass under no_sync left was dropped since)
        self.gradient.add(ids, grad)  # this rank's sum, as .grad accumulates
        ddp = self._module()
        if ddp is not None and not ddp.require_forward_param_sync:  # as its forward decided
            self.unsynced = True  # no_sync: averaged at the pass that syncs
            return
        union, total = exchange(self.gradient.ids, self.gradient.parameter.grad)
        self.gradient.replace(union, total)
        self.unsynced = False

    def check_step(self) -> None:
        """Refuse a step of a gradient no pass has averaged since passes under ``no_sync``."""
        if self.unsynced and self.gradient.live():
            raise DistributedNotSupportedError(
                "the table's gradient holds backward passes run under DDP's no_sync() and none "
                "that synced since: each rank would step its rows with its own gradient (DDP's "
                "replicas would drift apart too). Run the last backward pass before a step "
                "outside no_sync(), as Accelerate's accumulate() does for the last batch of an "
                "epoch"
            )

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
