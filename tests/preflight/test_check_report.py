"""`llama-guard check --json` as a node-health gate: one verdict, one recommended action, exit 0/1/2.

Unit tests of the reduction (:mod:`llama_guard.preflight.check_report`), the GPU rows' actions on the NVML
double, and the CLI end to end (the shipped file on a stated card, a broken config, a lost GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import FakeNvml
from harness import FAKE_NVML_RUN, ROOT, config_text, free_port
from llama_guard.config import Config
from llama_guard.preflight.check_report import overall, unknown
from llama_guard.preflight.gpu import check_gpu
from llama_guard.vocab.exitcodes import EXIT_GATE_FAIL, EXIT_GATE_PASS, EXIT_GATE_UNKNOWN
from llama_guard.vocab.verdicts import CheckResult, NodeAction, NodeVerdict, Verdict

TESTS = Path(__file__).resolve().parents[1]


def line(verdict: Verdict, name: str = "x", action: NodeAction = NodeAction.NONE) -> CheckResult:
    return CheckResult(name, verdict, f"{name} detail", action=action)


def test_all_ok_passes_with_no_action() -> None:
    node = overall([line(Verdict.OK), line(Verdict.NOTE), line(Verdict.HINT)])
    assert (node.verdict, node.action, node.exit_code, node.reasons) == (NodeVerdict.PASS, NodeAction.NONE,
                                                                         EXIT_GATE_PASS, ())


def test_warnings_pass_the_gate_and_keep_their_action() -> None:
    node = overall([line(Verdict.OK), line(Verdict.WARN, "persistence"),
                    line(Verdict.WARN, "remapped rows", NodeAction.RESET_GPU)])
    assert (node.verdict, node.action, node.exit_code) == (NodeVerdict.WARN, NodeAction.RESET_GPU, EXIT_GATE_PASS)
    assert node.reasons[0].startswith("remapped rows:") and len(node.reasons) == 2


def test_a_fail_without_an_action_is_a_configuration_fix() -> None:
    node = overall([line(Verdict.WARN, "gpu", NodeAction.RESET_GPU), line(Verdict.FAIL, "vram budget")])
    assert (node.verdict, node.action, node.exit_code) == (NodeVerdict.FAIL, NodeAction.FIX_CONFIG, EXIT_GATE_FAIL)
    assert node.reasons == ("vram budget: vram budget detail",)  # the WARN did not decide


def test_the_most_severe_action_wins_and_comes_first() -> None:
    node = overall([line(Verdict.FAIL, "model"), line(Verdict.FAIL, "gpu", NodeAction.REBOOT),
                    line(Verdict.FAIL, "other", NodeAction.RESET_GPU)])
    assert node.action is NodeAction.REBOOT
    assert [r.split(":")[0] for r in node.reasons] == ["gpu", "other", "model"]
    assert node.summary == "fail (reboot): gpu: gpu detail"


def test_unknown_is_exit_2() -> None:
    node = unknown("the check did not finish: OSError: boom")
    assert (node.verdict, node.exit_code) == (NodeVerdict.UNKNOWN, EXIT_GATE_UNKNOWN)


def gpu_config(tmp: Path, enabled: str = "on") -> Config:
    return Config.model_validate({"server": {"model": str(tmp / "m.gguf")}, "gpu": {"enabled": enabled}})


@pytest.mark.parametrize(("break_it", "action"), [
    (lambda f: f.lose_gpu(), NodeAction.REBOOT),                                   # off the bus
    (lambda f: f.fail("nvmlDeviceGetTemperature", 16), NodeAction.RESET_GPU),      # NVML_ERROR_RESET_REQUIRED
    (lambda f: setattr(f, "init_error", 9), NodeAction.REBOOT),                    # driver not loaded
    (lambda f: setattr(f, "init_error", 18), NodeAction.REBOOT),                   # driver/library mismatch
    (lambda f: setattr(f, "init_error", 12), NodeAction.FIX_CONFIG),               # no driver, enabled = "on"
], ids=["gpu-lost", "reset-required", "driver-not-loaded", "driver-mismatch", "no-driver"])
@pytest.mark.parametrize("enabled", ["on", "auto"])  # "auto" with layers to offload (the default 999) too
def test_gpu_failures_name_their_action(tmp_path: Path, break_it: Any, action: NodeAction, enabled: str) -> None:
    fake = FakeNvml()
    break_it(fake)
    [gpu] = [r for r in check_gpu(gpu_config(tmp_path, enabled), nvml_module=fake) if r.name == "gpu"]
    assert gpu.verdict is Verdict.FAIL and gpu.action is action, gpu
    assert overall([gpu]).action is action


def test_a_pending_row_remap_asks_for_a_reset_without_failing(tmp_path: Path) -> None:
    fake = FakeNvml()
    fake.gpus[0].values["remapped_rows"] = (0, 2, 1, 0)
    results = check_gpu(gpu_config(tmp_path), nvml_module=fake)
    node = overall(results)
    assert (node.verdict, node.action) == (NodeVerdict.WARN, NodeAction.RESET_GPU), results


# ---------------------------------------------------------------------------------------------- the CLI


def cli(config: Path, *, nvml: dict[str, object] | None = None, tmp: Path | None = None) -> tuple[int, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
    command = [sys.executable, "-m", "llama_guard"]
    if nvml is not None:
        assert tmp is not None
        script = tmp / "nvml.json"
        script.write_text(json.dumps(nvml))
        env.update({"FAKE_NVML_SCRIPT": str(script), "FAKE_NVML_STATE": str(tmp / "nvml-state.json"),
                    "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)})
        command = FAKE_NVML_RUN
    out = subprocess.run([*command, "check", "--json", "--config", str(config)], capture_output=True, text=True,
                         env=env, cwd=str(ROOT), timeout=90, check=False)
    return out.returncode, json.loads(out.stdout)


def test_cli_a_config_error_is_a_fail_with_fix_config_not_78(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = 'eighty'\nbogus = 1\n")
    code, doc = cli(bad)
    assert code == EXIT_GATE_FAIL
    assert (doc["verdict"], doc["action"], doc["exit_code"], doc["ok"]) == ("fail", "fix_config", 1, False)
    assert any("server.bogus: unknown key" in r for r in doc["reasons"]) and "port" in doc["summary"]


def test_cli_healthy_node_passes_and_a_lost_gpu_says_reboot(tmp_path: Path, llama_server_bin: Path,
                                                             real_model: Path) -> None:
    cfg = tmp_path / "lg.toml"
    cfg.write_text(config_text({
        "server": {"binary": str(llama_server_bin), "model": str(real_model), "port": free_port(),
                   "n_gpu_layers": 99, "ctx_size": 2048, "threads": 1, "user": "", "group": ""},
        "gpu": {"enabled": "on", "vram_total_mib": 16384},
        "recovery": {"reset_command": [sys.executable, str(TESTS / "stub_reset.py"), "-i", "{index}"]},
        "runtime": {"dir": str(tmp_path / "run")}}))
    code, doc = cli(cfg, nvml={}, tmp=tmp_path)
    assert code == EXIT_GATE_PASS and doc["verdict"] in ("pass", "warn"), doc["reasons"]
    assert doc["action"] in ("none", "reset_gpu") and doc["ok"] is True
    code, doc = cli(cfg, nvml={"lost": True}, tmp=tmp_path)
    assert code == EXIT_GATE_FAIL, doc
    assert (doc["verdict"], doc["action"]) == ("fail", "reboot")
    assert doc["summary"].startswith("fail (reboot): gpu: ") and "lost" in doc["summary"].lower()
    gpu = next(c for c in doc["checks"] if c["name"] == "gpu")
    assert gpu["verdict"] == "FAIL" and gpu["action"] == "reboot"


def test_cli_offload_asked_without_nvml_fails_by_the_error_and_a_cpu_config_passes(
        tmp_path: Path, llama_server_bin: Path, real_model: Path) -> None:
    """[gpu].enabled = "auto": a GPU node whose driver is gone must not pass when the config offloads."""
    def write(layers: int) -> Path:
        cfg = tmp_path / f"lg-{layers}.toml"
        cfg.write_text(config_text({
            "server": {"binary": str(llama_server_bin), "model": str(real_model), "port": free_port(),
                       "n_gpu_layers": layers, "ctx_size": 2048, "threads": 1, "user": "", "group": ""},
            "gpu": {"enabled": "auto", "vram_total_mib": 16384}, "runtime": {"dir": str(tmp_path / "run")}}))
        return cfg

    for init_error, action in ((12, "fix_config"), (9, "reboot")):  # no driver library; driver not loaded
        code, doc = cli(write(99), nvml={"fail": {"nvmlInit": init_error}}, tmp=tmp_path)
        assert code == EXIT_GATE_FAIL and (doc["verdict"], doc["action"]) == ("fail", action), doc["reasons"]
        gpu = next(c for c in doc["checks"] if c["name"] == "gpu")
        assert gpu["verdict"] == "FAIL" and gpu["action"] == action, gpu
        assert doc["summary"].startswith(f"fail ({action}): gpu: n_gpu_layers = 99 asks for the GPU")
    code, doc = cli(write(0), nvml={"fail": {"nvmlInit": 12}}, tmp=tmp_path)
    assert code == EXIT_GATE_PASS and doc["verdict"] in ("pass", "warn") and doc["action"] == "none", doc["reasons"]
