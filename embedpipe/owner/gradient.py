"""The table's gradient as a torch ``Parameter``: accumulated by backward, seen by clipping, and
taken by the optimizer step.

An ``nn.Embedding`` trains inside the frameworks people use because its gradient is an ordinary
``.grad``: backward passes add to it, ``clip_grad_norm_`` counts and scales it, ``zero_grad``
drops it, and ``optimizer.step()`` applies it with the learning rate the schedule set. The
offloaded table gets the same by holding its pending gradient in :attr:`TableGradient.parameter`::

    parameter: (U, D), a stride-0 view of one zero (no memory)   .grad: (U, D), the gradient of
    ids (U,) sorted, the rows the gradient is for                        those rows, summed as
                                                                         backward passes add up

The parameter sits in the model where the ``nn.Embedding`` was (``embedpipe.hf.offload``), so
``model.parameters()`` yields it in the embedding's place and a global norm sums it in the same
order. The step is taken in torch's global optimizer step pre-hook, before the optimizer reads
any ``.grad``, when the optimizer holds the parameter (NOTE [ Which optimizer steps the table ]):
a copy of the gradient is queued as one table step, with the learning rate of the parameter
group that holds it, and ``.grad`` is hidden from the optimizer while it steps (NOTE [ A step
leaves .grad as torch does ]). A ``step(closure)`` (Lightning) computes the gradient inside the
step, after clipping: then the step is taken when the closure returns.

NOTE [ A step leaves .grad as torch does ]
torch steps every parameter whose ``.grad`` is not None, and leaves ``.grad`` as it was: a loop
that never zeroes it adds the next batch to it, a second ``step()`` applies it again, and one
zeroed in place (``zero_grad(set_to_none=False)``, a frozen table's) still counts a step
(Adagrad's ``lr_decay`` and Adam's bias correction count it) and moves nothing. The table's
step does the same: it takes a copy of ``.grad`` (lazy: made when either is first written), hides
``.grad`` from the optimizer while it steps (AdamW and friends skip a parameter without one; its
update would write the stand-in parameter, and its state would hold the batch's rows), and puts
it back in the post-step hook. A zeroed gradient is a step of no rows. What the fused kernels do
with ``GradScaler`` (``grad_scale``: divide, leaving ``.grad`` unscaled; ``found_inf``: skip the
step, ``.grad`` hidden all the same) the table's step does too.

NOTE [ The table's learning rate ]
The row optimizer's ``lr`` is the table's learning rate, and a schedule reaches it through the
group that holds the parameter:

- a group of its own (``{"params": [pipe.parameter], "lr": 0.05}``, what ``embedpipe.hf.Trainer``
  makes): its ``lr`` is the table's, read at every step, so a scheduler sets it exactly as it
  sets the matching group of a torch ``Adagrad``;
- a group shared with dense weights (``AdamW(model.parameters())``): the row optimizer's ``lr``
  times the group's rate relative to the rate it was built with, ``group["lr"] / built``.
  ``built`` is the group's ``initial_lr`` where a scheduler set one; otherwise the group's rate
  when embedpipe first saw the optimizer: when the pipe was made, at the pipe's first batch, or
  at the optimizer's first step, whichever came first (a rate other than the optimizer's default
  ``defaults['lr']`` then is warned about: a warmup or a resumed decay may have begun, NOTE [ A
  rate changed before embedpipe saw it ] in ``builtrate.py``), kept in the group as
  ``group["embedpipe_built_lr"]`` so that it travels with ``optimizer.state_dict()`` (a resumed
  run restores it). So a hand-written warmup (which sets the rate inside the loop, after the
  batch is drawn), ``ReduceLROnPlateau`` and a rate changed by hand scale the table as they
  scale the group. A built rate of 0 raises: no factor can follow it;
- in no optimizer: the row optimizer's ``lr``, stepped by ``pipe.step()``.

Other hyperparameters of the group (AdamW's weight decay, betas, eps) do not apply to the table;
``maximize`` does (the table ascends too); a weight decay or momentum raises where they would
apply (NOTE [ A group's settings the table cannot take ] in ``groupsettings.py``).

NOTE [ Which optimizer steps the table ]
Only an optimizer that holds ``pipe.parameter`` takes the table's gradient, when its ``step()``
runs, in whatever order several optimizers step (two tables in two optimizers, an
encoder-decoder, a frozen stage whose optimizer never steps). Any other optimizer's step leaves
it pending. If the gradient is still pending at the next backward pass after such a step, the
pipe warns once: no optimizer that holds it stepped (call ``pipe.step()``, or freeze the table
with ``requires_grad_(False)``). An optimizer that holds the embedding weight ``offload``
replaced (built before ``offload``) raises at its step: it can never reach the table.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..errors import EmbeddingsOffloadedError
from ..store.layout import remembered_steps
from .builtrate import BUILT_LR, see_first
from .freshstate import STEPPED, count_step, has_stepped, refuse_fresh_state, steps_here
from .gradcheck import passed_by, warn_replaced, warn_unreached
from .groupsettings import refuse_unmatched_settings

#: Called with (ids (U,) CPU int64, grad (U, D) on the gradient's device, lr or None) per step.
StepSink = Callable[[torch.Tensor, torch.Tensor, "float | None"], None]
#: Called with (ids, grad) before a step is taken; raises to refuse it (a non-finite gradient).
StepCheck = Callable[[torch.Tensor, torch.Tensor], None]

#: Backward passes with no optimizer step ever seen before the pipe warns that none may come.
PILE_UP_WARNING = 100


class TableGradient:
    """The pending gradient of the table's rows, as :attr:`parameter`'s ``.grad``."""

    def __init__(
        self, table: Any, optimizer: Any, check: StepCheck, on_step: StepSink, parameter: Any
    ) -> None:
        """The gradient of ``table``'s rows, stepped by the row ``optimizer``; ``parameter``:
        the one to hold it in (``offload`` makes it, so that an optimizer built before the pipe
        holds it too); a new one if None."""
        fresh = nn.Parameter(torch.empty(0, table.dim))
        self.parameter = parameter if parameter is not None else fresh
        self.ids: torch.Tensor | None = None  # the rows of parameter.grad, sorted
        self._version = -1  # parameter.grad's version counter when this object last changed it
        self.row, self.base_lr, self.check, self.on_step = optimizer, optimizer.lr, check, on_step
        self.backwards = 0  # backward passes added since the last step
        #: batches read to train since an optimizer holding the parameter last stepped (NOTE [ A
        #: gradient the table did not get ]: one with no backward pass added since warns)
        self.leaves = 0
        self._made: torch.Tensor | None = None  # the .grad this object made (the same NOTE)
        self.steps = 0  # steps taken
        self.path = os.path.realpath(table.path)  # (the steps of this process: freshstate.py)
        self.stepped = remembered_steps(table.metadata, optimizer)  # (NOTE [ A new optimizer...)
        self.remembers = optimizer.remembers()
        self._warned = False
        #: an optimizer that does not hold the parameter stepped while its gradient was pending
        self._passed_over = False
        self._warned_passed_over = self._warned_unreached = self._warned_replaced = False
        ref = weakref.ref(self)

        def pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
            gradient = ref()
            return None if gradient is None else gradient._pre_step(optimizer, args, kwargs)

        def post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            gradient = ref()
            if gradient is not None:
                gradient._post_step()

        self._hook = register_optimizer_step_pre_hook(pre_step)
        self._post_hook = register_optimizer_step_post_hook(post_step)
        #: the gradient an optimizer's step took, put back as .grad after it: (that tensor, its
        #: version then); not pending unless changed or replaced, though the next step takes it
        self._taken: tuple[torch.Tensor, int] | None = None
        self._hidden: tuple[torch.Tensor, bool] | None = None
        self._value_hook: Any = None
        self.trains()
        self.clear()  # an adopted parameter may hold what an earlier pipe left
        self.see_optimizers("when the pipe was made")  # optimizers built before: rates as built

    def trains(self) -> bool:
        """The parameter requires grad (the table is not frozen). Then it is hooked to refuse a
        loss that uses its value (:func:`_refuse_its_value`): when the pipe is made, or at the
        first batch read after the table is unfrozen (a frozen parameter takes no hook)."""
        if not self.parameter.requires_grad:
            return False
        if self._value_hook is None:
            self._value_hook = self.parameter.register_hook(_refuse_its_value)
        return True

    # ----------------------------------------------------------------------------- backward
    def live(self) -> bool:
        """``.grad`` holds a gradient: not dropped, nor zeroed in place (see :attr:`pending`)."""
        grad = self.parameter.grad
        if grad is None or self.ids is None:
            return False
        return grad._version == self._version or bool(grad.any())

    @property
    def pending(self) -> bool:
        """A gradient has been accumulated and no step has taken it (nor ``zero_grad`` dropped it).

        ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place instead of dropping it; for a
        sparse gradient (what ``nn.Embedding(sparse=True)`` gives ``SparseAdam``) that leaves no
        row at all, so a zeroed gradient counts as dropped here too: its rows are not stepped
        (Adam would otherwise decay their moments and move them). In-place changes are seen by
        the tensor's version counter; clipping changes it too, but leaves a non-zero gradient.
        A gradient an optimizer's step took and nothing changed since is not pending, though it
        stays as ``.grad`` (NOTE [ A step leaves .grad as torch does ]).
        """
        if not self.live():
            return False
        grad, taken = self.parameter.grad, self._taken
        return taken is None or taken[0] is not grad or taken[1] != grad._version

    def add(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Add one backward pass's gradient ``grad`` (U, D) of the rows ``ids`` (U,) sorted.

        Sums as ``.grad`` accumulation does, bit for bit: a row in both gets ``old + new``; a
        row in one gets its value (``0 + x`` is ``x``)."""
        held = self.parameter.grad
        self.backwards += 1
        if self._passed_over and self.pending and not self._warned_passed_over:
            self._warned_passed_over = True
            warnings.warn(
                "an optimizer stepped that does not hold pipe.parameter, and none that holds it "
                "did: the embedding table's gradient was not taken and keeps adding up. Build "
                "the optimizer from model.parameters() after offload() (or add pipe.parameter "
                "to it), call pipe.step() after your optimizer's step, or freeze the table with "
                "pipe.parameter.requires_grad_(False)",
                RuntimeWarning,
                stacklevel=4,
            )
        self._taken = self._hidden = None  # (a taken gradient not zeroed adds up, as .grad does)
        if not self.live() or held.shape[0] != len(self.ids):  # dropped by zero_grad: anew
            self._hold(ids, grad)
        else:
            both, where = torch.unique(torch.cat([self.ids, ids]), return_inverse=True)
            old, new = (
                where[: len(self.ids)].to(held.device),
                where[len(self.ids) :].to(held.device),
            )
            if len(both) == len(self.ids):  # no new rows: add in place, as AccumulateGrad does
                held.index_add_(0, new, grad.to(held.dtype))
                self._version = held._version
            else:
                total = held.new_zeros(len(both), held.shape[1])
                total.index_add_(0, old, held)
                total.index_add_(0, new, grad.to(held.dtype))
                self._hold(both, total)
        if self.steps == 0 and self.backwards == PILE_UP_WARNING and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.backwards} backward passes have added to the embedding table's gradient "
                "and no optimizer has stepped: the table is trained when a torch optimizer steps "
                "(optimizer.step()) or when pipe.step() is called",
                RuntimeWarning,
                stacklevel=4,
            )

    def replace(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """Hold ``grad`` (U, D) of the rows ``ids`` in place of the pending gradient (the ranks'
        average of it: NOTE [ The gradient averaged as DDP averages .grad ] in ranks/ddp.py)."""
        self._taken = self._hidden = None
        self._hold(ids, grad)

    def _hold(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        param = self.parameter
        param.grad = None
        param.data = grad.new_zeros(()).expand(grad.shape)  # the shape .grad needs, no memory
        param.grad = self._made = grad
        self.ids = ids
        self._version = grad._version

    def clear(self) -> None:
        """Drop the pending gradient, as ``zero_grad()`` does."""
        self._passed_over = False
        param = self.parameter
        param.grad = self._made = None
        param.data = param.data.new_empty(0, param.shape[1])
        self.ids = None
        self.backwards = 0
        self._taken = self._hidden = None

    # ----------------------------------------------------------------------------- the step
    def step(self, lr: float | None = None) -> bool:
        """Take the pending gradient as one table step (``lr`` None: the row optimizer's).

        Returns False when there was nothing to take."""
        self._see_replaced(stacklevel=3)  # the program's pipe.step()
        if not self.pending:
            self.clear()
            return False
        ids, grad = self.ids, self.parameter.grad
        self.check(ids, grad)  # a refused step leaves the gradient pending, as .grad stays
        self._passed_over = False
        self.clear()  # before it is queued: a signal in between loses it, never queues it twice
        self.on_step(ids, grad, lr)
        self.steps += 1
        count_step(self.path)
        return True

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """torch's global step pre-hook: ``args`` is ``(optimizer, *step args)``."""
        group = _group_of(optimizer, self.parameter)
        if group is None:
            _refuse_stale(optimizer)
            if self.pending:
                self._passed_over = True  # warned about at the next backward if still pending
            return None
        if isinstance(optimizer, torch.optim.LBFGS):
            raise RuntimeError(
                "LBFGS cannot train an offloaded table: its line search re-evaluates the loss "
                "at trial points of every parameter; leave pipe.parameter out of it"
            )
        see_first(group, "at this step", optimizer, stacklevel=5)  # the program's step()
        leaves, self.leaves = self.leaves, 0
        if leaves and not self.backwards and not self._warned_unreached:  # (NOTE in gradcheck.py)
            self._warned_unreached = passed_by(optimizer, self.parameter) and warn_unreached(leaves)
        if STEPPED not in group:  # first seen: loaded, or new (looked at once, not every step)
            group[STEPPED] = has_stepped(optimizer)
        if kwargs.get("grad_scaler") is not None:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() takes the GradScaler itself (grad_scaler=): "
                "embedpipe cannot tell how it unscales the table's gradient; leave "
                "pipe.parameter out of this optimizer and step the table with pipe.step()"
            )
        if _found_inf(optimizer):  # GradScaler, and an optimizer that unscales itself (fused)
            self._hide(taken=False)  # it skips this step: the gradient stays, as torch's does
            return None
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if closure is None:
            self._step_by(optimizer, group)
            return None
        calls = 0

        def closure_then_step() -> Any:  # the gradient exists (and is clipped) after the closure
            nonlocal calls
            calls += 1
            if calls > 1:
                raise RuntimeError(
                    f"{type(optimizer).__name__}.step() called its closure twice; an offloaded "
                    "table takes one gradient per step (optimizers such as LBFGS are not supported)"
                )
            out = closure()
            self._step_by(optimizer, group)
            return out

        if len(args) > 1:
            return (args[0], closure_then_step, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_then_step}

    def _step_by(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
        """One table step by ``optimizer``, of what ``.grad`` holds, as torch steps a parameter
        (NOTE [ A step leaves .grad as torch does ])."""
        grad = self.parameter.grad
        if grad is None or self.ids is None:
            return  # torch skips a parameter with no .grad
        self._see_replaced(stacklevel=5)  # the program's optimizer.step()
        refuse_unmatched_settings(optimizer, group, self.row)  # NOTE in groupsettings.py
        remembered = self.stepped + self.steps if self.remembers else 0
        refuse_fresh_state(optimizer, group, remembered, here=steps_here(self.path))
        live = self.live()
        scale = getattr(optimizer, "grad_scale", None)  # GradScaler, and a fused optimizer
        if scale is not None and live:
            grad.div_(scale.to(grad.device))  # as its kernel does, leaving .grad unscaled
            self._version = grad._version
        lr = self._group_lr(optimizer, group)
        # zeroed in place: no row moves, but the step counts (Adam's, Adagrad's lr_decay)
        ids, rows = (self.ids, grad) if live else (self.ids[:0], grad[:0])
        # the step's own copy: .grad stays the user's to change (lazy: copied at a write)
        taken = -rows if group.get("maximize") else _lazy_clone(rows)
        self.check(ids, taken)  # a refused step leaves the gradient pending
        self._passed_over = False
        self.backwards = 0
        self._hide(taken=True)
        self.on_step(ids, taken, lr)
        self.steps += 1
        count_step(self.path)

    def _see_replaced(self, stacklevel: int) -> None:  # (NOTE in gradcheck.py)
        grad = self.parameter.grad
        if grad is not None and grad is not self._made and not self._warned_replaced:
            self._warned_replaced = warn_replaced(stacklevel + 1)

    def _hide(self, taken: bool) -> None:
        """Hide ``.grad`` from the optimizer stepping now (it skips a parameter without one);
        the post-step hook puts it back, ``taken`` by this step or still pending."""
        if self.parameter.grad is not None:
            self._hidden = (self.parameter.grad, taken)
            self.parameter.grad = None

    def _post_step(self) -> None:
        """An optimizer's step ended: the gradient it hid is ``.grad`` again. (A step that
        raised runs no post-step hook: its gradient, taken or not, is then gone.)"""
        hidden, self._hidden = self._hidden, None
        if hidden is not None and self.ids is not None and self.parameter.grad is None:
            grad, taken = hidden
            self.parameter.grad = grad
            if taken:
                self._taken = (grad, grad._version)

    # ----------------------------------------------------------------------------- rates
    def see_optimizers(self, when: str = "at the pipe's first batch") -> None:
        """Note the rate of every group that holds the parameter, in every optimizer alive, as
        first seen (NOTE [ The table's learning rate ]): when the pipe is made and at its first
        batch. A group is a dict whose ``params`` list holds the parameter: two walks of the
        garbage collector's referrers, in C (a walk of every object in Python took 0.2 s in a
        process with transformers loaded, twice per pipe)."""
        lists = [r for r in gc.get_referrers(self.parameter) if type(r) is list]
        held = {id(params) for params in lists}
        for group in gc.get_referrers(*lists) if lists else ():
            if type(group) is dict and "lr" in group and id(group.get("params")) in held:
                see_first(group, when)

    def _group_lr(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> float | None:
        """The table's learning rate for a step by ``group`` (see the NOTE)."""
        lr = float(group["lr"])
        if len(group["params"]) == 1:
            return lr
        built = group.get("initial_lr", group.get(BUILT_LR))
        if not built:
            raise RuntimeError(
                f"the {type(optimizer).__name__} group that holds the embedding table had a "
                f"learning rate of {built} when embedpipe first saw it, so the table's rate "
                "cannot follow it as a factor of its built rate: set group['initial_lr'] to the "
                "rate the group was built with (as LRScheduler does), or give pipe.parameter a "
                "group of its own"
            )
        return self.base_lr * (lr / float(built))

    def close(self, stacklevel: int = 6) -> None:
        """Stop taking steps; a gradient still pending is not applied (warned, at the frame
        ``stacklevel`` up: the caller of ``pipe.close``)."""
        if self.pending:
            warnings.warn(
                f"the embedding gradient of {self.backwards} backward pass(es) was never taken "
                "by an optimizer step and is not applied (as torch drops a .grad no step "
                "used); call optimizer.step() or pipe.step() before close()",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
            self.clear()
        self._hook.remove()
        self._post_hook.remove()
        if self._value_hook is not None:
            self._value_hook.remove()


#: The attribute ``offload`` sets on the embedding weight it replaces (the table's path).
OFFLOADED = "_embedpipe_offloaded"


def _refuse_its_value(grad: torch.Tensor) -> None:
    """The parameter's own gradient hook. The pipe sets ``.grad`` itself and never puts the
    parameter in a graph: a gradient autograd computes for it comes from a loss that used its
    value, which stands for no rows."""
    raise EmbeddingsOffloadedError(
        "the loss used the value of pipe.parameter (a weight penalty or a norm over "
        "model.parameters(), or a 0 * p.sum() term that touches every parameter for DDP?): it "
        "holds the pending gradient of the embedding table, not its rows, so such a term sees "
        "zeros where nn.Embedding's weight has the whole table. Leave pipe.parameter out of it "
        "(p is not pipe.parameter): the table's rows are on disk, no loss can read them all, "
        "and DDP never waits for the table's parameter (the pipe takes it out of DDP's)"
    )


#: A copy made when either tensor is first written (torch's copy-on-write), else a copy now.
_lazy_clone = getattr(torch, "_lazy_clone", torch.clone)


def _found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """``GradScaler`` found an inf in the gradients of an optimizer that unscales them in its own
    step (``fused=True``): it calls the step all the same, with ``found_inf`` set, and the
    optimizer skips it."""
    found = getattr(optimizer, "found_inf", None)
    return found is not None and bool(found.item())


def _group_of(optimizer: torch.optim.Optimizer, parameter: nn.Parameter) -> dict[str, Any] | None:
    """The group of ``optimizer`` that holds ``parameter``, if one does."""
    return next(
        (g for g in optimizer.param_groups if any(p is parameter for p in g["params"])), None
    )


def _refuse_stale(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer that holds a weight ``offload`` replaced was built before it: it steps a
    stale V x D copy, keeps it alive, and can never reach the table."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            path = getattr(p, OFFLOADED, None)
            if path is not None:
                raise RuntimeError(
                    f"this {type(optimizer).__name__} holds the embedding weight that offload() "
                    f"moved to {path}: it was built before offload(), steps a stale copy of the "
                    "table and can never train it. Build the optimizer after offload(), from "
                    "model.parameters()"
                )
