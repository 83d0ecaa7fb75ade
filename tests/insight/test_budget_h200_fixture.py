"""The budget against NVML's figure for a real CUDA llama-server on the H200 at eight flag sets
(tests/fixtures/h200_vram/vram_measure.json, scripts/gpu_vram_measure.py), with the real SmolLM2 GGUF.

Two runs calibrate the two CUDA constants (``reference``: CUDA_RUNTIME_MIB; ``ngl0``: CUDA_CONTEXT_MIB);
the other six are independent checks of the weights, KV cache and compute-buffer arithmetic. The bench
runs of the same fixture check the ceiling and the "not bandwidth-bound" verdict."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from llama_guard.insight.budget import Settings, estimate, kv_read_bytes, weights_read_bytes
from llama_guard.insight.ceiling import Ceiling, bandwidth_from_bus
from llama_guard.insight.model_facts import read_model_facts
from llama_guard.vocab.units import MIB

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "h200_vram" / "vram_measure.json").read_text())
CALIBRATION = {"reference", "ngl0"}


def settings(flags: list[str]) -> Settings:
    m = dict(zip(flags[::2], flags[1::2], strict=True))
    return Settings(n_gpu_layers=int(m["-ngl"]), ctx_size=int(m["-c"]), parallel=int(m["-np"]),
                    batch_size=int(m["-b"]), ubatch_size=int(m["-ub"]), cache_type_k=m.get("-ctk", "f16"),
                    cache_type_v=m.get("-ctv", "f16"), flash_attn=m["-fa"])


@pytest.mark.parametrize("name", sorted(FIXTURE["configs"]))
def test_budget_within_ten_percent_of_nvml(real_model: Path, name: str) -> None:
    config = FIXTURE["configs"][name]
    assert FIXTURE["model_bytes"] == real_model.stat().st_size  # the same GGUF file
    budget = estimate(read_model_facts(real_model), settings(config["flags"]), gpu_build=True)
    predicted, measured = budget.total / MIB, config["pid_mib"]
    tolerance = 0.10 if name in CALIBRATION else 0.05  # the independent ones came out within 2 %
    assert predicted == pytest.approx(measured, rel=tolerance), f"{name}: predicted {predicted:.0f} MiB"


def test_the_h200_bench_is_far_below_its_ceiling(real_model: Path) -> None:
    gpu = FIXTURE["gpu"]
    bw = bandwidth_from_bus(gpu["bus_width_bits"], gpu["max_mem_clock_mhz"])
    runs = FIXTURE["bench"]["reference"]["runs"]
    median = statistics.median(r["predicted_per_second"] for r in runs)
    context = int(statistics.median(r["cache_n"] + r["prompt_n"] + r["predicted_n"] for r in runs))
    facts = read_model_facts(real_model)
    s = settings(FIXTURE["bench"]["reference"]["flags"])
    c = Ceiling(bandwidth=bw, source="NVML", weights_read=weights_read_bytes(facts, s, gpu=True),
                kv_read=kv_read_bytes(facts, s, context), context=context, measured=median)
    assert c.tokens_per_s == pytest.approx(49_000, rel=0.03)  # SmolLM2 on an H200: a ceiling near 49,000
    assert 600 < median < 700 and c.bandwidth_bound is False
    assert "not bandwidth-bound" in c.verdict() and "kernel launches" in c.verdict()
