"""The decode speeds recorded at upgrade trials (upgrade/figures.py): what a build found replaced at a
start is compared with. Keyed by the build's hash and the flags (not the executable's path)."""

from __future__ import annotations

from pathlib import Path

from llama_guard.config import Config
from llama_guard.upgrade.figures import FIGURES_FILE, MAX_FIGURES, flags_key, record, recorded


def config(**server: object) -> Config:
    return Config.model_validate({"server": {"model": "/m.gguf", **server}})


def test_a_figure_is_read_back_for_its_build_and_flags_only(tmp_path: Path) -> None:
    key = flags_key(config())
    record(tmp_path, {"aaa": 41.5, "bbb": 12.0}, key)
    assert recorded(tmp_path, "aaa", key) == 41.5 and recorded(tmp_path, "bbb", key) == 12.0
    assert recorded(tmp_path, "ccc", key) is None
    assert recorded(tmp_path, "aaa", flags_key(config(threads=3))) is None
    record(tmp_path, {"aaa": 40.0}, key)  # a later trial's figure replaces it
    assert recorded(tmp_path, "aaa", key) == 40.0


def test_the_key_is_the_flags_and_the_trial_size_not_the_executable() -> None:
    assert flags_key(config(binary="/opt/a/llama-server")) == flags_key(config(binary="/opt/b/llama-server"))
    assert flags_key(config(ctx_size=4096)) != flags_key(config(ctx_size=8192))
    bigger = Config.model_validate({"server": {"model": "/m.gguf"}, "upgrade": {"trial_tokens": 64}})
    assert flags_key(bigger) != flags_key(config())


def test_a_missing_or_malformed_file_reads_as_no_figure(tmp_path: Path) -> None:
    assert recorded(tmp_path / "absent", "aaa", "k") is None
    for text in ("not json", "[1, 2]", '{"aaa:k": {"tokens_per_s": "fast"}}'):
        (tmp_path / FIGURES_FILE).write_text(text)
        assert recorded(tmp_path, "aaa", "k") is None


def test_only_the_newest_figures_are_kept(tmp_path: Path) -> None:
    for i in range(MAX_FIGURES + 4):
        record(tmp_path, {f"build{i}": float(i)}, "k")
    assert recorded(tmp_path, "build0", "k") is None
    assert recorded(tmp_path, f"build{MAX_FIGURES + 3}", "k") == float(MAX_FIGURES + 3)
