"""Builds the daemon's event outputs, service-manager notifier, watchers and ports from the configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llama_guard.config import Config
from llama_guard.core.gpu_port import GpuPort
from llama_guard.core.ports import BuildPort, ChildSetupPort, FrontPort, Listening, SlotPort
from llama_guard.core.service import ServiceNotifier
from llama_guard.model.watcher import Watcher
from llama_guard.output.eventlog import Emitter
from llama_guard.output.journal import JournalSink, journald_enabled
from llama_guard.output.notify import SdNotifier


def make_emitter(config: Config) -> Emitter:
    """Events to journald (native protocol) when stderr is the journal or ``[log].format`` is
    "journald"; otherwise to stderr, readable on a terminal and JSON lines elsewhere."""
    if journald_enabled(config.log.format):
        sink = JournalSink()
        sink.set_fallback_level(config.log.level)  # stderr fallback: no debug lines at "info"
        emitter = Emitter(min_level=config.log.level, fmt="json", sinks=[sink], sink_level="debug")
        emitter.stderr_enabled = False
        return emitter
    fmt = config.log.format if config.log.format != "journald" else "json"
    return Emitter(min_level=config.log.level, fmt=fmt)


def make_notifier() -> ServiceNotifier:
    """The sd_notify notifier (a no-op without ``$NOTIFY_SOCKET``); the variables are removed from
    the daemon's environment so that no child can inherit them."""
    return SdNotifier(unset_environment=True)


@dataclass(frozen=True)
class Watchers:
    """What the daemon is handed (:class:`llama_guard.core.daemon.Daemon`'s arguments of the same
    names): its watchers, in the order they start, and, among them, its ports."""

    watchers: list[Watcher]
    gpu: GpuPort
    child: ChildSetupPort
    slots: SlotPort
    front: FrontPort
    exporter: Listening
    builds: BuildPort


def make_watchers(config: Config, *, nvml_module: Any = None, emitter: Emitter) -> Watchers:
    """The optional watchers: limits, GPU, planned restarts, slots (the KV cache carried across restarts),
    metrics (served when [metrics].listen is set; it counts every event of ``emitter``), the front door
    (when [front].listen is set, on the socket systemd passed if any). Among them the ports: the GPU
    watcher is the GPU port, the limits watcher the child set-up, the slots watcher the KV slot port,
    the front door the front door port, the metrics watcher the exporter, the upgrade watcher the
    build port (preflight, probation and roll-back of llama-server builds).
    ``nvml_module``: the pynvml module the GPU watcher uses (None: the real ``pynvml``; tests inject a
    fake)."""
    from llama_guard.exporter.metrics import MetricsSource
    from llama_guard.front import activation
    from llama_guard.front.source import FrontSource
    from llama_guard.gpu.watcher import GpuSource
    from llama_guard.insight.need_cache import NeedCache
    from llama_guard.limits.watcher import LimitsSource
    from llama_guard.preflight.vram_check import need_mib_in_child
    from llama_guard.restarts.watcher import ScheduleSource
    from llama_guard.slots.watcher import SlotsSource
    from llama_guard.tune.bench import decode_speed
    from llama_guard.upgrade.watcher import UpgradeSource

    gpu = GpuSource(nvml_module=nvml_module, need_cache=NeedCache(need_mib_in_child))
    limits = LimitsSource()
    slots = SlotsSource()
    builds = UpgradeSource(measure=decode_speed)
    metrics = MetricsSource(gpu_sample=gpu.last_sample, usage=limits.last_usage, build=lambda: builds.serving,
                            slot_files=slots.held_files)
    emitter.sinks.append(metrics)
    # The front door (off unless [front].listen is set), on the socket systemd passed if any; its
    # metrics go to the exporter's registry.
    front = FrontSource(registry=metrics.registry, passed=activation.take())
    watchers: list[Watcher] = [limits, gpu, ScheduleSource(gpu_sample=gpu.last_sample), slots, builds, front, metrics]
    return Watchers(watchers, gpu=gpu, child=limits, slots=slots, front=front, exporter=metrics, builds=builds)
