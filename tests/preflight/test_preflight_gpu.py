"""`llama-guard check`'s GPU rows, on a scripted fake NVML (read-only by construction)."""

from __future__ import annotations

from pathlib import Path

from fake_nvml import GIB, FakeNvml
from gguf_synth import write_gguf
from llama_guard.config import Config
from llama_guard.preflight.gpu import check_gpu, check_vram
from llama_guard.vocab.verdicts import NodeAction


def cfg(tmp: Path, model_bytes: int = 1024, **gpu: object) -> Config:
    model = tmp / "m.gguf"
    with model.open("wb") as handle:
        handle.truncate(model_bytes)
    return Config.model_validate({"server": {"model": str(model)}, "gpu": {"enabled": "auto", **gpu}})


def rows(results: list) -> dict[str, tuple[str, str]]:  # type: ignore[type-arg]
    return {r.name: (r.verdict, r.detail) for r in results}


def test_healthy_gpu(tmp_path: Path) -> None:
    out = rows(check_gpu(cfg(tmp_path), nvml_module=FakeNvml()))
    assert out["gpu"][0] == "OK" and "driver 535.183.01" in out["gpu"][1] and "1024 of 81920 MiB" in out["gpu"][1]
    assert "persistence" not in out and "gpu process" not in out


def test_warnings_and_refusal(tmp_path: Path) -> None:
    fake = FakeNvml(driver="550.54.15")
    fake.gpus[0].values.update({"persistence": 0, "processes": [(4242, 3 * GIB)]})
    out = rows(check_gpu(cfg(tmp_path, driver_version="535", foreign_processes="refuse"), nvml_module=fake))
    assert out["driver"][0] == "WARN" and "535" in out["driver"][1]
    assert out["persistence"][0] == "WARN" and "nvidia-persistenced" in out["persistence"][1]
    assert out["gpu process"] == ("FAIL", "pid 4242 holds 3072 MiB of VRAM ([gpu].foreign_processes = refuse)")


def test_vram_budget_against_nvml_free_memory(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "tiny.gguf")
    config = Config.model_validate({"server": {"model": str(model)}, "gpu": {"enabled": "auto"}})
    roomy = rows(check_vram(config, nvml_module=FakeNvml()))
    assert roomy["vram budget"][0] == "OK" and "MiB available (NVML: free memory of GPU 0" in roomy["vram budget"][1]
    fake = FakeNvml()
    fake.gpus[0].values.update({"memory_used": 80 * GIB - 100 * 2**20, "memory_total": 80 * GIB})
    tight = check_vram(config, nvml_module=fake)
    assert tight[0].verdict == "FAIL" and "does not fit" in tight[0].detail
    assert "of 100 MiB available" in tight[0].detail
    assert tight[0].data is not None and tight[0].data["budget"]["fits"] is False


def test_required_gpu_missing_is_a_failure_optional_is_a_warning(tmp_path: Path) -> None:
    fake = FakeNvml()
    fake.init_error = 9  # driver not loaded
    assert check_gpu(cfg(tmp_path, enabled="on"), nvml_module=fake)[0].verdict == "FAIL"
    config = cfg(tmp_path)  # no driver library: fine for a CPU-only config
    no_offload = config.model_copy(update={"server": config.server.model_copy(update={"n_gpu_layers": 0})})
    [row] = check_gpu(no_offload, nvml_module=_failing(12))
    assert (row.verdict, row.action) == ("WARN", NodeAction.NONE)


def test_offload_asked_and_nvml_unavailable_fails_with_the_action_of_the_error(tmp_path: Path) -> None:
    # [gpu].enabled = "auto" but n_gpu_layers > 0 (the default): a GPU node whose driver is gone must
    # not pass the gate. The action follows the NVML error's kind.
    config = cfg(tmp_path)
    assert config.server.n_gpu_layers > 0
    for init_error, action, fix in ((12, NodeAction.FIX_CONFIG, "install the NVIDIA driver"),
                                    (9, NodeAction.REBOOT, "reboot the host")):
        [row] = check_gpu(config, nvml_module=_failing(init_error))
        assert (row.verdict, row.action) == ("FAIL", action), row.detail
        assert f"n_gpu_layers = {config.server.n_gpu_layers} asks for the GPU" in row.detail and fix in row.detail
    assert "or set n_gpu_layers = 0" in check_gpu(config, nvml_module=_failing(12))[0].detail


def _failing(init_error: int) -> FakeNvml:
    fake = FakeNvml()
    fake.init_error = init_error
    return fake


def test_no_offload_on_a_gpu_host_still_counts_the_cuda_context(tmp_path: Path) -> None:
    # H200: llama-server -ngl 0 -c 512 held 526 MiB (tests/fixtures/h200_vram): a CUDA build keeps its
    # context and a compute buffer on the GPU even with no layer offloaded.
    model = write_gguf(tmp_path / "tiny.gguf")
    config = Config.model_validate({"server": {"model": str(model), "n_gpu_layers": 0},
                                    "gpu": {"enabled": "auto"}})
    row = check_vram(config, nvml_module=FakeNvml())[0]
    assert row.verdict == "OK" and "CUDA context 518" in row.detail and "weights 0" in row.detail



def test_a_gpu_that_asks_for_a_reset_or_a_reboot_fails_check(tmp_path: Path) -> None:
    fake = FakeNvml()
    assert "recovery" not in rows(check_gpu(cfg(tmp_path), nvml_module=fake))  # 0: none
    fake.gpus[0].values["recovery_action"] = 1
    [row] = [r for r in check_gpu(cfg(tmp_path), nvml_module=fake) if r.name == "recovery"]
    assert row.verdict == "FAIL" and "gpu_reset" in row.detail and "nvidia-smi --gpu-reset" in row.detail
    assert row.action is NodeAction.RESET_GPU
    fake.gpus[0].values["recovery_action"] = 2
    [row] = [r for r in check_gpu(cfg(tmp_path), nvml_module=fake) if r.name == "recovery"]
    assert "reboot the host" in row.detail and row.action is NodeAction.REBOOT
    fake.gpus[0].values["recovery_action"] = None  # a driver without the field: nothing to say
    assert "recovery" not in rows(check_gpu(cfg(tmp_path), nvml_module=fake))
