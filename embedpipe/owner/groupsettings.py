"""The settings of the torch optimizer group that steps the table, against its row optimizer
(NOTE [ A group's settings the table cannot take ])."""

from __future__ import annotations

from typing import Any

import torch

# NOTE [ A group's settings the table cannot take ]
# The table's update is its row optimizer's (embedpipe.optim.SGD, Adagrad, Adam), with the row
# optimizer's own settings (its lr, as a factor of the group's: NOTE [ The table's learning rate ]
# in gradient.py; its eps, betas, lr_decay, initial_accumulator_value). The torch optimizer whose
# group holds pipe.parameter says when the table steps, how its rate moves and whether it ascends
# (maximize). Where that torch optimizer is the one the row optimizer matches (torch.optim.SGD
# for SGD, Adagrad for Adagrad; SparseAdam, Adam's, takes neither), a program moved from
# nn.Embedding expects the group's settings that the row optimizer has no counterpart for to
# train the table as they trained the embedding: weight decay and momentum. They cannot: torch applies them to every row
# of nn.Embedding's weight at every step (the dense gradient plus weight_decay * weight; a
# momentum buffer that moves rows no batch looked up), and the table updates the batch's rows.
# Found by a probe: SGD with momentum, Adagrad with weight decay, trained the dense weights with
# them and the table without (5e-5 to 7e-3 from nn.Embedding), silently. Such a group raises at
# its optimizer's step, before anything steps (a ZeroRedundancyOptimizer is checked by the
# optimizer it wraps: its own step takes the table's gradient, review). A torch optimizer of
# another kind (AdamW over the dense weights, a row Adagrad for the table) is the program's choice
# of two optimizers, and nothing is checked.

#: The torch optimizer each row optimizer matches that has the settings (by the row's ``name``).
MATCHES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
}
#: The group's settings that move rows no batch looked up: each must be 0 (or absent).
DENSE_ONLY = ("weight_decay", "momentum")


def matches(optimizer: torch.optim.Optimizer, row: Any) -> bool:
    """Whether ``optimizer`` (or the one a ``ZeroRedundancyOptimizer`` wraps) is the torch
    optimizer the row optimizer ``row`` matches."""
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        optimizer = getattr(optimizer, "optim", optimizer)
    return isinstance(optimizer, MATCHES.get(row.name, ()))


def refuse_unmatched_settings(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], row: Any, where: str = ""
) -> None:
    """Raise if ``group`` of ``optimizer``, the torch optimizer the row optimizer ``row``
    matches, has a weight decay or a momentum (see the NOTE); ``where``: what gives the group
    its settings, where not the group itself (a Trainer's arguments)."""
    if not matches(optimizer, row):
        return
    kind = type(optimizer).__name__
    for name in DENSE_ONLY:
        if not group.get(name):
            continue
        if where:
            what = where
            advice = (
                "Train with weight_decay=0 and no momentum in optim_args, or pass Trainer("
                "optimizers=(your optimizer, None)) with pipe.parameter in a group of its own "
                "without them"
            )
        else:
            what = f"the {kind} group that steps the embedding table has"
            advice = (
                f"Give pipe.parameter a group of its own with {name}=0 (the dense weights keep "
                f"theirs): {kind}([{{'params': dense}}, {{'params': [pipe.parameter], "
                f"'{name}': 0}}], ...)"
            )
            if name == "momentum":
                advice += (
                    "; a scheduler that cycles the momentum of every group (OneCycleLR, "
                    "CyclicLR) needs cycle_momentum=False"
                )
        raise ValueError(
            f"{what} {name}={group[name]}: torch applies it to every row of nn.Embedding's "
            f"weight at every step, and the table's {row!r} updates only the rows a batch "
            f"looked up, so the table would train otherwise than the embedding, silently. {advice}"
        )
