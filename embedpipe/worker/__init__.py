"""The worker side: what runs in a DataLoader worker, and the batch it returns.

- ``lookup.py``: :class:`Lookup`, the collate function the DataLoader runs (the user's collate,
  then the ids' unique rows from the shared cache or the table into a ring slot), and the
  datasets that check each sample's ids;
- ``looked_up.py``: :class:`LookedUp`, what a worker sends back for a batch;
- ``batch.py``: :class:`EmbeddedBatch`, born unclaimed in a worker, claimed in the training
  process; it talks to the owner through the small ``Owner`` protocol the owner satisfies;
- ``collate.py``: :class:`PadCollator`, the default collate (pads ragged token lists);
- ``orphans.py``: a worker exits when its parent dies.
"""

from .batch import EmbeddedBatch
from .collate import PadCollator
from .looked_up import LookedUp
from .lookup import Lookup

__all__ = ["EmbeddedBatch", "LookedUp", "Lookup", "PadCollator"]
