"""Ranks: one table sharded by row range over the processes of ``torch.distributed``.

- ``shards.py``: :class:`Shards`, this rank's rows and the collectives (rows, gradients,
  commits) on embedpipe's own gloo group;
- ``shard_owner.py``: :class:`ShardOwner`, the owner of one shard, which meets the others in
  those collectives.
"""

from .shard_owner import ShardOwner
from .shards import Shards

__all__ = ["ShardOwner", "Shards"]
