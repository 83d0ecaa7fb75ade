"""The files llama-guard writes under [runtime].dir are its own: atomic, owner-only, and locked
against a second daemon on the same directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, DaemonRun, base_sections, free_port, server_pids_of, wait_gone
from llama_guard.status.status import LOCK_NAME, PID_NAME, STATUS_NAME, AlreadyRunning, RuntimeLock, StatusFile

pytestmark = pytest.mark.timeout(120)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_status_and_pid_files_are_owner_only_and_atomic(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    status = StatusFile(runtime)
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        status.write({"daemon_pid": os.getpid(), "phase": "ready"})
    finally:
        os.umask(old_umask)
    assert mode(runtime) == 0o700
    assert mode(runtime / STATUS_NAME) == 0o600
    assert mode(runtime / PID_NAME) == 0o600
    assert (runtime / PID_NAME).read_text() == f"{os.getpid()}\n"
    # A world-readable file left by an older version is replaced, not reused with its mode.
    (runtime / STATUS_NAME).chmod(0o644)
    status.write({"daemon_pid": os.getpid(), "phase": "starting"})
    assert mode(runtime / STATUS_NAME) == 0o600
    assert json.loads((runtime / STATUS_NAME).read_text())["phase"] == "starting"
    assert sorted(p.name for p in runtime.iterdir()) == [PID_NAME, STATUS_NAME]  # no temporary left


def test_lock_names_the_holder_and_is_released(tmp_path: Path) -> None:
    first = RuntimeLock(tmp_path / "run")
    first.acquire()
    assert mode(tmp_path / "run" / LOCK_NAME) == 0o600
    # The same lock taken from another process fails while held (flock is per open file).
    code = ("import sys; from pathlib import Path; from llama_guard.status.status import RuntimeLock, AlreadyRunning\n"
            "try:\n RuntimeLock(Path(sys.argv[1])).acquire()\nexcept AlreadyRunning as e:\n"
            " print(e.pid); sys.exit(3)\n")
    held = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=30, check=False)
    assert held.returncode == 3 and held.stdout.strip() == str(os.getpid()), held
    with pytest.raises(AlreadyRunning) as info:
        RuntimeLock(tmp_path / "run").acquire()
    assert info.value.pid == os.getpid() and str(os.getpid()) in str(info.value)
    first.release()
    again = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                           timeout=30, check=False)
    assert again.returncode == 0, again


def test_second_daemon_refuses_and_leaves_the_first_alone(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    port = free_port()
    sections = base_sections(tmp_path, str(llama_server_bin), str(real_model), port)
    first = DaemonRun(tmp_path, sections).start()
    second: DaemonRun | None = None
    try:
        ready = first.wait_event("server_ready", 60)
        runtime = tmp_path / "run"
        pid_before = (runtime / PID_NAME).read_text()
        assert pid_before == f"{first.pid}\n"
        # The same runtime dir, another port: a second server would be possible but must not start.
        other = dict(sections, server={**sections["server"], "port": free_port()})
        second_dir = tmp_path / "second"
        second_dir.mkdir()
        second = DaemonRun(second_dir, other)
        second.start()
        code = second.wait_exit(60)
        assert code != 0
        names = second.names()
        assert "server_starting" not in names, names
        error = second.wait_event("config_error")
        assert f"llama-guard pid {first.pid}" in error["reason"], error
        assert server_pids_of(port) == [int(ready["server_pid"])]
        assert not server_pids_of(int(other["server"]["port"]))  # type: ignore[arg-type]
        # The winner's files are intact, and `status` still finds it.
        assert (runtime / PID_NAME).read_text() == pid_before
        assert json.loads((runtime / STATUS_NAME).read_text())["daemon_pid"] == first.pid
        status = subprocess.run([sys.executable, "-m", "llama_guard", "status", "--runtime-dir", str(runtime)],
                                capture_output=True, text=True, cwd=str(ROOT), timeout=30, check=False)
        assert status.returncode == 0 and f"llama-guard pid {first.pid}" in status.stdout, status
    finally:
        if second is not None:
            second.stop()
        first.signal(signal.SIGTERM)
        assert first.wait_exit(30) == 0
        first.stop()
        assert wait_gone(int(first.wait_event("server_ready")["server_pid"]))


HOLD_LOCK = ("import fcntl, os, sys, time\n"
             "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); fcntl.flock(fd, fcntl.LOCK_EX)\n"
             "print('held', flush=True); time.sleep(120)\n")


def test_a_lock_holder_that_is_not_llama_guard_is_named_as_what_it_is(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(runtime / LOCK_NAME)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(AlreadyRunning) as info:
            RuntimeLock(runtime).acquire()
        text = str(info.value)
        assert info.value.pid == holder.pid
        assert f"pid {holder.pid} ({os.path.realpath(sys.executable)}: " in text and "which is not llama-guard" in text
        assert "llama-guard pid" not in text
    finally:
        holder.kill()
        holder.wait()
    lock = RuntimeLock(runtime)
    lock.acquire()  # the holder gone, the lock is free at once
    lock.release()


def test_a_runtime_dir_others_may_write_is_refused_naming_its_mode(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    runtime.chmod(0o777)
    with pytest.raises(PermissionError) as info:
        RuntimeLock(runtime).acquire()
    assert "writable by others (mode 0777)" in str(info.value)
    assert not (runtime / LOCK_NAME).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_runtime_dir_of_another_user_is_refused_naming_its_owner(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, 65534, 65534)  # made in advance by an unprivileged user (nobody)
    with pytest.raises(PermissionError) as info:
        RuntimeLock(runtime).acquire()
    assert "belongs to uid 65534" in str(info.value)


def test_a_deleted_lock_file_is_locked_again_at_the_next_status_write(tmp_path: Path) -> None:
    from llama_guard.status.snapshot import RuntimeFiles
    from llama_guard.status.status import holder_of

    runtime = tmp_path / "run"
    files = RuntimeFiles(runtime, lambda *a, **k: None)
    files.acquire({})
    try:
        assert holder_of(runtime) == os.getpid()
        shutil.rmtree(runtime)
        assert holder_of(runtime) is None
        files.write({"daemon_pid": os.getpid()})
        assert holder_of(runtime) == os.getpid()
        with pytest.raises(AlreadyRunning):
            RuntimeLock(runtime).acquire()
    finally:
        files.release()
    assert holder_of(runtime) is None
