"""Checkpoints of a table folder: commit, list, recover, restore and copy, with plain file calls.

A table folder holds the *live* arrays, which the owner writes in place while it trains, and the
committed checkpoints, each a complete zarr group of hard links to the chunk files as they were::

    table.zarr/
      zarr.json                   the group; attributes["embedpipe"] = the live metadata
      weight/, state/             live arrays: chunk files c/<i>/0, written in place
      checkpoints/                a zarr group
        000007-step-1200/         checkpoint 7, at training step 1200: zarr.json, weight/, state/,
                                  every file a hard link to the live file as it was at the commit

NOTE [ Checkpoint commit ]
A chunk file shared with a checkpoint (link count > 1) is never written in place: the first
write after a commit copies it and renames the copy over the live name (copy-on-write,
``rowstore.RawRows``), so a committed checkpoint never changes. A commit is::

    fsync every live file that is not in the previous checkpoint     (new since then: the data)
    checkpoints/.tmp-<seq>/  <- zarr.json, then a hard link per live file, fsync every folder
    rename .tmp-<seq> -> <seq>-step-<step>; fsync checkpoints/        (the commit point)
    rewrite the live zarr.json; prune beyond keep (rename to .trash-<seq> first, then delete)

so a crash anywhere leaves the previous checkpoints whole and the new one either complete or
absent. A reader pins the checkpoint it opened with a shared ``flock`` on its folder
(:class:`Pin`); pruning takes an exclusive one without waiting and skips a checkpoint that is
pinned (it goes at a later commit), so ``keep`` can be exceeded while readers are open. Opening the table to write (:func:`recover`) deletes ``.tmp-*`` and ``.trash-*`` debris
and makes every live file a link to the latest checkpoint's file again, so rows written in place
after that commit are gone. Readers open a checkpoint folder, never the live arrays.

Every name here is a valid zarr node and every folder has its ``zarr.json`` before anything else
is put in it, so zarr-python lists the group's members without warnings.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .mapped import changing_files

CHECKPOINTS = "checkpoints"
METADATA = "zarr.json"
#: The folders of a table that hold its arrays (and are what a checkpoint links).
CONTENT = ("weight", "state")
#: Files being written that are not part of the table yet: our copy-on-write and restore
#: temporaries, and zarr-python's atomic-write temporaries.
_DEBRIS = re.compile(r"(\.tmp|\.partial)$")
#: A row chunk's file of an array (zarr's default chunk keys: ``c/CHUNK/0``, ``c/CHUNK``), or
#: a temporary of one
_CHUNK = re.compile(r"(?:^|/)c/(\d+)(?:/0)?(?:\.[^/]*)?$")
_NAME = re.compile(r"^(\d{6,})-step-(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its sequence number (commit order), training step and folder."""

    seq: int
    step: int
    path: str
    time: str = ""


# ----------------------------------------------------------------------------- metadata files
def group_metadata(attributes: dict[str, Any]) -> bytes:
    """The zarr.json of a zarr v3 group with these attributes."""
    doc = {"attributes": attributes, "zarr_format": 3, "node_type": "group"}
    return json.dumps(doc, indent=2).encode()


def read_attributes(folder: str) -> dict[str, Any]:
    """The attributes in ``folder``'s zarr.json."""
    with open(os.path.join(folder, METADATA), "rb") as f:
        return dict(json.loads(f.read()).get("attributes") or {})


def write_file(path: str, data: bytes) -> None:
    """Write ``path`` atomically and durably: temporary file, fsync, rename, fsync the folder."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            write_all(f.fileno(), data)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def write_all(fd: int, data: Any, offset: int | None = None) -> None:
    """Write every byte of ``data`` (at ``offset``, or at the file position): short writes are
    continued, a write that makes no progress raises ``OSError(ENOSPC)``."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = (
            os.write(fd, view[done:])
            if offset is None
            else os.pwrite(fd, view[done:], offset + done)
        )
        if n <= 0:
            raise OSError(errno.ENOSPC, "no bytes written (disk full?)")
        done += n


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- listing
def checkpoints(root: str) -> list[Checkpoint]:
    """The committed checkpoints of the table at ``root``, oldest commit first."""
    folder = os.path.join(root, CHECKPOINTS)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _NAME.match(name)
        if match:
            path = os.path.join(folder, name)
            try:
                stamp = read_attributes(path).get("embedpipe", {}).get("checkpoint", {})
            except (OSError, ValueError):
                stamp = {}
            found.append(Checkpoint(int(match[1]), int(match[2]), path, str(stamp.get("time", ""))))
    return sorted(found, key=lambda c: c.seq)


def latest(root: str) -> Checkpoint | None:
    found = checkpoints(root)
    return found[-1] if found else None


def _next_seq(root: str) -> int:
    folder = os.path.join(root, CHECKPOINTS)
    numbers = [int(m[0]) for n in os.listdir(folder) if (m := re.search(r"\d+", n))]
    return max(numbers, default=0) + 1


# ----------------------------------------------------------------------------- the file tree
def content_files(folder: str) -> dict[str, os.stat_result]:
    """Every file of the arrays in ``folder`` (relative path -> stat), temporaries left out."""
    files = {}
    for top in CONTENT:
        base = os.path.join(folder, top)
        for dirpath, _, names in os.walk(base):
            for name in names:
                if not _DEBRIS.search(name):
                    path = os.path.join(dirpath, name)
                    files[os.path.relpath(path, folder)] = os.lstat(path)
    return files


def _debris(folder: str) -> Iterator[str]:
    for top in CONTENT:
        for dirpath, _, names in os.walk(os.path.join(folder, top)):
            for name in names:
                if _DEBRIS.search(name):
                    yield os.path.join(dirpath, name)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard-link ``src`` at ``dst``; copy it where a link cannot be made (another filesystem)."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        with open(src, "rb") as source, open(dst, "wb") as target:
            copy_sparse(source.fileno(), target.fileno())


def copy_sparse(src: int, dst: int) -> None:
    """Copy the file open at ``src`` into the empty file at ``dst``, leaving its holes holes: a
    chunk of zeros (optimizer state starts so) takes no disk space, and its copy should not."""
    size = os.fstat(src).st_size
    os.ftruncate(dst, size)
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # nothing but a hole from here on
                return
            raise
        end = os.lseek(src, start, os.SEEK_HOLE)
        _copy_range(src, dst, start, end)
        offset = end


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    """Copy bytes ``start:end`` at the same offsets: in the kernel where it can (the same
    filesystem), through a buffer where it cannot (another one: EXDEV)."""
    while start < end:
        try:
            copied = os.copy_file_range(src, dst, end - start, start, start)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            break
        if copied <= 0:
            raise OSError(errno.EIO, "copy_file_range copied nothing")
        start += copied
    while start < end:
        block = os.pread(src, min(end - start, 1 << 20), start)
        if not block:
            raise OSError(errno.EIO, "the file ended before its size")
        write_all(dst, block, start)
        start += len(block)


def _place(files: dict[str, os.stat_result], src: str, dst: str) -> None:
    """Link (or copy) each of ``files`` from ``src`` into ``dst``, every folder's zarr.json
    before anything else in it (so a zarr reader listing the folder never meets a bare one)."""
    made = set()
    for rel in sorted(files, key=lambda r: (not r.endswith(METADATA), r.count(os.sep), r)):
        target = os.path.join(dst, rel)
        parent = os.path.dirname(target)
        if parent not in made:
            os.makedirs(parent, exist_ok=True)
            made.add(parent)
        _link_or_copy(os.path.join(src, rel), target)


def _fsync_tree(folder: str) -> None:
    """fsync every folder under ``folder``, deepest first, then ``folder``."""
    for dirpath, _, _ in sorted(os.walk(folder), key=lambda w: -w[0].count(os.sep)):
        fsync_dir(dirpath)


# ----------------------------------------------------------------------------- commit
def commit(root: str, metadata: dict[str, Any], step: int, keep: int) -> Checkpoint:
    """Commit the live arrays of ``root`` as a checkpoint at ``step`` (see the NOTE).

    ``metadata`` is the table's embedpipe metadata at that step. Raises ``OSError`` (full disk,
    ...) with every earlier checkpoint intact and no trace of the failed one.
    """
    folder = os.path.join(root, CHECKPOINTS)
    if not os.path.exists(os.path.join(folder, METADATA)):
        os.makedirs(folder, exist_ok=True)
        write_file(os.path.join(folder, METADATA), group_metadata({"embedpipe": "checkpoints"}))
    files = content_files(root)
    previous = latest(root)
    durable = content_files(previous.path) if previous else {}
    for rel, st in files.items():  # new since the last commit: make the data durable first
        old = durable.get(rel)
        if old is None or (old.st_ino, old.st_dev) != (st.st_ino, st.st_dev):
            fsync_file(os.path.join(root, rel))
    seq = _next_seq(root)
    tmp = os.path.join(folder, f".tmp-{seq:06d}")
    stamp = {"seq": seq, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        os.mkdir(tmp)
        write_file(
            os.path.join(tmp, METADATA),
            group_metadata({"embedpipe": {**metadata, "step": step, "checkpoint": stamp}}),
        )
        with changing_files():  # the live files get a second name (NOTE in mapped.py)
            _place(files, root, tmp)
        _fsync_tree(tmp)
        final = os.path.join(folder, f"{seq:06d}-step-{step}")
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(folder)
    prune(root, keep)
    return Checkpoint(seq, step, final, stamp["time"])


def prune(root: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, except those a reader has pinned. Each is
    renamed to ``.trash-*`` first, so a crash in the middle never leaves a half-deleted
    checkpoint that looks committed."""
    found = checkpoints(root)
    trash = []
    for checkpoint in found[: max(0, len(found) - keep)]:
        fd = os.open(checkpoint.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)  # a reader has it open: it goes at a later commit
            continue
        target = os.path.join(os.path.dirname(checkpoint.path), f".trash-{checkpoint.seq:06d}")
        try:
            os.rename(checkpoint.path, target)
        finally:
            os.close(fd)
        trash.append(target)
    if not trash:
        return
    fsync_dir(os.path.join(root, CHECKPOINTS))
    # Deleting is slow (freeing the chunks only a pruned checkpoint held: 0.5 s for 1 GiB,
    # measured) and not needed for correctness: do it off the commit's path, and let the
    # table's close() wait for it (finish_deleting). A crash first leaves .trash-* folders,
    # which the next open to write deletes.
    thread = threading.Thread(target=_delete, args=(trash,), name="embedpipe-prune", daemon=True)
    _deleting.setdefault(root, []).append(thread)
    thread.start()


#: Background deletions of pruned checkpoints, per table folder.
_deleting: dict[str, list[threading.Thread]] = {}


def _delete(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def finish_deleting(root: str) -> None:
    """Wait until the pruned checkpoints of ``root`` are deleted (nothing of ours is left
    working in the folder once its table is closed)."""
    for thread in _deleting.pop(root, []):
        thread.join()


class Pin:
    """A reader's shared ``flock`` on a checkpoint folder: pruning leaves the folder alone while
    the pin is held. :func:`pin_latest` takes one on a checkpoint that still exists."""

    def __init__(self, folder: str) -> None:
        self.fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(self.fd, fcntl.LOCK_SH)  # waits only while a prune renames this folder
        if not os.path.exists(folder):  # renamed to .trash- just before the pin: not a checkpoint
            self.release()
            raise FileNotFoundError(folder)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:  # noqa: SIM105 (at interpreter exit os and contextlib may be gone already)
            self.release()
        except (AttributeError, TypeError):
            pass


# ----------------------------------------------------------------------------- recover, restore
def recover(root: str, only: Callable[[str], bool] | None = None) -> Checkpoint | None:
    """Make the live arrays of ``root`` the latest checkpoint again; returns it (None if none).

    Deletes what a crash can leave: an uncommitted ``.tmp-*`` checkpoint, a ``.trash-*`` one
    being deleted, temporary chunk files, and every row written after the last commit.
    ``only``: the files of the arrays to take back (``shard_files``: a shard's, which its owner
    alone writes), and nothing else: the checkpoints folder only with the table's metadata.
    """
    folder = os.path.join(root, CHECKPOINTS)
    if os.path.isdir(folder) and (only is None or only(METADATA)):  # (the committer's)
        for name in os.listdir(folder):
            if name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    checkpoint = latest(root)
    if checkpoint is not None:
        restore(root, checkpoint.path, only)
    return checkpoint


def shard_files(chunks: tuple[int, int], others: bool) -> Callable[[str], bool]:
    """Which files of a table (relative paths) a shard's owner writes: the chunk files of rows
    chunks ``[first, end)`` of every array, and (``others``) every file that is not a row
    chunk's (the metadata), which the owner holding the writer lock writes. That owner adds
    the arrays a job's optimizer needs, every chunk of them; another shard's ``recover``
    leaves the chunks of arrays its checkpoint lacks (``restore``), which the first shard's
    owner removes when it takes the metadata back, and fills again when a job needs them."""

    def of_shard(rel: str) -> bool:
        chunk = _CHUNK.search(rel.replace(os.sep, "/"))  # (a temporary's name too)
        return others if chunk is None else chunks[0] <= int(chunk[1]) < chunks[1]

    return of_shard


def restore(root: str, source: str, only: Callable[[str], bool] | None = None) -> int:
    """Make the live arrays of ``root`` those of the checkpoint folder ``source`` (of this table
    or another one); returns how many files changed. Files are hard-linked (copied across
    filesystems); the live metadata becomes the source's, less its checkpoint stamp.
    ``only``: the files to take back (relative paths), as ``recover``'s."""
    with changing_files():  # the live files replaced (NOTE in mapped.py)
        return _restore(root, source, only)


def _restore(root: str, source: str, only: Callable[[str], bool] | None) -> int:
    for path in _debris(root):
        if only is None or only(os.path.relpath(path, root)):
            unlink(path)
    want = content_files(source)
    have = content_files(root)
    if only is not None:
        want = {rel: st for rel, st in want.items() if only(rel)}
        have = {rel: st for rel, st in have.items() if only(rel)}
    # files the source lacks: an array added since; without the metadata, the committer's
    # (the first shard's owner prepared it for the job to come: ``shard_files``)
    for rel in sorted(set(have) - set(want)) if only is None or only(METADATA) else ():
        os.unlink(os.path.join(root, rel))
        if only is not None:  # its folders once empty (another shard's may still hold files)
            _remove_empty_parents(root, rel)
    changed = 0
    for rel in sorted(want, key=lambda r: (not r.endswith(METADATA), r.count(os.sep), r)):
        st, now = want[rel], have.get(rel)
        if now is not None and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            continue
        target = os.path.join(root, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.restore.tmp"
        unlink(tmp)
        _link_or_copy(os.path.join(source, rel), tmp)
        os.replace(tmp, target)
        changed += 1
    if only is None:
        _remove_empty_folders(root)
    elif not only(METADATA):
        return changed
    attributes = read_attributes(source)
    meta = dict(attributes.get("embedpipe", {}))
    meta.pop("checkpoint", None)
    write_file(os.path.join(root, METADATA), group_metadata({**attributes, "embedpipe": meta}))
    return changed


def _remove_empty_parents(root: str, rel: str) -> None:
    folder = os.path.dirname(rel)
    while folder:
        try:
            os.rmdir(os.path.join(root, folder))
        except OSError:  # not empty
            return
        folder = os.path.dirname(folder)


def snapshot(source: str, destination: str) -> Checkpoint:
    """Make ``destination`` (a new folder) a table of its own holding the checkpoint folder
    ``source``, with that as its one checkpoint: hard links where the filesystem allows, copies
    elsewhere. Built under a temporary name and renamed, so it appears whole or not at all."""
    tmp = f"{destination}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.mkdir(tmp)
        restore(tmp, source)
        meta = read_attributes(tmp)["embedpipe"]
        checkpoint = commit(tmp, meta, int(meta.get("step", 0)), keep=1)
        _fsync_tree(tmp)
        os.rename(tmp, destination)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(destination))
    return Checkpoint(checkpoint.seq, checkpoint.step, checkpoint.path.replace(tmp, destination, 1))


def _remove_empty_folders(root: str) -> None:
    for top in CONTENT:
        for dirpath, _, _ in os.walk(os.path.join(root, top), topdown=False):
            if not os.listdir(dirpath):
                os.rmdir(dirpath)


def unlink(path: str) -> None:
    """Remove ``path`` if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
