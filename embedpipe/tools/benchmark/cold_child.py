"""The loaders of the ``cold`` section, each in a child process of its own (``cold.py`` starts
them and reads what they print, one JSON line per answer).

A child warms its loader up first, over ``warmup`` passes of their own: enough that a cache
is full when the timed passes start (``cold.py`` counts them), as it is for most of a training
run. A child made with ``"serve": True`` (the cold passes) then prints its ready line and
answers the commands the section writes to its stdin, one JSON line each, until the section
closes it: ``{"device": n}`` measures the device's own random-row rate at queue depth 1 and 16
(``os.pread`` of one row at random offsets across the table's chunk files, one and 16 threads,
the files' pages dropped first); ``{"pass": n}`` drops the table's pages from the page cache and
times the loader over the batches of timed pass ``n`` (fresh ids every pass). The section's two
cold loaders (lazy, and a cache) so take turns pass by pass over the same batches, each still in
its own process and cgroup. Without ``"serve"`` (the memory runs) a child times ``repeats``
passes and prints one line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from .cgroup import drop_page_cache


def table_files(path: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, "weight", "c", "*", "0")))


def device_rate(files: list[str], row_bytes: int, reads: int, depth: int, seed: int) -> float:
    """Random one-row reads per second at queue depth ``depth`` (that many threads of
    ``os.pread``, which releases the GIL), the files' pages dropped first."""
    fds = [os.open(name, os.O_RDONLY) for name in files]
    try:
        rows_per_file = os.fstat(fds[0]).st_size // row_bytes
        rng = np.random.default_rng(seed)
        which = rng.integers(0, len(fds), reads).tolist()
        offsets = (rng.integers(0, rows_per_file, reads) * row_bytes).tolist()
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # one page per read, as embedpipe
        drop_page_cache(files)

        def read(part: range) -> None:
            for k in part:
                os.pread(fds[which[k]], row_bytes, offsets[k])

        threads = [
            threading.Thread(target=read, args=(range(t, reads, depth),)) for t in range(depth)
        ]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return reads / (time.perf_counter() - started)
    finally:
        for fd in fds:
            os.close(fd)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One loader (see the module docstring); returns what a child without ``"serve"`` prints."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Sampler

    from ...pipe.handle import EmbeddingPipe
    from ...store.table import Table
    from .traces import TraceDataset, zipf_trace

    torch.set_num_threads(1)
    table = Table.open(spec["path"])
    vocab, dim = table.num_rows, table.dim
    files = table_files(spec["path"])
    batches, repeats, warmup = spec["batches"], spec.get("repeats", 1), spec.get("warmup", 1)
    trace_args = argparse.Namespace(
        vocab=vocab,
        zipf=spec["zipf"],
        seed=spec["seed"],
        batch_size=spec["batch_size"],
        seq_len=spec["seq_len"],
    )
    trace = zipf_trace(trace_args, (warmup + repeats) * batches)
    per_pass = batches * spec["batch_size"]

    class Passes(Sampler):
        """The sequences of pass ``number``: fresh ids every pass (the first ``warmup`` warm
        the loader up and fill its cache)."""

        number = 0

        def __len__(self) -> int:
            return per_pass

        def __iter__(self):
            return iter(range(self.number * per_pass, (self.number + 1) * per_pass))

    passes = Passes()
    kw = {
        "batch_size": spec["batch_size"],
        "sampler": passes,
        "num_workers": spec["workers"],
        "persistent_workers": spec["workers"] > 0,
    }
    dataset = TraceDataset(trace.ids)
    out: dict[str, Any] = {"qd1": [], "qd16": [], "rates": [], "seconds": []}
    if spec["kind"] == "in_ram":
        weight = table.to_tensor()
        table.close()
        embedding = nn.Embedding.from_pretrained(weight, freeze=True)
        out["loop_started"] = time.time()
        for batch in DataLoader(dataset, **kw):
            embedding(batch["input_ids"])
        return out
    table.close()
    out["loop_started"] = time.time()
    owner = spec.get("owner", "thread")  # a thread: the cache's bytes are counted from its objects
    with EmbeddingPipe(spec["path"], cache_rows=spec["cache_rows"], owner=owner) as pipe:
        loader = pipe.loader(dataset, **kw)
        for number in range(warmup):  # the workers started, the cache filled
            passes.number = number
            for batch in loader:
                batch["inputs_embeds"]
        out["cached_rows"] = pipe.stats()["cached_rows"]
        out["ring_bytes"] = loader.ring.nbytes if loader.ring is not None else 0
        if owner == "thread":
            out["pipe_bytes"] = out["ring_bytes"] + cache_bytes(pipe._owner)

        def device(number: int) -> dict[str, float]:
            reads = spec["device_reads"]
            return {key: device_rate(files, dim * 4, reads, depth, number)
                    for depth, key in ((1, "qd1"), (16, "qd16"))}  # fmt: skip

        def timed(number: int) -> dict[str, float]:
            passes.number = warmup - 1 + number
            drop_page_cache(files)
            before = pipe.stats()["rows_read"]
            started = time.perf_counter()
            for batch in loader:
                batch["inputs_embeds"]
            seconds = time.perf_counter() - started
            return {"seconds": seconds, "rate": (pipe.stats()["rows_read"] - before) / seconds}

        if spec.get("serve"):
            answer(out)
            for line in sys.stdin:
                command = json.loads(line)
                answer(device(command["device"]) if "device" in command else timed(command["pass"]))
        else:
            for number in range(1, repeats + 1):
                if spec.get("device_reads"):
                    for key, rate in device(number).items():
                        out[key].append(rate)
                got = timed(number)
                out["seconds"].append(got["seconds"])
                out["rates"].append(got["rate"])
        loader = None  # its workers end before the pipe closes
    return out


def answer(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


def cache_bytes(owner: Any) -> int:
    """The cache's shared block (rows, slot ids, versions, the per-row ``slot_of``) and the
    owner's per-slot and per-row arrays (``last_updated``, the policy's counts)."""
    total = len(owner.shared.block.mmap)
    for part in (owner.cache, owner.cache.policy):
        for value in vars(part).values():
            if isinstance(value, np.ndarray):
                total += value.nbytes
    return total
