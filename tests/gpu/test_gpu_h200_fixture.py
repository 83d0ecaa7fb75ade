"""Replay the real NVIDIA H200 readings (tests/fixtures/h200_gpu_watch.json, made by scripts/gpu_probe.py)
through the same code: the chokepoint (via a fake loaded with the real values) and the event rules.

Expectations are stated from the recorded readings (in each test's docstring), not derived by re-implementing
the rules under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_nvml import FakeGpu, FakeNvml, sample_from_dict
from llama_guard.gpu.kmsg import KmsgParser, strip_prefix
from llama_guard.gpu.nvml import Nvml, open_gpu
from llama_guard.gpu.nvml_session import DeviceSelector
from llama_guard.gpu.readings import GpuSample
from llama_guard.gpu.rules import GpuWatch, WatchSettings, server_on_gpu, vram_released

FIXTURE = Path(__file__).parents[1] / "fixtures" / "h200_gpu_watch.json"
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def samples(raw: list[dict[str, Any]]) -> list[GpuSample]:
    return [sample_from_dict(d) for d in raw]


def test_real_selectors_pick_the_real_gpu_among_others(probe: dict[str, Any]) -> None:
    """Each selector form recorded on the H200 (uuid, PCI bus id in the short and NVML forms)
    goes through the chokepoint's selection again and picks that GPU, not a decoy at index 0."""
    ident = probe["identity"]
    decoy = FakeGpu(0, "GPU-00000000-0000-0000-0000-000000000000", "00000000:01:00.0", "decoy")
    real = FakeGpu(1, ident["uuid"], "0000" + ident["pci_bus_id"].upper(), ident["name"])
    for form, recorded in probe["selection"].items():
        kind, _, value = recorded["selector"].partition(" ")
        selector = (DeviceSelector(uuid=value) if kind == "uuid"
                    else DeviceSelector(pci_bus_id=recorded["selector"].rsplit(" ", 1)[1]))
        opened = open_gpu(selector, module=FakeNvml([decoy, real]))
        assert isinstance(opened, Nvml), (form, opened)
        assert opened.sample().identity.uuid == recorded["uuid"], form


def test_chokepoint_reproduces_the_real_sample_from_the_raw_values(probe: dict[str, Any]) -> None:
    real = samples(probe["baseline"]["samples"])[-1]
    ident = real.identity
    rows = real.remapped_rows
    fake = FakeNvml([FakeGpu(ident.index, ident.uuid, "0000" + ident.pci_bus_id.upper(), ident.name)],
                    driver=real.driver_version or "")
    fake.gpus[0].values.update(
        temperature=real.temperature_c, thr_slowdown=real.temp_slowdown_c, thr_shutdown=real.temp_shutdown_c,
        thr_gpu_max=real.temp_gpu_max_c, power_mw=real.power_mw, power_limit_mw=real.power_limit_mw,
        clock_events=real.clock_event_reasons, memory_used=real.memory_used_bytes,
        memory_total=real.memory_total_bytes, processes=[(p.pid, p.used_bytes) for p in real.processes or ()],
        persistence=int(bool(real.persistence_mode)), ecc_uncorrected=real.ecc_uncorrected_volatile,
        remapped_rows=(rows.correctable, rows.uncorrectable, int(rows.pending), int(rows.failure)) if rows else None,
        pcie_gen=real.pcie_gen, pcie_width=real.pcie_width, pstate=real.pstate)
    assert Nvml(module=fake).sample() == real


def test_baseline_readings_raise_only_the_driver_event(probe: dict[str, Any]) -> None:
    """The H200 at rest (45 °C against a slowdown of 89, 80 W of 700 W, clock reason 1 = idle, persistence on,
    no process, driver 580): against a 535 pin only ``gpu_driver_version`` is raised, once."""
    real = samples(probe["baseline"]["samples"])
    watch = GpuWatch(WatchSettings(power_sustain_s=0, throttle_sustain_s=0, driver_version="535"),
                     proc_name=lambda pid: "proc")
    events = [e for i, s in enumerate(real) for e in watch.observe(s, 10.0 * i)]
    assert [name for name, _ in events] == ["gpu_driver_version"]
    assert events[0][1]["driver_version"] == "580.159.04" and events[0][1]["expected"] == "535"


def test_baseline_readings_cross_thresholds_set_at_them(probe: dict[str, Any]) -> None:
    """The same real readings against thresholds set at them (45 °C; 11 % of the power limit; the driver
    pinned to its major 580): the temperature and power events fire, the driver's does not, idle is no throttle."""
    real = samples(probe["baseline"]["samples"])
    at_them = WatchSettings(temperature_warn_c=45, power_warn_fraction=0.11, power_sustain_s=0,
                            throttle_sustain_s=0, driver_version="580")
    watch = GpuWatch(at_them, proc_name=lambda pid: "proc")
    names = {name for i, s in enumerate(real) for name, _ in watch.observe(s, 10.0 * i)}
    assert names == {"gpu_temperature_high", "gpu_power_high"}


def test_real_foreign_process_is_reported_with_its_pid_and_memory(probe: dict[str, Any]) -> None:
    foreign = probe["foreign"]
    child = foreign["child_pid"]
    during = samples(foreign["samples"])
    held = {p.pid: p.used_bytes for s in during for p in s.processes or ()}
    assert child in held
    assert held[child] is not None
    assert held[child] >= foreign["alloc_gib"] << 30
    assert all(server_on_gpu(s, child) for s in during)
    assert not any(server_on_gpu(s, probe["host"]["pid"]) for s in during)

    elsewhere = GpuWatch(proc_name=lambda pid: "python3")
    elsewhere.set_server_pid(probe["host"]["pid"], 0.0)
    events = [e for i, s in enumerate(during) for e in elsewhere.observe(s, float(i))]
    foreign_events = [f for n, f in events if n == "gpu_foreign_process"]
    assert [f["foreign_pid"] for f in foreign_events] == [child]  # once, not once per sample
    assert foreign_events[0]["foreign_mib"] == round(held[child] / MIB)

    as_server = GpuWatch()
    as_server.set_server_pid(child, 0.0)
    assert [e for i, s in enumerate(during) for e in as_server.observe(s, float(i))
            if e[0] == "gpu_foreign_process"] == []


def test_real_vram_release_after_the_process_stopped(probe: dict[str, Any]) -> None:
    foreign = probe["foreign"]
    before = sample_from_dict(foreign["before"])
    after = sample_from_dict(foreign["release"]["sample"])
    during = sample_from_dict(foreign["samples"][-1])
    child = foreign["child_pid"]
    assert vram_released(during, child, baseline_used_bytes=before.memory_used_bytes) is False
    assert vram_released(after, child, baseline_used_bytes=before.memory_used_bytes) is True
    assert foreign["release"]["released"] is True
    assert foreign["release"]["after_s"] < 30


def test_real_kmsg_records_parse_and_hold_no_xid(probe: dict[str, Any]) -> None:
    km = probe["kmsg"]
    records = km["nvrm_records"]
    assert records, "the H200's kernel log has NVRM lines"
    for raw in records:
        assert strip_prefix(raw).startswith("NVRM:")
        assert not raw.startswith("NVRM:")
    parser = KmsgParser(probe["identity"]["pci_bus_id"])
    assert [r for line in records for r in parser.feed(line)] == []
