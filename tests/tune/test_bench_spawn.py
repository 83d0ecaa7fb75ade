"""``bench --spawn`` starts the real llama-server through the daemon's child set-up: the service
manager's variables stripped, ``[server].env`` added, ``[limits]`` rlimits set, privileges dropped
(no capabilities, no_new_privs), in its own process group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import base_sections, config_text, free_port, merge
from llama_guard.config import load_config
from llama_guard.tune.bench import BenchError, spawned_server


def _status(pid: int) -> dict[str, str]:
    rows = (line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: value.strip() for key, value in rows}


def _soft_nofile(pid: int) -> str:
    row = next(line for line in Path(f"/proc/{pid}/limits").read_text().splitlines()
               if line.startswith("Max open files"))
    return row.split()[3]


def test_bench_spawn_uses_the_daemon_child_setup(tmp_path: Path, llama_server_bin: Path, real_model: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sections = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), free_port()), {
        "server": {"env": {"LG_BENCH_MARK": "yes"}},
        "limits": {"nofile": 4321},
    })
    path = tmp_path / "bench.toml"
    path.write_text(config_text(sections))
    config = load_config(path)
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    with spawned_server(config, tmp_path / "server.log") as proc:
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{proc.pid}/environ").read_bytes().decode().split("\0") if "=" in item)
        status = _status(proc.pid)
        assert os.getpgid(proc.pid) == proc.pid  # its own process group
        assert environ["LG_BENCH_MARK"] == "yes"
        assert "NOTIFY_SOCKET" not in environ and "WATCHDOG_USEC" not in environ
        assert _soft_nofile(proc.pid) == "4321"
        assert status["NoNewPrivs"] == "1"
        assert int(status["CapEff"], 16) == 0 and int(status["CapAmb"], 16) == 0
    assert proc.poll() is not None


def test_bench_spawn_refuses_an_unknown_server_user(tmp_path: Path, llama_server_bin: Path,
                                                    real_model: Path) -> None:
    sections = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), free_port()),
                     {"server": {"user": "no-such-user-lg"}})
    path = tmp_path / "bench.toml"
    path.write_text(config_text(sections))
    with pytest.raises(BenchError, match="no such user"), spawned_server(load_config(path), tmp_path / "log"):
        pass
