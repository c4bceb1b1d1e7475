"""Reaching a table's owner process from a training process: starting one of its own
(``server.py``, forked by the process's zygote: ``zygote.py``; or ``job.py`` for the ranks of a
job), or connecting to a service that listens at an address (``embedpipe serve``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from ..errors import ServiceNotFoundError
from .address import socket_path
from .channel import Channel, peer_of
from .zygote import Forked, fork_owner
from .zygote import available as zygote_available

P = TypeVar("P")

#: The owner process's program: ``module``'s ``main`` (not ``-m``, which would run the module a
#: second time beside the one the package imports, and warn so on every start).
_MAIN = "import sys; from embedpipe.service.{module} import main; sys.exit(main(sys.argv[1:]))"


def start_owner(
    lock_fd: int | None, module: str = "server", *more: int
) -> tuple[subprocess.Popen | Forked, Channel]:
    """An owner process of this one's (``server.py``, forked by this process's zygote; ``job.py``
    with a listening socket's descriptor and the number of ranks as ``more``), lent the writer
    lock's descriptor."""
    lent = ((lock_fd,) if lock_fd is not None else ()) + more[:1]
    if module == "server" and zygote_available():
        return _with_channel(lambda fds: fork_owner(fds, _start_zygote), lent)
    return _with_channel(lambda fds: _start(module, fds, *more), lent)


def _start_zygote() -> tuple[subprocess.Popen, Channel]:
    return _with_channel(partial(_start, "zygote"))


def _with_channel(
    start: Callable[[tuple[int, ...]], P], lent: tuple[int, ...] = ()
) -> tuple[P, Channel]:
    """``start(fds)``'s process, given the other end of a new channel as ``fds[0]`` and
    ``lent`` after it; and the channel."""
    channel, theirs = Channel.pair()
    try:
        return start((theirs.fileno(), *lent)), channel
    except BaseException:
        channel.close()
        raise
    finally:
        theirs.close()


def _start(module: str, fds: tuple[int, ...], *more: int) -> subprocess.Popen:
    """``module``'s ``main`` in a new interpreter, given ``fds``, the first of them as ``FD``:
    ``FD PARENT MORE...``."""
    return subprocess.Popen(
        [sys.executable, "-P", "-c", _MAIN.format(module=module), str(fds[0]), str(os.getpid()),
         *map(str, more)],
        pass_fds=fds,
        env=_environment(),
        start_new_session=True,  # a Ctrl-C in the terminal is the training process's
    )  # fmt: skip


def connect(address: str, table: str) -> Channel:
    """A connection to the service at ``address`` (``embedpipe serve``)."""
    path = socket_path(address)
    try:
        channel = Channel.connect(path)
    except (FileNotFoundError, ConnectionRefusedError) as e:
        raise ServiceNotFoundError(
            f"no table service listens at {address} ({e.strerror}); start one with "
            f"`embedpipe serve {table} --address {address}`"
        ) from None
    pid, uid = peer_of(channel.sock)
    if uid != os.getuid():  # its replies are pickles: only ours may be read
        channel.close()
        raise PermissionError(
            f"the process listening at {address} (pid {pid}) is another user's (uid {uid}): "
            "embedpipe connects only to a service of this user's"
        )
    return channel


def _environment() -> dict[str, str]:
    """The owner process's environment: this one's, with embedpipe importable as here."""
    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    return env
