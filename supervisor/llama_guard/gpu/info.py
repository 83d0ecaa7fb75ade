"""What the budget and the ceiling need from the GPU: free memory and memory bandwidth, read through
the NVML chokepoint (:mod:`llama_guard.gpu.nvml`, read-only), or from ``[gpu]`` overrides
(``vram_total_mib``, ``memory_bandwidth_gbs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llama_guard.config import Config
from llama_guard.config.gpu import GpuWatchMode
from llama_guard.gpu.nvml import WatchOff
from llama_guard.gpu.nvml_errors import NvmlError
from llama_guard.vocab.units import MIB


@dataclass(frozen=True)
class GpuMemoryFacts:
    """``available`` bytes for the server (None: unknown) and where the figure came from; ``bandwidth``
    bytes/s (None: unknown) and its source; ``name`` of the GPU ("" without one); ``note`` why a figure
    is missing. ``server_bytes``: what pids in ``own_pids`` already hold (added back to the free memory,
    so that a running server's own VRAM does not count against it)."""

    available: int | None
    available_source: str
    bandwidth: float | None
    bandwidth_source: str
    name: str = ""
    total: int | None = None
    note: str = ""


def gpu_memory_facts(config: Config, *, nvml_module: Any = None, own_pids: tuple[int, ...] = ()) -> GpuMemoryFacts:
    """Free VRAM and bandwidth for ``config``'s GPU. Never raises: an unreachable GPU gives Nones and a
    ``note``. ``nvml_module`` is a pynvml stand-in for tests (default: the real ``pynvml``)."""
    from llama_guard.gpu import DeviceSelector, open_gpu
    from llama_guard.insight.ceiling import bandwidth_from_bus

    gpu = config.gpu
    available: int | None = None
    avail_src = ""
    total: int | None = None
    bandwidth: float | None = None
    bw_src = ""
    name = ""
    note = ""
    if gpu.vram_total_mib is not None:
        available, avail_src = gpu.vram_total_mib * MIB, f"[gpu].vram_total_mib = {gpu.vram_total_mib}"
        total = available
    if gpu.memory_bandwidth_gbs is not None:
        bandwidth, bw_src = gpu.memory_bandwidth_gbs * 1e9, f"[gpu].memory_bandwidth_gbs = {gpu.memory_bandwidth_gbs:g}"
    if (available is None or bandwidth is None) and gpu.enabled is not GpuWatchMode.OFF:
        selector = DeviceSelector(gpu.index, gpu.uuid, gpu.pci_bus_id)
        opened = open_gpu(selector, enabled=gpu.enabled,
                          module=nvml_module)
        if isinstance(opened, WatchOff):
            note = f"no GPU reading: {opened.reason}"
        else:
            try:
                sample = opened.sample()
                name = sample.identity.name
                if available is None and sample.memory_total_bytes is not None \
                        and sample.memory_used_bytes is not None:
                    total = sample.memory_total_bytes
                    ours = sum(p.used_bytes or 0 for p in sample.processes or () if p.pid in own_pids)
                    available = total - sample.memory_used_bytes + ours
                    avail_src = f"NVML: free memory of GPU {sample.identity.index} ({name})" + (
                        f", plus {ours // MIB} MiB held by the running server" if ours else "")
                if bandwidth is None:
                    try:
                        bits, mhz = opened.memory_interface()
                        bandwidth = bandwidth_from_bus(bits, mhz)
                        bw_src = f"NVML: {bits} bit × {mhz} MHz × 2"
                    except (NvmlError, ValueError) as exc:
                        note = f"memory bandwidth not reported by NVML ({exc})"
            except NvmlError as exc:
                note = f"the GPU does not answer NVML: {exc}"
            finally:
                opened.close()
    elif gpu.enabled is GpuWatchMode.OFF and (available is None or bandwidth is None):
        note = 'GPU watch off ([gpu].enabled = "off")'
    return GpuMemoryFacts(available, avail_src, bandwidth, bw_src or note or "no GPU", name, total, note)
