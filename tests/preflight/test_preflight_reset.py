"""``llama-guard check`` says whether a GPU reset would be possible here, and if not, why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_nvml import FakeNvml
from harness import FAKE_NVML_RUN, ROOT, config_text
from llama_guard.config import Config
from llama_guard.core.privileges import CAP_NUMBERS, RESET_CAPABILITIES, Credentials, reset_precondition
from llama_guard.preflight import run_checks
from llama_guard.preflight.gpu import check_reset

TESTS = Path(__file__).resolve().parents[1]


ALL_CAPS = (1 << 41) - 1
RT = Credentials(0, 0, (), ALL_CAPS, ALL_CAPS, 0, 0, ALL_CAPS, False)
USER = Credentials(1000, 1000, (), 0, 0, 0, 0, ALL_CAPS, False)


def config(**recovery: object) -> Config:
    return Config.model_validate({"gpu": {"enabled": "auto", "index": 0}, "recovery": recovery})


def which_found(name: str) -> str | None:
    return f"/usr/bin/{name}" if name == "nvidia-smi" else None


def test_possible_when_root_command_found_and_gpu_watched() -> None:
    fake = FakeNvml()
    r = check_reset(config(), creds=RT, which=which_found, nvml_module=fake)
    assert r.verdict == "OK", r
    assert "/usr/bin/nvidia-smi" in r.detail and "GPU 0 (NVIDIA Fake" in r.detail
    assert "nvidia-smi --gpu-reset -i {index}" in r.detail
    assert fake.refcount == 0  # NVML opened and released again


def test_not_root_is_named() -> None:
    r = check_reset(config(), creds=USER, which=which_found, nvml_module=FakeNvml())
    assert r.verdict == "WARN" and "uid 1000, not root" in r.detail
    assert "not found" not in r.detail and "cannot be watched" not in r.detail
    assert "exit 69" in r.detail


def test_missing_command_on_path_is_named() -> None:
    r = check_reset(config(), creds=RT, which=lambda _: None, nvml_module=FakeNvml())
    assert r.verdict == "WARN" and "'nvidia-smi' was not found on PATH" in r.detail


def test_replaced_command_is_looked_up_by_its_path(tmp_path: Path) -> None:
    stub = tmp_path / "reset-stub"
    r = check_reset(config(reset_command=[str(stub), "{index}"]), creds=RT, which=which_found, nvml_module=FakeNvml())
    assert r.verdict == "WARN" and f"{str(stub)!r} was not found" in r.detail
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    r = check_reset(config(reset_command=[str(stub), "{index}"]), creds=RT, which=which_found, nvml_module=FakeNvml())
    assert r.verdict == "OK" and str(stub) in r.detail


def test_a_host_without_the_nvidia_driver_needs_no_reset_under_auto() -> None:
    """No NVIDIA library (a CPU host) with ``[gpu].enabled = "auto"``: no GPU is watched, so a reset
    is not applicable (OK, said why), not a warning the operator cannot act on. A driver that is
    there but not loaded (it may have dropped) and ``"on"`` (a GPU is required) still warn."""
    no_library = FakeNvml()
    no_library.init_error = 12  # NVML_ERROR_LIBRARY_NOT_FOUND
    r = check_reset(config(), creds=RT, which=lambda _: None, nvml_module=no_library)
    assert r.verdict == "OK" and r.detail.startswith("not applicable") and "restarted only" in r.detail
    required = Config.model_validate({"gpu": {"enabled": "on", "index": 0}})
    r = check_reset(required, creds=RT, which=lambda _: None, nvml_module=no_library)
    assert r.verdict == "WARN" and "cannot be watched" in r.detail
    dropped = FakeNvml()
    dropped.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    r = check_reset(config(), creds=RT, which=which_found, nvml_module=dropped)
    assert r.verdict == "WARN" and "cannot be watched" in r.detail


def test_gpu_watch_off_is_named() -> None:
    cfg = Config.model_validate({"gpu": {"enabled": "off"}})
    r = check_reset(cfg, creds=RT, which=which_found, nvml_module=FakeNvml())
    assert r.verdict == "WARN" and "GPU watch is off" in r.detail


@pytest.mark.parametrize("cap", RESET_CAPABILITIES)
def test_root_without_the_reset_capability_is_named(cap: str) -> None:
    """Root with a bounded capability set that lacks what the reset needs: not possible, and why."""
    creds = Credentials(0, 0, (), ALL_CAPS & ~(1 << CAP_NUMBERS[cap]), ALL_CAPS, 0, 0, ALL_CAPS, True)
    r = check_reset(config(), creds=creds, which=which_found, nvml_module=FakeNvml())
    assert r.verdict == "WARN" and f"lacks {cap}" in r.detail and "not root" not in r.detail
    assert reset_precondition(creds) != "" and reset_precondition(RT) == ""


def test_precondition_reads_this_process() -> None:
    """Without arguments the precondition is decided from /proc/self/status as it is now."""
    status = Path("/proc/self/status").read_text()
    eff = int(next(x for x in status.splitlines() if x.startswith("CapEff:")).split()[1], 16)
    possible = os.geteuid() == 0 and all(eff >> CAP_NUMBERS[c] & 1 for c in RESET_CAPABILITIES)
    assert (reset_precondition() == "") is possible


@pytest.mark.parametrize(("code", "words", "verdict"), [(9, "kernel driver not loaded", "WARN"),
                                                     (12, "library not found", "OK")])
def test_no_driver_is_named(code: int, words: str, verdict: str) -> None:
    """A driver not loaded (it may have dropped) is a warning; no library at all under ``"auto"`` is a
    host without the driver, where a reset is not applicable: both name the cause."""
    fake = FakeNvml()
    fake.init_error = code
    r = check_reset(config(), creds=RT, which=which_found, nvml_module=fake)
    assert r.verdict == verdict and words in r.detail
    assert ("cannot be watched" in r.detail) is (verdict == "WARN")


def test_every_reason_at_once() -> None:
    fake = FakeNvml()
    fake.lose_gpu()
    r = check_reset(config(), creds=USER, which=lambda _: None, nvml_module=fake)
    assert r.verdict == "WARN"
    assert "GPU is lost" in r.detail and "root" in r.detail and "not found" in r.detail


@pytest.mark.parametrize(("recovery", "why"), [({"reset_on": []}, "reset_on is empty"),
                                               ({"max_resets": 0}, "max_resets = 0")])
def test_resets_switched_off(recovery: dict[str, object], why: str) -> None:
    r = check_reset(config(**recovery), creds=USER, which=lambda _: None, nvml_module=FakeNvml())
    assert r.verdict == "OK" and "off" in r.detail and why in r.detail


def test_run_checks_reports_it() -> None:
    import fake_pynvml_mod

    cfg = Config.model_validate({"server": {"binary": "/bin/true", "model": "/nonexistent.gguf"},
                                 "recovery": {"reset_command": ["/nonexistent/reset", "{index}"]}})
    rows = {r.name: r for r in run_checks(cfg, Path("x.toml"), nvml_module=fake_pynvml_mod)}
    assert rows["gpu reset"].verdict == "WARN"
    assert "'/nonexistent/reset' was not found" in rows["gpu reset"].detail


def test_cli_check_prints_it(tmp_path: Path, llama_server_bin: Path) -> None:
    cfg = tmp_path / "lg.toml"
    cfg.write_text(config_text({
        "server": {"binary": str(llama_server_bin), "model": str(tmp_path / "none.gguf"), "n_gpu_layers": 0},
        "recovery": {"reset_command": [sys.executable, str(TESTS / "stub_reset.py"), "-i", "{index}"]},
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_GUARD_")}
    out = subprocess.run([*FAKE_NVML_RUN, "check", "--config", str(cfg)], env=env,
                         cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=False)
    line = next((x for x in out.stdout.splitlines() if " gpu reset " in x), None)
    assert line is not None, out.stdout + out.stderr
    if os.geteuid() == 0:
        assert line.startswith("OK") and sys.executable in line and "NVIDIA Fake" in line, line
    else:
        assert line.startswith("WARN") and "not root" in line, line
