"""`llama-guard check` flags [server] sizes llama-server cannot run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, base_sections, config_text, free_port, merge
from llama_guard.config import Config
from llama_guard.preflight.server import MIN_SLOT_TOKENS, check_settings


def sizes(**server: int) -> list[tuple[str, str]]:
    config = Config.model_validate({"server": server})
    return [(r.verdict, r.detail) for r in check_settings(config)]


@pytest.mark.parametrize(("server", "verdict"), [
    ({"ctx_size": 1}, "FAIL"),                                   # the real server aborts in warm-up
    ({"ctx_size": 3, "parallel": 2}, "FAIL"),                     # 1 token per slot
    ({"ctx_size": 4, "parallel": 8}, "FAIL"),                     # parallel above ctx_size
    ({"ctx_size": 2 * MIN_SLOT_TOKENS, "parallel": 2, "batch_size": 2, "ubatch_size": 2}, "OK"),
    ({"ctx_size": 256, "batch_size": 512, "ubatch_size": 256}, "WARN"),  # runs, batch lowered to context
    ({"ctx_size": 8192, "parallel": 4, "batch_size": 4096, "ubatch_size": 512}, "WARN"),  # 2048 per slot
    ({"ctx_size": 8192}, "OK"),                                   # the shipped defaults
    ({"ctx_size": 0}, "OK"),                                      # the model's own context
])
def test_sizes(server: dict[str, int], verdict: str) -> None:
    results = sizes(**server)
    assert [v for v, _ in results] == [verdict], results


def test_fail_names_the_abort_and_the_fix() -> None:
    [(verdict, detail)] = sizes(ctx_size=1)
    assert verdict == "FAIL" and "warm-up" in detail and "Raise ctx_size" in detail


def test_check_cli_fails_for_ctx_size_1(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    sections = merge(base_sections(tmp_path, str(llama_server_bin), str(real_model), free_port()),
                     {"server": {"ctx_size": 1}})
    config = tmp_path / "llama-guard.toml"
    config.write_text(config_text(sections))
    out = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(config)],
                         capture_output=True, text=True, timeout=120, cwd=str(ROOT), check=False)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "sizes" in out.stdout and "FAIL" in out.stdout and "ctx_size = 1" in out.stdout, out.stdout
