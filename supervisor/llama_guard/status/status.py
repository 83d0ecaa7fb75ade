"""The daemon's status snapshot, pid file and lock under ``[runtime].dir``.

``status.json`` is rewritten atomically (write to a temporary file, then rename) on every phase
change; ``llama-guard.pid`` holds the daemon's pid for ``llama-guard restart``, written the same
way and rewritten whenever it no longer names the daemon. Both are mode 0600 and the directory
llama-guard creates is 0700 (systemd's ``RuntimeDirectoryMode=0700``). ``llama-guard.lock`` is
held with ``flock`` for the daemon's life (:class:`RuntimeLock`; who may hold it and how its holder
is known: :mod:`.instance`): a second daemon of the same instance refuses to start and names the
first. A status file that cannot be
written is reported once (through ``on_error``: the daemon makes it the ``status_write_failed``
event) and otherwise ignored: status is a convenience, never a reason to stop supervising; a
failed write never leaves an empty pid file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_guard.host.paths import read_regular
from llama_guard.status.instance import describe, is_llama_guard, lock_holder, unsafe_dir

STATUS_NAME = "status.json"
PID_NAME = "llama-guard.pid"
LOCK_NAME = "llama-guard.lock"
FILE_MODE = 0o600
DIR_MODE = 0o700


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temporary file in the same directory, fsync-free
    rename), mode 0600 from the start. Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # an old tmp left with other bits
        with open(fd, "w", encoding="utf-8", closefd=False) as handle:
            handle.write(text)
    except OSError:  # a full disk: no half-written temporary file left behind
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    else:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def make_runtime_dir(directory: Path) -> None:
    """Create ``directory`` (mode 0700) if absent; an existing one keeps its mode. Raises OSError."""
    if not directory.is_dir():
        directory.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=DIR_MODE)


class AlreadyRunning(Exception):
    """Another llama-guard (or, named as what it is, another process) holds the runtime directory's
    lock or serves this instance's port; ``pid`` is its pid (None if unknown)."""

    def __init__(self, directory: Path, pid: int | None, what: str = "") -> None:
        if pid and not is_llama_guard(pid):
            who = f"{describe(pid)}, which is not llama-guard,"
        else:
            who = f"llama-guard pid {pid}" if pid else "another llama-guard"
        held = what or f"it holds {directory / LOCK_NAME}"
        super().__init__(f"{who} already runs on {directory} ({held}); refusing to start a second llama-server")
        self.pid = pid


class RuntimeLock:
    """This instance's identity, held for the daemon's life: an exclusive ``flock`` on
    ``<dir>/llama-guard.lock`` (whose content is the holder's pid, for people), in a directory only
    this user may write (:func:`~llama_guard.status.instance.unsafe_dir`).

    The kernel drops it when the holder exits, however it exits, so nothing stale blocks a start.
    The lock file is never deleted by llama-guard; when someone else deletes it, or the whole
    directory, :meth:`refresh` takes the lock of the new file at that path.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`AlreadyRunning` (naming the holder) or OSError (an unsafe
        directory: PermissionError naming its owner or mode). Nothing is held after a failure."""
        self._fd = self._lock_file()

    def refresh(self) -> None:
        """When the lock file at the path is no longer the one locked (the file or the directory was
        deleted), lock the file found or made there instead; never raises (tried again next time)."""
        if self._fd is None:
            return
        try:
            same = os.path.samestat(os.fstat(self._fd), os.stat(self.dir / LOCK_NAME, follow_symlinks=False))
        except OSError:
            same = False
        if same:
            return
        with contextlib.suppress(AlreadyRunning, OSError):
            fd = self._lock_file()
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = fd

    def _lock_file(self) -> int:
        make_runtime_dir(self.dir)
        problem = unsafe_dir(self.dir)
        if problem:
            raise PermissionError(errno.EPERM, problem)
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise PermissionError(errno.EPERM, f"{self.dir / LOCK_NAME} belongs to another user")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AlreadyRunning(self.dir, lock_holder(self.dir / LOCK_NAME) or None) from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def release(self) -> None:
        """Drop the lock (the file stays); never raises."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def holder_of(directory: Path) -> int | None:
    """The pid of the process that holds ``directory``'s lock (the kernel's lock table), or None
    when none does (0: one does but its pid cannot be seen). Not the pid file: that can be stale,
    overwritten or deleted."""
    return lock_holder(directory / LOCK_NAME)


def _read_pid_text(text: str) -> int | None:
    try:
        pid = int(text.strip())
    except ValueError:
        return None
    return pid if pid > 0 else None


def _names_me(pidfile: Path) -> bool:
    """Whether ``pidfile`` is a regular file that holds this process's pid (and nothing else)."""
    try:
        return read_regular(pidfile).decode(errors="replace") == f"{os.getpid()}\n"
    except OSError:
        return False


class StatusFile:
    """Writes ``<dir>/status.json`` and ``<dir>/llama-guard.pid`` (the caller holds the
    directory's :class:`RuntimeLock`, so no other daemon writes them)."""

    def __init__(self, directory: Path, on_error: Callable[[str], None] | None = None) -> None:
        """``on_error(reason)`` is called once, at the first failed write (default: one stderr line)."""
        self.dir = directory
        self._on_error = on_error
        self._warned = False

    def write(self, snapshot: dict[str, Any]) -> None:
        """Replace the snapshot atomically; never raises."""
        try:
            make_runtime_dir(self.dir)
            # Kept true: the directory may have been removed, the file overwritten or replaced.
            if not _names_me(self.dir / PID_NAME):
                write_private(self.dir / PID_NAME, f"{os.getpid()}\n")
            write_private(self.dir / STATUS_NAME, json.dumps(snapshot, indent=1, default=str) + "\n")
        except OSError as exc:
            if not self._warned:
                self._warned = True
                reason = str(exc.strerror or exc)
                if self._on_error is not None:
                    with contextlib.suppress(Exception):
                        self._on_error(reason)
                        return
                print(f"llama-guard: cannot write status under {self.dir}: {reason}; "
                      "`llama-guard status` and `llama-guard restart` will not find this daemon",
                      file=sys.stderr)

    def remove(self) -> None:
        """Remove the pid file and mark the snapshot stopped; never raises."""
        with contextlib.suppress(OSError):
            pidfile = self.dir / PID_NAME
            if read_regular(pidfile).decode(errors="replace").strip() == str(os.getpid()):
                pidfile.unlink()
        with contextlib.suppress(OSError, ValueError):
            path = self.dir / STATUS_NAME
            data = json.loads(read_regular(path))
            if data.get("daemon_pid") == os.getpid():
                path.unlink()


def read_status(directory: Path) -> dict[str, Any] | None:
    """The last snapshot, or None when there is none. Raises PermissionError when the file (or
    the directory) exists but may not be read: "not running" would be a false answer."""
    try:
        data = json.loads(read_regular(directory / STATUS_NAME))
    except PermissionError:
        raise
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_pid(directory: Path) -> int | None:
    """The running daemon's pid from the pid file, or None when absent, stale or not llama-guard.
    Raises PermissionError when the pid file (or its directory) may not be read."""
    try:
        pid = int(read_regular(directory / PID_NAME).decode().strip())
    except PermissionError:
        raise
    except (OSError, ValueError):
        return None
    if pid <= 0 or not is_llama_guard(pid):
        return None
    return pid


@dataclass(frozen=True)
class Located:
    """The daemon of one runtime directory as ``status`` and ``restart`` find it: ``pid`` the holder
    of the directory's lock (None: no daemon runs for it); ``note`` says what did not agree (a pid
    file that names another process), "" when all agreed."""

    pid: int | None
    note: str = ""


def locate_daemon(directory: Path) -> Located:
    """Which llama-guard serves ``directory``: the holder of its lock (:func:`holder_of`), checked
    to be llama-guard by its command line; the pid file only when the holder's pid cannot be read.
    Never another instance's pid, whatever the pid file says. Raises PermissionError when the pid
    file may not be read."""
    file_pid = read_pid(directory)
    held = holder_of(directory)
    if held is None:
        note = (f"{directory / PID_NAME} names llama-guard pid {file_pid}, which does not serve {directory} "
                "(a stale pid file, or another instance's)") if file_pid is not None else ""
        return Located(None, note)
    if held == 0:  # held, but the holder's pid cannot be seen (another pid namespace): the pid file, if it agrees
        return Located(file_pid, "" if file_pid else f"a daemon holds {directory}'s lock but its pid is unknown")
    if not is_llama_guard(held):
        return Located(None, f"{describe(held)} holds {directory}'s lock but is not llama-guard")
    note = "" if file_pid == held else (f"{directory / PID_NAME} names {file_pid or 'no live llama-guard'}; "
                                        f"the daemon of {directory} is pid {held}")
    return Located(held, note)
