"""The writer lock: held by one process, named when refused, and gone with its process even when
that process's forked children (DataLoader workers) live on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import embedpipe
from embedpipe import errors


@pytest.fixture
def path(tmp_path):
    embedpipe.Table.from_tensor(tmp_path / "t.zarr", np.zeros((10, 4), np.float32)).close()
    return tmp_path / "t.zarr"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_writer_releases_the_lock_though_its_forked_child_lives(path):
    script = textwrap.dedent(
        f"""
        import os, sys, time, embedpipe
        table = embedpipe.Table.open({str(path)!r}, "r+")
        child = os.fork()
        if child == 0:  # a worker started with fork: lives on after its parent is killed
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
        time.sleep(60)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(process.stdout.readline())
    try:
        with pytest.raises(errors.TableLockedError, match=rf"pid {process.pid}"):
            embedpipe.Table.open(path, "r+")  # held, and the holder is named
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        os.kill(child, 0)  # the child still lives...
        embedpipe.Table.open(path, "r+").close()  # ...and the lock went with its parent
    finally:
        for pid in (child, process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.stdout.close()


def test_the_lock_leaves_nothing_in_the_folder_for_zarr_to_trip_on(path):
    with embedpipe.Table.open(path, "r+"):
        assert sorted(os.listdir(path)) == ["checkpoints", "weight", "zarr.json"]
