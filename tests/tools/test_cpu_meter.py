"""The benchmark's CPU meter counts the training process and every process under it: children
alive at both ends, children born and reaped within a sample, and a grandchild its parent
reaped."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from embedpipe.tools.benchmark.cpu import CpuMeter

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def burn(seconds: float) -> list[str]:
    return [sys.executable, "-c", BURN.format(s=seconds)]


def burn_in_grandchild(seconds: float, done: str) -> list[str]:
    """A child that runs a CPU-burning child of its own to its end, writes ``done`` and sleeps:
    alive when the meter stops, its child reaped by it, not by the meter's process."""
    code = (
        "import pathlib, subprocess, time\n"
        f"subprocess.run({burn(seconds)!r}, check=True)\n"
        f"pathlib.Path({done!r}).touch()\n"
        "time.sleep(60)\n"
    )
    return [sys.executable, "-c", code]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_meter_counts_children_reaped_living_and_grandchildren(tmp_path):
    done = tmp_path / "done"
    meter = CpuMeter()
    meter.start()
    subprocess.run(burn(0.4), check=True)  # born and reaped within the sample
    living = subprocess.Popen(burn_in_grandchild(0.4, str(done)))
    try:
        t = time.process_time()
        while time.process_time() - t < 0.2:  # the training process's own
            pass
        deadline = time.monotonic() + 30
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        meter.stop()
    finally:
        living.kill()
        living.wait()
    assert done.exists()
    assert 0.15 <= meter.own <= 0.6
    assert 0.9 <= meter.tree <= 1.6  # 0.4 + 0.4 + 0.2, and three interpreters' starts
