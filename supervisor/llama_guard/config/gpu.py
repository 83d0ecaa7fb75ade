"""``[gpu]``: which GPU to watch, whether to watch it at all, and the thresholds of its events."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import Field

from llama_guard.config.base import Policy, PositiveFloat, Reload, Section


class GpuWatchMode(str, enum.Enum):
    """``[gpu].enabled``: watch the GPU when one answers NVML, always (else refuse to run), never."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class ForeignProcesses(str, enum.Enum):
    """``[gpu].foreign_processes``: another process holding VRAM at a start is reported, or refuses it."""

    WARN = "warn"
    REFUSE = "refuse"

class GpuConfig(Section):
    """``[gpu]``: which GPU to watch and the thresholds of its events."""

    enabled: GpuWatchMode = GpuWatchMode.AUTO
    index: Annotated[int, Field(ge=0), Policy("gpu_index")] = 0
    uuid: str = ""
    pci_bus_id: str = ""
    sample_interval_s: Annotated[PositiveFloat, Reload.LIVE] = 10.0
    temperature_warn_c: int = Field(85, ge=1, le=150)
    power_warn_fraction: float = Field(0.95, gt=0, le=1.5)
    foreign_processes: Annotated[ForeignProcesses, Reload.LIVE] = ForeignProcesses.WARN
    require_server_on_gpu: Annotated[bool, Reload.LIVE] = True
    server_on_gpu_timeout_s: Annotated[PositiveFloat, Reload.LIVE] = 10.0
    vram_release_timeout_s: Annotated[PositiveFloat, Reload.LIVE, Policy("vram_release_s")] = 30.0
    driver_version: str = ""
    enable_persistence: Annotated[bool, Reload.LIVE] = False
    slowdown_margin_c: int = Field(5, ge=0, le=50)
    temperature_hysteresis_c: int = Field(5, ge=0, le=50)
    power_sustain_s: float = Field(60.0, ge=0)
    throttle_sustain_s: float = Field(30.0, ge=0)
    reminder_interval_s: PositiveFloat = 3600.0
    kmsg_path: str = "/dev/kmsg"
    expected_vram_mib: int = Field(0, ge=0)
    vram_wait_timeout_s: Annotated[PositiveFloat, Policy()] = 300.0
    # Memory bandwidth for `bench`'s ceiling, GB/s (1e9 bytes/s); unset = from NVML (bus width x clock).
    memory_bandwidth_gbs: float | None = Field(None, gt=0, allow_inf_nan=False)
    # VRAM size for `check`'s budget instead of NVML's free memory, MiB (a stated card; tests).
    vram_total_mib: int | None = Field(None, gt=0)
