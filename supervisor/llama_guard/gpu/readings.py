"""One GPU sample: plain frozen data, no NVML types.

Produced by :meth:`llama_guard.gpu.nvml.Nvml.sample`, consumed by the pure
:class:`llama_guard.gpu.rules.GpuWatch`. Every reading is ``None`` when NVML does not support it
on this GPU (or refused it); the names of such readings are listed in ``GpuSample.unsupported``.
:func:`sample_to_dict` makes a JSON-safe dict (fixtures, status).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Clock-event ("throttle") reason bits, from nvml.h (nvmlClocksEventReason*).
CLOCK_EVENT_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
#: The bits that mean "the GPU runs slower than it could because of heat or power".
THROTTLE_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
#: The bit of an idle GPU (clocks down because nothing runs).
GPU_IDLE = 0x1
#: The reasons ``/metrics`` exports (``llama_guard_gpu_throttle_reason{reason=…}``): idle and the slowdowns.
EXPORTED_CLOCK_EVENTS: dict[int, str] = {
    bit: name for bit, name in CLOCK_EVENT_BITS.items() if bit & (THROTTLE_MASK | GPU_IDLE)}


def decode_clock_events(mask: int) -> tuple[str, ...]:
    """Names of the set bits of a clock-event reasons bitmask, lowest bit first; unknown bits as hex."""
    names = [name for bit, name in CLOCK_EVENT_BITS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_BITS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return tuple(names)


@dataclass(frozen=True)
class GpuProcess:
    """A compute process holding a context on the GPU.

    ``pid`` is as NVML reports it (the host's pid namespace); ``used_bytes`` is its VRAM in bytes,
    ``None`` where the driver cannot tell (e.g. some vGPU/WDDM setups).
    """

    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class RemappedRows:
    """Row-remapping counters (A100/H100-class memory): rows remapped and their state."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True)
class GpuIdentity:
    """What identifies the watched GPU; read once per NVML session.

    ``index`` is NVML's (PCI bus order, as nvidia-smi shows), which is not CUDA's default order:
    give the server ``CUDA_VISIBLE_DEVICES=<uuid>`` to be sure both name the same GPU.
    """

    index: int
    uuid: str
    pci_bus_id: str
    name: str


@dataclass(frozen=True)
class GpuSample:
    """One snapshot of the watched GPU.

    Units are in the names: ``_c`` degrees Celsius, ``_mw`` milliwatts, ``_bytes`` bytes.
    ``clock_event_reasons`` is NVML's raw bitmask (see :data:`CLOCK_EVENT_BITS`).
    """

    identity: GpuIdentity
    driver_version: str | None = None
    temperature_c: int | None = None
    temp_slowdown_c: int | None = None
    temp_shutdown_c: int | None = None
    temp_gpu_max_c: int | None = None
    power_mw: int | None = None
    power_limit_mw: int | None = None
    clock_event_reasons: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    processes: tuple[GpuProcess, ...] | None = None
    persistence_mode: bool | None = None
    ecc_uncorrected_volatile: int | None = None
    remapped_rows: RemappedRows | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pstate: int | None = None
    unsupported: tuple[str, ...] = field(default=())

    @property
    def throttle_names(self) -> tuple[str, ...]:
        """The clock-event reasons that are heat or power slowdowns (idle and app clocks left out)."""
        return decode_clock_events((self.clock_event_reasons or 0) & THROTTLE_MASK)

    def pids(self) -> frozenset[int] | None:
        """The pids holding the GPU, or None when the process list is not available."""
        return None if self.processes is None else frozenset(p.pid for p in self.processes)


def sample_to_dict(sample: GpuSample) -> dict[str, Any]:
    """A JSON-safe dict of ``sample`` (tuples become lists)."""
    return asdict(sample)
