"""The bandwidth ceiling against the V100 arithmetic of docs/insight.md and NVML's figures."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_nvml import FakeNvml
from gguf_synth import facts_27b
from llama_guard.config import Config
from llama_guard.gpu.info import gpu_memory_facts
from llama_guard.insight.budget import Settings, kv_read_bytes, weights_read_bytes
from llama_guard.insight.ceiling import Ceiling, bandwidth_from_bus, ceiling_tokens_per_s


def test_v100_bandwidth_and_the_16_gb_ceiling() -> None:
    bw = bandwidth_from_bus(4096, 877)
    assert bw / 1e9 == pytest.approx(898.0, abs=0.5)  # datasheet 900 GB/s
    assert ceiling_tokens_per_s(bw, 16e9) == pytest.approx(56.1, abs=0.1)  # "cannot beat ~56 tokens/s"
    c = Ceiling(bandwidth=bw, source="NVML", weights_read=int(16e9), kv_read=0, context=0, measured=38.6)
    assert c.efficiency == pytest.approx(38.6 / 56.1, abs=0.005)  # "about 69%"
    assert c.bandwidth_bound is True and "bandwidth-bound" in c.verdict() and "69%" in c.verdict()


def test_h200_bandwidth_and_a_small_model_is_not_bandwidth_bound() -> None:
    bw = bandwidth_from_bus(6016, 3201)
    assert bw / 1e12 == pytest.approx(4.81, abs=0.01)  # datasheet 4.8 TB/s
    # SmolLM2-135M Q4_1: ~98 MB read per token → a ceiling near 49,000 tokens/s; measured ~650.
    c = Ceiling(bandwidth=bw, source="NVML", weights_read=96_000_000, kv_read=2_000_000, context=300, measured=650.0)
    assert c.tokens_per_s == pytest.approx(49_100, rel=0.01)
    assert c.bandwidth_bound is False
    text = c.verdict()
    assert "not bandwidth-bound" in text and "1%" not in text and "per-token costs bind" in text
    assert c.as_dict()["binding_limit"].startswith("per-token overhead")


def test_unknown_bandwidth_says_so() -> None:
    c = Ceiling(bandwidth=None, source="no GPU found and [gpu].memory_bandwidth_gbs not set", weights_read=10**8,
                kv_read=0, context=10, measured=100.0)
    assert c.tokens_per_s is None and c.efficiency is None
    assert "ceiling unknown" in c.verdict() and "memory_bandwidth_gbs" in c.verdict()


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        bandwidth_from_bus(0, 877)
    with pytest.raises(ValueError, match="positive"):
        ceiling_tokens_per_s(1e12, 0)


def test_27b_bytes_per_token_grow_with_the_context() -> None:
    f = facts_27b()
    s = Settings(cache_type_k="q8_0", cache_type_v="q8_0")
    weights = weights_read_bytes(f, s, gpu=True)
    assert weights == weights_read_bytes(f, s, gpu=False)  # all offloaded: the same tensors
    short, long = kv_read_bytes(f, s, 256), kv_read_bytes(f, s, 8192)
    assert long == pytest.approx(32 * short, rel=1e-6)
    v100 = bandwidth_from_bus(4096, 877)
    assert ceiling_tokens_per_s(v100, weights + long) < ceiling_tokens_per_s(v100, weights + short) < 60


def cfg(tmp: Path, **gpu: object) -> Config:
    return Config.model_validate({"server": {"model": str(tmp / "m.gguf")}, "gpu": {"enabled": "auto", **gpu}})


def test_bandwidth_and_free_memory_from_nvml(tmp_path: Path) -> None:
    facts = gpu_memory_facts(cfg(tmp_path), nvml_module=FakeNvml())
    assert facts.bandwidth == pytest.approx(bandwidth_from_bus(6016, 3201))
    assert "6016 bit × 3201 MHz" in facts.bandwidth_source
    assert facts.available == 79 * 2**30 and "NVML" in facts.available_source


def test_config_overrides_win_over_nvml(tmp_path: Path) -> None:
    fake = FakeNvml()
    facts = gpu_memory_facts(cfg(tmp_path, memory_bandwidth_gbs=900, vram_total_mib=16384), nvml_module=fake)
    assert facts.bandwidth == 900e9 and facts.available == 16384 * 2**20
    assert fake.calls["nvmlInit"] == 0  # nothing asked of NVML when both are stated


def test_no_gpu_gives_no_figures_and_a_reason(tmp_path: Path) -> None:
    fake = FakeNvml()
    fake.init_error = 12  # no libnvidia-ml: a CPU host
    facts = gpu_memory_facts(cfg(tmp_path), nvml_module=fake)
    assert facts.bandwidth is None and facts.available is None and "no GPU reading" in facts.note


def test_a_gpu_that_does_not_report_its_bus_width(tmp_path: Path) -> None:
    fake = FakeNvml()
    fake.fail("nvmlDeviceGetMemoryBusWidth", 3)
    facts = gpu_memory_facts(cfg(tmp_path), nvml_module=fake)
    assert facts.bandwidth is None and "not reported by NVML" in facts.note and facts.available is not None
