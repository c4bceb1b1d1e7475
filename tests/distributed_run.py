"""The training runs of ``test_distributed.py``, one process per rank (``torchrun`` starts them).

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_run.py MODE FOLDER ...

Every run trains the tiny BERT of ``helpers.py`` with DDP on its dense weights, on the batches a
``DistributedSampler`` deals each rank, and writes what the test compares into ``FOLDER`` (rank 0).

- ``parity OPTIMIZER:WORKERS:CLIP ...``: for each run, DDP over the whole model with
  ``nn.Embedding`` and the matching torch optimizer (the reference), then the same with the
  embeddings offloaded to a table sharded over the ranks; saves both tables and both models'
  dense weights into ``FOLDER/OPTIMIZER/``.
- ``resume PHASE``: ``first`` trains straight through (the reference), then trains a second
  table to a checkpoint, takes two more steps and dies without closing; ``second`` reopens that
  table and finishes the epoch from the checkpoint.
- ``lose HOW``: rank 1 dies (``kill``) or hangs (``hang``) at step 3; rank 0 records the error it
  gets and how long it took.
- ``mismatch HOW``: ranks out of step: rank 1 reads one batch more than rank 0 (``batch``),
  rank 0 closes before a step that rank 1 takes (``step``), or only rank 1 steps and both read
  on (``unclosed``).
- ``alone HOW``: rank 1 raises at step 3, after a checkpoint at step 2, while rank 0 trains on
  into DDP's collectives; the pipe closed by ``with`` (``HOW=with``), in a ``finally``
  (``finally``) or at interpreter exit (``exit``). Rank 0 writes the checkpoint's rows.
- ``held``: a batch claimed before ``load_checkpoint`` and read after a step; its rows against
  the table's.
- ``serve_fails``: the last rank fails to serve its rows at its third request.
- ``owner_dies``: owner processes on two machines; the last rank kills its machine's owner
  process at step 3, after a checkpoint at step 2; every rank records its error.
- ``noisy OWNER ...``: a dataset that draws word dropout from numpy's, torch's and ``random``'s
  global generators in its workers (2 a rank), a shuffled ``DistributedSampler`` and the model's
  own dropout, DDP + ``nn.Embedding`` + Adagrad with clipping against the pipe with each
  ``owner`` (``FOLDER/noisy-OWNER/``): the tables, dense weights and every batch's ids.
- ``two OWNER ...``: two tables, each in a torch optimizer of its own (Adagrad, SGD; SGD steps
  first), read by two loaders zipped over the same batches, against DDP + two ``nn.Embedding``
  (``FOLDER/two-OWNER-rankR.pt``).
- ``frameworks``: ``transformers.Trainer`` with ``nn.Embedding`` (the reference, the settings
  of ``test_hf_trainer.py``), then ``embedpipe.hf.Trainer`` with checkpoints, then a run
  resumed from its first checkpoint into a fresh table, then ``evaluate`` and ``save_model``,
  without and with accumulation (``FOLDER/trainer-1/``, ``trainer-2/``); the same for Lightning's
  DDP (``lightning/``) and an Accelerate loop (``accelerate/``), each against itself with
  ``nn.Embedding``.
One launch does several runs: each launch costs seconds of imports on 2 cores.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embedpipe
from embedpipe.pipe.placeholder import ignore_in_ddp
from tests.helpers import REFERENCE_OPTIMIZERS, tiny_model, zipf_dataset

BATCH = 4  # per rank
STEPS = 8
LR = {"sgd": 0.5, "adagrad": 0.3}
DENSE_LR = 0.05
PIPE_OPTIMIZERS = {"sgd": embedpipe.optim.SGD, "adagrad": embedpipe.optim.Adagrad}


def data(steps: int = STEPS) -> list[dict]:
    return zipf_dataset(BATCH * dist.get_world_size() * steps, seed=1)


def sampler(samples: list[dict]) -> DistributedSampler:
    return DistributedSampler(samples, shuffle=True, seed=3, drop_last=True)


def dense_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if "word_embeddings" not in n]


def train_reference(optimizer: str, clip: float) -> tuple[torch.Tensor, dict]:
    """DDP over the whole model, nn.Embedding included: its gradient is averaged with the rest."""
    model = tiny_model()
    ddp = DDP(model)
    emb = model.bert.embeddings.word_embeddings
    emb_opt = REFERENCE_OPTIMIZERS[optimizer]([emb.weight], LR[optimizer])
    dense = torch.optim.SGD(dense_parameters(model), lr=DENSE_LR)
    samples = data()
    for batch in DataLoader(samples, batch_size=BATCH, sampler=sampler(samples)):
        out = ddp(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
        out.loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        dense.step()
        emb_opt.step()
        dense.zero_grad()
        emb_opt.zero_grad()
    return emb.weight.detach().clone(), dense_state(model)


def offloaded_model(path: str) -> torch.nn.Module:
    """The tiny BERT, its embeddings offloaded to ``path``; ``PIPE_OWNER=served``: into the
    table the test made (and serves), which the model's placeholder names."""
    model = tiny_model()
    if served():  # as offload leaves the model, the table written by the test
        embeddings = model.get_input_embeddings()
        placeholder = embedpipe.hf.OffloadedEmbedding(
            *embeddings.weight.shape, os.path.abspath(path), padding_idx=embeddings.padding_idx
        )
        placeholder.attach(torch.nn.Parameter(torch.empty(0, embeddings.weight.shape[1])))
        model.set_input_embeddings(placeholder)
        ignore_in_ddp(model, placeholder)
        return model
    embedpipe.hf.offload(model, path, chunk_rows=64).close()  # rank 0 writes, the others wait
    return model


def served() -> bool:
    return os.environ.get("PIPE_OWNER") == "served"


def service_address(path: str, machine: int | str | None = None) -> str:
    """Where the test serves the table at ``path`` to the ranks of ``machine`` (torchrun's
    ``GROUP_RANK``, a machine's own service: ``PIPE_OWNER=served``)."""
    machine = os.environ.get("GROUP_RANK", "0") if machine is None else machine
    return f"unix:{os.path.abspath(path)}.{machine}.sock"


def serve_tables(owner: str, *paths: str):
    """Owner ``served``: rank 0 serves each table (``embedpipe serve``) at the address the
    pipes connect to; returns what stops them, called by every rank once its pipes closed."""
    services = []
    if owner == "served" and dist.get_rank() == 0:
        for path in paths:
            command = [sys.executable, "-m", "embedpipe.tools.cli", "serve", path, "--address"]
            service = subprocess.Popen(
                [*command, service_address(path, 0)], stdout=subprocess.PIPE, text=True
            )
            services.append(service)
            assert service.stdout.readline().startswith("serving"), service.wait()
    dist.barrier()

    def stop() -> None:
        dist.barrier()  # every rank's pipes closed
        for service in services:
            service.terminate()
            assert service.wait(timeout=30) == 0
            service.stdout.close()

    return stop


def make_pipe(path: str, optimizer: str, **options) -> embedpipe.EmbeddingPipe:
    """The pipe of every run; ``PIPE_OWNER=process``: one owner process for the ranks;
    ``served``: the service the test runs for the table (``embedpipe serve``)."""
    options.setdefault("owner", os.environ.get("PIPE_OWNER", "thread"))
    if options["owner"] == "served":
        options["owner"] = service_address(path)
    return embedpipe.EmbeddingPipe(
        path,
        cache_rows=int(os.environ.get("PIPE_CACHE_ROWS", "300")),
        optimizer=PIPE_OPTIMIZERS[optimizer](lr=LR[optimizer]),
        **options,
    )


def optimizer_for(model: torch.nn.Module, pipe: embedpipe.EmbeddingPipe, optimizer: str):
    """One torch optimizer: the dense weights, and the table in a group of its own (its lr)."""
    return torch.optim.SGD(
        [
            {"params": dense_parameters(model)},
            {"params": [pipe.parameter], "lr": LR[optimizer]},
        ],
        lr=DENSE_LR,
    )


def train_offloaded(
    path: str, optimizer: str, workers: int, clip: float, **options
) -> tuple[torch.nn.Module, embedpipe.EmbeddingPipe, torch.optim.Optimizer]:
    model = offloaded_model(path)
    ddp = DDP(model)
    pipe = make_pipe(path, optimizer, **options)
    opt = optimizer_for(model, pipe, optimizer)
    run(ddp, model, pipe, opt, workers, clip, range(STEPS))
    return model, pipe, opt


def run(ddp, model, pipe, opt, workers: int, clip: float, steps: range, die_at: int = -1) -> None:
    samples = data()
    loader = pipe.loader(samples, batch_size=BATCH, sampler=sampler(samples), num_workers=workers)
    for step, batch in enumerate(loader):
        print("rank", dist.get_rank(), "step", step, file=sys.stderr, flush=True)
        if step < steps.start:
            continue  # a resumed run skips the batches trained before its checkpoint
        if step == die_at:
            # every rank has claimed this batch first: a rank still on its way there would find
            # the job dropped by its service once the first died (seen once in CI: exit 1)
            dist.barrier()
            os._exit(0)  # a crash: nothing closed, nothing flushed
        out = ddp(
            inputs_embeds=batch["inputs_embeds"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
        out.loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if step + 1 == steps.stop:
            break


def train_step(ddp, opt, batch) -> None:
    """One step of the offloaded model on ``batch``, no clipping."""
    out = ddp(
        inputs_embeds=batch["inputs_embeds"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
    )
    out.loss.backward()
    opt.step()
    opt.zero_grad()


def dense_state(model: torch.nn.Module) -> dict:
    return {
        n: p.detach().clone() for n, p in model.named_parameters() if "word_embeddings" not in n
    }


def parity(folder: str, *runs: str) -> None:
    for name in runs:
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        if name == "reload":
            reload(os.path.join(folder, name))
        else:
            parity_run(os.path.join(folder, name), *name.split(":"))


def parity_run(
    folder: str, optimizer: str, workers: str, clip: str, consistency: str = "exact"
) -> None:
    reference, reference_dense = train_reference(optimizer, float(clip))
    path = os.path.join(folder, "table.zarr")
    options = {"consistency": "bounded", "max_staleness": 2} if consistency == "bounded" else {}
    model, pipe, _ = train_offloaded(path, optimizer, int(workers), float(clip), **options)
    stats = pipe.stats()
    try:
        pipe.table.to_tensor()  # the other rank's cached rows are not in the files yet
        unflushed = "no error"
    except embedpipe.errors.DistributedNotSupportedError as e:
        unflushed = str(e)
    # on every rank, as transformers asks: it flushes every rank's shard (hf/saving.py)
    saved = os.path.join(folder, "saved")
    model.save_pretrained(saved, is_main_process=dist.get_rank() == 0)
    pipe.flush()  # on every rank
    flushed = pipe.table.to_tensor()
    pipe.close()
    if dist.get_rank() == 0:
        table = embedpipe.Table.open(path)
        torch.save(
            {
                "saved": type(model).from_pretrained(saved).get_input_embeddings().weight,
                "reference": reference,
                "offloaded": table.to_tensor(),
                "reference_dense": reference_dense,
                "offloaded_dense": dense_state(model),
                "stats": stats,
                "unflushed": unflushed,
                "flushed": flushed,
                "shards": table.metadata.get("shards"),
                "step": table.step,
            },
            os.path.join(folder, "result.pt"),
        )


CHECKPOINT_AT = 4


def reload(folder: str) -> None:
    """Adagrad, 2 workers, clipping (the parity run's settings): 2 steps, a snapshot (into a
    folder rank 0 makes a second after the other rank asked for it; then, as Trainer saving a
    step again, emptied by rank 0 and saved again), 2 more
    steps, then load_checkpoint right after a step (a rank's writeback may still be applying
    it), the dense weights back, and steps 3 to 8 again: the table the straight run trains."""
    path = os.path.join(folder, "table.zarr")
    model = offloaded_model(path)
    ddp = DDP(model)
    pipe = make_pipe(path, "adagrad")
    opt = optimizer_for(model, pipe, "adagrad")
    run(ddp, model, pipe, opt, 2, 1.0, range(2))
    snapshot = os.path.join(folder, "checkpoint-2", "table")
    if dist.get_rank() == 0:  # as Trainer: rank 0 makes the folder, another rank may ask first
        time.sleep(1.0)
        os.makedirs(os.path.dirname(snapshot))
    pipe.save_checkpoint(snapshot)
    if dist.get_rank() == 0:  # as Trainer saving a step again: rank 0 empties the folder
        shutil.rmtree(snapshot)
    pipe.save_checkpoint(snapshot)  # done again, not the first one's result
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    run(ddp, model, pipe, opt, 2, 1.0, range(2, 4))
    pipe.load_checkpoint(snapshot)
    model.load_state_dict(dense)
    run(ddp, model, pipe, opt, 2, 1.0, range(2, STEPS))
    pipe.close()
    if dist.get_rank() == 0:
        table = embedpipe.Table.open(path)
        result = {"offloaded": table.to_tensor(), "dense": dense_state(model), "step": table.step}
        torch.save(result, os.path.join(folder, "result.pt"))


def resume(folder: str, phase: str) -> None:
    path = os.path.join(folder, "resumed.zarr")
    dense_file = os.path.join(folder, "dense.pt")
    if phase == "first":
        straight = os.path.join(folder, "straight.zarr")
        model, pipe, _ = train_offloaded(straight, "adagrad", 0, 1.0)
        pipe.close()
        model = offloaded_model(path)
        ddp = DDP(model)
        pipe = make_pipe(path, "adagrad")
        opt = optimizer_for(model, pipe, "adagrad")
        run(ddp, model, pipe, opt, 2, 1.0, range(CHECKPOINT_AT))
        checkpoint = pipe.checkpoint()
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "step": checkpoint.step}, dense_file)
        dist.barrier()
        run(ddp, model, pipe, opt, 2, 1.0, range(CHECKPOINT_AT, STEPS), die_at=CHECKPOINT_AT + 2)
        return
    saved = torch.load(dense_file)
    model = tiny_model()
    model.set_input_embeddings(
        embedpipe.hf.OffloadedEmbedding(*model.get_input_embeddings().weight.shape, path)
    )
    model.load_state_dict(saved["model"], strict=False)
    ddp = DDP(model)
    pipe = make_pipe(path, "adagrad")
    pipe.attach(model)
    assert pipe.table.step == saved["step"] == CHECKPOINT_AT, (pipe.table.step, saved["step"])
    opt = optimizer_for(model, pipe, "adagrad")
    run(ddp, model, pipe, opt, 2, 1.0, range(CHECKPOINT_AT, STEPS))
    pipe.close()


def lose(folder: str, how: str) -> None:
    path = os.path.join(folder, "table.zarr")
    model = offloaded_model(path)
    ddp = DDP(model)
    pipe = make_pipe(path, "sgd", timeout=float(os.environ.get("PIPE_TIMEOUT", "300")))
    opt = optimizer_for(model, pipe, "sgd")
    # a heavy field: the workers' result queue fills while rank 1 sleeps before its kill, the
    # case where its workers used to hang in their exit, holding its sockets
    samples = [{**s, "blob": torch.zeros(256 * 1024, dtype=torch.uint8)} for s in data()]
    loader = pipe.loader(samples, batch_size=BATCH, sampler=sampler(samples), num_workers=2)
    start = time.monotonic()
    try:
        for step, batch in enumerate(loader):
            if step == 2:
                pipe.checkpoint()
            if step == 3 and dist.get_rank() == 1:
                if how == "kill":
                    time.sleep(2)  # the workers fill the result queue meanwhile
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            start = time.monotonic()
            train_step(ddp, opt, batch)
        outcome = {"error": None}
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e), "after": time.monotonic() - start}
    report_and_exit(folder, pipe, outcome)


def alone(folder: str, how: str) -> None:
    path = os.path.join(folder, "table.zarr")
    model = offloaded_model(path)
    ddp = DDP(model)
    pipe = make_pipe(path, "sgd")
    opt = optimizer_for(model, pipe, "sgd")
    samples = data()

    def train() -> None:
        loader = pipe.loader(samples, batch_size=BATCH, sampler=sampler(samples))
        for step, batch in enumerate(loader):
            if step == 2:
                pipe.checkpoint()
                if dist.get_rank() == 0:
                    torch.save(embedpipe.Table.open(path).to_tensor(), f"{folder}/checkpoint.pt")
            if step == 3 and dist.get_rank() == 1:
                raise ValueError("rank 1 fails alone")
            train_step(ddp, opt, batch)

    if how == "with":
        with pipe:
            train()
    elif how == "finally":
        try:
            train()
        finally:
            pipe.close()
    else:
        train()  # the pipe left open: closed at exit


def report_and_exit(folder: str, pipe: embedpipe.EmbeddingPipe, outcome: dict) -> None:
    """Close the pipe (its error, if any, goes into ``outcome``), write this rank's outcome to
    ``FOLDER/rankR.json`` and exit at once: a peer is gone, do not wait for it at exit."""
    try:
        pipe.close()
    except Exception as e:
        outcome["close"] = type(e).__name__
    with open(os.path.join(folder, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)


def no_sync_plans(folder: str, owner: str, *plans: str) -> None:
    """Plans of backward passes around DDP's ``no_sync``, each trained with DDP + a replicated
    ``nn.Embedding`` + SGD and through a pipe: S a pass that syncs, N forward and backward in
    ``no_sync``, F the forward in it and the backward outside, B the forward outside and the
    backward in it (DDP decides at the forward), ``|`` a step. Writes each plan's table (or
    its error) as ``FOLDER/plan-K-rankR.pt``."""
    rank, samples = dist.get_rank(), data(16)

    def passes(ddp, plan: str, batches, step) -> None:
        for c in plan:
            if c == "|":
                step()
                continue
            batch = next(batches)
            with ddp.no_sync() if c in "NF" else contextlib.nullcontext():
                loss = ddp(**batch).loss
            with ddp.no_sync() if c in "NB" else contextlib.nullcontext():
                loss.backward()

    for k, plan in enumerate(plans):
        model = tiny_model()
        ddp = DDP(model)
        table = model.get_input_embeddings().weight
        opt = torch.optim.SGD(
            [{"params": dense_parameters(model)}, {"params": [table], "lr": 0.5}], lr=0.05
        )
        mine = iter(DataLoader(samples, batch_size=BATCH, sampler=sampler(samples)))
        plain = ({k: b[k] for k in ("input_ids", "attention_mask", "labels")} for b in mine)
        passes(ddp, plan, plain, lambda o=opt: (o.step(), o.zero_grad()))
        reference = table.detach().clone()
        path = os.path.join(folder, f"plan-{k}.zarr")
        model = offloaded_model(path)
        ddp, error = DDP(model), None
        with make_pipe(path, "sgd", owner=owner) as pipe:
            opt = torch.optim.SGD(
                [{"params": dense_parameters(model)}, {"params": [pipe.parameter], "lr": 0.5}],
                lr=0.05,
            )
            loader = pipe.loader(samples, batch_size=BATCH, sampler=sampler(samples))
            batches = (
                {
                    **{k: b[k] for k in ("attention_mask", "labels")},
                    "inputs_embeds": b["inputs_embeds"],
                }
                for b in loader
            )
            try:
                passes(ddp, plan, batches, lambda o=opt: (o.step(), o.zero_grad()))
            except embedpipe.errors.DistributedNotSupportedError as e:
                error = str(e)
                opt.zero_grad()
            pipe.flush()
            got = pipe.table.to_tensor()
        torch.save(
            {"reference": reference, "got": got, "error": error},
            os.path.join(folder, f"plan-{k}-rank{rank}.pt"),
        )


def owner_dies(folder: str) -> None:
    """Owner processes on two machines (``PIPE_OWNER=process``, a torchrun agent a machine):
    after a checkpoint at step 2, the last rank kills its machine's owner process at step 3;
    every rank records the error it gets and how long after the kill, then exits."""
    path = os.path.join(folder, "table.zarr")
    model = offloaded_model(path)
    ddp = DDP(model)
    pipe = make_pipe(path, "sgd", timeout=60.0)
    opt = optimizer_for(model, pipe, "sgd")
    samples = data()
    loader = pipe.loader(samples, batch_size=BATCH, sampler=sampler(samples), num_workers=2)
    killed = os.path.join(folder, "killed")
    try:
        for step, batch in enumerate(loader):
            if step == 2:
                pipe.checkpoint()
            if step == 3 and dist.get_rank() == dist.get_world_size() - 1:
                with open(killed, "w") as f:
                    f.write(str(time.time()))
                os.kill(pipe._owner.owner_pid, signal.SIGKILL)
            train_step(ddp, opt, batch)
        outcome = {"error": None}
    except Exception as e:
        with open(killed) as f:
            at = float(f.read())
        outcome = {"error": type(e).__name__, "message": str(e), "after": time.time() - at}
    report_and_exit(folder, pipe, outcome)


def _small_pipe(folder: str) -> tuple[embedpipe.EmbeddingPipe, list[dict]]:
    """A 256-row table in chunks of 32 (a shard a rank or a machine), an SGD pipe, and samples
    of rows of both halves."""
    path = os.path.join(folder, "small.zarr")
    if dist.get_rank() == 0:
        embedpipe.Table.create(path, 256, 4, chunk_rows=32, overwrite=True).close()
    dist.barrier()
    pipe = make_pipe(path, "sgd", timeout=60.0)
    ids = torch.tensor([5, 200, 7, 150])
    return pipe, [{"input_ids": ids.clone()} for _ in range(8 * dist.get_world_size())]


def _sgd_step(pipe: embedpipe.EmbeddingPipe, batch) -> None:
    batch["inputs_embeds"].sum().backward()  # each row moves by lr at every step
    pipe.step()


def held(folder: str) -> None:
    """A batch claimed before ``load_checkpoint`` and read after one more step: its rows, of
    every shard, against the table's after a flush (FOLDER/held-rankR.json)."""
    pipe, samples = _small_pipe(folder)
    loader = pipe.loader(samples, batch_size=1, sampler=DistributedSampler(samples, shuffle=False))
    batches = iter(loader)
    _sgd_step(pipe, next(batches))
    snapshot = os.path.join(folder, "snapshot")
    pipe.save_checkpoint(snapshot)
    kept = next(batches)  # claimed before the load, read after it
    pipe.load_checkpoint(snapshot)
    _sgd_step(pipe, next(batches))  # changes its rows again
    read = kept["inputs_embeds"].detach()[0]
    pipe.flush()
    ids = kept["input_ids"][0].numpy()
    error = (read - torch.from_numpy(pipe.table.read(ids))).abs().max().item()
    pipe.close()
    with open(os.path.join(folder, f"held-rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"error": error}, f)


def serve_fails(folder: str) -> None:
    """The last rank fails to serve its rows at its third request (its owner's write fails, a
    full disk); every rank's loop runs in ``with pipe:``: what each raised, how long after."""
    pipe, samples = _small_pipe(folder)
    outcome: dict = {"error": None}
    start = time.time()
    try:
        with pipe:
            owner, asked = pipe._owner, [0]
            serve = owner._serve

            def failing(ids: np.ndarray) -> np.ndarray:
                asked[0] += 1
                if dist.get_rank() == dist.get_world_size() - 1 and asked[0] == 3 and len(ids):
                    raise OSError(28, "No space left on device (injected)")
                return serve(ids)

            owner._serve = failing
            loader = pipe.loader(
                samples, batch_size=1, sampler=DistributedSampler(samples, shuffle=False)
            )
            for step, batch in enumerate(loader):
                start = time.time() if step == 2 else start
                _sgd_step(pipe, batch)
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    outcome["after"] = time.time() - start
    with open(os.path.join(folder, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(outcome, f)
    os._exit(0)


def mismatch(folder: str, how: str = "batch") -> None:
    """``batch``: rank 1 reads one batch more, then both step and close; ``step``: rank 0
    closes before its first step, where rank 1 steps and reads on; ``unclosed``: only rank 1
    steps, then both read a batch and go back through it."""
    path = os.path.join(folder, "table.zarr")
    model = offloaded_model(path)
    pipe = make_pipe(path, "sgd")
    samples = data()
    loader = iter(pipe.loader(samples, batch_size=BATCH, sampler=sampler(samples)))
    outcome: dict = {"error": None}
    try:
        try:
            for _ in range(1 + dist.get_rank() if how == "batch" else 1):
                model(inputs_embeds=next(loader)["inputs_embeds"]).logits.sum().backward()
            if how == "batch" or dist.get_rank() == 1:
                pipe.step()
            if how == "step" and dist.get_rank() == 1:
                next(loader)
            if how == "unclosed":
                model(inputs_embeds=next(loader)["inputs_embeds"]).logits.sum().backward()
        finally:
            pipe.close()
    except Exception as e:
        outcome = {"error": type(e).__name__, "message": str(e)}
    with open(os.path.join(folder, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(outcome, f)


class NoisySamples(torch.utils.data.Dataset):
    """Samples whose ids a word dropout draws from every global generator, in ``__getitem__``
    (so in the DataLoader's workers): numpy's picks the ids, torch's the replacements,
    ``random``'s whether to reverse them."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        sample = dict(self.samples[i])
        ids = sample["input_ids"].clone()
        drop = torch.from_numpy(np.random.random(len(ids)) < 0.15)
        ids[drop] = torch.randint(1, 1000, (int(drop.sum()),))
        if random.random() < 0.5:
            ids = ids.flip(0)
        sample["input_ids"] = ids
        return sample


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def noisy(folder: str, *owners: str) -> None:
    """Both runs draw the same numbers in the same order: seeded after the model is made, then
    DDP, the optimizers (and the pipe), the loader's workers and the model's dropout."""
    samples = NoisySamples(data())

    def train(model, embed, optimizers, loader) -> tuple[list, torch.nn.Module]:
        ddp = DDP(model.train())  # train(): BERT's dropout draws in this process
        seen = []
        for batch in loader:
            seen.append(batch["input_ids"].clone())
            out = ddp(
                **embed(batch), attention_mask=batch["attention_mask"], labels=batch["labels"]
            )
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        return seen, model

    model = tiny_model()
    seed_everything(5)
    emb = model.bert.embeddings.word_embeddings
    optimizers = [
        torch.optim.Adagrad([emb.weight], lr=LR["adagrad"]),
        torch.optim.SGD(dense_parameters(model), lr=DENSE_LR),
    ]
    loader = DataLoader(samples, batch_size=BATCH, sampler=sampler(samples), num_workers=2)
    reference_seen, _ = train(model, lambda b: {"input_ids": b["input_ids"]}, optimizers, loader)
    reference, reference_dense = emb.weight.detach().clone(), dense_state(model)
    for owner in owners:
        model = offloaded_model(os.path.join(folder, f"noisy-{owner}.zarr"))
        stop = serve_tables(owner, os.path.join(folder, f"noisy-{owner}.zarr"))
        seed_everything(5)
        pipe = make_pipe(os.path.join(folder, f"noisy-{owner}.zarr"), "adagrad", owner=owner)
        loader = pipe.loader(samples, batch_size=BATCH, sampler=sampler(samples), num_workers=2)
        seen, _ = train(
            model,
            lambda b: {"inputs_embeds": b["inputs_embeds"]},
            [optimizer_for(model, pipe, "adagrad")],
            loader,
        )
        pipe.flush()
        table = pipe.table.to_tensor()
        pipe.close()
        stop()
        result = {"reference": reference, "offloaded": table, "dense": dense_state(model)}
        result["reference_dense"] = reference_dense
        result["batches"] = [torch.equal(a, b) for a, b in zip(reference_seen, seen)]
        result["count"] = (len(reference_seen), len(seen))
        torch.save(result, os.path.join(folder, f"noisy-{owner}-rank{dist.get_rank()}.pt"))


class TwoTables(torch.nn.Module):
    """Two embeddings (or their rows, given) and a dense head: the loss of ``two``'s runs."""

    def __init__(self, embeddings: bool) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b = torch.nn.Embedding(1000, 8), torch.nn.Embedding(1000, 8)
        self.head = torch.nn.Linear(8, 1)
        if not embeddings:
            del self.a, self.b

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "a"):
            a, b = self.a(a), self.b(b)
        return self.head(a * b.tanh()).square().mean()


def two(folder: str, *owners: str) -> None:
    samples = data()
    reference = TwoTables(embeddings=True)
    initial = {n: getattr(reference, n).weight.detach().clone() for n in "ab"}
    ddp = DDP(reference)
    optimizers = [
        torch.optim.SGD([reference.b.weight], lr=LR["sgd"]),
        torch.optim.Adagrad([reference.a.weight], lr=LR["adagrad"]),
        torch.optim.SGD(reference.head.parameters(), lr=DENSE_LR),
    ]
    for batch in DataLoader(samples, batch_size=BATCH, sampler=sampler(samples)):
        ddp(batch["input_ids"], batch["input_ids"]).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for owner in owners:
        model = TwoTables(embeddings=False)
        ddp = DDP(model)
        paths = {n: os.path.join(folder, f"two-{owner}-{n}.zarr") for n in "ab"}
        if dist.get_rank() == 0:
            for n, path in paths.items():
                embedpipe.Table.from_tensor(path, initial[n], chunk_rows=64).close()
        stop = serve_tables(owner, *paths.values())
        pipes = {n: make_pipe(paths[n], o, owner=owner) for n, o in zip("ab", ("adagrad", "sgd"))}
        optimizers = [
            torch.optim.SGD([pipes["b"].parameter], lr=LR["sgd"]),
            torch.optim.Adagrad([pipes["a"].parameter], lr=LR["adagrad"]),
            torch.optim.SGD(model.parameters(), lr=DENSE_LR),
        ]
        loaders = [
            pipes["a"].loader(samples, batch_size=BATCH, sampler=sampler(samples), num_workers=2),
            pipes["b"].loader(samples, batch_size=BATCH, sampler=sampler(samples)),
        ]
        for a, b in zip(*loaders):
            ddp(a["inputs_embeds"], b["inputs_embeds"]).backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        result = {}
        for n, pipe in pipes.items():
            pipe.flush()
            trained = pipe.table.to_tensor()
            result[n] = (getattr(reference, n).weight.detach(), trained)
            result[f"{n} moved"] = int((trained != initial[n]).any(dim=1).sum())
            pipe.close()
        stop()
        result["head"] = [
            torch.equal(x, y) for x, y in zip(reference.head.parameters(), model.head.parameters())
        ]
        torch.save(result, os.path.join(folder, f"two-{owner}-rank{dist.get_rank()}.pt"))


def frameworks(folder: str) -> None:
    """HF Trainer without and with accumulation, Lightning's DDP, an Accelerate loop."""
    runs = {
        "trainer-1": lambda out: trainer_run(out, "1"),
        "trainer-2": lambda out: trainer_run(out, "2"),
        "lightning": lightning_ddp,
        "accelerate": accelerate_ddp,
    }
    for name, run_ in runs.items():
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        run_(os.path.join(folder, name))


def trainer_run(folder: str, accumulation: str) -> None:
    from tests.frameworks import VOCAB, bert, offloaded, samples
    from tests.hf.test_hf_trainer import ReferenceTrainer, arguments, grad_norms

    data = samples(32)  # 4 batches of 4 a rank an epoch
    every = 4 // int(accumulation)  # a checkpoint half-way: 8 batches a rank, 2 epochs
    options = dict(
        gradient_accumulation_steps=int(accumulation), ddp_backend="gloo", save_steps=every
    )
    reference = ReferenceTrainer(
        model=bert(),
        args=arguments(os.path.join(folder, "reference"), **options),
        train_dataset=data,
    )
    reference.train()
    held_out = samples(20, seed=1)  # 5 a rank: Accelerate evens out the ranks' batches
    reference_eval = reference.evaluate(held_out)["eval_loss"]

    def train(name: str, resume: str | None = None):
        model = bert()
        pipe = offloaded(model, os.path.join(folder, f"{name}.zarr"), cache_rows=VOCAB // 20)
        args = arguments(os.path.join(folder, name), save_strategy="steps", **options)
        run = embedpipe.hf.Trainer(model=model, args=args, train_dataset=data, pipe=pipe)
        run.train(resume_from_checkpoint=resume)
        return run, pipe

    straight, pipe = train("embedpipe")
    steps = straight.state.global_step
    evaluation = straight.evaluate(held_out)["eval_loss"]  # every rank reads its batches' rows
    first = os.path.join(folder, "embedpipe", f"checkpoint-{every}")
    resumed, resumed_pipe = train("resumed", resume=first)
    straight.save_model(os.path.join(folder, "saved"))  # every rank, as Trainer's examples do
    pipe.flush()
    resumed_pipe.flush()
    result = {
        "steps": (reference.state.global_step, steps, resumed.state.global_step),
        "reference": reference.model.get_input_embeddings().weight.detach().clone(),
        "offloaded": pipe.table.to_tensor(),
        "resumed": resumed_pipe.table.to_tensor(),
        "reference_dense": dense_state(reference.model),
        "offloaded_dense": dense_state(straight.model),
        "resumed_dense": dense_state(resumed.model),
        "grad_norms": (grad_norms(reference), grad_norms(straight)),
        "eval_loss": (reference_eval, evaluation),
    }
    pipe.close()
    resumed_pipe.close()
    if accumulation == "1":
        result["streamed"] = streamed(folder)
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(folder, "result.pt"))


def streamed(folder: str) -> dict:
    """A Hugging Face streaming dataset of 4 files through Trainer over the 2 ranks: with
    ``dispatch_batches=False`` each rank's batches (a file shard of its own) as
    ``transformers.Trainer``'s; left unset (Trainer would dispatch batches from rank 0),
    ``embedpipe.hf.Trainer`` raises, also on arguments another Trainer was given before. Each
    rank's outcome, gathered."""
    import datasets
    import transformers

    from tests.frameworks import VOCAB, bert, offloaded, samples
    from tests.hf.test_hf_trainer import arguments

    rows = [{k: v.tolist() for k, v in sample.items()} for sample in samples(32)]
    stream = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=4)
    undispatched = {"dispatch_batches": False}

    def ids(trainer) -> list[list[list[int]]]:
        return [batch["input_ids"].tolist() for batch in trainer.get_train_dataloader()]

    def args(**options):
        return arguments(os.path.join(folder, "streamed"), max_steps=4, **options)

    reference = transformers.Trainer(
        model=bert(), args=args(accelerator_config=undispatched), train_dataset=stream
    )
    model = bert()
    pipe = offloaded(model, os.path.join(folder, "streamed.zarr"), cache_rows=VOCAB // 20)
    run = embedpipe.hf.Trainer(
        model=model, args=args(accelerator_config=undispatched), train_dataset=stream, pipe=pipe
    )
    expected, got = ids(reference), ids(run)
    unset = args()  # dispatch_batches left unset; first given to a Trainer of a map-style set
    embedpipe.hf.Trainer(model=model, args=unset, train_dataset=samples(8), pipe=pipe)
    try:
        embedpipe.hf.Trainer(model=model, args=unset, train_dataset=stream, pipe=pipe)
        refused = ""
    except ValueError as e:
        refused = str(e)
    pipe.close()
    outcome = {"same": expected == got, "ids": got, "refused": refused}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    return {"ranks": gathered}


def lightning_ddp(folder: str) -> None:
    """Lightning's own DDP (``strategy="ddp"`` under torchrun) with clipping, accumulation 2, a
    warmup schedule and a checkpoint a epoch: nn.Embedding, then the table with PipeCallback,
    then a run resumed from the first epoch's checkpoint."""
    from embedpipe.lightning import PipeCallback
    from tests.frameworks import bert, offloaded, samples, with_adagrad_table
    from tests.test_frameworks import (
        DENSE_LR,
        TABLE_LR,
        lightning_fit,
        offloaded_inputs,
        reference_inputs,
    )

    data = samples(32)
    ddp = {"devices": 2, "strategy": "ddp_find_unused_parameters_true"}
    ddp["use_distributed_sampler"] = False  # the loaders get theirs

    def loader_of(make):
        return make(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))

    def reference_optimizer(model):
        dense = torch.optim.AdamW(dense_parameters(model), lr=DENSE_LR, eps=1e-6)
        return with_adagrad_table(dense, model.get_input_embeddings().weight)

    reference = bert(dropout=0.0)
    root = os.path.join(folder, "reference")
    lightning_fit(
        reference, reference_optimizer, loader_of(DataLoader), reference_inputs, root=root, **ddp
    )
    injected_reference = bert(dropout=0.0)  # Lightning's default: its own DistributedSampler
    lightning_fit(
        injected_reference,
        reference_optimizer,
        DataLoader(data, batch_size=4),
        reference_inputs,
        root=os.path.join(folder, "injected_reference"),
        **{**ddp, "use_distributed_sampler": True},
    )

    def run(name: str, ckpt: str | None = None, injected: bool = False) -> torch.Tensor:
        """``injected``: Lightning's default, a DistributedSampler it puts in the loader."""
        model = bert(dropout=0.0)
        pipe = offloaded(model, os.path.join(folder, f"{name}.zarr"))

        def optimizer(m):
            groups = [{"params": dense_parameters(m)}, {"params": [pipe.parameter], "lr": TABLE_LR}]
            return torch.optim.AdamW(groups, lr=DENSE_LR, eps=1e-6)

        lightning_fit(
            model,
            optimizer,
            pipe.loader(data, batch_size=4) if injected else loader_of(pipe.loader),
            offloaded_inputs,
            callbacks=[PipeCallback(pipe)],
            root=os.path.join(folder, name),
            ckpt=ckpt,
            **{**ddp, "use_distributed_sampler": injected},
        )
        pipe.flush()
        table = pipe.table.to_tensor()
        pipe.close()
        return table, model

    whole, model = run("whole")
    first = sorted(glob.glob(os.path.join(folder, "whole", "epoch=0*.ckpt")))[0]
    resumed, _ = run("resumed", ckpt=first)
    injected, injected_model = run("injected", injected=True)
    if dist.get_rank() == 0:
        result = {
            "injected": injected,
            "injected_dense": dense_state(injected_model),
            "injected_reference": injected_reference.get_input_embeddings().weight.detach(),
            "injected_reference_dense": dense_state(injected_reference),
            "reference": reference.get_input_embeddings().weight.detach().clone(),
            "reference_dense": dense_state(reference),
            "offloaded": whole,
            "offloaded_dense": dense_state(model),
            "resumed": resumed,
        }
        torch.save(result, os.path.join(folder, "result.pt"))


def accelerate_ddp(folder: str) -> None:
    """The Accelerate loop of ``test_frameworks.py`` (accumulate 2, clip at each sync, warmup,
    the table in save_state/load_state) under torchrun: nn.Embedding, then the table, then a
    run resumed from the state saved after 2 batches (load_state + skip_first_batches)."""
    from tests.frameworks import bert, offloaded, samples, with_adagrad_table
    from tests.test_frameworks import (
        DENSE_LR,
        TABLE_LR,
        accelerate_run,
        offloaded_inputs,
        reference_inputs,
    )

    data = samples(36)  # 9 batches of 4: 5 a rank (Accelerate repeats samples to even them)
    reference = bert(dropout=0.0)
    dense = torch.optim.AdamW(dense_parameters(reference), lr=DENSE_LR, eps=1e-6)
    optimizer = with_adagrad_table(dense, reference.get_input_embeddings().weight)
    accelerate_run(reference, optimizer, DataLoader(data, batch_size=4), reference_inputs)
    result = {"reference": reference.get_input_embeddings().weight.detach().clone()}
    result["reference_dense"] = dense_state(reference)
    state = os.path.join(folder, "whole.zarr") + ".state"
    for name, resume in (("whole", None), ("resumed", (state, 2))):
        model = bert(dropout=0.0)
        pipe = offloaded(model, os.path.join(folder, f"{name}.zarr"))
        groups = [{"params": dense_parameters(model)}, {"params": [pipe.parameter], "lr": TABLE_LR}]
        optimizer = torch.optim.AdamW(groups, lr=DENSE_LR, eps=1e-6)
        loader = pipe.loader(data, batch_size=4, num_workers=2)
        save_at = 2 if resume is None else None
        model = accelerate_run(
            model, optimizer, loader, offloaded_inputs, save_at=save_at, resume=resume
        )
        pipe.flush()
        result[name] = pipe.table.to_tensor()
        result[f"{name}_dense"] = dense_state(getattr(model, "module", model))
        pipe.close()
    if dist.get_rank() == 0:
        torch.save(result, os.path.join(folder, "result.pt"))


if __name__ == "__main__":
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    mode, folder, *args = sys.argv[1:]
    modes = {"parity": parity, "resume": resume, "lose": lose, "mismatch": mismatch}
    modes["frameworks"] = frameworks
    modes["noisy"] = noisy
    modes["two"] = two
    modes["owner_dies"] = owner_dies
    modes["held"] = held
    modes["alone"] = alone
    modes["no_sync_plans"] = no_sync_plans
    modes["serve_fails"] = serve_fails
    modes[mode](folder, *args)
    dist.destroy_process_group()
