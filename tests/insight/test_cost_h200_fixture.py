"""Replays the H200 runs of scripts/gpu_cost.py (tests/fixtures/h200_cost/) through today's code.

Insight (``insight/``): a 27B-class model (scripts/gpu_synth_model.py: qwen2, 64 layers × 5120, 40/8 heads
of 128, feed-forward 21504, a 152,064-token vocabulary, Q4_K) served by the CUDA llama-server at three flag
sets; recorded are each configuration, the server's ``-lv 4`` buffer sizes, NVML's figure for its pid and
``bench``'s inputs. Here the same model's header is written again (a sparse file: the metadata and tensor
index of the 15.2 GB file, no data), and today's budget, need estimate and ceiling are computed from it:
nothing predicted is read from the fixture.

Start-up: one round's recorded daemon events (``start_after_events.jsonl``) go through today's event catalog.
``start_before.json``, ``start_after.json``, ``rss.json``, ``liveness_*.txt`` and ``front_smol.txt`` are the
start-up, memory, decode-speed and front-door tables of the same run on that machine (benchmarks/bench_start.py,
bench_rss.py, bench_liveness.py, bench_front.py), kept as recorded: figures, not tests.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from llama_guard.config import load_config
from llama_guard.insight.budget import Settings, estimate, weights_read_bytes
from llama_guard.insight.ceiling import Ceiling
from llama_guard.insight.model_facts import read_model_facts
from llama_guard.preflight.vram_check import need_mib_in_child
from llama_guard.vocab.events import CATALOG, render_message
from llama_guard.vocab.units import MIB

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_synth_model  # noqa: E402

FIX = Path(__file__).parents[1] / "fixtures" / "h200_cost"
SUMMARY: dict[str, Any] = json.loads((FIX / "insight" / "summary.json").read_text())
ROWS = {row["name"]: row for row in SUMMARY["rows"]}
MODEL_BYTES = 15_240_752_736  # the file the H200 run served (ls -l there)


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("m") / "qwen27b.gguf"
    gpu_synth_model.write(path, name="random Qwen2 27B-class Q4_K", sparse=True, **gpu_synth_model.SHAPE_27B)
    assert path.stat().st_size == MODEL_BYTES  # the same tensor index as the file on the GPU machine
    return path


def settings_of(name: str, tmp_path: Path, model: Path) -> Settings:
    """The recorded config file, loaded by today's config code (paths pointed at this host)."""
    text = (FIX / "insight" / f"config-{name}.toml").read_text()
    text = text.replace("/tmp/lg/qwen27b.gguf", str(model)).replace("/tmp/lg/build/bin/llama-server", "/bin/true")
    text = text.replace(f"/tmp/res/insight-27b/run-{name}", str(tmp_path / "run"))
    path = tmp_path / "config.toml"
    path.write_text(text)
    return Settings.from_server(load_config(path).server)


def cuda0(row: dict[str, Any], kind: str) -> float:
    return float(sum(b["mib"] for b in row["server_buffers"] if b["device"] == "CUDA0" and b["kind"] == kind))


@pytest.mark.parametrize("name", ["ref", "ctx32k-f16", "ngl40"])
def test_check_predicts_nvmls_figure_within_5_percent(name: str, tmp_path: Path, model_27b: Path) -> None:
    row = ROWS[name]
    budget = estimate(read_model_facts(model_27b), settings_of(name, tmp_path, model_27b), gpu_build=True)
    measured = row["nvml_after_bench"]["pid_used_mib"]
    assert abs(budget.total / MIB - measured) <= 0.05 * measured, (budget.total / MIB, measured)
    # The parts the server printed: weights and KV cache to within 1 %.
    assert abs(budget.weights_gpu / MIB - cuda0(row, "model")) <= 0.01 * cuda0(row, "model")
    assert abs(budget.kv_cache / MIB - cuda0(row, "KV")) <= 0.01 * cuda0(row, "KV")


def test_the_need_estimate_of_a_152k_vocabulary_is_cheap_and_below_what_the_server_took(
        tmp_path: Path, model_27b: Path) -> None:
    settings = settings_of("ref", tmp_path, model_27b)
    need = need_mib_in_child(str(model_27b), settings)  # header and tensor index only (a sparse file)
    measured = ROWS["ref"]["nvml_after_bench"]["pid_used_mib"]
    assert need is not None and 0.85 * measured <= need <= measured  # the admission waits for 90 %


def test_benchs_ceiling_replays_to_the_recorded_verdicts(tmp_path: Path, model_27b: Path) -> None:
    facts = read_model_facts(model_27b)
    ceilings = {}
    for name in ROWS:
        recorded = json.loads((FIX / "insight" / f"bench-{name}.json").read_text())["results"][0]["ceiling"]
        s = settings_of(name, tmp_path, model_27b)
        gpu_weights = weights_read_bytes(facts, s, gpu=True)  # today's budget, from the model's header
        ceilings[name] = Ceiling(recorded["bandwidth"], recorded["source"], gpu_weights, recorded["kv_read"],
                                 recorded["context"], recorded["measured"], True,
                                 weights_read_bytes(facts, s, gpu=False) - gpu_weights)
        assert ceilings[name].tokens_per_s == pytest.approx(recorded["ceiling_tokens_per_s"], rel=0.01)
    # Fully offloaded, the 27B model reads ~14.8 GB per token: a quarter of the H200's 4.8 TB/s ceiling
    # (fixed per-token costs still take ~3/4 of each token's 12.8 ms there), which the rule calls bandwidth-bound.
    assert ceilings["ref"].bandwidth_bound and ceilings["ctx32k-f16"].bandwidth_bound
    assert ceilings["ref"].host_weights_read == 0
    # With 40 of 64 layers offloaded, 5.7 GB stay in host memory: the CPU's reads bind, not launches.
    partial = ceilings["ngl40"]
    assert not partial.bandwidth_bound and partial.host_weights_read > 5e9
    assert "host memory" in partial.verdict() and "small model" not in partial.verdict()
    assert partial.as_dict()["binding_limit"] == "host memory (layers on the CPU)"


# ------------------------------------------------------------------ start-up and restart (bench_start.py)


def recorded_events() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIX / "start_after_events.jsonl").read_text().splitlines() if line]


def test_the_recorded_daemon_events_render_with_todays_catalog() -> None:
    events = recorded_events()
    assert events
    for event in events:  # every name still in the catalog, every message the same from the same fields
        assert event["event"] in CATALOG, event["event"]
        fields = {k: v for k, v in event.items() if k not in ("event", "message", "timestamp", "level")}
        recorded = TEMPLATE_AT_RECORDING.get(event["event"], "").format(**fields) or event["message"]
        assert recorded == event["message"], event["event"]  # the older template made the recorded line
        if event["event"] not in TEMPLATE_AT_RECORDING:
            assert render_message(event["event"], fields) == event["message"], event["event"]


# Templates changed on purpose since the recording: the template the recorded message was made with.
# limit_not_raised was "{limit}: {reason}", which named the limit twice (the reason starts with it).
TEMPLATE_AT_RECORDING = {"limit_not_raised": "{limit}: {reason}"}
