"""Files that are not what llama-guard expects: a FIFO where llama-guard expects a regular file
(api_key_file, the config, the runtime dir's pid file and status.json) must be refused at once
with a clear message, never block the process (which then also ignores SIGTERM)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llama_guard.config import ConfigError
from llama_guard.config.api_key import read_api_key
from llama_guard.config.server import ServerConfig

pytestmark = pytest.mark.usefixtures("clean_env")


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llama_guard", *args], capture_output=True, text=True,
                          timeout=30, stdin=subprocess.DEVNULL)


def test_api_key_file_fifo_is_a_config_error(tmp_path: Path) -> None:
    """Regression: api_key_file = a FIFO: read_api_key blocked in open() forever (no writer); `run`
    then hung before its signal handlers could act, and SIGTERM did nothing."""
    server = ServerConfig(binary="/bin/true", model="/tmp/m.gguf", api_key_file=str(_fifo(tmp_path / "key")))
    with pytest.raises(ConfigError, match="not a regular file"):
        read_api_key(server)


@pytest.mark.parametrize("name", ["llama-guard.pid", "status.json"])
@pytest.mark.parametrize("verb", ["status", "restart"])
def test_runtime_file_fifo_does_not_hang_the_cli(tmp_path: Path, name: str, verb: str) -> None:
    """Regression: a FIFO in place of the pid file or status.json made `llama-guard status` (a health
    check run from cron/monitoring) and `restart` block forever."""
    run = tmp_path / "run"
    run.mkdir()
    _fifo(run / name)
    proc = _cli(verb, "--runtime-dir", str(run))
    assert proc.returncode in (1, 3), proc.stderr
    assert "Traceback" not in proc.stderr


def test_status_with_fifo_config_does_not_hang(tmp_path: Path) -> None:
    """Regression: `llama-guard status --config FIFO` blocked reading the config for [runtime].dir."""
    proc = _cli("status", "--config", str(_fifo(tmp_path / "cfg.toml")))
    assert proc.returncode == 78, proc.stderr  # main: an unreadable config is a config error for status
    assert "not a regular file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_runtime_dir_deleted_while_running_gets_its_pid_file_back(tmp_path: Path) -> None:
    """Regression: `rm -rf /run/llama-guard` (tmpfiles cleanup, an operator) while the daemon runs: the
    next snapshot recreated the dir and status.json but never the pid file, so `llama-guard status`
    said "not running" (exit 3) and `restart` found no daemon for the rest of the daemon's life."""
    import shutil

    from llama_guard.status.status import PID_NAME, STATUS_NAME, StatusFile

    run = tmp_path / "run"
    writer = StatusFile(run, on_error=lambda reason: None)
    writer.write({"phase": "ready"})
    shutil.rmtree(run)
    writer.write({"phase": "ready"})
    assert (run / STATUS_NAME).is_file()
    assert (run / PID_NAME).read_text().strip() == str(os.getpid())


def test_world_readable_api_key_file_is_a_check_warning(tmp_path: Path) -> None:
    """Regression: api_key_file mode 0644 (any local user can read the server's API key): `check`
    said OK without a word."""
    from llama_guard.config import Config
    from llama_guard.preflight.process import check_api_key

    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    key.chmod(0o644)
    config = Config.model_validate({"server": {"binary": "/bin/true", "model": "/tmp/m.gguf",
                                               "api_key_file": str(key)}})
    result = check_api_key(config)
    assert result.verdict == "WARN" and "chmod" in result.detail, result
    key.chmod(0o640)
    assert check_api_key(config).verdict == "OK"
