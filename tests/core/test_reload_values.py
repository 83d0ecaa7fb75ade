"""A reload names what changed with its old and new value, secrets masked; a config path or model
that is a symlink loop is named as one (not "no such file")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from llama_guard.config import Config, ConfigError, load_config
from llama_guard.core.model_file import model_problem
from llama_guard.core.reload import API_KEY_NAME, MASK, reload_report


def _config(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return load_config(path)


def test_reload_report_shows_old_and_new_values(tmp_path: Path) -> None:
    old = _config(tmp_path, '[server]\nport = 8080\nenv = {HF_HOME = "/a"}\nextra_args = ["--no-webui"]\n'
                            '[health]\ninterval_s = 5.0\n[gpu]\nindex = 0\n')
    new = _config(tmp_path, '[server]\nport = 8081\nenv = {HF_HOME = "/b", XDG_CACHE_HOME = "/c"}\n'
                            'extra_args = ["--no-webui", "--jinja"]\n[health]\ninterval_s = 2.0\n[gpu]\nindex = 1\n')
    report = reload_report(old, new)
    assert report.values["server.port"] == "8080 → 8081"
    assert report.values["health.interval_s"] == "5.0 → 2.0"
    assert report.values["gpu.index"] == "0 → 1"
    assert report.values["server.extra_args"] == "--no-webui → --no-webui --jinja"
    # [server].env: names only, never a value.
    env = report.values["server.env"]
    assert "/a" not in env and "/b" not in env and "/c" not in env, env
    assert env == f"{{HF_HOME={MASK}}} → {{HF_HOME={MASK}, XDG_CACHE_HOME={MASK}}} (value of HF_HOME changed)"
    text = report.text()
    assert "applied: health.interval_s 5.0 → 2.0" in text, text
    assert "NOT applied, needs a daemon restart: gpu.index 0 → 1" in text, text
    assert "server.port: 8080 → 8081" in report.values_text()


def test_reload_report_masks_the_api_key(tmp_path: Path) -> None:
    config = _config(tmp_path, "")
    report = reload_report(config, config, key_changed=True)
    assert report.server_restart == [API_KEY_NAME]
    assert report.values[API_KEY_NAME] == f"{MASK} → {MASK}"
    assert report.changed == ["server"]


def test_a_symlink_loop_is_named_as_one(tmp_path: Path) -> None:
    loop = tmp_path / "loop.toml"
    os.symlink(loop, loop)
    with pytest.raises(ConfigError) as info:
        load_config(loop)
    assert info.value.lines == [f"{loop}: symlink loop (too many levels of symbolic links)"]
    with pytest.raises(ConfigError) as missing:
        load_config(tmp_path / "absent.toml")
    assert missing.value.lines == [f"{tmp_path / 'absent.toml'}: no such file"]
    model = tmp_path / "a.gguf"
    os.symlink(tmp_path / "b.gguf", model)
    os.symlink(model, tmp_path / "b.gguf")
    assert model_problem(model) == f"{model}: symlink loop (too many levels of symbolic links)"
