"""Lightning: a callback that keeps an offloaded table in step with the LightningModule.

::

    pipe = embedpipe.EmbeddingPipe(table, cache_rows=..., optimizer=embedpipe.optim.Adagrad(lr=0.05))
    trainer = lightning.Trainer(callbacks=[embedpipe.lightning.PipeCallback(pipe)],
                                gradient_clip_val=1.0, accumulate_grad_batches=4)
    trainer.fit(module, train_dataloaders=pipe.loader(dataset, batch_size=32))

Nothing else is needed for the training itself: the table's gradient parameter sits in the module
(``embedpipe.hf.offload``; the callback attaches it otherwise), so ``configure_optimizers`` over
``self.parameters()`` holds it, ``gradient_clip_val`` clips it in the global norm, and the table
steps when Lightning's optimizer steps (after the closure that runs backward and clipping).

The callback logs the pipe's figures (hit rate, rows read and written per step, writeback lag:
``meter.py``) with ``pl_module.log_dict`` as often as Lightning logs, and makes Lightning's
checkpoints hold the table. Lightning writes a checkpoint as one
file and does not tell its callbacks where, so each checkpoint's table is a snapshot of its own
(hard links: only chunks changed since take space), in ``<dirpath>/embedpipe/step-<N>-<id>`` beside the
checkpoint files, and the checkpoint records its path. ``trainer.fit(ckpt_path=...)`` loads it
back. Snapshots are kept when Lightning deletes a checkpoint (``save_top_k``): delete those of
checkpoints you no longer need.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import lightning

from .pipe.handle import EmbeddingPipe
from .pipe.meter import PipeMeter
from .pipe.placeholder import OffloadedEmbedding, ignore_in_ddp
from .store.checkpoints import snapshot

#: The key of the table in a Lightning checkpoint.
CHECKPOINT_KEY = "embedpipe"


class PipeCallback(lightning.Callback):
    """Attach ``pipe`` to the module being fitted and keep its table in every checkpoint."""

    def __init__(self, pipe: EmbeddingPipe) -> None:
        if pipe.optimizer is None:
            raise ValueError("PipeCallback trains the table: give the pipe an optimizer")
        self.pipe = pipe
        self.meter = PipeMeter(pipe)

    def setup(
        self, trainer: lightning.Trainer, pl_module: lightning.LightningModule, stage: str
    ) -> None:
        for callback in getattr(trainer, "checkpoint_callbacks", ()) if stage == "fit" else ():
            if getattr(callback, "save_weights_only", False):
                raise ValueError(
                    f"{type(callback).__name__}(save_weights_only=True): Lightning then leaves "
                    "the callbacks out of its checkpoints, and with them the table's snapshot "
                    "that PipeCallback keeps in each, so they would hold no word embeddings; "
                    "set save_weights_only=False"
                )
        if all(p is not self.pipe.parameter for p in pl_module.parameters()):
            self.pipe.attach(pl_module)
        # Lightning's DDP wraps the LightningModule, whose attribute DDP reads: offload told
        # only the model inside it to leave the table's parameter alone (docs/scale-out.md)
        for module in pl_module.modules():
            if isinstance(module, OffloadedEmbedding):
                ignore_in_ddp(pl_module, module)

    def on_train_batch_end(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """The pipe's figures (``meter.py``) into Lightning's log, as often as it logs."""
        every = max(1, getattr(trainer, "log_every_n_steps", 50))
        if trainer.global_step % every == 0:
            figures = self.meter.since_last()
            if figures:
                pl_module.log_dict(figures, on_step=True, on_epoch=False, batch_size=1)

    def on_save_checkpoint(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        checkpoint: dict[str, Any],
    ) -> None:
        committed = self.pipe.checkpoint()
        root = getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
        # a name of its own for every save: a folder of an earlier run in the same directory
        # is never taken for this one's (hard links: a second save of one step costs no copy)
        name = f"step-{committed.step}-{uuid.uuid4().hex[:8]}"
        folder = os.path.abspath(os.path.join(root, "embedpipe", name))
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        snapshot(committed.path, folder)
        checkpoint[CHECKPOINT_KEY] = {"snapshot": folder, "step": committed.step}

    def on_load_checkpoint(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        checkpoint: dict[str, Any],
    ) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            raise KeyError(
                "this Lightning checkpoint holds no embedpipe table: it was saved without "
                "embedpipe.lightning.PipeCallback; resume from one saved with it"
            )
        self.pipe.load_checkpoint(saved["snapshot"])
