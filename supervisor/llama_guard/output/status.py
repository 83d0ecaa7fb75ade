"""The daemon's status snapshot and pid file under ``[runtime].dir``.

``status.json`` is rewritten atomically (write to a temporary file, then rename) on every phase
change; ``llama-guard.pid`` holds the daemon's pid for ``llama-guard restart``. A runtime
directory that cannot be written is reported once (through ``on_error``: the daemon makes it
the ``status_write_failed`` event) and otherwise ignored: status is a convenience, never a
reason to stop supervising. Both files are written to a temporary name and renamed, so a full
disk never leaves an empty or half-written pid file behind.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

STATUS_NAME = "status.json"
PID_NAME = "llama-guard.pid"


class StatusFile:
    """Writes ``<dir>/status.json`` and ``<dir>/llama-guard.pid``."""

    def __init__(self, directory: Path, on_error: Callable[[str], None] | None = None) -> None:
        """``on_error(reason)`` is called once, at the first failed write (default: one stderr line)."""
        self.dir = directory
        self._on_error = on_error
        self._warned = False
        self._pid_written = False

    def _replace(self, name: str, text: str) -> None:
        tmp = self.dir / f".{name}.{os.getpid()}"
        try:
            tmp.write_text(text)
            tmp.replace(self.dir / name)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def write(self, snapshot: dict[str, Any]) -> None:
        """Replace the snapshot atomically; never raises."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not self._pid_written:
                self._replace(PID_NAME, f"{os.getpid()}\n")
                self._pid_written = True
            self._replace(STATUS_NAME, json.dumps(snapshot, indent=1, default=str) + "\n")
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
            if pidfile.read_text().strip() == str(os.getpid()):
                pidfile.unlink()
        with contextlib.suppress(OSError, ValueError):
            path = self.dir / STATUS_NAME
            data = json.loads(path.read_text())
            if data.get("daemon_pid") == os.getpid():
                path.unlink()


def read_status(directory: Path) -> dict[str, Any] | None:
    """The last snapshot, or None when there is none."""
    try:
        data = json.loads((directory / STATUS_NAME).read_text())
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
    """The running daemon's pid from the pid file, or None when absent, stale or not llama-guard."""
    try:
        pid = int((directory / PID_NAME).read_text().strip())
    except (OSError, ValueError):
        return None
    if pid <= 0 or not is_llama_guard(pid):
        return None
    return pid
