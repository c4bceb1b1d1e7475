"""The user's surface: the pipe, its DataLoader, and what a model holds of it.

- ``handle.py``: :class:`EmbeddingPipe`, the handle on one table (options, ``parameter``,
  ``loader``, ``step``, checkpoints, ``close``);
- ``loader.py``: :class:`PipeLoader`, a DataLoader whose batches arrive embedded;
- ``placeholder.py``: :class:`OffloadedEmbedding`, the module that stands where a model's
  ``nn.Embedding`` was and holds ``pipe.parameter`` (and the scale its rows were multiplied by);
- ``rowscale.py``: what a word embedding computes besides the lookup (a scale, or nothing), and
  the scale applied to ``inputs_embeds``;
- ``callhooks.py``: the hooks on the model's word embedding (NEFTune, PEFT's
  ``enable_input_require_grads``), run on each batch's ``inputs_embeds``;
- ``derived.py``: hooks on the model's modules that find positions or the pooled token in
  ``input_ids``, so that ``inputs_embeds`` give them the same;
- ``meter.py``: :class:`PipeMeter`, the pipe's figures per logging interval for trainers' logs.
"""

from .handle import EmbeddingPipe
from .loader import PipeLoader
from .meter import PipeMeter
from .placeholder import OffloadedEmbedding

__all__ = ["EmbeddingPipe", "OffloadedEmbedding", "PipeLoader", "PipeMeter"]
