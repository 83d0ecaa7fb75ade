"""`llama-guard status`/`restart` never answer "not running" when they cannot know: a broken config
names its problem (exit 78), unreadable runtime files say so (status exit 4), and the last planned
restart is rendered from the history record's own fields."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from llama_guard.status.status_view import render
from needs import unavailable

SUPERVISOR = Path(__file__).resolve().parents[2] / "supervisor"


def cli(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SUPERVISOR)}
    return subprocess.run([*prefix, sys.executable, "-m", "llama_guard", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd="/", check=False)


def test_status_and_restart_with_a_broken_config_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 1\n[server]\nport = 2\n")
    for verb in ("status", "restart"):
        out = cli(verb, "--config", str(bad))
        assert out.returncode == 78, out
        assert "config error" in out.stderr and "--runtime-dir" in out.stderr
        assert "not running" not in out.stderr and "no running daemon" not in out.stderr
    missing = cli("status", "--config", str(tmp_path / "missing.toml"))
    assert missing.returncode == 78 and "missing.toml" in missing.stderr


def test_status_on_a_runtime_dir_it_may_not_read_says_so(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        unavailable("needs root and setpriv to read the runtime dir as uid 65534")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / "llama-guard.pid").write_text(f"{os.getpid()}\n")
    tmp_path.chmod(0o755)
    out = cli("status", "--runtime-dir", str(run_dir),
              prefix=("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"))
    if "No module named" in out.stderr:
        unavailable(f"uid 65534 cannot import llama_guard here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 4, out
    assert "permission denied" in out.stderr


def test_last_planned_restart_shows_the_records_reason_and_outcome() -> None:
    snap = {"phase": "ready", "server_pid": 7, "daemon_pid": 6,
            "planned_restarts": {"next_fire": None, "history": [
                {"kind": "requested", "reason": "SIGUSR1 (llama-guard restart)", "drained": True,
                 "unavailable_s": 0.52}]}}
    from llama_guard.status.status_view import document

    text = "\n".join(render(document(snap)))
    line = next(ln for ln in text.splitlines() if "last planned restart" in ln)
    assert "SIGUSR1" in line and "drained" in line and "0.5 s" in line and "None" not in line
