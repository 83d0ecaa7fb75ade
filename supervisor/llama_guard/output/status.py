"""The daemon's status snapshot, pid file and lock under ``[runtime].dir``.

``status.json`` is rewritten atomically (write to a temporary file, then rename) on every phase
change; ``llama-guard.pid`` holds the daemon's pid for ``llama-guard restart``, written the same
way. Both are mode 0600 and the directory llama-guard creates is 0700 (systemd's
``RuntimeDirectoryMode=0700``). ``llama-guard.lock`` is held with ``flock`` for the daemon's
life (:class:`RuntimeLock`): a second daemon on the same directory refuses to start and names
the first. A status file that cannot be written is reported once (through ``on_error``: the daemon
makes it the ``status_write_failed`` event) and otherwise ignored: status is a convenience,
never a reason to stop supervising; a failed write never leaves an empty pid file.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

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
    """Another llama-guard holds the runtime directory's lock; ``pid`` is its pid (None if unknown)."""

    def __init__(self, directory: Path, pid: int | None) -> None:
        who = f"llama-guard pid {pid}" if pid else "another llama-guard"
        super().__init__(f"{who} already runs on {directory} (it holds {directory / LOCK_NAME}); "
                         "refusing to start a second llama-server")
        self.pid = pid


class RuntimeLock:
    """An exclusive ``flock`` on ``<dir>/llama-guard.lock``, whose content is the holder's pid.

    The kernel drops the lock when the holder exits, however it exits, so a stale lock file never
    blocks a start. The file is never deleted (deleting it would let two daemons lock two files).
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`AlreadyRunning` (naming the holder) or OSError."""
        make_runtime_dir(self.dir)
        fd = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid_text(os.pread(fd, 32, 0).decode(errors="replace"))
            os.close(fd)
            raise AlreadyRunning(self.dir, holder) from None
        except OSError:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays); never raises."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _read_pid_text(text: str) -> int | None:
    try:
        pid = int(text.strip())
    except ValueError:
        return None
    return pid if pid > 0 else None


class StatusFile:
    """Writes ``<dir>/status.json`` and ``<dir>/llama-guard.pid`` (the caller holds the
    directory's :class:`RuntimeLock`, so no other daemon writes them)."""

    def __init__(self, directory: Path, on_error: Callable[[str], None] | None = None) -> None:
        """``on_error(reason)`` is called once, at the first failed write (default: one stderr line)."""
        self.dir = directory
        self._on_error = on_error
        self._warned = False
        self._pid_written = False

    def write(self, snapshot: dict[str, Any]) -> None:
        """Replace the snapshot atomically; never raises."""
        try:
            make_runtime_dir(self.dir)
            if not self._pid_written or not (self.dir / PID_NAME).is_file():  # the dir may have been removed
                write_private(self.dir / PID_NAME, f"{os.getpid()}\n")
                self._pid_written = True
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
