"""The pid file and status snapshot behind `llama-guard status` and `llama-guard restart`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from llama_guard.status.status import PID_NAME, StatusFile, read_pid, read_status


def test_write_read_remove(tmp_path: Path) -> None:
    sf = StatusFile(tmp_path / "run")
    sf.write({"phase": "ready", "daemon_pid": os.getpid()})
    assert read_status(tmp_path / "run") == {"phase": "ready", "daemon_pid": os.getpid()}
    assert (tmp_path / "run" / PID_NAME).read_text().strip() == str(os.getpid())
    sf.remove()
    assert read_status(tmp_path / "run") is None
    assert not (tmp_path / "run" / PID_NAME).exists()


def test_stale_or_foreign_pid_is_never_signalled(tmp_path: Path) -> None:
    (tmp_path / PID_NAME).write_text("999999999\n")
    assert read_pid(tmp_path) is None
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / PID_NAME).write_text(f"{sleeper.pid}\n")  # a live process that is not llama-guard
        assert read_pid(tmp_path) is None
        out = subprocess.run([sys.executable, "-m", "llama_guard", "restart", "--runtime-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 1 and "no running daemon" in out.stderr
        time.sleep(0.2)
        assert sleeper.poll() is None  # SIGUSR1 would have killed sleep
    finally:
        sleeper.kill()
        sleeper.wait()


def test_unwritable_runtime_dir_is_reported_once_and_ignored(tmp_path: Path, capsys: object) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    sf = StatusFile(blocker / "run")  # a directory below a regular file cannot be created
    sf.write({"a": 1})
    sf.write({"a": 2})
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert err.count("cannot write status") == 1
