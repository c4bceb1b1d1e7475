"""A new torch optimizer on a table whose row optimizer keeps the state of earlier steps
(NOTE [ A new optimizer and the table's state ])."""

from __future__ import annotations

from typing import Any

import torch

# NOTE [ A new optimizer and the table's state ]
# A torch optimizer keeps each parameter's state (Adagrad's sum, Adam's moments, step count): a
# new one starts afresh, unless a state dict is loaded into it. The table keeps its row
# optimizer's state whichever torch optimizer steps it: a second one built mid-run (a new
# Trainer) trained on from the first's state (8.99e-6 apart after 4 Adagrad steps). So each group
# that steps the table is marked (a key its state_dict carries). At its optimizer's first step a
# group is taken as loaded where the optimizer holds state of a step (a state dict saved before
# the mark; torch's Adagrad makes its state at step 0 when built, which is not one). An unmarked
# group that steps a table whose row optimizer remembers steps raises. One exception: a group
# that keeps no state of its own (SGD without momentum), made before the table took a step in
# this process (through any pipe, since a snapshot was last loaded into it here): a loop resumed
# in a new process builds its SGD anew and loads nothing into it, and nothing tells it from a
# new one. Made after such a step (a second Trainer, Lightning's configure_optimizers at a
# second fit, a new pipe on the table for it), it raises as any.
STEPPED = "embedpipe_stepped"

#: Steps taken in this process, by table (its real path), since a snapshot was last loaded.
_steps_here: dict[str, int] = {}


def count_step(path: str) -> None:
    _steps_here[path] = _steps_here.get(path, 0) + 1


def loaded_here(path: str) -> None:
    """A snapshot was loaded into the table at ``path`` (its real path)."""
    _steps_here.pop(path, None)


def steps_here(path: str) -> int:
    return _steps_here.get(path, 0)


def refuse_fresh_state(optimizer: Any, group: dict[str, Any], steps: int, here: int) -> None:
    """Raise if ``group``, unmarked (or marked with why), steps a table remembering ``steps``,
    ``here`` of them taken in this process since the table was opened or loaded."""
    mark = group.get(STEPPED)
    stateless = isinstance(optimizer, torch.optim.SGD) and not group.get("momentum")
    if steps and mark is not True and not (stateless and not isinstance(mark, str) and not here):
        raise RuntimeError(
            mark if isinstance(mark, str) else f"this {type(optimizer).__name__} steps the "
            f"embedding table for the first time, and the table keeps the state of {steps} "
            "step(s) of its row optimizer (sums, moments, step count), where torch starts a new "
            "optimizer's state afresh for an nn.Embedding: training on would differ. Step on "
            "with the optimizer that stepped it, or one loaded from its state_dict() (one saved "
            f"by an earlier embedpipe: set its group['{STEPPED}'] = True); or train a copy of "
            "the rows anew (Table.from_tensor(NEW_PATH, pipe.table.to_tensor()), in memory)"
        )  # fmt: skip
    group[STEPPED] = True


def has_stepped(optimizer: Any) -> bool:
    """Whether ``optimizer`` holds state of a step: loaded (torch's Adagrad makes its state, at
    step 0, when it is built)."""
    steps = [state.get("step", 1) for state in optimizer.state.values() if state]
    return any(float(step) > 0 for step in steps)
