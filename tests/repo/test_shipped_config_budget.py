"""The shipped etc/llama-guard.toml tells the truth about the card it names: `llama-guard check` passes
it on a stated 16 GB V100 (16,160 MiB, what NVML reports for one) with the 27B-shaped Q4_K_M model
the header names, and the figures its header quotes are the
ones `check` prints (all layers on the GPU would not fit, as the header says)."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gguf_synth import write_gguf_27b
from harness import FAKE_NVML_RUN

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "etc" / "llama-guard.toml"
MIB_PER_GIB = 1024
V100_16GB_MIB = 16160  # NVML's memory total of a V100-SXM2-16GB / V100-PCIE-16GB (nvidia-smi: "16160MiB")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_27b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf_27b(tmp_path_factory.mktemp("m27b") / "model-27b-Q4_K_M.gguf")


def check(binary: Path, model: Path, tmp: Path, **overrides: str) -> tuple[int, dict[str, Any]]:
    """`llama-guard check --json` on the shipped file; only what this host cannot have is overridden:
    the binary and model paths, the server account (no `llama-server` user here), and the stated card.
    The GPU is NVML's double, sized as that card (the shipped file offloads, so a host without the
    driver fails `check`)."""
    script = tmp / "nvml.json"
    script.write_text(json.dumps({"values": {"memory_total": V100_16GB_MIB * 2**20, "memory_used": 0}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
    env.update({"FAKE_NVML_SCRIPT": str(script), "FAKE_NVML_STATE": str(tmp / "nvml-state.json"),
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests"), env.get("PYTHONPATH", "")) if p)})
    env.update({"LLAMA_GUARD_SERVER__BINARY": str(binary), "LLAMA_GUARD_SERVER__MODEL": str(model),
                "LLAMA_GUARD_SERVER__USER": "", "LLAMA_GUARD_SERVER__GROUP": "",
                "LLAMA_GUARD_SERVER__SUPPLEMENTARY_GROUPS": "[]", "LLAMA_GUARD_GPU__VRAM_TOTAL_MIB": str(V100_16GB_MIB),
                **{f"LLAMA_GUARD_{k.upper()}": v for k, v in overrides.items()}})
    out = subprocess.run([*FAKE_NVML_RUN, "check", "--json", "--config", str(SHIPPED)],
                         capture_output=True, text=True, env=env, timeout=90, check=False)
    return out.returncode, json.loads(out.stdout)


def vram_row(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in doc["checks"] if c["name"] == "vram budget" and "data" in c)


def header_gib(pattern: str) -> float:
    header = SHIPPED.read_text().split("\n[server]")[0]
    found = re.search(pattern, header.replace("\n# ", " "))
    assert found, pattern
    return float(found.group(1))


def test_check_passes_the_shipped_file_on_a_16_gb_v100(llama_server_bin: Path, model_27b: Path,
                                                        tmp_path: Path) -> None:
    code, doc = check(llama_server_bin, model_27b, tmp_path)
    failed = [c for c in doc["checks"] if c["verdict"] == "FAIL"]
    assert code == 0 and not failed, failed
    row = vram_row(doc)
    assert row["verdict"] == "OK", row["detail"]  # not even "tight" (within the estimate's ±10 %)
    budget = row["data"]["budget"]
    assert budget["available"] == V100_16GB_MIB * 2**20
    header = SHIPPED.read_text().split("\n[server]")[0].replace("\n# ", " ")
    assert f"{V100_16GB_MIB:,} MiB" in header
    # The header names the example shape precisely: the one this test's model has.
    shape = inspect.signature(write_gguf_27b).parameters
    assert (f"{shape['n_layer'].default} blocks, embedding {shape['n_embd'].default}, "
            f"{shape['n_head'].default} query / {shape['n_head_kv'].default} KV heads of {shape['head_dim'].default}, "
            f"FFN {shape['n_ff'].default}, vocab {shape['n_vocab'].default}") in header
    # The header's figures are the product's: what it budgets, and the weights on the GPU.
    assert budget["total"] / 2**30 == pytest.approx(header_gib(r"it budgets ~([\d.]+) GiB"), abs=0.05)
    assert budget["weights_gpu"] / 2**30 == pytest.approx(header_gib(r"output layer \(~([\d.]+) GiB"), abs=0.05)


def test_all_layers_do_not_fit_as_the_header_says(llama_server_bin: Path, model_27b: Path, tmp_path: Path) -> None:
    code, doc = check(llama_server_bin, model_27b, tmp_path, server__n_gpu_layers="999")
    row = vram_row(doc)
    assert code == 1 and row["verdict"] == "FAIL", row["detail"]  # --json: a node gate's "fail"
    assert (doc["verdict"], doc["action"]) == ("fail", "fix_config") and doc["reasons"][0].startswith("vram budget")
    budget = row["data"]["budget"]
    assert budget["total"] / 2**30 == pytest.approx(header_gib(r"this cache ~([\d.]+) GiB"), abs=0.05)
    assert budget["weights_gpu"] / 2**30 == pytest.approx(header_gib(r"weights alone are ~([\d.]+) GiB"), abs=0.05)
    # The ladder names the changes the header names: fewer layers or a shorter context fit, a q4_0
    # cache alone does not.
    steps = {s["change"].split(" ")[0]: s for s in row["data"]["ladder"]}
    assert {"n_gpu_layers", "ctx_size", "cache_type_k"} <= set(steps)
    assert steps["n_gpu_layers"]["fits_after"] and steps["ctx_size"]["fits_after"]
    assert not steps["cache_type_k"]["fits_after"]
