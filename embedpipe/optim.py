"""Sparse row optimizers: update only the rows a batch looked up, and their optimizer state.

The writeback side hands an optimizer the rows of the U unique ids of a batch, their gradient
already summed per id, and the matching rows of each state array::

    rows: (U, D)   grad: (U, D)   state: {"sum": (U, D)} or {"exp_avg": .., "exp_avg_sq": ..}

and ``update`` changes all of them in place. ``step`` is the number of optimizer steps taken on
the whole table, this one included, as torch keeps one step counter per parameter, not per row.

===========  ===================================  ==========================================
class        matches                              state arrays (initial value)
===========  ===================================  ==========================================
``SGD``      ``torch.optim.SGD(lr=lr)``           none
``Adagrad``  ``torch.optim.Adagrad``, sparse      ``sum`` (``initial_accumulator_value``)
``Adam``     ``torch.optim.SparseAdam``           ``exp_avg`` (0), ``exp_avg_sq`` (0)
===========  ===================================  ==========================================

Hyperparameters and defaults are torch's. Every row passed in is updated, even one whose
gradient is all zeros: SparseAdam likewise decays the moments of every index present in the
sparse gradient. Momentum and weight decay are left out, as torch rejects them with sparse
gradients; ``eps`` must be > 0 (Adagrad in torch accepts 0, which turns a present row with a
zero gradient and a zero accumulator into NaN).

Parity (torch 2.13, CPU, float32 and float64; ``tests/owner/test_optim.py``). Each ``update`` repeats
the op sequence of the torch code path it matches, so given the same per-id gradient all three
are **bitwise** equal to torch, tables and state alike (30 steps, lr 0.5 / 0.5 / 0.1, Zipf ids):
``SGD`` and ``Adagrad`` to ``nn.Embedding`` (dense gradient) with ``torch.optim.SGD`` /
``torch.optim.Adagrad`` (``_single_tensor_adagrad``'s fused ``addcmul_``/``addcdiv_``), ``Adam``
to ``nn.Embedding(sparse=True)`` with ``SparseAdam`` (``_functional.sparse_adam``). A row with
an all-zero gradient is left exactly as it was by dense SGD and Adagrad, so updating only the
looked-up rows is the same as torch updating the whole table.

The gradient itself is where torch can differ. The dense backward of ``nn.Embedding`` and the one
embedpipe uses both sum repeated ids in occurrence order, so against a dense ``nn.Embedding``
SGD and Adagrad stay bitwise with duplicated ids too. ``nn.Embedding(sparse=True)`` instead
yields one value per occurrence: ``SGD`` adds them one at a time and ``Adagrad``/``SparseAdam``
sum them in ``coalesce()``'s order (an unstable sort). Against that reference, looked up with
the raw (duplicated) ids, tables differ by rounding: measured max abs diff over 30 steps 1.9e-5
(SGD), about 5e-7 (Adagrad, Adam) on rows up to ~13; the tests assert ``rtol=1e-5, atol=1e-4``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, TypeAlias

import numpy as np
import torch


def _require(ok: bool, name: str, value: object, valid: str) -> None:
    if not ok:
        raise ValueError(f"invalid {name}: {value!r}; it must be {valid}")


def _check_lr(lr: float) -> None:
    _require(math.isfinite(lr) and lr >= 0.0, "learning rate lr", lr, "finite and >= 0")


class _RowOptimizerBase:
    name: ClassVar[str]

    def state_init(self) -> dict[str, float]:
        """State array name -> initial value, in the order the arrays are stored."""
        return {}

    def remembers(self) -> bool:
        """Whether a step depends on the steps before: state arrays, or the step count (Adam's
        bias correction, Adagrad's ``lr_decay``). A fresh torch optimizer starts those anew."""
        return bool(self.state_init()) or self.name == "adam" or bool(getattr(self, "lr_decay", 0))

    def config(self) -> dict:
        """A JSON-able dict that :func:`from_config` turns back into an equal optimizer."""
        options = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return {"name": self.name, **options}

    def update(
        self,
        rows: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, torch.Tensor],
        step: int,
        lr: float | None = None,
    ) -> None:
        """Apply one step to ``rows`` (U, D) and their ``state`` in place, given ``grad`` (U, D)
        summed per id, at learning rate ``lr`` (None: ``self.lr``; an optimizer group's scheduled
        rate otherwise, see ``gradient.py``)."""
        self._update(rows, grad, state, step, self.lr if lr is None else lr)


@dataclass(frozen=True)
class SGD(_RowOptimizerBase):
    """Plain SGD, ``row -= lr * grad``, as ``torch.optim.SGD(lr=lr)``."""

    lr: float
    name: ClassVar[str] = "sgd"

    def __post_init__(self) -> None:
        _check_lr(self.lr)

    def _update(self, rows, grad, state, step: int, lr: float) -> None:
        rows.add_(grad, alpha=-lr)


@dataclass(frozen=True)
class Adagrad(_RowOptimizerBase):
    """Adagrad as ``torch.optim.Adagrad`` on a sparse gradient; state ``sum`` (U, D)."""

    lr: float = 0.01
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10
    name: ClassVar[str] = "adagrad"

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        for name in ("lr_decay", "initial_accumulator_value"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0.0, name, value, "finite and >= 0")
        _require(math.isfinite(self.eps) and self.eps > 0.0, "eps", self.eps, "finite and > 0")

    def state_init(self) -> dict[str, float]:
        return {"sum": self.initial_accumulator_value}

    def _update(self, rows, grad, state, step: int, lr: float) -> None:
        # The ops of torch's dense single-tensor branch, in its order (fused addcmul_ and
        # addcdiv_): bitwise parity with nn.Embedding + torch.optim.Adagrad depends on it.
        clr = lr / (1 + (step - 1) * self.lr_decay)
        total = state["sum"]
        total.addcmul_(grad, grad, value=1)
        rows.addcdiv_(grad, total.sqrt().add_(self.eps), value=-clr)


@dataclass(frozen=True)
class Adam(_RowOptimizerBase):
    """Adam as ``torch.optim.SparseAdam``; state ``exp_avg`` and ``exp_avg_sq`` (U, D)."""

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-08
    name: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _require(len(self.betas) == 2, "betas", self.betas, "a pair (beta1, beta2)")
        for i, beta in enumerate(self.betas):
            _require(0.0 <= beta < 1.0, f"beta at index {i}", beta, "in [0, 1)")
        object.__setattr__(self, "betas", tuple(self.betas))  # a JSON list comes back a tuple
        _require(math.isfinite(self.eps) and self.eps > 0.0, "eps", self.eps, "finite and > 0")

    def state_init(self) -> dict[str, float]:
        return {"exp_avg": 0.0, "exp_avg_sq": 0.0}

    def _update(self, rows, grad, state, step: int, lr: float) -> None:
        # SparseAdam's op sequence: old += (new - old) * (1 - beta), then an unfused
        # -step_size * (m / denom). Its numer (update + old) equals the new exp_avg bit for bit.
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.add_(grad.sub(exp_avg).mul_(1 - beta1))
        exp_avg_sq.add_(grad.pow(2).sub_(exp_avg_sq).mul_(1 - beta2))
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        rows.add_(exp_avg.div(exp_avg_sq.sqrt().add_(self.eps)).mul_(-step_size))


RowOptimizer: TypeAlias = SGD | Adagrad | Adam

_BY_NAME: dict[str, type[RowOptimizer]] = {cls.name: cls for cls in (SGD, Adagrad, Adam)}


def from_config(config: dict) -> RowOptimizer:
    """The optimizer that ``config`` (as returned by ``.config()``) describes."""
    options = dict(config)
    name = options.pop("name", None)
    cls = _BY_NAME.get(name)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown optimizer name {name!r}; expected one of {sorted(_BY_NAME)}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown {name} option(s) {unknown}; expected some of {sorted(known)}")
    return cls(**options)


def update_in_float32(
    optimizer: RowOptimizer,
    rows: np.ndarray,
    state: dict[str, np.ndarray],
    grad: torch.Tensor,
    step: int,
    lr: float | None,
) -> None:
    """Run ``optimizer`` on ``rows`` and ``state`` in place (``lr`` None: its own); float16 rows
    are updated in float32 and rounded back, since an ``eps`` of 1e-8 and a squared gradient
    both vanish in float16."""
    rows_t = torch.from_numpy(rows)
    state_t = {name: torch.from_numpy(values) for name, values in state.items()}
    if rows_t.dtype in (torch.float32, torch.float64):
        optimizer.update(rows_t, grad, state_t, step, lr=lr)
        return
    wide = {name: values.float() for name, values in state_t.items()}
    wide_rows = rows_t.float()
    optimizer.update(wide_rows, grad.float(), wide, step, lr=lr)
    rows_t.copy_(wide_rows)
    for name, values in state_t.items():
        values.copy_(wide[name])
