"""Persistence mode turned on by llama-guard when a sample finds it off and
``[gpu].enable_persistence`` asks for it: only as root with ``CAP_SYS_ADMIN`` (the reset's
credentials, :func:`~llama_guard.core.privileges.reset_precondition`), through one NVML call on the
GPU lane. The outcome is reported as ``gpu_persistence_off`` with the action taken; an NVML error
is reported, never raised (a hung call raises :class:`~llama_guard.gpu.nvml_errors.NvmlHung`).
"""

from __future__ import annotations

from llama_guard.core.offload import Lane
from llama_guard.core.privileges import reset_precondition
from llama_guard.gpu import Nvml, NvmlError
from llama_guard.gpu.nvml import nvml_step
from llama_guard.model.watcher import Context


async def enable_persistence(ctx: Context, nvml: Nvml, lane: Lane, gpu_index: int) -> None:
    """Turn persistence mode on for GPU ``gpu_index`` (its NVML index) on ``lane``; reports the outcome."""
    if reset_precondition():  # the same credentials: root with CAP_SYS_ADMIN
        ctx.emit("gpu_persistence_off", gpu_index=gpu_index,
                 action="not changed: [gpu].enable_persistence needs llama-guard to run as root "
                        "with CAP_SYS_ADMIN")
        return
    try:
        await nvml_step(lane, lambda: nvml.set_persistence(True), "enabling persistence mode")
    except NvmlError as exc:
        ctx.emit("gpu_persistence_off", gpu_index=gpu_index, action=f"could not enable it: {exc}")
        return
    ctx.emit("gpu_persistence_off", gpu_index=gpu_index,
             action="enabled by llama-guard ([gpu].enable_persistence); prefer nvidia-persistenced")
