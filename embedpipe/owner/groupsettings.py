"""The settings of the torch optimizer group that steps the table, against its row optimizer
(NOTE [ A group's settings the table cannot take ])."""

from __future__ import annotations

from typing import Any

import torch

# NOTE [ A group's settings the table cannot take ]
# The table's update is its row optimizer's (embedpipe.optim.SGD, Adagrad, Adam). The torch
# optimizer whose group holds pipe.parameter says when the table steps, at what rate and whether
# it ascends (NOTE [ The table's learning rate ] in gradient.py). Where that torch optimizer is
# the one the row optimizer matches (torch.optim.SGD for SGD, Adagrad for Adagrad, SparseAdam
# for Adam), a program moved from nn.Embedding to the pipe expects every setting of the group to
# train the table as it trained the embedding, and two kinds cannot:
#
# - weight decay and momentum: torch applies them to every row of nn.Embedding's weight at
#   every step (the dense gradient plus weight_decay * weight; a momentum buffer that moves rows
#   no batch looked up), which an update of the batch's rows cannot match;
# - a setting the row optimizer has too (Adagrad's eps, lr_decay, initial_accumulator_value;
#   SparseAdam's betas, eps) at another value than the row optimizer's: the table steps with the
#   row optimizer's.
#
# Found by a probe: Trainer(optim="sgd") with momentum, or optim="adagrad" with weight decay,
# trained the table 5e-5 to 7e-3 away from nn.Embedding's, with no error and no warning. Such a
# group now raises at its optimizer's step, before anything steps. A torch optimizer of another
# kind (AdamW over the dense weights, a row Adagrad for the table) is the program's own choice of
# two optimizers: its settings are not the table's, as documented, and nothing is checked.

#: The torch optimizer each row optimizer matches (by the row optimizer's ``name``).
MATCHES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.SparseAdam,
}
#: The group's settings that move rows no batch looked up: each must be 0 (or absent).
DENSE_ONLY = ("weight_decay", "momentum")
#: The settings the row optimizer has too, by its name.
SHARED = {"adagrad": ("lr_decay", "eps", "initial_accumulator_value"), "adam": ("betas", "eps")}


def refuse_unmatched_settings(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], row: Any, fix: str = ""
) -> None:
    """Raise if ``group`` of ``optimizer``, the torch optimizer the row optimizer ``row``
    matches, has a setting that would train ``nn.Embedding`` otherwise than ``row`` trains the
    table (see the NOTE); ``fix``: how to leave it out, where the default advice does not fit."""
    if not isinstance(optimizer, MATCHES.get(row.name, ())):
        return
    kind = type(optimizer).__name__
    for name in DENSE_ONLY:
        if group.get(name):
            raise ValueError(
                f"the {kind} group that steps the embedding table has {name}={group[name]}: "
                f"torch applies it to every row of nn.Embedding's weight at every step, and the "
                f"table's {row!r} updates only the rows a batch looked up, so the table would "
                "train otherwise than the embedding, silently. "
                + (
                    fix
                    or f"Give pipe.parameter a group of its own with {name}=0 (the dense weights "
                    f"keep theirs): {kind}([{{'params': dense}}, {{'params': [pipe.parameter], "
                    f"'{name}': 0}}], ...)"
                )
            )
    for name in SHARED.get(row.name, ()):
        mine, theirs = getattr(row, name), group.get(name)
        if theirs is not None and _value(theirs) != _value(mine):
            raise ValueError(
                f"the {kind} group that steps the embedding table has {name}={theirs}, and the "
                f"table's {row!r} has {name}={mine}: the table steps with the row optimizer's, "
                f"so it would train otherwise than an nn.Embedding in that group, silently. Make "
                f"them the same (embedpipe.optim.{type(row).__name__}({name}=...), or the group's)"
            )


def _value(setting: Any) -> Any:
    """A setting as compared: betas as a tuple of floats (a list from a state_dict)."""
    return tuple(map(float, setting)) if isinstance(setting, list | tuple) else float(setting)
