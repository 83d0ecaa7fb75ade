"""``check`` rows about the GPU: what NVML reports (read-only), the VRAM budget against it, whether the
daemon could reset it here; and what an NVML error at check time asks of the operator."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from typing import Any

from llama_guard.config import Config
from llama_guard.config.gpu import ForeignProcesses, GpuWatchMode
from llama_guard.core.privileges import Credentials, reset_precondition
from llama_guard.gpu.nvml import WatchOff
from llama_guard.gpu.nvml_errors import (
    DeviceNotFound,
    DriverMismatch,
    DriverNotLoaded,
    GpuLost,
    LibraryNotFound,
    NvmlError,
    NvmlHung,
    ResetRequired,
    UnknownError,
)
from llama_guard.model.policy.verdicts import RECOVERY_ADVICE
from llama_guard.model.types import RecoveryAction
from llama_guard.vocab.verdicts import CheckResult, NodeAction, Verdict

# What an NVML error at check time asks of the operator. A GPU off the bus (NVIDIA's Xid 79 family,
# NVML_ERROR_GPU_IS_LOST), a driver not loaded or not matching its library (an upgrade without a
# reboot), an NVML call that never returns: the host needs a reboot. NVML_ERROR_RESET_REQUIRED: a GPU
# reset. No driver library or a selector that names no GPU: the configuration ([gpu]) is wrong for
# this host. (NVML API reference, nvmlReturn_t; NVIDIA's Xid catalog for the recovery actions.)
GPU_ERROR_ACTIONS: tuple[tuple[type[NvmlError], NodeAction], ...] = (
    (ResetRequired, NodeAction.RESET_GPU),
    (GpuLost, NodeAction.REBOOT), (UnknownError, NodeAction.REBOOT), (DriverNotLoaded, NodeAction.REBOOT),
    (DriverMismatch, NodeAction.REBOOT), (NvmlHung, NodeAction.REBOOT),
    (LibraryNotFound, NodeAction.FIX_CONFIG), (DeviceNotFound, NodeAction.FIX_CONFIG),
)


# What to do when the config offloads layers ([gpu].enabled = "auto") and NVML cannot be opened, by
# the action of the NVML error (:data:`GPU_ERROR_ACTIONS`).
OFFLOAD_FIX: dict[NodeAction, str] = {
    NodeAction.FIX_CONFIG: ("install the NVIDIA driver (or correct [gpu].index/uuid/pci_bus_id), or set "
                            "n_gpu_layers = 0 to run on the CPU"),
    NodeAction.RESET_GPU: "reset the GPU (nvidia-smi --gpu-reset) once no process uses it",
    NodeAction.REBOOT: "reboot the host",
}


def gpu_error_action(error: NvmlError | None) -> NodeAction:
    """The :data:`GPU_ERROR_ACTIONS` row of ``error``'s type; ``fix_config`` for any other (or None)."""
    for kind, action in GPU_ERROR_ACTIONS:
        if isinstance(error, kind):
            return action
    return NodeAction.FIX_CONFIG


def check_gpu(config: Config, *, nvml_module: Any = None) -> list[CheckResult]:
    """The GPU as NVML sees it (read-only): name, driver (against ``[gpu].driver_version``),
    memory used/total, persistence mode, other processes holding VRAM (the VRAM budget is
    :func:`check_vram`).

    FAIL when ``[gpu].enabled = "on"``, or ``"auto"`` with ``n_gpu_layers`` > 0, and NVML cannot reach
    the GPU (the action by the NVML error: :data:`OFFLOAD_FIX`); WARN for what the daemon would also
    warn about (no driver with ``n_gpu_layers = 0``); nothing is changed on the GPU.
    """
    if config.gpu.enabled is GpuWatchMode.OFF:
        return [CheckResult("gpu", Verdict.OK, 'GPU watch off ([gpu].enabled = "off")')]
    from llama_guard.gpu import DeviceSelector, open_gpu
    from llama_guard.gpu.rules import driver_in_series

    selector = DeviceSelector(config.gpu.index, config.gpu.uuid, config.gpu.pci_bus_id)
    opened = open_gpu(selector, enabled=config.gpu.enabled, module=nvml_module)
    if isinstance(opened, WatchOff):
        if config.gpu.enabled is GpuWatchMode.ON:
            return [CheckResult("gpu", Verdict.FAIL, f"GPU watch off: {opened.reason}",
                                action=gpu_error_action(opened.error))]
        if config.server.n_gpu_layers > 0:  # "auto", but the config offloads: this GPU node is not healthy
            action = gpu_error_action(opened.error)
            return [CheckResult("gpu", Verdict.FAIL, f"n_gpu_layers = {config.server.n_gpu_layers} asks for the "
                                f"GPU, but NVML is unavailable: {opened.reason}; {OFFLOAD_FIX[action]}",
                                action=action)]
        return [CheckResult("gpu", Verdict.WARN, f"GPU watch off: {opened.reason}")]
    recovery: RecoveryAction | None = None
    try:
        sample = opened.sample()
        with contextlib.suppress(NvmlError):  # not reported by this driver/GPU: nothing to say
            recovery = opened.recovery_action()
    except NvmlError as exc:
        return [CheckResult("gpu", Verdict.FAIL, f"the GPU does not answer NVML: {exc}", action=gpu_error_action(exc))]
    finally:
        opened.close()
    mib = 2**20
    ident = sample.identity
    used, total = sample.memory_used_bytes, sample.memory_total_bytes
    memory = f"{used // mib} of {total // mib} MiB used" if used is not None and total is not None else "memory ?"
    results = [CheckResult("gpu", Verdict.OK, f"GPU {ident.index} {ident.name} ({ident.pci_bus_id}, {ident.uuid}), "
                                        f"driver {sample.driver_version}, {memory}")]
    expected = config.gpu.driver_version
    if expected and sample.driver_version and not driver_in_series(sample.driver_version, expected):
        results.append(CheckResult("driver", Verdict.WARN, f"driver {sample.driver_version} is outside the "
                                                     f"configured series {expected!r} ([gpu].driver_version)"))
    rows = sample.remapped_rows
    if rows is not None and rows.pending:
        # A row remap is applied at the next GPU reset (NVIDIA, "GPU Memory Error Management": row remapping).
        results.append(CheckResult("remapped rows", Verdict.WARN, f"a row remap is pending ({rows.uncorrectable} "
                                   f"uncorrectable, {rows.correctable} correctable rows remapped): it takes effect "
                                   "at the next GPU reset", action=NodeAction.RESET_GPU))
    if sample.persistence_mode is False:
        results.append(CheckResult("persistence", Verdict.WARN, "persistence mode is off: enable the "
                                                          "nvidia-persistenced service"))
    if recovery is not None and recovery is not RecoveryAction.NONE:
        results.append(CheckResult("recovery", Verdict.FAIL,
                                   f"the driver asks for a recovery action ({recovery.name.lower()}, NVML's "
                                   f"GPU recovery action field): {RECOVERY_ADVICE[recovery]}",
                                   action=NodeAction.RESET_GPU if recovery is RecoveryAction.GPU_RESET
                                   else NodeAction.REBOOT))
    for proc in sample.processes or ():
        verdict = Verdict.FAIL if config.gpu.foreign_processes is ForeignProcesses.REFUSE else Verdict.WARN
        results.append(CheckResult("gpu process", verdict,
                                   f"pid {proc.pid} holds {(proc.used_bytes or 0) // mib} MiB of VRAM "
                                   f"([gpu].foreign_processes = {config.gpu.foreign_processes.value})"))
    return results


def _find_command(command: str, which: Callable[[str], str | None]) -> str | None:
    if "/" in command:
        return command if os.path.isfile(command) and os.access(command, os.X_OK) else None
    return which(command)


def check_reset(config: Config, *, creds: Credentials | None = None,
                which: Callable[[str], str | None] = shutil.which, nvml_module: Any = None) -> CheckResult:
    """Whether the daemon could reset the GPU here, and if not, why: the GPU watch must be on (a
    reset has to be verified), llama-guard must have what ``nvidia-smi --gpu-reset`` needs under the
    credentials it actually has (euid 0 and CAP_SYS_ADMIN in ``CapEff`` of ``/proc/self/status``:
    :func:`llama_guard.core.privileges.reset_precondition`), and ``[recovery].reset_command`` must be
    found. Read-only: NVML is opened and closed, nothing reset.

    ``creds``, ``which`` and ``nvml_module`` (a pynvml stand-in; None: the real ``pynvml``) are
    injectable for tests. WARN, not FAIL, when a reset is not
    possible: the daemon then restarts the server only, and a lost GPU ends it with exit 69.
    """
    rec = config.recovery
    if not rec.reset_on or rec.max_resets == 0:
        why = "[recovery].reset_on is empty" if not rec.reset_on else "[recovery].max_resets = 0"
        return CheckResult("gpu reset", Verdict.OK, f"GPU resets are off ({why}): restart only")
    reasons: list[str] = []
    gpu_text = ""
    if config.gpu.enabled is GpuWatchMode.OFF:
        reasons.append('the GPU watch is off ([gpu].enabled = "off"), so a reset could not be verified')
    else:
        from llama_guard.gpu import DeviceSelector, open_gpu

        selector = DeviceSelector(config.gpu.index, config.gpu.uuid, config.gpu.pci_bus_id)
        opened = open_gpu(selector, enabled=config.gpu.enabled, module=nvml_module)
        if (isinstance(opened, WatchOff) and isinstance(opened.error, LibraryNotFound)
                and config.gpu.enabled is GpuWatchMode.AUTO):  # a host without the NVIDIA driver
            return CheckResult("gpu reset", Verdict.OK,
                               f"not applicable: {opened.reason}; with [gpu].enabled = \"auto\" no GPU is "
                               "watched here and a failing server is restarted only")
        if isinstance(opened, WatchOff):
            reasons.append(f"the GPU cannot be watched ({opened.reason}), so a reset could not be verified")
        else:
            try:
                identity = opened.open()
                gpu_text = f"GPU {identity.index} ({identity.name}, {identity.pci_bus_id}) watched"
            except NvmlError as exc:
                reasons.append(f"the GPU cannot be watched ({exc}), so a reset could not be verified")
            finally:
                opened.close()
    refusal = reset_precondition(creds)
    if refusal:
        reasons.append(refusal)
    command = rec.reset_command[0]
    found = _find_command(command, which)
    if found is None:
        where = "" if "/" in command else " on PATH"
        reasons.append(f"the reset command {command!r} was not found{where} ([recovery].reset_command)")
    argv_text = " ".join(rec.reset_command)
    if reasons:
        return CheckResult("gpu reset", Verdict.WARN,
                           "a GPU reset would not be possible here: " + "; ".join(reasons)
                           + f". On {', '.join(rec.reset_on)} llama-guard restarts the server only, "
                             "and a lost GPU ends with exit 69")
    return CheckResult("gpu reset", Verdict.OK,
                       f"possible: root with CAP_SYS_ADMIN, {found} found, {gpu_text}; "
                       f"on {', '.join(rec.reset_on)} it runs "
                       f"`{argv_text}` (at most {rec.max_resets} per {rec.reset_window_s:.0f} s)")


def check_vram(config: Config, *, nvml_module: Any = None) -> list[CheckResult]:
    """The VRAM budget from the model's GGUF metadata against the GPU's free memory (or
    ``[gpu].vram_total_mib``), with the operators' ladder when it does not fit
    (:mod:`llama_guard.preflight.vram_check`). The first row carries the budget as ``data``."""
    from llama_guard.gpu.info import gpu_memory_facts
    from llama_guard.preflight.vram_check import report_lines, vram_report

    report = vram_report(config, gpu_memory_facts(config, nvml_module=nvml_module))
    rows = report_lines(report)
    return [CheckResult(name, verdict, detail, report.as_dict() if i == 0 else None)
            for i, (verdict, name, detail) in enumerate(rows)]
