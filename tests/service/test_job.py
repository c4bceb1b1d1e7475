"""One owner process shared by the 2 ranks of a ``torchrun`` job on one machine
(``EmbeddingPipe(..., owner="process")`` under a process group): the runs of
``distributed_run.py`` with ``PIPE_OWNER=process``, against DDP + a replicated ``nn.Embedding``
and the matching torch optimizer, bit for bit (with 2 ranks DDP's sum is ``g0 / 2 + g1 / 2``,
as the ranks' average here); and the framework runs of the scale-out tests (HF Trainer,
Lightning, an Accelerate loop), held to the same checks as with the owner in threads."""

from __future__ import annotations

import pytest
import torch

import embedpipe

from ..ranks import test_distributed as distributed
from ..ranks.test_distributed import torchrun

pytest.importorskip("transformers", reason="the runs train a tiny transformers BERT")

RUNS = ["sgd:0:0", "adagrad:2:1.0"]  # SGD without workers; Adagrad, 2 workers a rank, clipping


@pytest.fixture(scope="module")
def runs(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setenv("PIPE_OWNER", "process")
    folder = tmp_path_factory.mktemp("shared")
    torchrun("parity", str(folder), *RUNS, "reload")
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def assert_as_ddp_through_one_owner(result: dict) -> None:
    """A parity run of 2 ranks through one owner: DDP's table, bit for bit, and no rows nor
    gradients sent between the ranks."""
    distributed.assert_as_ddp(result)
    stats = result["stats"]
    assert stats["batches"] == 16  # both ranks' batches, through the one owner
    assert stats["remote_rows"] == 0 and stats["served_rows"] == 0  # no rows between ranks
    moved = ("rows_sent_bytes", "rows_received_bytes", "gradient_sent_bytes")
    assert [stats[k] for k in moved] == [0, 0, 0]  # the gradient through shared memory
    assert result["unflushed"] == "no error"  # one owner: a read flushes it, on any rank
    assert torch.equal(result["flushed"], result["offloaded"])


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_two_ranks_sharing_one_owner_process_train_the_table_ddp_trains(runs, run):
    assert_as_ddp_through_one_owner(torch.load(runs / run / "result.pt"))


@pytest.mark.slow
def test_a_snapshot_loaded_mid_run_on_every_rank_trains_the_straight_runs_table(runs):
    distributed.assert_reloaded_as_straight(runs)


@pytest.fixture(scope="module")
def framework_runs(tmp_path_factory, monkeypatch_module):
    pytest.importorskip("lightning", reason="the framework runs include Lightning's DDP")
    pytest.importorskip("accelerate", reason="the framework runs include an Accelerate loop")
    monkeypatch_module.setenv("PIPE_OWNER", "process")
    folder = tmp_path_factory.mktemp("frameworks")
    torchrun("frameworks", str(folder))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["1", "2"])
def test_hf_trainer_with_one_owner_process_for_its_ranks(framework_runs, accumulation):
    """Bit for bit, with accumulation and without; resume, evaluate, save_model
    (a snapshot asked by rank 1 before rank 0 made its folder waits for rank 0's request)."""
    distributed.test_hf_trainer_under_torchrun_trains_the_table_trainer_trains_with_nn_embedding(
        framework_runs, accumulation
    )


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_lightning_and_accelerate_with_one_owner_process_for_their_ranks(framework_runs, framework):
    """The Accelerate loop's second pipe hung at its first batch before NOTE [ A fork never
    frees a process group ]."""
    distributed.test_lightning_and_accelerate_ddp_train_the_table_they_train_with_nn_embedding(
        framework_runs, framework
    )


@pytest.mark.slow
def test_a_killed_rank_makes_the_other_raise_within_seconds_at_the_last_checkpoint(tmp_path):
    """Rank 1 killed after the checkpoint at step 2 (``distributed_run.py``'s ``lose``): the
    owner process they share ends without a commit, rank 0 raises within seconds (embedpipe's
    error names the last checkpoint; when DDP's all-reduce sees the loss first, gloo's error,
    and the pipe's close raises ``OwnerDiedError``), and the table reopens at the checkpoint,
    its lock free."""
    procs = distributed.launch("lose", str(tmp_path), "kill", env={"PIPE_OWNER": "process"})
    try:
        outcome = distributed._outcome(tmp_path, 0, procs, limit=120)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if outcome["error"] == "RuntimeError":  # DDP's own all-reduce saw it first (gloo's error)
        assert "gloo" in outcome["message"] and outcome["close"] == "OwnerDiedError", outcome
    else:  # the owner's connection, or the gradient's exchange
        assert outcome["error"] in ("OwnerDiedError", "PeerLostError"), outcome
        assert "last checkpoint" in outcome["message"], outcome
    assert outcome["after"] < 12, outcome  # seen by its connections (2 s of it rank 1 slept)
    table = embedpipe.Table.open(tmp_path / "table.zarr")
    assert table.step == 2  # the last checkpoint; nothing after it
    table.close()
    embedpipe.Table.open(tmp_path / "table.zarr", "r+").close()  # and the lock is free
