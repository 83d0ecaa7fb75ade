"""The NVML chokepoint (llama_guard.gpu.nvml) and the Xid waiter, against a scripted fake pynvml."""

from __future__ import annotations

import logging
import threading

import pytest
from fake_nvml import GIB, FakeGpu, FakeNvml, Seq, sample_from_dict
from llama_guard.config.gpu import GpuWatchMode
from llama_guard.gpu import nvml_errors as nv
from llama_guard.gpu import nvml_session
from llama_guard.gpu.nvml import Nvml, WatchOff, open_gpu
from llama_guard.gpu.nvml_errors import (
    DeviceNotFound,
    DriverNotLoaded,
    GpuLost,
    LibraryNotFound,
    NoPermission,
    Suspended,
)
from llama_guard.gpu.nvml_session import DeviceSelector
from llama_guard.gpu.pci import normalise_pci
from llama_guard.gpu.readings import decode_clock_events, sample_to_dict
from llama_guard.gpu.xid import XidAction, run_xid_waiter, xid_info
from llama_guard.model.types import XidScope


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(fake: FakeNvml | None = None, **kw: object) -> tuple[FakeNvml, Nvml, Clock]:
    fake = fake or FakeNvml()
    clock = Clock()
    return fake, Nvml(module=fake, clock=clock, **kw), clock  # type: ignore[arg-type]


def test_sample_reads_every_reading_with_units() -> None:
    fake, nvml, _ = make()
    g = fake.gpus[0].values
    g.update(temperature=71, power_mw=650_000, clock_events=0x1 | 0x40, memory_used=3 * GIB,
             processes=[(42, 2 * GIB), (43, None)], persistence=0, remapped_rows=(1, 0, 1, 0), pstate=2)
    s = nvml.sample()
    assert (s.temperature_c, s.temp_slowdown_c, s.temp_shutdown_c, s.temp_gpu_max_c) == (71, 89, 95, 87)
    assert (s.power_mw, s.power_limit_mw) == (650_000, 700_000)
    assert decode_clock_events(s.clock_event_reasons or 0) == ("gpu_idle", "hw_thermal_slowdown")
    assert s.throttle_names == ("hw_thermal_slowdown",)
    assert (s.memory_used_bytes, s.memory_total_bytes) == (3 * GIB, 80 * GIB)
    assert [(p.pid, p.used_bytes) for p in s.processes or ()] == [(42, 2 * GIB), (43, None)]
    assert s.persistence_mode is False
    assert s.remapped_rows is not None
    assert s.remapped_rows.pending
    assert s.remapped_rows.correctable == 1
    assert (s.pcie_gen, s.pcie_width, s.pstate, s.driver_version) == (5, 16, 2, "535.183.01")
    assert s.identity.pci_bus_id == "0000:02:00.0"
    assert s.unsupported == ()
    assert sample_from_dict(sample_to_dict(s)) == s


def test_decode_unknown_bits_kept_as_hex() -> None:
    assert decode_clock_events(0x4 | 0x10000) == ("sw_power_cap", "0x10000")


def test_init_is_lazy_and_static_readings_read_once_per_session() -> None:
    fake, nvml, _ = make()
    assert fake.calls["nvmlInit"] == 0
    for _ in range(3):
        nvml.sample()
    assert fake.calls["nvmlInit"] == 1
    assert fake.calls["nvmlDeviceGetTemperatureThreshold"] == 3  # slowdown, shutdown, gpu max: once
    assert fake.calls["nvmlDeviceGetTemperature"] == 3


@pytest.mark.parametrize(
    ("selector", "expect_index"),
    [
        (DeviceSelector(index=1), 1),
        (DeviceSelector(uuid="GPU-b"), 1),
        (DeviceSelector(index=0, pci_bus_id="0000:b3:00.0"), 1),
        (DeviceSelector(pci_bus_id="B3:00.0"), 1),
        (DeviceSelector(pci_bus_id="00000000:02:00.0"), 0),
    ],
)
def test_device_selection(selector: DeviceSelector, expect_index: int) -> None:
    fake = FakeNvml([FakeGpu(0, "GPU-a", "00000000:02:00.0"), FakeGpu(1, "GPU-b", "00000000:B3:00.0")])
    nvml = Nvml(selector, module=fake)
    assert nvml.open().index == expect_index


def test_unknown_device_is_a_config_problem_not_a_lost_gpu() -> None:
    fake = FakeNvml()
    result = open_gpu(DeviceSelector(uuid="GPU-nope"), module=fake)
    assert isinstance(result, WatchOff)
    assert isinstance(result.error, DeviceNotFound)
    assert "uuid GPU-nope" in result.message
    assert fake.refcount == 0  # released


def test_device_that_vanishes_after_being_found_is_lost() -> None:
    fake, nvml, _ = make()
    nvml.sample()
    fake.driver_reload()
    fake.gpus.clear()
    with pytest.raises(GpuLost):
        nvml.sample()


@pytest.mark.parametrize(("code", "cls", "words"), [(12, LibraryNotFound, "library not found"),
                                                    (9, DriverNotLoaded, "driver not loaded")])
def test_host_without_driver_gives_watch_off(code: int, cls: type, words: str) -> None:
    fake = FakeNvml()
    fake.init_error = code
    result = open_gpu(DeviceSelector(), module=fake)
    assert isinstance(result, WatchOff)
    assert isinstance(result.error, cls)
    assert result.message.startswith("GPU watch off: ")
    assert words in result.message


def test_missing_pynvml_module_is_library_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_module(name: str) -> object:
        raise ImportError(name)

    monkeypatch.setattr(nvml_session.importlib, "import_module", no_module)
    result = open_gpu(DeviceSelector())
    assert isinstance(result, WatchOff)
    assert isinstance(result.error, LibraryNotFound)
    assert "nvidia-ml-py" in result.reason


def test_enabled_off_never_touches_nvml() -> None:
    fake = FakeNvml()
    assert isinstance(open_gpu(DeviceSelector(), enabled=GpuWatchMode.OFF, module=fake), WatchOff)
    assert sum(fake.calls.values()) == 0


def test_real_pynvml_errors_translate_by_code() -> None:
    import pynvml

    assert isinstance(nv.translate(pynvml.NVMLError(15), "x"), GpuLost)
    assert isinstance(nv.translate(pynvml.NVMLError(9), "x"), DriverNotLoaded)
    assert isinstance(nv.translate(pynvml.NVMLError(3), "x"), nv.NotSupported)
    assert isinstance(nv.translate(pynvml.NVMLError(4), "x"), NoPermission)
    assert isinstance(nv.translate(pynvml.NVMLError(18), "x"), nv.DriverMismatch)
    assert type(nv.translate(pynvml.NVMLError(7), "x")) is nv.NvmlError


def test_not_supported_is_cached_logged_once_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    fake, nvml, clock = make(unsupported_retry_s=600)
    fake.fail("nvmlDeviceGetRemappedRows", 3)
    caplog.set_level(logging.INFO, logger="llama_guard.gpu.nvml")
    for _ in range(5):
        s = nvml.sample()
        clock.t += 10
        assert s.remapped_rows is None
        assert "remapped_rows" in s.unsupported
        assert s.temperature_c == 45  # the rest of the sample is unaffected
    assert fake.calls["nvmlDeviceGetRemappedRows"] == 1
    assert sum("remapped_rows unavailable" in r.message for r in caplog.records) == 1
    fake.heal("nvmlDeviceGetRemappedRows")
    clock.t += 600  # retry interval passed: asked again, and now it answers
    s = nvml.sample()
    assert s.remapped_rows is not None
    assert "remapped_rows" not in s.unsupported
    assert any("available again" in r.message for r in caplog.records)


def test_not_supported_cache_cleared_by_reinit() -> None:
    fake, nvml, _ = make()
    fake.fail("nvmlDeviceGetPowerUsage", 3, times=1)
    assert nvml.sample().power_mw is None
    assert nvml.sample().power_mw is None  # cached: not asked
    nvml.close()
    assert nvml.sample().power_mw == 100_000  # a new session asks again


def test_no_permission_reading_is_none_not_an_error() -> None:
    fake, nvml, _ = make()
    fake.fail("nvmlDeviceGetTotalEccErrors", 4)
    s = nvml.sample()
    assert s.ecc_uncorrected_volatile is None
    assert "ecc_uncorrected_volatile" in s.unsupported


def test_gpu_lost_mid_run_then_back_reinitialises() -> None:
    fake, nvml, _ = make()
    fake.gpus[0].values["temperature"] = Seq(40, 41, 42)
    assert nvml.sample().temperature_c == 40
    fake.lose_gpu()
    with pytest.raises(GpuLost):
        nvml.sample()
    assert not nvml._initialised
    assert fake.refcount == 0
    with pytest.raises(GpuLost):
        nvml.sample()
    fake.gpu_back()
    assert nvml.sample().temperature_c == 41
    assert nvml.init_count == 3


def test_unknown_once_refetches_handle_twice_is_lost() -> None:
    fake, nvml, _ = make()
    nvml.sample()
    fake.fail("nvmlDeviceGetTemperature", 999, times=1)
    assert nvml.sample().temperature_c == 45
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 2
    fake.fail("nvmlDeviceGetTemperature", 999, times=2)
    with pytest.raises(GpuLost, match="twice"):
        nvml.sample()


def test_driver_dropped_then_returns() -> None:
    fake, nvml, _ = make()
    nvml.sample()
    fake.driver_reload()
    fake.init_error = 9
    with pytest.raises(DriverNotLoaded):
        nvml.sample()
    fake.init_error = None
    s = nvml.sample()
    assert s.temperature_c == 45
    assert nvml.init_count == 2


def test_session_shut_down_under_us_is_reopened_transparently() -> None:
    fake, nvml, _ = make()
    nvml.sample()
    fake.driver_reload()  # handles void, NVML uninitialised
    assert nvml.sample().temperature_c == 45


def test_suspended_session_stays_released_until_resumed() -> None:
    from llama_guard.gpu.rules import GpuWatch, WatchSettings, sample_once

    _fake, nvml, clock = make()
    nvml.sample()
    inits = nvml.init_count
    nvml.suspend()
    assert not nvml._initialised and nvml.suspended
    with pytest.raises(Suspended):
        nvml.sample()
    assert not nvml._initialised and nvml.init_count == inits  # nobody re-opened it
    # The sampler sees no sample and reports nothing (a suspended session is not a lost GPU).
    verdict = sample_once(nvml, GpuWatch(WatchSettings()), clock())
    assert verdict.sample is None and verdict.events == [] and verdict.error is None
    nvml.resume()
    assert nvml.sample().temperature_c == 45 and nvml.init_count == inits + 1


def test_old_pynvml_without_clocks_event_reasons_falls_back() -> None:
    fake, nvml, _ = make()
    fake.nvmlDeviceGetCurrentClocksEventReasons = None  # type: ignore[assignment,method-assign]
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x20  # type: ignore[attr-defined]
    assert nvml.sample().throttle_names == ("sw_thermal_slowdown",)


def test_persistence_is_written_only_on_request_and_needs_root() -> None:
    fake, nvml, _ = make()
    for _ in range(3):
        nvml.sample()
    assert fake.persistence_writes == []
    fake.fail("nvmlDeviceSetPersistenceMode", 4, times=1)
    with pytest.raises(NoPermission):
        nvml.set_persistence(True)
    nvml.set_persistence(True)
    assert fake.persistence_writes == [1]


def test_pci_normalisation() -> None:
    assert normalise_pci("00000000:02:00.0") == normalise_pci("PCI:0000:02:00") == "0000:02:00.0"
    assert normalise_pci("0000:B3:00.0") == "0000:b3:00.0"
    assert normalise_pci("0001:02:00.1") != normalise_pci("0000:02:00.1")
    assert normalise_pci("GPU-1234") is None


# ---- Xid events -------------------------------------------------------------------------------
def test_xid_event_set_returns_xid_or_none_on_timeout() -> None:
    fake, nvml, _ = make()
    es = nvml.xid_event_set()
    assert es.wait(10) is None
    fake.push_xid(79)
    assert es.wait(10) == 79
    es.close()
    assert fake.event_sets == 0


def test_xid_waiter_delivers_and_stops() -> None:
    fake, nvml, _ = make()
    for x in (13, 79):
        fake.push_xid(x)
    stop = threading.Event()
    seen: list[int] = []

    def on_xid(x: int) -> None:
        seen.append(x)
        if len(seen) == 2:
            stop.set()

    reason = run_xid_waiter(nvml, stop, on_xid, on_error=lambda e: pytest.fail(str(e)), timeout_ms=5)
    assert (reason, seen, fake.event_sets) == (None, [13, 79], 0)


def test_xid_waiter_reports_lost_gpu_and_registers_again() -> None:
    fake, nvml, _ = make()
    stop = threading.Event()
    errors: list[Exception] = []
    seen: list[int] = []

    def on_error(exc: Exception) -> None:
        errors.append(exc)
        fake.gpu_back()
        fake.push_xid(48)

    es = nvml.xid_event_set()  # registered while the GPU was fine
    es.close()
    fake.lose_gpu()

    def on_xid(x: int) -> None:
        seen.append(x)
        stop.set()

    run_xid_waiter(nvml, stop, on_xid, on_error=on_error, timeout_ms=5, retry_s=0.0)
    assert [type(e) for e in errors] == [GpuLost]
    assert seen == [48]
    # mine, the one that failed to register on the lost GPU (freed), the one after it came back
    assert fake.calls["nvmlEventSetCreate"] == 3
    assert fake.event_sets == 0


def test_xid_waiter_gives_up_when_not_supported() -> None:
    fake, nvml, _ = make()
    fake.fail("nvmlDeviceRegisterEvents", 3)
    reason = run_xid_waiter(nvml, threading.Event(), lambda x: None, on_error=lambda e: None)
    assert reason.startswith("xid events not supported")
    assert fake.event_sets == 0


@pytest.mark.parametrize(
    ("xid", "scope", "action"),
    [(79, XidScope.DEVICE, XidAction.REBOOT), (8, XidScope.APP, XidAction.RESTART),
     (48, XidScope.DEVICE, XidAction.RESET),
     (119, XidScope.DEVICE, XidAction.RESET), (74, XidScope.DEVICE, XidAction.RESET),
     (13, XidScope.APP, XidAction.RESTART), (31, XidScope.APP, XidAction.RESTART),
     (43, XidScope.APP, XidAction.RESTART), (94, XidScope.APP, XidAction.RESTART),
     (109, XidScope.APP, XidAction.RESTART), (63, XidScope.DEVICE, XidAction.EVENT_ONLY),
     (92, XidScope.DEVICE, XidAction.EVENT_ONLY), (154, XidScope.DEVICE, XidAction.FOLLOW_RECOVERY_ACTION),
     (12345, XidScope.DEVICE, XidAction.EVENT_ONLY)],
)
def test_xid_table(xid: int, scope: XidScope, action: XidAction) -> None:
    info = xid_info(xid)
    assert (info.scope, info.action) == (scope, action) and info.meaning


def test_gpu_xid_event_renders() -> None:
    from llama_guard.vocab.events import render_message

    fields = {"gpu_index": 0, "xid": 79, "meaning": "GPU has fallen off the bus"}
    assert render_message("gpu_xid", fields) == "GPU 0 reported Xid 79: GPU has fallen off the bus"


# ------------------------------------------------------------ per-process utilisation (liveness)

def test_process_busy_reads_the_servers_samples_since_the_last_call() -> None:
    fake, nvml, _ = make()
    g = fake.gpus[0].values
    busy, since = nvml.process_busy(frozenset({42}), 0)  # an idle GPU: NVML says NOT_FOUND
    assert (busy, since) == (False, 0)
    g["process_util"] = [(7, 90, 40)]  # another process works, ours does not
    busy, since = nvml.process_busy(frozenset({42}), since)
    assert busy is False and since > 0
    g["process_util"] = [(7, 90, 40), (43, 55, 12)]  # a wrapper's child (43) computes
    busy, newer = nvml.process_busy(frozenset({42, 43}), since)
    assert busy is True and newer >= since
    g["process_util"] = [(43, 0xFFFFFFFF, 0)]  # "unavailable" is no use
    assert nvml.process_busy(frozenset({43}), newer)[0] is False


def test_process_busy_without_per_process_samples_raises_not_supported() -> None:
    fake, nvml, _ = make()
    fake.fail("nvmlDeviceGetProcessUtilization", 3, times=1)
    with pytest.raises(nv.NotSupported):
        nvml.process_busy(frozenset({42}), 0)
    fake.lose_gpu()
    with pytest.raises(GpuLost):
        nvml.process_busy(frozenset({42}), 0)
