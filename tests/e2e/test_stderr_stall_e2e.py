"""End to end with the REAL llama-server: llama-guard's stderr is a pipe whose reader stopped
reading (journald stalled, a paused terminal). The daemon must go on as if it were read: /livez,
requests through the front door, supervision (a killed server is replaced) and SIGTERM."""

from __future__ import annotations

import fcntl
import os
import platform
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from front_fixtures import served
from harness import ROOT, RunPool, free_port, server_pids_of

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

F_SETPIPE_SZ = 1031  # fcntl(2)
WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}  # write(2)'s number (asm/unistd.h)


def blocked_on_stderr(pid: int) -> bool:
    """Whether a thread of process ``pid`` waits in ``write(2, …)`` (proc(5): /proc/PID/task/TID/syscall
    is the syscall number and its arguments while the thread is blocked): its stderr is full."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "syscall").read_text().startswith(f"{WRITE_SYSCALL[platform.machine()]} 0x2 "):
                return True
        except OSError:
            continue
    return False


def wait_until(what: str, condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.1)


def answers(port: int, path: str) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10).status_code
    except httpx.HTTPError:
        return 0


def test_a_stderr_nobody_reads_stops_nothing(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    pool = RunPool()
    front = free_port()
    run = pool.new(tmp_path, str(llama_server_bin), str(real_model), {
        "front": {"listen": f"127.0.0.1:{front}", "hold_timeout_s": 120.0},
        "health": {"canary": False, "interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0},
        "recovery": {"stable_after_s": 1.0, "max_restarts": 5}})
    port: int = run.port  # type: ignore[attr-defined]
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    fcntl.fcntl(write_fd, F_SETPIPE_SZ, 4096)
    try:
        run.proc = subprocess.Popen([*run.command, "run", "--config", str(run.config)], stdin=subprocess.DEVNULL,
                                    stdout=write_fd, stderr=write_fd, env=run.env, cwd=str(ROOT))
        os.close(write_fd)
        # At log level debug every line of llama-server's load is an event: the pipe fills and stays full.
        wait_until("llama-guard waits on its full stderr", lambda: blocked_on_stderr(run.pid), 120)
        wait_until("the front door's /readyz answers 200", lambda: answers(front, "/readyz") == 200, 120)
        assert answers(front, "/livez") == 200
        assert served(front)
        (first,) = server_pids_of(port)
        os.kill(first, signal.SIGKILL)
        wait_until("a new llama-server is ready", lambda: server_pids_of(port) not in ([], [first])
                   and answers(front, "/readyz") == 200, 120)
        assert served(front)
        assert blocked_on_stderr(run.pid), "the pipe was read"
        run.signal(signal.SIGTERM)
        assert run.wait_exit(60) == 0
    finally:
        leftovers = pool.finish()
        os.close(read_fd)
    assert not leftovers, f"llama-server pids {leftovers} outlived their daemon"
