"""The policy's parameters (:class:`~llama_guard.core.types.Params`) from a validated configuration:
read at daemon start and again at each reload."""

from __future__ import annotations

from llama_guard.config import Config
from llama_guard.config.gpu import GpuWatchMode
from llama_guard.core.types import Params, reset_deadline_s


def params_from(config: Config, *, reset_possible: bool = False) -> Params:
    """The policy's parameters from a validated configuration; ``reset_possible`` when the GPU
    watch is on (a reset can be verified)."""
    gpu_wanted = config.gpu.enabled is not GpuWatchMode.OFF and config.server.n_gpu_layers > 0
    return Params(
        load_timeout_s=config.health.load_timeout_s,
        hang_strikes=config.health.hang_strikes,
        backoff_initial_s=config.recovery.backoff_initial_s,
        backoff_factor=config.recovery.backoff_factor,
        backoff_max_s=config.recovery.backoff_max_s,
        max_restarts=config.recovery.max_restarts,
        restart_window_s=config.recovery.restart_window_s,
        stable_after_s=config.recovery.stable_after_s,
        stop_grace_s=config.recovery.stop_grace_s,
        # Only the front door knows every request in flight and can refuse new ones meanwhile.
        exit_drain_s=config.front.stop_drain_s if config.front.address is not None else 0.0,
        drain_timeout_s=config.schedule.drain_timeout_s,
        reset_save_s=config.slots.reset_save_timeout_s if config.slots.enabled else 0.0,
        require_gpu=gpu_wanted and config.gpu.require_server_on_gpu,
        reset_possible=reset_possible,
        reset_on=frozenset(config.recovery.reset_on),
        max_resets=config.recovery.max_resets,
        reset_window_s=config.recovery.reset_window_s,
        reset_deadline_s=reset_deadline_s(config.recovery, config.gpu),
        vram_release_s=config.gpu.vram_release_timeout_s,
        foreign_wait_s=config.recovery.foreign_wait_s,
        reset_timeout_s=config.recovery.reset_timeout_s,
        reset_retry=config.recovery.reset_toggles_persistence,
        gpu_index=config.gpu.index,
        vram_admission=reset_possible and gpu_wanted,
        vram_wait_timeout_s=config.gpu.vram_wait_timeout_s,
        load_stall_s=config.health.load_stall_s,
        progress_cpu_s=config.health.progress_cpu_s,
        model_path=str(config.server.model),
        offload_layers=config.server.n_gpu_layers,
        port=config.server.port,
        port_wait_s=config.recovery.port_wait_s,
        repeat_confirm_s=config.recovery.repeat_confirm_s,
        silent_limit_s=config.health.silent_limit_s,
        hold_after_errors=config.front.hold_after_errors,
        canary=config.health.canary,
    )
