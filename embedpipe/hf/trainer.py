"""``embedpipe.hf.Trainer``: a ``transformers.Trainer`` whose word embeddings live in a pipe.

Used exactly like ``transformers.Trainer``, with one more argument::

    table = embedpipe.hf.offload(model, "vocab.zarr")
    pipe = embedpipe.EmbeddingPipe(table, cache_rows=..., optimizer=embedpipe.optim.Adagrad(lr=0.05))
    trainer = embedpipe.hf.Trainer(model=model, args=args, train_dataset=ds, pipe=pipe)
    trainer.train()

What it changes, and nothing else:

- **Loaders.** Every loader Trainer builds (training, evaluation, prediction) is ``pipe.loader``
  with Trainer's own sampler, batch size, workers and collator: ``get_train_dataloader``,
  ``get_eval_dataloader`` and ``get_test_dataloader`` do what Trainer's do, building the loader
  with ``pipe.loader`` where Trainer calls ``DataLoader``. Accelerate prepares it like any
  DataLoader (device placement, its one-ahead fetch, ``skip_first_batches`` on resume).
- **Inputs.** A batch reaches the model as ``inputs_embeds`` (made on the device, from the rows
  made final there) plus the other fields; the ids are left out, as models refuse both.
- **Optimizer.** The table's gradient parameter gets a group of its own in Trainer's optimizer,
  at the row optimizer's learning rate and no weight decay: ``max_grad_norm`` clips it within
  the one global norm (the logged ``grad_norm`` counts it), ``gradient_accumulation_steps`` sums
  it, the scheduler scales it, and Trainer's ``optimizer.step()`` steps the table.
- **Logs.** Every training log line (the loss's) carries the pipe's figures: hit rate, rows
  read and written per step, writeback lag (``embedpipe/...``, ``meter.py``).
- **Checkpoints.** Every ``checkpoint-N/`` holds ``embedpipe-table/``, a snapshot of the table
  at step N (hard links, see ``Table`` checkpoints), written before Trainer's own files (under
  ``torchrun``, by every rank's shard together: ``docs/scale-out.md``);
  ``train(resume_from_checkpoint=...)`` and ``load_best_model_at_end`` load it back, into any
  table of the same shape. ``save_model()`` writes a folder ``from_pretrained`` loads with the
  trained word embeddings in it.
"""

from __future__ import annotations

import copy
import os
import shutil
from functools import partial
from typing import Any

import torch
import transformers
from torch.utils.data import IterableDataset
from transformers.trainer_pt_utils import BatchRebalanceSampler
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker
from transformers.utils import is_datasets_available

from ..owner.freshstate import STEPPED
from ..owner.groupsettings import refuse_unmatched_settings
from ..pipe.handle import EmbeddingPipe
from ..pipe.meter import PipeMeter
from ..pipe.rowsource import pipe_step, rows_path
from ..store.table import Table
from ..worker.batch import INPUTS_EMBEDS, EmbeddedBatch
from ..worker.collate import PadCollator
from .saving import (
    add_word_embeddings,
    leaving_word_embeddings_out,
    model_files,
    offloaded_keys,
    rows_to_save,
)

if is_datasets_available():
    import datasets

#: The folder inside each of Trainer's checkpoint folders that holds the table's snapshot.
TABLE_FOLDER = "embedpipe-table"


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` with its word embeddings in ``pipe`` (see the module doc).

    ``pipe`` must train the table (have an optimizer) and be made over the table the model was
    offloaded to; ``ids_key`` is the field of the token ids (``"input_ids"``). Without a
    ``data_collator`` or tokenizer, ragged token lists are padded with the pipe's
    ``padding_idx`` (:class:`~embedpipe.worker.collate.PadCollator`).
    """

    def __init__(
        self, *args: Any, pipe: EmbeddingPipe, ids_key: str = "input_ids", **kwargs: Any
    ) -> None:
        if not isinstance(pipe, EmbeddingPipe):
            raise TypeError(f"pipe must be an embedpipe.EmbeddingPipe, got {type(pipe).__name__}")
        if pipe.optimizer is None:
            raise ValueError(
                "embedpipe.hf.Trainer trains the table: give the pipe an optimizer "
                "(for a frozen table, use transformers.Trainer with pipe.loader)"
            )
        self.pipe = pipe
        self.ids_key = ids_key
        model = kwargs.get("model", args[0] if args else None)
        if model is not None:
            pipe.attach(model)
        if kwargs.get("data_collator") is None and kwargs.get("processing_class") is None:
            kwargs["data_collator"] = PadCollator(pipe.padding_idx, ids_key, hf_labels=True)
        arguments = kwargs.get("args", args[1] if len(args) > 1 else None)
        config = getattr(arguments, "accelerator_config", None)
        #: Accelerate's dispatch_batches was left unset (Trainer's default), and set False here.
        self._undispatched = config is not None and getattr(config, "dispatch_batches", 0) is None
        if self._undispatched:
            # Accelerate would otherwise rebuild the batches of an iterable dataset, which an
            # EmbeddedBatch refuses; over one process the batches are the same, over several
            # they are not (_refuse_dispatch). On a copy: the caller's arguments stay as given.
            arguments = copy.copy(arguments)
            arguments.accelerator_config = copy.copy(config)
            arguments.accelerator_config.dispatch_batches = False
            if "args" in kwargs:
                kwargs["args"] = arguments
            else:
                args = (args[0], arguments, *args[2:])
        self._checkpointing = False
        self._resuming: Any = None  # train()'s resume_from_checkpoint
        super().__init__(*args, **kwargs)
        self._made_at = pipe_step(pipe)  # the table's step as this Trainer found it
        self._meter = PipeMeter(pipe)
        evaluated = self.eval_dataset
        if not isinstance(evaluated, dict):
            evaluated = {"eval": evaluated}
        for dataset in (self.train_dataset, *evaluated.values()):
            self._refuse_dispatch(dataset)  # at once, not at the first evaluation

    def _refuse_dispatch(self, dataset: Any) -> None:
        """Over several processes, an iterable ``dataset`` whose batches transformers.Trainer
        would dispatch from the main process (dispatch_batches left unset) raises."""
        processes = self.accelerator.num_processes
        if self._undispatched and processes > 1 and isinstance(dataset, IterableDataset):
            raise ValueError(
                f"transformers.Trainer over {processes} processes reads an iterable dataset in "
                "the main process and sends each process its batches (Accelerate's "
                "dispatch_batches), which embedpipe cannot do: each process looks its batches "
                "up itself. Pass TrainingArguments(accelerator_config={'dispatch_batches': "
                "False}): each process then reads its own share of the stream, with or without "
                "embedpipe"
            )

    def train(
        self,
        resume_from_checkpoint: Any = None,
        trial: Any = None,
        ignore_keys_for_eval: Any = None,
        **kwargs: Any,
    ) -> Any:
        self._resuming = resume_from_checkpoint
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            self._resuming = None

    def call_model_init(self, trial: Any = None) -> Any:
        """Trainer's ``call_model_init``. A run's new model (each ``train()``, each trial of
        ``hyperparameter_search``) that does not resume from a checkpoint raises where the
        table has stepped since this Trainer was made (``model_init`` may load a snapshot of
        that step first): its rows are no longer the ones the new model starts from."""
        model = super().call_model_init(trial)
        made_at, stepped = getattr(self, "_made_at", None), pipe_step(self.pipe)
        if made_at is not None and not self._resuming and stepped != made_at:
            raise ValueError(
                f"Trainer(model_init=...) starts each run (train(), a trial of "
                f"hyperparameter_search) from a new model, but the table {self.pipe.table.path} "
                f"keeps the rows and optimizer state trained since this Trainer was made (step "
                f"{made_at}, now {stepped}): with nn.Embedding this run would start from "
                "model_init's embeddings. Load the table's snapshot of that step in model_init "
                "(pipe.load_checkpoint), or give each run a table of its own (a new offload, "
                "pipe and Trainer)"
            )
        return model

    # ----------------------------------------------------------------------------- data
    # Trainer's three loader getters, each as transformers (5.x) writes it, building the loader
    # through the pipe: the loader code of their ``_get_dataloader`` is ``_pipe_loader``.
    def get_train_dataloader(self) -> Any:
        """Trainer's ``get_train_dataloader``: the training set, ``_get_train_sampler``, the
        train batch size, seeded workers."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._pipe_loader(
            self.train_dataset, "Training", self._train_batch_size, self._get_train_sampler, True
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Trainer's ``get_eval_dataloader``: ``eval_dataset`` (a name of one of
        ``self.eval_dataset``'s, a dataset, or ``self.eval_dataset``), ``_get_eval_sampler``;
        with persistent workers, the loader kept and given again."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        persistent = self.args.dataloader_persistent_workers
        if persistent and key in getattr(self, "_eval_dataloaders", {}):
            return self._eval_dataloaders[key]
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        loader = self._pipe_loader(
            eval_dataset, "Evaluation", self.args.eval_batch_size, self._get_eval_sampler
        )
        if persistent:
            if not hasattr(self, "_eval_dataloaders"):
                self._eval_dataloaders = {}
            self._eval_dataloaders[key] = loader
        return loader

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """Trainer's ``get_test_dataloader``: ``_get_eval_sampler``, the eval batch size."""
        return self._pipe_loader(
            test_dataset, "test", self.args.eval_batch_size, self._get_eval_sampler
        )

    def _pipe_loader(
        self,
        dataset: Any,
        description: str,
        batch_size: int,
        sampler_fn: Any,
        is_training: bool = False,
    ) -> Any:
        """Trainer's ``_get_dataloader`` with ``pipe.loader`` for ``DataLoader``: the unused
        columns removed (from a ``datasets.Dataset``, else by the collator), the ``dataloader_*``
        arguments, the sampler (a ``BatchRebalanceSampler`` as the batch sampler), seeded
        training workers, and Accelerate's ``prepare``."""
        args, collator = self.args, self.data_collator
        if is_datasets_available() and isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        params: dict[str, Any] = {
            "batch_size": batch_size,
            "collate_fn": collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "multiprocessing_context": args.dataloader_multiprocessing_context,
            "prefetch_factor": args.dataloader_prefetch_factor,
            "in_order": args.dataloader_in_order,
        }
        sampler = None
        if not isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = sampler_fn(dataset)
            if isinstance(sampler, BatchRebalanceSampler):
                del params["batch_size"]
                params["batch_sampler"] = sampler
            else:
                if sampler is not None:
                    params["sampler"] = sampler
                params["drop_last"] = args.dataloader_drop_last
            if is_training:
                params["worker_init_fn"] = partial(
                    seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
                )
        self._refuse_dispatch(dataset)
        loader = self.pipe.loader(dataset, ids_key=self.ids_key, **params)
        loader = self.accelerator.prepare(loader)
        if isinstance(sampler, BatchRebalanceSampler):
            # rank-aware already: Accelerate's BatchSamplerShard around it must pass through
            shard = getattr(loader, "batch_sampler", None)
            if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
                shard.num_processes, shard.process_index = 1, 0
        return loader

    def _prepare_inputs(self, inputs: Any) -> Any:
        if not isinstance(inputs, EmbeddedBatch):
            return super()._prepare_inputs(inputs)
        batch = inputs.to(self.args.device)
        prepared = {k: v for k, v in batch.fields.items() if k != self.ids_key}
        prepared[INPUTS_EMBEDS] = batch[INPUTS_EMBEDS]  # the model's first read: rows final here
        return prepared

    # ----------------------------------------------------------------------------- optimizer
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Trainer's optimizer over the dense weights, plus a group of the table's own."""
        parameter = self.pipe.parameter
        if all(p is not parameter for p in self.model.parameters()):  # made by model_init
            self.pipe.attach(self.model)
        if self.optimizer is not None:
            return super().create_optimizer(model)
        trains = parameter.requires_grad  # False: the user froze the word embeddings
        parameter.requires_grad_(False)  # Trainer groups only parameters that require grad
        try:
            optimizer = super().create_optimizer(model)
        finally:
            parameter.requires_grad_(trains)
        if trains:  # its weight decay and momentum would move the embedding's every row
            settings = {**optimizer.defaults, "weight_decay": self.args.weight_decay}
            optim = getattr(self.args.optim, "value", self.args.optim)
            what = f"Trainer's optim={optim!r} would give the word embeddings"
            refuse_unmatched_settings(optimizer, settings, self.pipe.optimizer, where=what)
            optimizer.add_param_group(
                {"params": [parameter], "lr": self.pipe.optimizer.lr, "weight_decay": 0.0}
            )
        return optimizer

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log, with the pipe's figures in its training lines (``meter.py``): hit
        rate, rows read and written per step, writeback lag; every logger gets them."""
        if "loss" in logs:
            logs = {**logs, **self._meter.since_last()}
        super().log(logs, *args, **kwargs)

    # ----------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        snapshot = os.path.join(self._get_output_dir(trial=trial), folder, TABLE_FOLDER)
        if self.args.should_save:
            if os.path.exists(snapshot):  # the same step saved again
                shutil.rmtree(snapshot)
            os.makedirs(os.path.dirname(snapshot), exist_ok=True)
        if self.args.should_save or self.pipe._owner.shards is not None:
            # first: a folder without it is no checkpoint. A table sharded over the ranks
            # (torchrun) is saved by every rank together; rank 0 writes the folder
            self.pipe.save_checkpoint(snapshot)
        checkpoint = os.path.dirname(snapshot)
        before = model_files(checkpoint)
        self._checkpointing = True
        try:
            with leaving_word_embeddings_out():  # the snapshot's rows, added below
                super()._save_checkpoint(model, trial)
        finally:
            self._checkpointing = False
        if self.args.should_save:
            with Table.open(snapshot, "r") as table:
                self._add_word_embeddings(checkpoint, before, snapshot=table)

    def _mine(self, module: Any) -> bool:
        """Whether the rows of ``module`` (an offloaded embedding) are in this pipe's table."""
        return os.path.realpath(rows_path(module)) == os.path.realpath(self.pipe.table.path)

    def _add_word_embeddings(
        self, folder: str, before: dict[str, Any], snapshot: Table | None = None
    ) -> None:
        """Write the rows of every offloaded embedding into the model file Trainer has just
        saved in ``folder`` (``before``: :func:`model_files` before), so ``from_pretrained``
        loads the trained ones (NOTE [ Checkpoints load with their word embeddings ]): a
        checkpoint's ``snapshot`` for those in this pipe's table, else the table holding each
        module's rows, as ``save_pretrained`` takes them (the caller flushed the pipe on every
        rank). Streamed: the table is never whole in memory."""

        def given(module: Any) -> Table | None:  # a checkpoint's: its snapshot, for the pipe's
            return snapshot if snapshot is not None and self._mine(module) else None

        with rows_to_save(offloaded_keys(self.model), flush=False, given=given) as rows:
            add_word_embeddings(folder, rows, before)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model for ``from_pretrained``, with the table's trained rows as its word
        embeddings (within a checkpoint, the table is saved apart, as a snapshot)."""
        if self._checkpointing:
            super().save_model(output_dir, _internal_call)
            return
        if not self.pipe._owner.closed:  # every rank's rows in the files (torchrun: every rank)
            self.pipe.flush()
        folder = output_dir if output_dir is not None else self.args.output_dir
        before = model_files(folder)
        with leaving_word_embeddings_out():  # the model file as Trainer writes it; rows below
            super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            self._add_word_embeddings(folder, before)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        from .offloading import skipping_word_embeddings

        if not any(name.startswith("optimizer") for name in os.listdir(resume_from_checkpoint)):
            raise ValueError(
                f"{resume_from_checkpoint} holds no optimizer state (saved with "
                "save_only_model=True): transformers resumes from it with a fresh optimizer for "
                "the other weights, while the table's snapshot holds its optimizer's state, so "
                "the run would differ from one with nn.Embedding. Resume from a checkpoint saved "
                "without save_only_model, or start a new run from the model it holds "
                "(from_pretrained on the folder, then offload)"
            )
        with skipping_word_embeddings(model or self.model):  # the table comes from the snapshot
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_table(resume_from_checkpoint, model or self.model)

    def _load_best_model(self) -> None:
        from .offloading import skipping_word_embeddings

        with skipping_word_embeddings(self.model):
            super()._load_best_model()
        best, last = self.state.best_model_checkpoint, pipe_step(self.pipe)  # (steps queued too)
        self._load_table(best, self.model)
        going_back = pipe_step(self.pipe) != last and self.optimizer is not None
        for group in self.optimizer.param_groups if going_back else ():
            if any(p is self.pipe.parameter for p in group["params"]):  # (NOTE in gradient.py)
                group[STEPPED] = (
                    f"load_best_model_at_end loaded the table of {best} with its row "
                    "optimizer's state, where transformers keeps its optimizer's state of the "
                    "last step: training on would differ from nn.Embedding. Resume from a "
                    "checkpoint instead (train(resume_from_checkpoint=...)), or train a copy "
                    "of the rows with a new Trainer"
                )

    def _load_table(self, checkpoint: str, model: Any) -> None:
        """The table's snapshot in ``checkpoint``, whose weights were just loaded into
        ``model``: the two go together, whatever state dict was loaded before (NOTE [ A state
        dict keeps the table's step ])."""
        snapshot = os.path.join(checkpoint, TABLE_FOLDER)
        if not os.path.isdir(snapshot):
            raise FileNotFoundError(
                f"{checkpoint} holds no table snapshot ({TABLE_FOLDER}/): it was not saved by "
                "embedpipe.hf.Trainer, or the save was interrupted; resume from another checkpoint"
            )
        self.pipe.load_checkpoint(snapshot)
        for _, placeholder in offloaded_keys(model):
            if self._mine(placeholder):
                placeholder._loaded_step = None
