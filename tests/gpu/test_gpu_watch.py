"""GPU event rules (llama_guard.gpu.rules): every event, hysteresis, reminders, no storm."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fake_nvml import GIB, FakeNvml
from llama_guard.gpu.nvml import Nvml
from llama_guard.gpu.nvml_errors import DriverNotLoaded, GpuLost, NotSupported
from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample
from llama_guard.gpu.rules import (
    Condition,
    GpuWatch,
    Step,
    WatchSettings,
    driver_in_series,
    foreign_processes,
    server_on_gpu,
    vram_released,
)
from llama_guard.vocab.events import CATALOG, render_message

ID = GpuIdentity(index=0, uuid="GPU-x", pci_bus_id="0000:02:00.0", name="Fake")
BASE = GpuSample(identity=ID, driver_version="535.183.01", temperature_c=50, temp_slowdown_c=95,
                 temp_shutdown_c=100, power_mw=100_000, power_limit_mw=300_000, clock_event_reasons=0,
                 memory_used_bytes=GIB, memory_total_bytes=16 * GIB, processes=(), persistence_mode=True)


def s(**kw: Any) -> GpuSample:
    return replace(BASE, **kw)


def names(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [n for n, _ in events]


def run(watch: GpuWatch, seq: list[tuple[float, GpuSample]]) -> list[tuple[float, str, dict[str, Any]]]:
    out = []
    for t, sample in seq:
        out += [(t, n, f) for n, f in watch.observe(sample, t)]
    return out


# ---- temperature ----------------------------------------------------------------------------
def test_temperature_fires_once_reminds_slowly_and_clears_past_hysteresis() -> None:
    w = GpuWatch(WatchSettings(reminder_s=600))
    temps = [80, 85, 87, 88, 86, 82, 81, 86, 84, 80, 79]
    seq = [(10.0 * i, s(temperature_c=t)) for i, t in enumerate(temps)]
    ev = run(w, seq)
    assert [(t, n) for t, n, _ in ev] == [(10.0, "gpu_temperature_high"), (90.0, "gpu_temperature_ok")]
    assert ev[0][2]["gpu_temp_c"] == 85
    assert ev[0][2]["threshold_c"] == 85
    assert ev[0][2]["reminder"] is False
    # still hot 10 minutes later: one reminder, not one per sample
    w2 = GpuWatch(WatchSettings(reminder_s=600))
    ev2 = run(w2, [(10.0 * i, s(temperature_c=90)) for i in range(130)])
    assert [(t, f["reminder"]) for t, _, f in ev2] == [(0.0, False), (600.0, True), (1200.0, True)]


def test_temperature_threshold_follows_the_gpus_slowdown_threshold() -> None:
    w = GpuWatch(WatchSettings())
    assert names(w.observe(s(temperature_c=74, temp_slowdown_c=80), 0)) == []  # warns at 75
    ev = w.observe(s(temperature_c=77, temp_slowdown_c=82), 1)
    assert names(ev) == ["gpu_temperature_high"]
    assert ev[0][1]["threshold_c"] == 77


def test_no_storm_when_temperature_wobbles_around_threshold() -> None:
    w = GpuWatch(WatchSettings(reminder_s=3600))
    seq = [(float(i), s(temperature_c=84 if i % 2 else 86)) for i in range(1000)]
    assert names([(n, f) for _, n, f in run(w, seq)]) == ["gpu_temperature_high"]


# ---- power ----------------------------------------------------------------------------------
def test_power_needs_to_be_sustained_and_clears_after_a_while_below() -> None:
    w = GpuWatch(WatchSettings(power_sustain_s=60, clear_after_s=30))
    high, low = s(power_mw=290_000), s(power_mw=200_000)
    assert run(w, [(0, high), (10, high), (20, low), (30, high), (80, high)]) == []
    ev = w.observe(high, 90)  # 60 s since 30
    assert names(ev) == ["gpu_power_high"]
    assert ev[0][1]["gpu_power_w"] == 290.0
    assert ev[0][1]["gpu_power_limit_w"] == 300.0
    # inside the hysteresis band (0.90..0.95): stays active, no clear
    assert run(w, [(100 + 10 * i, s(power_mw=280_000)) for i in range(20)]) == []
    assert names(w.observe(low, 400)) == []
    assert names(w.observe(low, 431)) == ["gpu_power_ok"]


def test_power_unknown_limit_is_no_event() -> None:
    w = GpuWatch(WatchSettings(power_sustain_s=0))
    assert w.observe(s(power_mw=10**9, power_limit_mw=None), 0) == []


# ---- throttle -------------------------------------------------------------------------------
def test_throttled_only_for_heat_or_power_reasons_when_sustained() -> None:
    w = GpuWatch(WatchSettings(throttle_sustain_s=20, clear_after_s=30))
    idle = s(clock_event_reasons=0x1 | 0x2)
    hot = s(clock_event_reasons=0x1 | 0x40 | 0x8)
    assert run(w, [(0, idle), (10, idle), (20, hot), (30, hot)]) == []
    ev = w.observe(hot, 40)
    assert names(ev) == ["gpu_throttled"]
    assert ev[0][1]["reasons"] == "hw_slowdown, hw_thermal_slowdown"
    assert run(w, [(50, idle), (60, hot), (70, idle)]) == []  # a blip back does not clear or refire
    assert names(w.observe(idle, 100)) == ["gpu_throttle_ok"]


# ---- persistence ----------------------------------------------------------------------------
def test_persistence_off_with_advice_and_reminder() -> None:
    w = GpuWatch(WatchSettings(reminder_s=1800))
    ev = run(w, [(60.0 * i, s(persistence_mode=False)) for i in range(61)])
    assert [t for t, _, _ in ev] == [0, 1800, 3600]
    assert "nvidia-persistenced" in ev[0][2]["advice"]
    assert "nvidia-persistenced" in render_message("gpu_persistence_off", ev[0][2])
    assert w.observe(s(persistence_mode=None), 4000) == []  # unsupported: no guess


# ---- foreign processes ----------------------------------------------------------------------
def test_foreign_process_reported_with_pid_name_and_memory_then_gone() -> None:
    w = GpuWatch(WatchSettings(reminder_s=600), proc_name={77: "python3"}.get)
    w.set_server_pid(100, 0)
    both = s(processes=(GpuProcess(100, 8 * GIB), GpuProcess(77, 2 * GIB)))
    ev = w.observe(both, 1)
    assert names(ev) == ["gpu_foreign_process"]
    f = ev[0][1]
    assert (f["foreign_pid"], f["foreign_name"], f["foreign_mib"]) == (77, "python3", 2048)
    assert render_message("gpu_foreign_process", f) == "GPU 0: pid 77 (python3) holds 2048 MiB of VRAM"
    assert run(w, [(float(t), both) for t in range(2, 100)]) == []
    ev = w.observe(s(processes=(GpuProcess(100, 8 * GIB),)), 120)
    assert names(ev) == ["gpu_foreign_process_gone"]
    assert ev[0][1]["foreign_pid"] == 77


def test_server_and_recently_replaced_server_are_not_foreign() -> None:
    w = GpuWatch(WatchSettings(foreign_grace_s=30))
    w.set_server_pid(100, 0)
    w.set_server_pid(200, 10)  # restart: 100 is still freeing its VRAM
    old_and_new = s(processes=(GpuProcess(100, GIB), GpuProcess(200, GIB)))
    assert w.observe(old_and_new, 20) == []
    ev = w.observe(old_and_new, 41)  # grace over and 100 still there: now it is foreign
    assert [(n, f["foreign_pid"]) for n, f in ev] == [("gpu_foreign_process", 100)]


def test_no_server_means_every_process_is_foreign() -> None:
    w = GpuWatch()
    ev = w.observe(s(processes=(GpuProcess(5, None),)), 0)
    assert ev[0][1]["foreign_mib"] == "?"


# ---- driver version --------------------------------------------------------------------------
def test_driver_version_outside_series_reported_once_per_version() -> None:
    w = GpuWatch(WatchSettings(driver_version="535"))
    assert w.observe(s(driver_version="535.183.01"), 0) == []
    ev = w.observe(s(driver_version="550.54.15"), 1)
    assert names(ev) == ["gpu_driver_version"]
    assert ev[0][1]["expected"] == "535"
    assert w.observe(s(driver_version="550.54.15"), 2) == []
    assert GpuWatch().observe(s(driver_version="1.0"), 0) == []  # no series configured


def test_driver_in_series() -> None:
    assert driver_in_series("535.183.01", "535")
    assert driver_in_series("535.183.01", "550, 535.183")
    assert not driver_in_series("5350.1", "535")
    assert not driver_in_series("535.104.05", "535.183")


# ---- lost GPU --------------------------------------------------------------------------------
def test_gpu_lost_once_then_recovered() -> None:
    w = GpuWatch(WatchSettings(reminder_s=300))
    w.observe(BASE, 0)
    ev = w.observe_error(GpuLost("nvmlDeviceGetTemperature", 15, "GPU is lost"), 10)
    assert names(ev) == ["gpu_lost"]
    assert ev[0][1]["gpu_index"] == 0
    assert ev[0][1]["error"] == "GpuLost"
    assert w.observe_error(DriverNotLoaded("nvmlInit", 9, "x"), 20) == []
    assert names(w.observe_error(GpuLost("x", 15, "x"), 400)) == ["gpu_lost"]  # slow reminder
    assert w.observe_error(NotSupported("x", 3, "x"), 500) == []  # not the lost family
    assert names(w.observe(BASE, 600)) == ["gpu_recovered"]
    assert w.observe(BASE, 610) == []


def test_end_to_end_with_fake_nvml_lost_mid_run() -> None:
    fake = FakeNvml()
    nvml = Nvml(module=fake)
    w = GpuWatch()
    got: list[str] = []
    for t in range(6):
        if t == 2:
            fake.lose_gpu()
        if t == 4:
            fake.gpu_back()
        try:
            got += names(w.observe(nvml.sample(), float(t)))
        except GpuLost as exc:
            got += names(w.observe_error(exc, float(t)))
    assert got == ["gpu_lost", "gpu_recovered"]


# ---- helpers for the policy ------------------------------------------------------------------
def test_server_on_gpu_and_vram_released() -> None:
    on = s(processes=(GpuProcess(100, 4 * GIB),), memory_used_bytes=5 * GIB)
    off_but_busy = s(processes=(), memory_used_bytes=5 * GIB)
    off = s(processes=(), memory_used_bytes=GIB)
    unknown = s(processes=None)
    assert server_on_gpu(on, 100) is True
    assert server_on_gpu(on, 101) is False
    assert server_on_gpu(unknown, 100) is None
    assert vram_released(on, 100) is False
    assert vram_released(off_but_busy, 100) is True
    assert vram_released(off_but_busy, 100, baseline_used_bytes=GIB) is False
    assert vram_released(off, 100, baseline_used_bytes=GIB) is True
    assert vram_released(unknown, 100) is None
    assert [p.pid for p in foreign_processes(on, {1})] == [100]


def test_condition_band_and_sustain() -> None:
    c = Condition(sustain_on_s=5, sustain_off_s=5, reminder_s=100)
    assert [c.update(True, False, t) for t in (0, 4, 5)] == [None, None, Step.FIRE]
    assert c.update(False, False, 6) is None  # band
    assert c.update(False, True, 7) is None
    assert c.update(True, False, 8) is None  # back on: off timer resets
    assert c.update(False, True, 9) is None
    assert c.update(False, True, 14) is Step.CLEAR


def test_every_event_is_in_the_catalogue_and_renders() -> None:
    w = GpuWatch(WatchSettings(power_sustain_s=0, throttle_sustain_s=0, clear_after_s=0,
                               driver_version="550"), proc_name=lambda pid: "x")
    w.set_server_pid(1, 0)
    bad = s(temperature_c=99, power_mw=300_000, clock_event_reasons=0x4, persistence_mode=False,
            processes=(GpuProcess(2, GIB),))
    seen = w.observe(bad, 0) + w.observe(BASE, 1)
    seen += w.observe_error(GpuLost("x", 15, "lost"), 2) + w.observe(BASE, 3)
    assert set(names(seen)) == {
        "gpu_temperature_high", "gpu_power_high", "gpu_throttled", "gpu_persistence_off",
        "gpu_foreign_process", "gpu_driver_version", "gpu_temperature_ok", "gpu_power_ok",
        "gpu_throttle_ok", "gpu_foreign_process_gone", "gpu_lost", "gpu_recovered"}
    for name, fields in seen:
        assert name in CATALOG
        assert "?" not in render_message(name, fields).replace("(?)", ""), (name, fields)


def test_settings_from_config() -> None:
    from llama_guard.config.gpu import GpuConfig

    gpu = GpuConfig(temperature_warn_c=80, driver_version="535", reminder_interval_s=120)
    st = WatchSettings.from_config(gpu)
    assert (st.temperature_warn_c, st.driver_version, st.reminder_s) == (80, "535", 120)


def test_tick_turns_samples_and_errors_into_events() -> None:
    from llama_guard.gpu.rules import sample_once

    fake = FakeNvml()
    fake.gpus[0].values["temperature"] = 90
    nvml, w = Nvml(module=fake), GpuWatch()
    first = sample_once(nvml, w, 0.0)
    assert first.sample is not None
    assert names(first.events) == ["gpu_temperature_high"]
    fake.lose_gpu()
    lost = sample_once(nvml, w, 10.0)
    assert lost.sample is None
    assert isinstance(lost.error, GpuLost)
    assert names(lost.events) == ["gpu_lost"]
