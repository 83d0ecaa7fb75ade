"""Which daemon serves a configuration, against the real llama-server: a deleted runtime directory
does not let a second daemon in, ``status``/``restart`` follow the holder of the instance's lock
(never a pid file that names another instance), and the daemon keeps its pid file true."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import ROOT, DaemonRun, RunPool, server_pids_of
from llama_guard.status.status import PID_NAME, STATUS_NAME

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]


@pytest.fixture
def pool() -> Iterator[RunPool]:
    runs = RunPool()
    yield runs
    assert runs.finish() == [], "a llama-server outlived its daemon"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llama_guard", *args], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=60, check=False)


def until(check: object, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if callable(check) and check():
            return True
        time.sleep(0.1)
    return False


def test_deleted_runtime_dir_does_not_let_a_second_daemon_in(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    first = pool.new(tmp_path, str(llama_server_bin), str(real_model)).start()
    ready = first.wait_event("server_ready", 60)
    runtime = tmp_path / "run"
    shutil.rmtree(runtime)  # the lock file, the pid file and status.json are gone
    # B: the very same configuration file.
    second_dir = tmp_path / "b"
    second_dir.mkdir()
    second = DaemonRun(second_dir, {})
    second.config = first.config
    pool.runs.append(second)
    t0 = time.monotonic()
    second.start()
    assert second.wait_exit(60) == 78
    refused_s = time.monotonic() - t0
    names = second.names()
    assert "server_starting" not in names and "daemon_started" not in names, names
    error = second.wait_event("config_error")
    assert f"llama-guard pid {first.pid}" in error["reason"], error
    assert second.wait_event("daemon_exit")["exit_code"] == 78
    assert server_pids_of(first.port) == [int(ready["server_pid"])]  # type: ignore[attr-defined]
    # A writes its files again (and locks the new lock file); `status` finds A through the lock, not the pid file.
    assert until(lambda: (runtime / PID_NAME).is_file(), 10)
    assert until(lambda: cli("status", "--config", str(first.config)).returncode == 0, 10)
    print(f"second daemon refused in {refused_s:.2f} s naming pid {first.pid}")


def test_status_and_restart_follow_the_name_holder_not_the_pid_file(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    (tmp_path / "a").mkdir()
    first = pool.new(tmp_path / "a", str(llama_server_bin), str(real_model)).start()
    ready = first.wait_event("server_ready", 60)
    runtime = tmp_path / "a" / "run"
    assert until(lambda: (runtime / STATUS_NAME).is_file(), 10)
    # A dead instance's runtime dir whose stale pid file (and snapshot) names the live daemon A.
    dead = tmp_path / "dead-run"
    dead.mkdir(mode=0o700)
    (dead / PID_NAME).write_text(f"{first.pid}\n")
    (dead / STATUS_NAME).write_text((runtime / STATUS_NAME).read_text())
    status = cli("status", "--runtime-dir", str(dead))
    assert status.returncode == 3, status
    assert f"names llama-guard pid {first.pid}, which does not serve {dead}" in status.stderr, status
    restart = cli("restart", "--runtime-dir", str(dead))
    assert restart.returncode == 1 and "no running daemon" in restart.stderr, restart
    # A was never signalled: a SIGHUP sent now is answered after any signal the CLI could have sent (the CLI
    # exited first; A's handler queues signals in the order they arrive), and nothing came before its answer.
    first.signal(signal.SIGHUP)
    first.wait_event("config_reloaded", 30)
    assert "restart_requested" not in first.names()
    assert server_pids_of(first.port) == [int(ready["server_pid"])]  # type: ignore[attr-defined]

    # A's own pid file overwritten while A runs: status still finds A, and A rewrites the file.
    (runtime / PID_NAME).write_text("1\n")
    status = cli("status", "--runtime-dir", str(runtime))
    assert status.returncode == 0 and f"llama-guard pid {first.pid}" in status.stdout, status
    assert until(lambda: (runtime / PID_NAME).read_text() == f"{first.pid}\n", 10), (runtime / PID_NAME).read_text()
    # And `restart` signals A (the holder), found the same way.
    restart = cli("restart", "--runtime-dir", str(runtime))
    assert restart.returncode == 0 and f"pid {first.pid}" in restart.stdout, restart
    assert first.wait_event("restart_requested", 20)["server_pid"] == int(ready["server_pid"])
    first.signal(signal.SIGTERM)
    assert first.wait_exit(30) == 0
    assert cli("status", "--runtime-dir", str(runtime)).returncode == 3


def test_truncated_model_is_78_naming_the_file(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with real_model.open("rb") as src:
        truncated.write_bytes(src.read(real_model.stat().st_size // 3))
    run = pool.new(tmp_path, str(llama_server_bin), str(truncated)).start()
    assert run.wait_exit(60) == 78
    failure = run.wait_event("server_boot_failure")
    assert "corrupted or incomplete" in failure["cause"], failure
    assert str(truncated) in failure["cause"] and failure["model"] == str(truncated), failure
    assert json.dumps(failure)  # a plain event


SQUATTER = """
import fcntl, hashlib, os, socket, sys, time
runtime, port = sys.argv[1], sys.argv[2]
names = []
for key in (f"llama-guard/port/{port}",
            "llama-guard/dir/" + hashlib.sha256(os.path.normpath(runtime).encode()).hexdigest()[:32]):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\\0" + key)  # the names an older llama-guard held: any local user can bind them
    s.listen()
    names.append(s)
print("names held", flush=True)
sys.stdin.readline()
try:
    fd = os.open(os.path.join(runtime, "llama-guard.lock"), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("lock taken", flush=True)
except OSError as exc:
    print(f"lock refused: {type(exc).__name__}", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="an unprivileged squatter beside a root daemon needs root")
def test_an_unprivileged_process_can_take_nothing_from_the_daemon(
        pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="llama-guard-squat-"))
    base.chmod(0o755)  # others may look in; the runtime directory llama-guard makes is its own (0700)
    squatter: subprocess.Popen[str] | None = None
    try:
        run = pool.new(base, str(llama_server_bin), str(real_model))
        runtime = base / "run"
        squatter = subprocess.Popen(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", SQUATTER,
             str(runtime), str(run.port)],  # type: ignore[attr-defined]
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert squatter.stdin is not None and squatter.stdout is not None
        assert squatter.stdout.readline().strip() == "names held"
        run.start()
        run.wait_event("server_ready", 60)
        squatter.stdin.write("\n")
        squatter.stdin.flush()
        assert squatter.stdout.readline().strip() == "lock refused: PermissionError"
        status = cli("status", "--runtime-dir", str(runtime))
        assert status.returncode == 0 and f"llama-guard pid {run.pid}" in status.stdout, status
    finally:
        if squatter is not None:
            squatter.kill()
            squatter.wait()
        pool.finish()
        shutil.rmtree(base, ignore_errors=True)
