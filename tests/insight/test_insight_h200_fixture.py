"""Replays `scripts/gpu_insight.py`'s run on the H200 (tests/fixtures/h200_insight/): the budget that
``check`` computes for the recorded configurations, against what the real CUDA llama-server then used.

The recorded inputs are the two configurations (context 8192 and 32768, the reference flags), the
buffer sizes the server printed at ``-lv 4`` and NVML's figure for its pid. The predictions are made
now, by today's code, from the same GGUF file (the real SmolLM2 model): nothing predicted is read from
the fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llama_guard.config import load_config
from llama_guard.insight.budget import Settings, estimate
from llama_guard.insight.model_facts import read_model_facts
from llama_guard.vocab.units import MIB

FIX = Path(__file__).parents[1] / "fixtures" / "h200_insight"
SUMMARY: dict[str, Any] = json.loads((FIX / "summary.json").read_text())
ROWS = {row["ctx_size"]: row for row in SUMMARY["rows"]}


def settings_of(ctx: int, tmp_path: Path, model: Path) -> Settings:
    """The recorded config file, loaded by today's config code (paths pointed at this host)."""
    text = (FIX / f"config-{ctx}.toml").read_text()
    text = text.replace("/tmp/lg/model.gguf", str(model)).replace("/tmp/lg/build/bin/llama-server", "/bin/true")
    text = text.replace(f"/tmp/lg/ins/run-{ctx}", str(tmp_path / "run"))
    path = tmp_path / "config.toml"
    path.write_text(text)
    return Settings.from_server(load_config(path).server)


def cuda0(row: dict[str, Any], kind: str) -> float:
    (mib,) = [b["mib"] for b in row["server_buffers"] if b["device"] == "CUDA0" and b["kind"] == kind]
    return float(mib)


@pytest.mark.parametrize("ctx", sorted(ROWS))
def test_check_budget_within_ten_percent_of_the_servers_nvml_figure(ctx: int, tmp_path: Path,
                                                                    real_model: Path) -> None:
    row = ROWS[ctx]
    budget = estimate(read_model_facts(real_model), settings_of(ctx, tmp_path, real_model), gpu_build=True)
    measured = row["nvml_after_warmup"]["pid_used_mib"]
    assert budget.total / MIB == pytest.approx(measured, rel=0.10)


# Known gap (2026-11-30): on CUDA with flash attention and a quantized KV cache the compute buffer grows
# faster with the context than the estimate (42.85 MiB printed at 32768 against 23.7 estimated); the
# total stays within 2 % because the calibrated CUDA constant is larger than that gap. strict: this test
# starts failing (and must be un-marked) once the compute estimate follows CUDA's.
@pytest.mark.parametrize("ctx", [8192, pytest.param(32768, marks=pytest.mark.xfail(
    strict=True, reason="compute buffer estimate ~45 % low on CUDA at 32768 (see comment)"))])
def test_budget_parts_match_the_buffers_the_server_printed(ctx: int, tmp_path: Path, real_model: Path) -> None:
    row = ROWS[ctx]
    budget = estimate(read_model_facts(real_model), settings_of(ctx, tmp_path, real_model), gpu_build=True)
    assert budget.weights_gpu / MIB == pytest.approx(cuda0(row, "model"), rel=0.01)
    assert budget.kv_cache / MIB == pytest.approx(cuda0(row, "KV"), rel=0.01)
    # The compute buffer is an estimate of llama.cpp's graph reservation (see insight/budget.py).
    assert budget.compute / MIB == pytest.approx(cuda0(row, "compute"), rel=0.15)


def test_a_bigger_context_grows_the_budget_as_the_server_grew(tmp_path: Path, real_model: Path) -> None:
    """Today's estimate at both recorded contexts grows as NVML saw the server grow, and its KV cache
    part as the server's printed KV buffer grew."""
    facts = read_model_facts(real_model)
    small, big = (estimate(facts, settings_of(ctx, tmp_path, real_model), gpu_build=True) for ctx in (8192, 32768))
    seen = ROWS[32768]["nvml_after_warmup"]["pid_used_mib"] - ROWS[8192]["nvml_after_warmup"]["pid_used_mib"]
    assert (big.total - small.total) / MIB == pytest.approx(seen, rel=0.10)
    assert (big.kv_cache - small.kv_cache) / MIB == pytest.approx(cuda0(ROWS[32768], "KV") - cuda0(ROWS[8192], "KV"),
                                                                  rel=0.01)
