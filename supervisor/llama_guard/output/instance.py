"""Which llama-guard daemon serves a configuration, known without any file: a name in the kernel's
abstract Unix-socket namespace (unix(7), "abstract"), held by a listening socket for the daemon's
life.

A lock file under ``[runtime].dir`` is lost when someone deletes the directory: a second daemon of
the same configuration would then lock a new file and start a second llama-server. An abstract name
cannot be deleted, only released when the process that bound it exits (however it exits), and the
kernel says who holds it: a ``connect`` to it and ``SO_PEERCRED`` give the holder's pid without
the holder having to answer. The names are keyed by the instance's identity: its runtime directory
(what ``status`` and ``restart`` know) and llama-server's port (two daemons cannot both serve it).

The namespace is per network namespace: a daemon in a private network namespace (systemd's
``PrivateNetwork=``) has its own ports as well, so the key still means what it should.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import struct
from pathlib import Path

PREFIX = "llama-guard/"
CONNECT_TIMEOUT_S = 1.0  # a holder's backlog that is full (its loop wedged) answers EAGAIN at once


def dir_key(directory: Path) -> str:
    """The abstract name of the instance whose ``[runtime].dir`` is ``directory`` (absolute,
    normalised; not resolved: the directory may be gone)."""
    norm = os.path.normpath(os.path.abspath(directory))
    return f"{PREFIX}dir/{hashlib.sha256(norm.encode()).hexdigest()[:32]}"


def port_key(port: int) -> str:
    """The abstract name of the instance that serves llama-server on TCP ``port``."""
    return f"{PREFIX}port/{port}"


def holder(key: str) -> int | None:
    """The pid of the process that holds the abstract name ``key`` (SO_PEERCRED of a connection to
    it), or None when nobody does. Never blocks longer than :data:`CONNECT_TIMEOUT_S`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect("\0" + key)
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.ETIMEDOUT) or isinstance(exc, TimeoutError):
            return 0  # held, by a daemon too busy to take the connection: its pid is unknown
        return None
    finally:
        sock.close()
    return pid if pid > 0 else 0


class NameTaken(Exception):
    """Another process holds the abstract name ``key``; ``pid`` is its pid (0: unknown)."""

    def __init__(self, key: str, pid: int) -> None:
        super().__init__(f"{key} is held by pid {pid or '?'}")
        self.key = key
        self.pid = pid


class InstanceName:
    """One abstract name held by a listening socket; connections to it (``holder`` of others) are
    accepted and closed by :meth:`answer`, so its backlog never fills."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._sock: socket.socket | None = None

    def bind(self) -> None:
        """Take the name or raise :class:`NameTaken` (naming the holder) or OSError."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.bind("\0" + self.key)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                pid = holder(self.key)
                raise NameTaken(self.key, pid or 0) from None
            raise
        sock.listen(16)
        self._sock = sock

    def fileno(self) -> int:
        """The listening socket's fd (-1 when not held), for the event loop's reader."""
        return self._sock.fileno() if self._sock is not None else -1

    def answer(self) -> None:
        """Accept and close every pending connection (the asker read our pid already); never raises."""
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()

    def release(self) -> None:
        """Give the name back; never raises."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
