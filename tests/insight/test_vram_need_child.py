"""The VRAM need for the admission is computed in a child process (the GGUF read holds the GIL for
seconds): same answer as in-process, None when the child cannot read the model or runs out of time."""

from __future__ import annotations

from pathlib import Path

from llama_guard.config import Config
from llama_guard.config.server import ServerConfig
from llama_guard.insight.budget import Settings
from llama_guard.preflight.vram_check import estimated_need_mib, need_mib_in_child


def test_the_child_gives_the_in_process_answer(real_model: Path) -> None:
    config = Config(server=ServerConfig(model=str(real_model), n_gpu_layers=99, ctx_size=4096))
    need = need_mib_in_child(str(real_model), Settings.from_server(config.server))
    assert need is not None and need == estimated_need_mib(config)


def test_an_unreadable_model_or_a_slow_child_gives_none(tmp_path: Path, real_model: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert need_mib_in_child(str(bad), Settings(n_gpu_layers=99)) is None
    assert need_mib_in_child(str(real_model), Settings(n_gpu_layers=99), timeout_s=0.01) is None
    assert need_mib_in_child(str(real_model), Settings(n_gpu_layers=0)) is None
