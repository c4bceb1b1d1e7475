"""Owner processes on several machines, each the owner of its machine's shard of the table
(``owner="process"`` under a process group spanning machines: NOTE [ A shard a machine ] in
``service/rank.py``). The machines are torchrun agents on this host (``--nnodes 2``, loopback
rendezvous): each agent's ranks share one owner process, as the ranks of one machine do.

The runs of ``distributed_run.py``, against DDP + a replicated ``nn.Embedding`` and the
matching torch optimizer: bit for bit at 2 ranks (DDP's sum is ``g0 / 2 + g1 / 2``); at 4 ranks
DDP's gloo all-reduce sums in its ring's order and the pipe in rank order, so the pipe is held
to the row-sharded pipe of the same 4 ranks (``owner="thread"``, the same sum), bit for bit,
and to DDP to float rounding."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import embedpipe

from ..helpers import tiny_model
from ..ranks import test_distributed as distributed
from ..ranks.test_distributed import RUN_TIMEOUT, SCRIPT, free_port, torchrun

pytest.importorskip("transformers", reason="the runs train a tiny transformers BERT")

RUNS = ["sgd:0:0", "adagrad:2:1.0"]  # SGD without workers; Adagrad, 2 workers a rank, clipping


def machines(*args: str, per_machine: int, env: dict[str, str]) -> None:
    """Two torchrun agents on this host, ``per_machine`` ranks each, as two machines."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    command += ["--nproc_per_node", str(per_machine), "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(free_port())]
    agents = [
        subprocess.Popen(
            [*command, "--node_rank", str(node), SCRIPT, *args],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its ranks and their owner processes: one group to kill
        )
        for node in range(2)
    ]
    try:
        for agent in agents:
            _, err = agent.communicate(timeout=RUN_TIMEOUT)
            assert agent.returncode == 0, err[-4000:]
    finally:
        for agent in agents:  # a launch that failed or hangs: nothing of it outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("machines")
    for per_machine, more in ((1, ["reload"]), (2, [])):
        machines("parity", str(folder / f"{2 * per_machine}"), *RUNS, *more,
                 per_machine=per_machine, env={"PIPE_OWNER": "process"})  # fmt: skip
    torchrun("parity", str(folder / "thread-4"), *RUNS, ranks=4)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_two_machines_of_one_rank_train_the_table_ddp_trains(two_machines, run):
    result = torch.load(two_machines / "2" / run / "result.pt")
    distributed.assert_as_ddp(result)
    stats = result["stats"]
    assert stats["remote_rows"] > 0 and stats["served_rows"] > 0  # rows crossed machines
    assert stats["rows_sent_bytes"] > 0 and stats["gradient_sent_bytes"] > 0
    assert "call pipe.flush() on every rank first" in result["unflushed"]
    assert torch.equal(result["flushed"], result["offloaded"])
    initial = tiny_model().bert.embeddings.word_embeddings.weight.detach()
    assert int((result["offloaded"] != initial).any(dim=1).sum()) > 50  # it trained rows


@pytest.mark.slow
def test_a_snapshot_loaded_mid_run_on_two_machines_trains_the_straight_runs_table(two_machines):
    """A snapshot saved at step 2 (twice, as Trainer saves a step again), 2 more steps, then
    ``load_checkpoint`` on every rank and steps 3 to 8 again: the straight run's table."""
    distributed.assert_reloaded_as_straight(two_machines / "2")


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_two_machines_of_two_ranks_train_the_table_the_row_sharded_ranks_train(two_machines, run):
    assert_as_row_sharded(two_machines, run)


def assert_as_row_sharded(folder, run: str) -> None:
    """The run of 2 machines x 2 ranks in ``folder / "4"``: the row-sharded pipe's of 4 ranks
    (``folder / "thread-4"``) bit for bit, DDP's to float rounding; rows crossed machines."""
    result = torch.load(folder / "4" / run / "result.pt")
    sharded = torch.load(folder / "thread-4" / run / "result.pt")
    assert result["step"] == 8
    assert torch.equal(result["offloaded"], sharded["offloaded"])
    for name, value in sharded["offloaded_dense"].items():
        assert torch.equal(value, result["offloaded_dense"][name]), name
    tolerance = 1e-6 if run.startswith("sgd") else 1e-4  # Adagrad amplifies DDP's rounding
    torch.testing.assert_close(result["offloaded"], result["reference"], rtol=0, atol=tolerance)
    stats = result["stats"]
    assert stats["remote_rows"] > 0 and stats["served_rows"] > 0
    assert stats["batches"] == 16  # both ranks of the machine, through its one owner


@pytest.mark.slow
def test_a_killed_owner_of_one_machine_makes_every_rank_raise_within_seconds(tmp_path):
    """The second machine's owner process killed at step 3 (a checkpoint at step 2): its
    rank raises OwnerDiedError naming the checkpoint, the first machine's rank PeerLostError
    (or DDP's all-reduce raises first), both within 10 s; the table reopens at the checkpoint, its lock free."""
    machines("owner_dies", str(tmp_path), per_machine=1, env={"PIPE_OWNER": "process"})
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    died, lost = outcomes[1], outcomes[0]
    assert died["error"] == "OwnerDiedError", died
    assert "rows 512 to 1,000" in died["message"] and "step 2" in died["message"], died
    # the pipe's exchange raises, or DDP's own all-reduce raises gloo's error first and the
    # pipe's close() raises then
    assert lost["error"] == "PeerLostError" or lost.get("close") == "PeerLostError", lost
    assert died["after"] < 10 and lost["after"] < 10, outcomes
    table = embedpipe.Table.open(tmp_path / "table.zarr")
    assert table.step == 2
    table.close()
    embedpipe.Table.open(tmp_path / "table.zarr", "r+").close()  # and the lock is free


@pytest.mark.slow
def test_a_job_of_two_machines_killed_after_a_checkpoint_resumes_bit_exact(tmp_path):
    """Every rank dies 2 steps after a checkpoint (nothing closed): the table reopens at the
    checkpoint, and a new job of the two machines trains on to the straight run's table and
    Adagrad state, bit for bit."""
    env = {"PIPE_OWNER": "process"}
    machines("resume", str(tmp_path), "first", per_machine=1, env=env)
    crashed = embedpipe.Table.open(tmp_path / "resumed.zarr")
    assert crashed.step == 4  # the checkpoint, not the two steps after it
    crashed.close()
    machines("resume", str(tmp_path), "second", per_machine=1, env=env)
    distributed.assert_resumed_exactly(tmp_path)


@pytest.fixture(scope="module")
def framework_runs(tmp_path_factory):
    pytest.importorskip("lightning", reason="the framework runs include Lightning's DDP")
    pytest.importorskip("accelerate", reason="the framework runs include an Accelerate loop")
    folder = tmp_path_factory.mktemp("frameworks")
    machines("frameworks", str(folder), per_machine=1, env={"PIPE_OWNER": "process"})
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["1", "2"])
def test_hf_trainer_on_two_machines(framework_runs, accumulation):
    """Bit for bit without accumulation, to rounding with it; resume, evaluate, save_model."""
    distributed.test_hf_trainer_under_torchrun_trains_the_table_trainer_trains_with_nn_embedding(
        framework_runs, accumulation
    )


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_lightning_and_accelerate_on_two_machines(framework_runs, framework):
    distributed.test_lightning_and_accelerate_ddp_train_the_table_they_train_with_nn_embedding(
        framework_runs, framework
    )


@pytest.mark.slow
def test_ranks_that_make_different_pipes_raise_before_an_owner_process_starts(tmp_path):
    """Rank 1's pipe with another learning rate, or another padding row: every rank raises
    (each machine's owner would otherwise train its shard its own way), and the table is free."""
    said = distributed.make_pipes(tmp_path, owner="process")
    assert said[None] == ["no error", "no error"]
    for differ in ("lr", "padding_idx"):
        distributed.assert_refused(tmp_path, said, differ)


@pytest.mark.slow
def test_a_batch_held_across_a_load_and_a_step_reads_every_machines_rows(tmp_path):
    machines("held", str(tmp_path), per_machine=1, env={"PIPE_OWNER": "process"})
    for rank in (0, 1):
        assert json.loads((tmp_path / f"held-rank{rank}.json").read_text())["error"] == 0.0


@pytest.mark.slow
def test_a_rank_that_fails_to_serve_its_rows_makes_every_rank_raise_at_once(tmp_path):
    """Two machines of two ranks; the last rank's owner fails to serve its rows (found by
    review: the other rank of its machine waited in a collective for it while it waited in its
    owner's close for that rank, until the 60 s timeout)."""
    machines("serve_fails", str(tmp_path), per_machine=2, env={"PIPE_OWNER": "process"})
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert outcomes[3]["error"] == "OSError", outcomes
    for outcome in outcomes[:3]:
        assert outcome["error"] in ("PeerLostError", "OwnerDiedError"), outcomes
    assert max(o["after"] for o in outcomes) < 10, outcomes
