"""A service's address (``unix:PATH``, the socket it listens on): checking one, the default
one for a table, and listening there safely."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import tempfile

#: The scheme of a service's address: ``unix:`` and the path of its socket.
SCHEME = "unix:"


def is_address(owner: object) -> bool:
    return isinstance(owner, str) and owner.startswith(SCHEME)


def socket_path(address: str) -> str:
    """The socket file of ``address`` (``unix:PATH``), checked to fit a Unix socket's name."""
    if not is_address(address) or len(address) == len(SCHEME):
        raise ValueError(f"a service's address is unix:PATH (a socket file), got {address!r}")
    path = os.path.abspath(os.path.expanduser(address[len(SCHEME) :]))
    if len(path.encode()) > 107:
        raise ValueError(
            f"the socket path {path} is {len(path.encode())} bytes: a Unix socket's is at most "
            "107; choose a shorter --address"
        )
    return path


def default_address(table_path: str, shard: tuple[int, int] | None = None) -> str:
    """The address ``embedpipe serve`` listens on without ``--address``: a socket of this user's
    in the temporary folder, named after the table's folder (and the shard)."""
    folder = os.path.join(tempfile.gettempdir(), f"embedpipe-{os.getuid()}")
    name = hashlib.sha1(os.path.realpath(table_path).encode()).hexdigest()[:16]
    if shard is not None:
        name += f"-{shard[0]}of{shard[1]}"
    return f"{SCHEME}{os.path.join(folder, name)}.sock"


def listen(path: str, address: str) -> socket.socket:
    """A listening socket at ``path``, reachable by this user only, in a folder no other user
    can replace it in; a socket file left by a service that died is replaced, a live
    service's is not, and nothing that is not a socket is touched."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or (st.st_uid != os.getuid() and not st.st_mode & stat.S_ISVTX):
        raise OSError(
            f"the folder of {address} is not a folder of this user's (owner uid {st.st_uid}): "
            "another user could replace the socket there; choose another --address"
        )
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket; choose another --address")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody listens: a dead service's socket
        else:
            raise OSError(f"{address} is in use by a running service; choose another --address")
        finally:
            probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(8)
    return listener
