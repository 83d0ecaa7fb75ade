"""The daemon's status snapshot, pid file and lock under ``[runtime].dir``.

``status.json`` is rewritten atomically (write to a temporary file, then rename) on every phase
change; ``llama-guard.pid`` holds the daemon's pid for ``llama-guard restart``, written the same
way and rewritten whenever it no longer names the daemon. Both are mode 0600 and the directory
llama-guard creates is 0700 (systemd's ``RuntimeDirectoryMode=0700``). ``llama-guard.lock`` is
held with ``flock`` for the daemon's life (:class:`RuntimeLock`), together with an abstract socket
name keyed by the directory (:mod:`.instance`) that survives the directory's deletion: a second
daemon of the same instance refuses to start and names the first. A status file that cannot be
written is reported once (through ``on_error``: the daemon makes it the ``status_write_failed``
event) and otherwise ignored: status is a convenience, never a reason to stop supervising; a
failed write never leaves an empty pid file.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from llama_guard.output.instance import InstanceName, NameTaken, dir_key, holder
from llama_guard.paths import read_regular

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
    """Another llama-guard holds the runtime directory's lock or this instance's name; ``pid`` is
    its pid (None if unknown)."""

    def __init__(self, directory: Path, pid: int | None, what: str = "") -> None:
        who = f"llama-guard pid {pid}" if pid else "another llama-guard"
        held = what or f"it holds {directory / LOCK_NAME}"
        super().__init__(f"{who} already runs on {directory} ({held}); refusing to start a second llama-server")
        self.pid = pid


class RuntimeLock:
    """This instance's identity, held for the daemon's life: the abstract name of its runtime
    directory (:mod:`.instance`) and an exclusive ``flock`` on ``<dir>/llama-guard.lock``, whose
    content is the holder's pid. (The daemon holds llama-server's port name beside it.)

    The kernel drops all of it when the holder exits, however it exits, so nothing stale blocks a
    start. The lock file is never deleted (deleting it would let two daemons lock two files); when
    someone else deletes it, or the whole directory, the names still refuse a second daemon.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._fd: int | None = None
        self.names: list[InstanceName] = []

    def acquire(self) -> None:
        """Take the names and the lock or raise :class:`AlreadyRunning` (naming the holder) or
        OSError. Nothing is held after a failure."""
        name = InstanceName(dir_key(self.dir))
        try:
            try:
                name.bind()
            except NameTaken as exc:
                raise AlreadyRunning(self.dir, exc.pid or None, "it holds this runtime directory's name, "
                                     "which outlives the directory") from None
            self.names.append(name)
            self._lock_file()
        except BaseException:
            self.release()
            raise

    def _lock_file(self) -> None:
        make_runtime_dir(self.dir)
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder_pid = _read_pid_text(os.pread(fd, 32, 0).decode(errors="replace"))
            os.close(fd)
            raise AlreadyRunning(self.dir, holder_pid) from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays) and the names; never raises."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        for name in self.names:
            name.release()
        self.names = []


def holder_of(directory: Path) -> int | None:
    """The pid of the daemon whose ``[runtime].dir`` is ``directory`` — the holder of its name —
    or None when none runs (0: one runs but its pid could not be read). Not the pid file: that
    can be stale, overwritten or deleted."""
    return holder(dir_key(directory))


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


def is_llama_guard(pid: int) -> bool:
    """Whether process ``pid`` is a llama-guard daemon (its command line names llama-guard or
    llama_guard), so that a stale pid file reused by another process is never signalled."""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # cannot tell; the kill itself will be refused if it is not ours
    # `llama-guard run ...` (console script, possibly via python) or `python -m llama_guard run ...`;
    # a mere mention (tail -f /var/log/llama-guard/..., an editor on the config) does not count.
    names = [os.path.basename(word) for word in cmdline[:3]]
    script = "llama-guard" in names
    module = any(a == "-m" and b == "llama_guard" for a, b in itertools.pairwise(cmdline))
    return (script or module) and "run" in cmdline


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
    of the directory's name (None: no daemon runs for it); ``note`` says what did not agree (a pid
    file that names another process), "" when all agreed."""

    pid: int | None
    note: str = ""


def locate_daemon(directory: Path) -> Located:
    """Which llama-guard serves ``directory``: the holder of its name (:func:`holder_of`), checked
    to be llama-guard by its command line; the pid file only when the holder's pid cannot be read.
    Never another instance's pid, whatever the pid file says. Raises PermissionError when the pid
    file may not be read."""
    file_pid = read_pid(directory)
    held = holder_of(directory)
    if held is None:
        note = (f"{directory / PID_NAME} names llama-guard pid {file_pid}, which does not serve {directory} "
                "(a stale pid file, or another instance's)") if file_pid is not None else ""
        return Located(None, note)
    if held == 0:  # held, but the holder's pid was not given (its loop is busy): the pid file, if it agrees
        return Located(file_pid, "" if file_pid else f"a daemon holds {directory}'s name but its pid is unknown")
    if not is_llama_guard(held):
        return Located(None, f"pid {held} holds {directory}'s name but is not llama-guard")
    note = "" if file_pid == held else (f"{directory / PID_NAME} names {file_pid or 'no live llama-guard'}; "
                                        f"the daemon of {directory} is pid {held}")
    return Located(held, note)
