"""What the daemon publishes about itself: the one status line (sd_notify ``STATUS=`` and
``llama-guard status``), the snapshot written to ``status.json``, and the runtime directory's files
(lock, status and pid files) with the switch to a new ``[runtime].dir`` on reload.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_guard.model.types import State
from llama_guard.model.watcher import Watcher
from llama_guard.status.instance import port_daemon
from llama_guard.status.status import AlreadyRunning, RuntimeLock, StatusFile
from llama_guard.vocab.phases import Phase

RECENT_EVENTS = 10  # how many of the latest events the snapshot carries


@dataclass(frozen=True)
class Liveness:
    """The serving server's answers to liveness rounds: ``answering``, the last round got an HTTP
    answer; ``silent_s``, seconds since the server last answered any request."""

    answering: bool
    silent_s: float


def status_line(state: State, now: float, last_eval_tps: float | None, gpu: str = "",
                liveness: Liveness | None = None) -> str:
    """One human line: ``ready: pid 4242, 38.6 tok/s last request, GPU 0 61°C 212 W, 2 restarts``.

    ``now``: monotonic seconds (the backoff's remaining time); ``last_eval_tps``: the speed of the
    running server's last request (tokens/s), shown while it serves; ``gpu``: the GPU port's
    fragment (``GPU 0 61°C 212 W``; empty for none); ``liveness``: said when the server stopped
    answering."""
    pid = f" pid {state.pid}" if state.pid else ""
    extra = ""
    if state.phase is Phase.BACKOFF and state.deadline is not None:
        extra = f", next start in {max(0.0, state.deadline - now):.1f} s"
    if state.phase is Phase.LENT and state.lend is not None and state.lend.until is not None:
        extra = f", to tune pid {state.lend.pid} for at most {max(0.0, state.lend.until - now):.0f} s more"
    if liveness is not None and not liveness.answering and state.phase in (Phase.READY, Phase.DRAINING):
        extra += f", not answering for {liveness.silent_s:.0f} s"
    if last_eval_tps is not None and state.phase in (Phase.READY, Phase.DRAINING):
        extra += f", {last_eval_tps:.1f} tok/s last request"
    if gpu:
        extra += f", {gpu}"
    if state.restarts:
        extra += f", {state.restarts} restarts"
    return f"{state.phase.value}:{pid}{extra}".replace(":,", ",").rstrip(":")


def _safe_snapshot(watcher: Watcher) -> dict[str, Any] | None:
    try:
        return watcher.snapshot()
    except Exception:
        return None


def snapshot(state: State, line: str, base_url: str, recent: Sequence[dict[str, Any]],
             watchers: Iterable[Watcher], liveness: Liveness | None = None) -> dict[str, Any]:
    """The ``status.json`` document: the policy state, the status ``line``, the latest events,
    ``liveness`` (null before the first round of a serving server) and each watcher's own section
    (under its name; a watcher whose snapshot raises is left out)."""
    serving = liveness is not None and state.phase in (Phase.READY, Phase.DRAINING)
    return {
        "daemon_pid": os.getpid(),
        "phase": state.phase.value,
        "server_pid": state.pid,
        "base_url": base_url,
        "status": line,
        "restarts": state.restarts,
        "recent_failures": len(state.failures),
        "last_failure": state.failure.text,
        "updated": time.time(),
        "events": list(recent)[-RECENT_EVENTS:],
        "liveness": ({"answering": liveness.answering, "silent_s": round(liveness.silent_s, 1)}
                     if serving and liveness is not None else None),
        **{w.name: snap for w in watchers if (snap := _safe_snapshot(w)) is not None},
    }


class RuntimeFiles:
    """This instance's identity and files: the runtime directory's lock, the check that no other
    llama-guard of this user serves its ports (:mod:`llama_guard.status.instance`: what answers
    when the directory was deleted) and the status file; ``emit`` reports failed writes
    (``status_write_failed``)."""

    def __init__(self, directory: Path, emit: Callable[..., None]) -> None:
        self._emit = emit
        self.lock = RuntimeLock(directory)
        self.status_file = self._status_file(directory)

    def _status_file(self, directory: Path) -> StatusFile:
        return StatusFile(directory, on_error=lambda reason: self._emit(
            "status_write_failed", runtime_dir=str(directory), reason=reason))

    def acquire(self, ports: dict[str, int]) -> None:
        """Take the directory's lock, then check that no llama-guard of this user serves one of
        ``ports`` (what each is → TCP port: llama-server's, the front door's); raises AlreadyRunning
        (naming the holder) or OSError, holding nothing. Blocking (a /proc scan)."""
        self.lock.acquire()
        for what, port in ports.items():
            pid = port_daemon(port)
            if pid is not None and pid != os.getpid():
                self.lock.release()
                raise AlreadyRunning(self.lock.dir, pid, f"it serves {what} {port}")

    def write(self, document: dict[str, Any]) -> None:
        """Write the status snapshot, first taking the lock again if the lock file was deleted
        (:meth:`RuntimeLock.refresh`); never raises."""
        self.lock.refresh()
        self.status_file.write(document)

    def release(self) -> None:
        """Give everything back; never raises."""
        self.lock.release()

    def switch(self, new: Path) -> str:
        """Move to directory ``new``: lock it, drop the old status file, release the old lock.
        Returns "" or why not (then the old directory stays in use)."""
        lock = RuntimeLock(new)
        try:
            lock.acquire()
        except (AlreadyRunning, OSError) as exc:
            return str(exc)
        self.status_file.remove()
        self.lock.release()
        self.lock = lock
        self.status_file = self._status_file(new)
        return ""
