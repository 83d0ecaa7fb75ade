"""The policy's parameters (:class:`~llama_guard.model.types.Params`) from a validated configuration:
read at daemon start and again at each reload.

Every key marked :class:`~llama_guard.config.base.Policy` in its section's model is copied to its
``Params`` field; what the policy needs that no single key says (the front door on, a GPU watched,
a reset possible) is derived below."""

from __future__ import annotations

from typing import Any

from llama_guard.config import Config
from llama_guard.config.base import Section, policy_keys
from llama_guard.config.gpu import GpuWatchMode
from llama_guard.model.types import Params, reset_deadline_s


def declared(config: Config) -> dict[str, Any]:
    """``Params`` field → value, for every key of ``config`` marked ``Policy``."""
    values: dict[str, Any] = {}
    for section_name in type(config).model_fields:
        section: Section = getattr(config, section_name)
        for key, field, mark in policy_keys(type(section)):
            value = getattr(section, key)
            values[field] = value if mark.convert is None else mark.convert(value)
    return values


def params_from(config: Config, *, reset_possible: bool = False) -> Params:
    """The policy's parameters from a validated configuration; ``reset_possible`` when the GPU
    watch is on (a reset can be verified)."""
    gpu_wanted = config.gpu.enabled is not GpuWatchMode.OFF and config.server.n_gpu_layers > 0
    return Params(
        **declared(config),
        # Only the front door knows every request in flight and can refuse new ones meanwhile.
        exit_drain_s=config.front.stop_drain_s if config.front.address is not None else 0.0,
        reset_save_s=config.slots.reset_save_timeout_s if config.slots.enabled else 0.0,
        require_gpu=gpu_wanted and config.gpu.require_server_on_gpu,
        reset_possible=reset_possible,
        reset_deadline_s=reset_deadline_s(config.recovery, config.gpu),
        vram_admission=reset_possible and gpu_wanted,
    )
