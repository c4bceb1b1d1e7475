"""The rate a torch optimizer group shared with dense weights was built with, against which the
table's rate follows the group's (NOTE [ The table's learning rate ] in ``gradient.py``)."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from typing import Any

import torch
import torch.utils.data

#: The key of a shared group's rate when embedpipe first saw it; optimizers ignore keys they do
#: not know, and ``state_dict`` carries it.
BUILT_LR = "embedpipe_built_lr"

# NOTE [ A rate changed before embedpipe saw it ]
# A shared group's built rate is its rate when embedpipe first sees it: at the pipe's first batch
# (a hand-written warmup sets the rate later, in the loop) or at its optimizer's first step. A
# program that sets the rate before that (a resumed run's decay, keyed on a saved step, set
# before the loop, with a fresh SGD that keeps no state to load) had its decayed rate taken for
# the built one: the table then stepped at 1 / decay times the group's rate, silently (found by a
# probe: 0.053 from nn.Embedding). Where the group is at another rate than its optimizer's
# default then, it is warned about, as at a first step: the group may also have been built with
# a rate of its own, which ``group['initial_lr']`` says (as LRScheduler sets it).

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DATA = os.path.dirname(os.path.abspath(torch.utils.data.__file__))


def see_first(
    group: dict[str, Any],
    when: str,
    optimizer: torch.optim.Optimizer | None = None,
    stacklevel: int = 0,
) -> None:
    """Note ``group``'s rate as built, if not noted yet, in the group itself (it travels with the
    optimizer's state_dict: a resumed run's decayed rate is not taken for the built one). A group
    shared with other parameters at another rate than its optimizer's default is warned about
    (``optimizer``: the group's; None: looked for, only then), at ``stacklevel`` as
    ``warnings.warn`` counts it from here (0: the program's frame that called into embedpipe or
    the DataLoader)."""
    if BUILT_LR not in group and "initial_lr" not in group and len(group["params"]) > 1:
        if optimizer is None:
            optimizer = optimizer_of(group)
        if optimizer is not None and group["lr"] != optimizer.defaults.get("lr"):
            warnings.warn(
                f"the {type(optimizer).__name__} group that holds the embedding table, first "
                f"seen by embedpipe {when}, is at a rate of {group['lr']}, not the optimizer's "
                f"default {optimizer.defaults.get('lr')}: the table's rate follows the group's "
                f"as a factor of {group['lr']}, taken as the rate the group was built with. If "
                "a warmup or a resumed schedule has changed it already, set "
                "group['initial_lr'] to the built rate (as LRScheduler does) or load the "
                "optimizer's state_dict (it carries the rate embedpipe saw first); a group "
                "built at a rate of its own says so with group['initial_lr'] too",
                RuntimeWarning,
                stacklevel=stacklevel or _program_stacklevel(),
            )
    group.setdefault(BUILT_LR, float(group["lr"]))


def optimizer_of(group: dict[str, Any]) -> torch.optim.Optimizer | None:
    """The optimizer whose ``param_groups`` hold ``group`` (None: none found)."""
    for groups in gc.get_referrers(group):
        if type(groups) is not list:
            continue
        for holder in gc.get_referrers(groups):
            # (an instance's __dict__ where Python keeps it apart from the instance)
            owners = gc.get_referrers(holder) if type(holder) is dict else [holder]
            for owner in owners:
                if isinstance(owner, torch.optim.Optimizer) and owner.param_groups is groups:
                    return owner
    return None


def _program_stacklevel() -> int:
    """The stacklevel, counted from :func:`see_first` (1), of the program's frame that called
    into embedpipe or torch's DataLoader."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE, _DATA)):
        frame, level = frame.f_back, level + 1
    return level
