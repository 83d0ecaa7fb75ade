"""Who holds a TCP port, read from /proc by psutil while other processes start and end: a scan that meets
a process's fd as it closes (``OSError`` EBADF from ``/proc/<pid>/fd``, not a ``psutil.Error``) is scanned
again, never raised — it ended a daemon with status 70 in a CI run ("watcher core.port holder failed:
OSError: [Errno 9] Bad file descriptor")."""

from __future__ import annotations

import errno
from types import SimpleNamespace

import psutil
import pytest
from llama_guard.host import procs


def listening(port: int, pid: int) -> SimpleNamespace:
    return SimpleNamespace(status=psutil.CONN_LISTEN, laddr=SimpleNamespace(port=port), pid=pid)


def test_a_scan_that_meets_a_closing_fd_is_scanned_again(monkeypatch: pytest.MonkeyPatch) -> None:
    answers: list[object] = [OSError(errno.EBADF, "Bad file descriptor"), [listening(8080, 4242)]]

    def scan(kind: str) -> object:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    monkeypatch.setattr(psutil, "net_connections", scan)
    assert procs.port_listener(8080) == 4242
    assert answers == []


def test_scans_that_keep_failing_answer_nobody_known(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def scan(kind: str) -> object:
        calls.append(kind)
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(psutil, "net_connections", scan)
    assert procs.port_listener(8080) is None
    assert len(calls) == procs.SCAN_TRIES
