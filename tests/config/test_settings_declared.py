"""Each setting is declared once, in its section's model: its type, default and bounds, when a
reload applies it (:class:`Reload`) and whether the policy reads it (:class:`Policy`). The policy's
``Params``, ``params_from`` and the reload report are derived from those declarations."""

from __future__ import annotations

import dataclasses
from typing import Annotated, ClassVar

from llama_guard.config import Config
from llama_guard.config.base import Policy, PositiveFloat, Reload, Section, policy_keys, reload_of
from llama_guard.config.gpu import GpuConfig
from llama_guard.core.reload import reload_report
from llama_guard.gpu.rules import WatchSettings
from llama_guard.model.params import declared, params_from
from llama_guard.model.types import Params

# Params fields no single key fills: derived in params_from, or fixed (not configurable).
DERIVED = {"exit_drain_s", "reset_save_s", "require_gpu", "reset_possible", "reset_deadline_s", "vram_admission"}
FIXED = {"kill_wait_s", "vram_poll_s", "identical_failures", "port_retry_s"}
# Params defaults that describe "no host known yet" rather than a default configuration's value.
HOST_DEFAULTS = {"gpu_index", "offload_layers", "model_path"}


def _sections() -> dict[str, type[Section]]:
    return {name: info.annotation for name, info in Config.model_fields.items()}


def test_every_params_field_comes_from_one_declared_key_or_is_derived() -> None:
    fields = {f.name for f in dataclasses.fields(Params)}
    keyed = [field for section in _sections().values() for _, field, _ in policy_keys(section)]
    assert len(keyed) == len(set(keyed)), "two keys fill one Params field"
    assert set(keyed) <= fields, sorted(set(keyed) - fields)
    assert set(keyed) | DERIVED | FIXED == fields, sorted(fields - set(keyed) - DERIVED - FIXED)
    assert not set(keyed) & (DERIVED | FIXED)


def test_params_defaults_are_the_declared_defaults() -> None:
    defaults = Params()
    config = Config()
    for field, value in declared(config).items():
        if field not in HOST_DEFAULTS:
            assert getattr(defaults, field) == value, field


def test_params_from_copies_every_declared_key() -> None:
    config = Config.model_validate({
        "health": {"silent_limit_s": 61.5}, "recovery": {"reset_toggles_persistence": False},
        "gpu": {"vram_release_timeout_s": 31.5}, "server": {"n_gpu_layers": 7}})
    params = params_from(config)
    assert (params.silent_limit_s, params.reset_retry, params.vram_release_s, params.offload_layers) == (
        61.5, False, 31.5, 7)


def test_a_key_says_when_a_reload_applies_it_else_its_section_does() -> None:
    class Knobs(Section):
        reload: ClassVar[Reload] = Reload.SERVER_RESTART

        fixed_s: PositiveFloat = 1.0
        live_s: Annotated[PositiveFloat, Reload.LIVE, Policy("other")] = 2.0

    assert reload_of(Knobs, "fixed_s") is Reload.SERVER_RESTART
    assert reload_of(Knobs, "live_s") is Reload.LIVE
    assert [(key, field) for key, field, _ in policy_keys(Knobs)] == [("live_s", "other")]


def test_the_reload_report_follows_the_declarations() -> None:
    old = Config()
    new = Config.model_validate({
        "health": {"interval_s": 9.0, "timeout_s": 4.0, "load_stall_s": 61.0},
        "recovery": {"stop_grace_s": 16.0}, "limits": {"warn_fraction": 0.7}, "log": {"format": "json"}})
    report = reload_report(old, new)
    assert sorted(report.applied) == ["health.interval_s", "recovery.stop_grace_s"]
    assert report.next_server_start == ["health.timeout_s"]
    assert report.server_restart == ["limits.warn_fraction"]
    assert sorted(report.daemon_restart) == ["health.load_stall_s", "log.format"]


def test_gpu_watch_thresholds_are_the_gpu_sections() -> None:
    gpu = GpuConfig(temperature_warn_c=70, reminder_interval_s=120.0, vram_release_timeout_s=12.0)
    settings = WatchSettings.from_config(gpu)
    assert (settings.temperature_warn_c, settings.reminder_s, settings.foreign_grace_s) == (70, 120.0, 12.0)
    default = GpuConfig()
    assert WatchSettings() == WatchSettings.from_config(default)
