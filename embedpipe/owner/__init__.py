"""The owner side: what the training process runs for the table, in its loop and its threads.

- ``owner.py``: :class:`Owner`, the one writer: hand-off of each batch, the pending gradient,
  the writeback's steps;
- ``durability.py``: what makes the owner's steps last: checkpoints, snapshots saved and loaded,
  close, and the messages of failed table writes (functions of the owner, which calls them);
- ``gradient.py``: :class:`TableGradient`, the table's gradient as ``pipe.parameter.grad``, and
  the optimizer step that takes it;
- ``writeback.py``: :class:`Writeback`, the queue and thread that apply the table's steps;
- ``batchorder.py``: the order of a loader's batches as the DataLoader draws it
  (:class:`Foresight` in its ``batch_sampler`` place);
- ``lookahead.py``: the batches seen ahead (:class:`Stream`), which feeds the lookahead policy;
- ``foresee.py``: the forked child that reads the ids of the batches ahead.

The row optimizers themselves are ``embedpipe.optim`` (pure functions of rows and state).
"""

from .batchorder import Foresight
from .gradient import TableGradient
from .lookahead import Stream
from .owner import Owner
from .writeback import Writeback

__all__ = ["Foresight", "Owner", "Stream", "TableGradient", "Writeback"]
