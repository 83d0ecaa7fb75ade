"""GPU watch: NVML sampling (:mod:`.nvml`), event rules (:mod:`.watch`), Xids from NVML
(:mod:`.xid`) and from the kernel log (:mod:`.kmsg`).

Only :mod:`.nvml` touches the ``pynvml`` module; nothing here imports it at import time, so a host
without the NVIDIA driver imports this package fine and gets a :class:`~.nvml.WatchOff`.
"""

from __future__ import annotations

from llama_guard.gpu.nvml import (
    LOST_ERRORS,
    DeviceNotFound,
    DeviceSelector,
    DriverMismatch,
    DriverNotLoaded,
    GpuLost,
    LibraryNotFound,
    NoPermission,
    NotSupported,
    Nvml,
    NvmlError,
    WatchOff,
    open_gpu,
)
from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample
from llama_guard.gpu.rules import GpuWatch, WatchSettings, server_on_gpu, vram_released
from llama_guard.gpu.sampler import Tick, tick

__all__ = [
    "LOST_ERRORS",
    "DeviceNotFound",
    "DeviceSelector",
    "DriverMismatch",
    "DriverNotLoaded",
    "GpuIdentity",
    "GpuLost",
    "GpuProcess",
    "GpuSample",
    "GpuWatch",
    "LibraryNotFound",
    "NoPermission",
    "NotSupported",
    "Nvml",
    "NvmlError",
    "Tick",
    "WatchOff",
    "WatchSettings",
    "open_gpu",
    "server_on_gpu",
    "tick",
    "vram_released",
]
