"""A table service (``embedpipe serve``) serving the ranks of a ``torchrun`` job on its machine:
every rank makes its pipe with ``owner="unix:PATH"``, rank 0 opens the table there for the
job, the others join it, and they share the service's one owner and cache as they share an
owner process of their own (``test_job.py``): the runs of ``distributed_run.py`` with
``PIPE_OWNER=served`` (the test makes each table and serves it beside it), against DDP + a
replicated ``nn.Embedding`` and the matching torch optimizer, bit for bit. A job whose rank dies
leaves the service up, the table at its last checkpoint, and a new job resumes from it to the
uninterrupted run's table."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading

import pytest
import torch

import embedpipe
from embedpipe.service import Service

from .. import distributed_run
from ..helpers import tiny_model, zipf_dataset
from ..ranks import test_distributed as distributed
from ..ranks.test_distributed import RUN_TIMEOUT, SCRIPT, free_port, launch, torchrun
from .test_job import assert_as_ddp_through_one_owner
from .test_machines import assert_as_row_sharded, machines
from .test_serve import serving

pytest.importorskip("transformers", reason="the runs train a tiny transformers BERT")

RUNS = ["sgd:0:0", "adagrad:2:1.0"]  # SGD without workers; Adagrad, 2 workers a rank, clipping


@contextlib.contextmanager
def served(*paths, machines: int = 1):
    """Each table written as the runs' ranks would offload it, and served at the addresses the
    runs connect to (``distributed_run.service_address``): the whole table, or with several
    ``machines`` a shard a machine (``--shard i/S``); yields the services' processes."""
    with contextlib.ExitStack() as stack:
        processes = []
        for path in paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            embedpipe.hf.offload(tiny_model(), path, chunk_rows=64).close()
            for i in range(machines):
                address = distributed_run.service_address(path, i)
                shard = ("--shard", f"{i}/{machines}") if machines > 1 else ()
                processes.append(stack.enter_context(serving(path, address, *shard))[1])
        yield processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    with (
        pytest.MonkeyPatch.context() as patch,
        served(*(str(folder / run / "table.zarr") for run in (*RUNS, "reload"))),
    ):
        patch.setenv("PIPE_OWNER", "served")
        torchrun("parity", str(folder), *RUNS, "reload")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_two_ranks_served_by_one_service_train_the_table_ddp_trains(runs, run):
    assert_as_ddp_through_one_owner(torch.load(runs / run / "result.pt"))


@pytest.mark.slow
def test_a_snapshot_loaded_through_a_service_trains_the_straight_runs_table(runs):
    distributed.assert_reloaded_as_straight(runs)


@pytest.mark.slow
def test_a_job_that_dies_leaves_the_service_up_and_a_new_job_resumes_exactly(tmp_path, monkeypatch):
    """Both ranks die 2 steps after the checkpoint at step 4 (``resume first``): each service
    drops the job's steps since, stays up, and the second job (``resume second``) resumes
    through it to the straight run's table and Adagrad state, bit for bit."""
    monkeypatch.setenv("PIPE_OWNER", "served")
    with served(str(tmp_path / "straight.zarr"), str(tmp_path / "resumed.zarr")) as services:
        torchrun("resume", str(tmp_path), "first")
        assert all(s.poll() is None for s in services), "a service ended with its job"
        assert embedpipe.Table.open(tmp_path / "resumed.zarr").step == distributed_run.CHECKPOINT_AT
        torchrun("resume", str(tmp_path), "second")
    distributed.assert_resumed_exactly(tmp_path)


@pytest.mark.slow
def test_a_killed_rank_makes_the_other_raise_and_leaves_the_service_up(tmp_path):
    """Rank 1 killed after the checkpoint at step 2 (``lose kill``): the service drops the job
    and ends rank 0's connection, rank 0 raises within seconds, the table reads as at the
    checkpoint, and the service serves the next job."""
    path = tmp_path / "table.zarr"
    with served(str(path)) as (service,):
        procs = launch("lose", str(tmp_path), "kill", env={"PIPE_OWNER": "served"})
        try:
            outcome = distributed._outcome(tmp_path, 0, procs, limit=120)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        if outcome["error"] == "RuntimeError":  # DDP's own all-reduce saw it first (gloo's)
            assert "gloo" in outcome["message"] and outcome["close"] == "OwnerDiedError", outcome
        else:
            assert outcome["error"] in ("OwnerDiedError", "PeerLostError"), outcome
            assert "last checkpoint" in outcome["message"], outcome
        assert outcome["after"] < 12, outcome
        assert service.poll() is None, "the service ended with its job"
        assert embedpipe.Table.open(path).step == 2
        address = distributed_run.service_address(str(path), 0)
        with embedpipe.EmbeddingPipe(
            path, cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
        ) as pipe:
            assert pipe.table.step == 2  # the job's steps since the checkpoint dropped
            batch = next(iter(pipe.loader(zipf_dataset(8, seed=1), batch_size=4)))
            batch["inputs_embeds"].sum().backward()
            pipe.step()
    assert embedpipe.Table.open(path).step == 3


@pytest.fixture(scope="module")
def shard_services(tmp_path_factory):
    """Two services of one table, shard 0/2 and 1/2, serving two torchrun agents on this host
    (two machines) of 1 and of 2 ranks each; and the row-sharded pipe of 4 ranks
    (``owner="thread"``), which sums the gradient in the same order."""
    folder = tmp_path_factory.mktemp("shards")
    for per_machine, more in ((1, ["reload"]), (2, [])):
        runs = folder / f"{2 * per_machine}"
        with served(*(str(runs / run / "table.zarr") for run in (*RUNS, *more)), machines=2):
            machines("parity", str(runs), *RUNS, *more, per_machine=per_machine,
                     env={"PIPE_OWNER": "served"})  # fmt: skip
    torchrun("parity", str(folder / "thread-4"), *RUNS, ranks=4)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_two_shard_services_serve_two_machines_of_one_rank_as_ddp_trains(shard_services, run):
    result = torch.load(shard_services / "2" / run / "result.pt")
    distributed.assert_as_ddp(result)
    stats = result["stats"]
    assert stats["remote_rows"] > 0 and stats["served_rows"] > 0  # rows crossed machines
    assert torch.equal(result["flushed"], result["offloaded"])


@pytest.mark.slow
def test_a_snapshot_loaded_through_shard_services_trains_the_straight_runs_table(shard_services):
    distributed.assert_reloaded_as_straight(shard_services / "2")


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_two_shard_services_serve_two_machines_of_two_ranks_as_the_row_sharded_ranks_train(
    shard_services, run
):
    assert_as_row_sharded(shard_services, run)


@pytest.mark.slow
def test_a_job_over_two_shard_services_that_dies_resumes_exactly_through_them(tmp_path):
    """Both machines' ranks die 2 steps after the checkpoint at step 4: each shard's service
    takes its own shard's files back to the checkpoint (never another's, which the other
    service may still be writing), stays up, and the next job resumes through them to the
    straight run's table and Adagrad state, bit for bit."""
    tables = (str(tmp_path / "straight.zarr"), str(tmp_path / "resumed.zarr"))
    env = {"PIPE_OWNER": "served", "PIPE_CACHE_ROWS": "16"}  # each shard writes rows it evicts
    with served(*tables, machines=2) as services:
        machines("resume", str(tmp_path), "first", per_machine=1, env=env)
        assert all(s.poll() is None for s in services), "a service ended with its job"
        machines("resume", str(tmp_path), "second", per_machine=1, env=env)
    distributed.assert_resumed_exactly(tmp_path)


@pytest.mark.slow
def test_a_job_whose_last_commit_fails_leaves_the_service_serving_the_next_job(
    tmp_path, monkeypatch
):
    """The last rank's close commits for the job; a commit that fails (a full disk) is raised
    on every rank, and the service drops the job as one that died (its steps taken back, the
    table released), so the next job is served, from the last checkpoint. The service runs in
    this process here, its commits made to fail."""
    path = tmp_path / "sgd:0:0" / "table.zarr"
    path.parent.mkdir()
    embedpipe.hf.offload(tiny_model(), str(path), chunk_rows=64).close()
    address = distributed_run.service_address(str(path), 0)
    service = Service(str(path), address)
    thread = threading.Thread(target=service.serve, daemon=True)
    thread.start()
    commit = embedpipe.Table._commit

    def full(table, step):
        raise OSError(errno.ENOSPC, f"No space left on device (committing step {step})")

    try:
        monkeypatch.setattr(embedpipe.Table, "_commit", full)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--master_port", str(free_port()), SCRIPT, "parity", str(tmp_path), "sgd:0:0"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                              env={**os.environ, "PIPE_OWNER": "served"})  # fmt: skip
        assert done.returncode != 0 and "No space left on device" in done.stderr
        monkeypatch.setattr(embedpipe.Table, "_commit", commit)
        assert thread.is_alive()
        with embedpipe.EmbeddingPipe(
            path, cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
        ) as pipe:
            assert pipe.table.step == 0  # the failed job's steps dropped
            batch = next(iter(pipe.loader(zipf_dataset(8, seed=1), batch_size=4)))
            batch["inputs_embeds"].sum().backward()
            pipe.step()
        assert embedpipe.Table.open(path).step == 1
    finally:
        service.stopped.set()
        thread.join(30)
    assert not thread.is_alive()
