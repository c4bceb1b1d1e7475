"""A table service (``embedpipe serve TABLE``) that outlives its jobs: a pipe made with
``owner="unix:PATH"`` trains the table nn.Embedding trains; a job that dies leaves the service
up and the table at its last checkpoint, from which a new job resumes to the uninterrupted run's
result; a dead service is raised; other tables and second jobs are refused; a reader in another
process reads the last checkpoint while a job trains."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import embedpipe
from embedpipe.errors import OwnerDiedError, ServiceNotFoundError, TableLockedError
from embedpipe.pipe import EmbeddingPipe
from embedpipe.service.address import socket_path
from embedpipe.service.channel import Channel, ChannelClosed

from .. import crash_run
from ..helpers import initial_table, run_cli, slow, train_offloaded, train_reference, zipf_dataset
from ..store.test_crash import _run

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def serving(path, address=None, *more):
    """``embedpipe serve path [more]`` in a process of its own, at ``address`` or a short socket
    path; yields its address and process; stops it with SIGTERM (it must exit 0)."""
    folder = tempfile.mkdtemp(prefix="ep-")
    address = address or f"unix:{folder}/s.sock"
    command = [sys.executable, "-m", "embedpipe.tools.cli", "serve", str(path), "--address"]
    process = subprocess.Popen(
        [*command, address, *more],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving") and address in line, (line, process.stderr.read())
        yield address, process
        if process.poll() is None:
            process.terminate()
            assert process.wait(timeout=30) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
        process.stderr.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def data():
    return zipf_dataset(64)


@pytest.mark.parametrize(("optimizer", "workers"), [("adagrad", 2), slow("sgd", 0)])
def test_a_service_trains_the_table_nn_embedding_trains_and_outlives_the_job(
    tmp_path, data, optimizer, workers
):
    ref, _, ref_state = train_reference(data, optimizer, 0.5)
    path = tmp_path / "t.zarr"
    initial_table(path)
    with serving(path) as (address, service):
        got, _, stats, table = train_offloaded(
            data, optimizer, 0.5, path, num_workers=workers, cache_rows=50, owner=address,
            make_table=False,
        )  # fmt: skip
        assert torch.equal(got, ref), (got - ref).abs().max()
        if optimizer == "adagrad":
            assert torch.equal(
                torch.from_numpy(table.read(np.arange(1000), "sum")), ref_state["sum"]
            )
        assert stats["steps"] == 8 and table.step == 8
        assert service.poll() is None  # still serving: a second job goes on from step 8
        with EmbeddingPipe(
            path, cache_rows=50, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
        ) as pipe:
            assert pipe.table.step == 8
            batch = next(iter(pipe.loader(data, batch_size=8)))
            batch["inputs_embeds"].sum().backward()
            pipe.step()
    assert embedpipe.Table.open(path).step == 9
    with embedpipe.Table.open(path, "r+"):  # the service released the lock when it stopped
        pass


def test_a_service_refuses_other_tables_second_jobs_and_writers(tmp_path, data):
    path, other = tmp_path / "t.zarr", tmp_path / "other.zarr"
    for p in (path, other):
        embedpipe.Table.create(p, 1000, 8).close()
    with serving(path) as (address, service):
        with pytest.raises(ValueError, match=rf"serves table {path}, not {other}"):
            EmbeddingPipe(
                other, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
            )
        with pytest.raises(TableLockedError, match=f"pid {service.pid}"):
            embedpipe.Table.open(path, "r+")
        with EmbeddingPipe(
            path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
        ) as pipe:
            second = subprocess.run(
                [sys.executable, "-c",
                 "import embedpipe, sys; embedpipe.EmbeddingPipe(sys.argv[1], cache_rows=10, "
                 "optimizer=embedpipe.optim.SGD(lr=0.1), owner=sys.argv[2])", str(path), address],
                capture_output=True, text=True, timeout=120, cwd=ROOT,
            )  # fmt: skip
            assert second.returncode != 0
            assert f"is serving another job (pid {os.getpid()})" in second.stderr, second.stderr
            stale = embedpipe.Table.open(path)  # at step 0
            batch = next(iter(pipe.loader(data, batch_size=8)))  # the first job is unharmed
            batch["inputs_embeds"].sum().backward()
            pipe.step()
    with pytest.raises(ValueError, match="at step 0, but its service holds it at step 1"):
        with serving(path) as (address, _):
            EmbeddingPipe(
                stale, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
            )
    assert embedpipe.Table.open(path).step == 1
    with pytest.raises(ServiceNotFoundError, match="embedpipe serve"):
        EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address)


@pytest.mark.parametrize("how", ["kill", slow("terminate")])
def test_a_dead_service_is_raised_within_seconds_naming_the_checkpoint(tmp_path, data, how):
    """SIGKILL, or SIGTERM (the service drops the job, as if it died, and exits 0): the job
    raises within seconds, and the table reopens at its last checkpoint."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8).close()
    with serving(path) as (address, service):
        pipe = EmbeddingPipe(
            path, cache_rows=30, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
        )
        began = None
        with pytest.raises(OwnerDiedError, match=rf"service at {address}.*step 2"):
            for n, batch in enumerate(pipe.loader(data, batch_size=8, num_workers=2)):
                batch["inputs_embeds"].sum().backward()
                pipe.step()
                if n == 1:
                    pipe.checkpoint()
                    at_2 = embedpipe.Table.open(path).read(np.arange(1000))
                if n == 4:
                    pipe.flush()  # steps 3-5 in the live arrays, not committed
                    getattr(service, how)()
                    began = time.monotonic()
        assert time.monotonic() - began < 10
        assert service.wait(timeout=10) == (0 if how == "terminate" else -signal.SIGKILL)
        assert pipe.table.step == 2 and np.array_equal(pipe.table.read(np.arange(1000)), at_2)
    reopened = embedpipe.Table.open(path, "r+")
    assert reopened.step == 2 and np.array_equal(reopened.read(np.arange(1000)), at_2)


@pytest.mark.slow
def test_a_killed_job_leaves_the_service_up_and_a_new_job_resumes_exactly(tmp_path):
    """kill -9 of a job between checkpoints (every 3 steps): the service stays up, the table
    reads as nn.Embedding + Adagrad at the last checkpoint (weights and state), and a new job
    through the same service resumes to the uninterrupted run's table and dense weights."""
    weight = torch.from_numpy(
        embedpipe.store.layout.normal_rows(0, 0, crash_run.V, crash_run.D, 1.0)
    )
    states = crash_run.reference(weight)
    path = tmp_path / "t.zarr"
    embedpipe.Table.from_tensor(path, weight, chunk_rows=64).close()
    torch.save(crash_run.initial_dense(), tmp_path / "dense-0.pt")
    ids = np.arange(crash_run.V)
    with serving(path) as (address, service):
        code, lines = _run(path, "--owner", address, kill_after_step=7)
        assert code == -signal.SIGKILL, lines[-3:]
        time.sleep(1)
        assert service.poll() is None, "the service ended with its job"
        reader = embedpipe.Table.open(path)
        assert reader.step == 6
        assert torch.equal(reader.to_tensor(), states[6][0])
        assert torch.equal(torch.from_numpy(reader.read(ids, "sum")), states[6][1])
        code, lines = _run(path, "--owner", address, "--resume")
        assert code == 0 and lines[-1] == f"done {crash_run.STEPS}", lines[-3:]
    final = embedpipe.Table.open(path)
    assert final.step == crash_run.STEPS
    assert torch.equal(final.to_tensor(), states[-1][0])
    assert torch.equal(torch.from_numpy(final.read(ids, "sum")), states[-1][1])
    dense = torch.load(tmp_path / f"dense-{crash_run.STEPS}.pt")
    assert torch.equal(dense, states[-1][2]), "dense weights differ after resume"


def test_a_reader_in_another_process_reads_the_last_checkpoint_while_a_job_trains(tmp_path, data):
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8).close()
    read = "import embedpipe, sys; t = embedpipe.Table.open(sys.argv[1]); print(t.step, t.to_tensor().sum().item())"
    with serving(path) as (address, _):
        with EmbeddingPipe(
            path, cache_rows=30, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
        ) as pipe:
            for n, batch in enumerate(pipe.loader(data, batch_size=8)):
                batch["inputs_embeds"].sum().backward()
                pipe.step()
                if n == 2:
                    pipe.checkpoint()
                    expected = embedpipe.Table.open(path).to_tensor().sum().item()
                if n == 5:
                    pipe.flush()  # steps 4-6 written to the live arrays: not for readers
                    got = subprocess.run(
                        [sys.executable, "-c", read, str(path)],
                        capture_output=True, text=True, timeout=120, check=True,
                    ).stdout.split()  # fmt: skip
                    assert got == ["3", repr(expected)]


def test_a_shard_service_serves_only_its_machine_and_holds_the_lock_for_shard_0(tmp_path, data):
    """``--shard i/S``: rows split at chunk boundaries; a job of one machine (the whole table)
    is refused by either shard's service, naming both; the first shard's holds the writer
    lock, the others' do not (the first's holds it for the job)."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8, chunk_rows=100).close()
    with serving(path, None, "--shard", "1/2") as (address, service):
        with pytest.raises(ValueError, match=r"rows 500 to 1,000 \(shard 1/2\), and this job's "
                           r"machine trains the whole table: a job of one machine needs"):  # fmt: skip
            EmbeddingPipe(path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address)
        embedpipe.Table.open(path, "r+").close()  # shard 1's service holds no lock
        with serving(path, None, "--shard", "0/2") as (first, _):
            with pytest.raises(TableLockedError):
                embedpipe.Table.open(path, "r+")
            with pytest.raises(ValueError, match=r"rows 0 to 500 \(shard 0/2\)"):
                EmbeddingPipe(
                    path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1), owner=first
                )
            with EmbeddingPipe(path, cache_rows=10, owner=first) as pipe:  # frozen: a reader
                assert next(iter(pipe.loader(data, batch_size=8)))["inputs_embeds"].shape[0] == 8
                assert pipe._owner.process is not None  # of its own: no service needed
        assert service.poll() is None
    assert embedpipe.Table.open(path).step == 0


def test_a_stray_rank_or_an_unreadable_request_never_holds_nor_stops_the_service(tmp_path, data):
    """A first request that joins a job the service does not serve (a late rank of a job that
    failed) has its connection ended; a request the service cannot read (another version's
    pickles) drops its job with one line on stderr: either way the next job is served."""
    path = tmp_path / "t.zarr"
    embedpipe.Table.create(path, 1000, 8).close()
    with serving(path) as (address, service):
        stray = Channel.connect(socket_path(address))
        stray.send({"op": "join", "rank": 1, "job": "a failed job's"})
        with pytest.raises(ChannelClosed):
            stray.receive()
        unreadable = Channel.connect(socket_path(address))
        header = b"cno_such_module_of_embedpipe\nRequest\n."  # a class it cannot import
        unreadable.sock.sendall(struct.pack("!QQ", len(header), 0) + header)
        with pytest.raises(ChannelClosed):
            unreadable.receive()
        with EmbeddingPipe(
            path, cache_rows=10, optimizer=embedpipe.optim.SGD(lr=0.1), owner=address
        ) as pipe:
            batch = next(iter(pipe.loader(data, batch_size=8)))
            batch["inputs_embeds"].sum().backward()
            pipe.step()
        assert service.poll() is None
        service.terminate()
        assert service.wait(timeout=30) == 0
        said = service.stderr.read()  # dropped as a job, or refused if the stray's was not yet
        assert "Exception in thread" not in said  # (a stop may print one swallowed in a finalizer)
        assert "dropped the job" in said or "refused a" in said
    assert embedpipe.Table.open(path).step == 1


def test_serve_reports_bad_input_in_one_line(tmp_path):
    result = run_cli("serve", tmp_path / "missing.zarr")
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    embedpipe.Table.create(tmp_path / "t.zarr", 10, 4).close()
    result = run_cli("serve", tmp_path / "t.zarr", "--address", "tcp://host:1")
    assert result.returncode == 1 and "unix:PATH" in result.stderr, result.stderr
    (tmp_path / "notes.txt").write_text("mine")
    result = run_cli("serve", tmp_path / "t.zarr", "--address", f"unix:{tmp_path}/notes.txt")
    assert result.returncode == 1 and "is not a socket" in result.stderr, result.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"  # never deleted
    with serving(tmp_path / "t.zarr") as (address, _):
        result = run_cli("serve", tmp_path / "t.zarr", "--address", address)
        assert result.returncode == 1 and "already open for writing" in result.stderr
        embedpipe.Table.create(tmp_path / "u.zarr", 10, 4).close()
        result = run_cli("serve", tmp_path / "u.zarr", "--address", address)
        assert result.returncode == 1 and "in use by a running service" in result.stderr
    embedpipe.Table.open(tmp_path / "u.zarr", "r+").close()  # the refused service let it go
    for bad in ("2/2", "1", "a/b", "1/0"):
        result = run_cli("serve", tmp_path / "u.zarr", "--shard", bad)
        assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
        assert "--shard" in result.stderr, result.stderr
