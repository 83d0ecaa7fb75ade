"""GPU watch: NVML sampling (:mod:`.nvml`), event rules (:mod:`.watch`), Xids from NVML
(:mod:`.xid`) and from the kernel log (:mod:`.kmsg`).

Only the NVML chokepoint (:mod:`.nvml_session`, the binding wrapper, and :mod:`.nvml`, the readings;
their typed errors in :mod:`.nvml_errors`) touches the ``pynvml`` module; nothing here imports it at
import time, so a host without the NVIDIA driver imports this package fine and gets a :class:`~.nvml.WatchOff`.
"""

from __future__ import annotations

from llama_guard.gpu.nvml import Nvml, WatchOff, open_gpu
from llama_guard.gpu.nvml_errors import (
    LOST_ERRORS,
    DeviceNotFound,
    DriverMismatch,
    DriverNotLoaded,
    GpuLost,
    LibraryNotFound,
    NoPermission,
    NotSupported,
    NvmlError,
)
from llama_guard.gpu.nvml_session import DeviceSelector
from llama_guard.gpu.readings import GpuIdentity, GpuProcess, GpuSample
from llama_guard.gpu.rules import GpuWatch, SampleVerdict, WatchSettings, sample_once, server_on_gpu, vram_released

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
    "SampleVerdict",
    "WatchOff",
    "WatchSettings",
    "open_gpu",
    "sample_once",
    "server_on_gpu",
    "vram_released",
]
