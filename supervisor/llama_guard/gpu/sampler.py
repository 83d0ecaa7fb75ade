"""One tick of the GPU watch: take a sample, judge it, return the events (for the daemon's thread).

Blocking (NVML calls, ~0.1-0.5 ms on an H200): call it from a worker thread, e.g.
``await asyncio.to_thread(tick, nvml, watch, time.monotonic())`` every ``[gpu].sample_interval_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llama_guard.gpu.nvml import Nvml, NvmlError
from llama_guard.gpu.readings import GpuSample
from llama_guard.gpu.rules import Event, GpuWatch


@dataclass(frozen=True)
class Tick:
    """What one tick saw: the sample (None when NVML failed), the events to emit, and the error."""

    sample: GpuSample | None
    events: list[Event] = field(default_factory=list)
    error: NvmlError | None = None


def tick(nvml: Nvml, watch: GpuWatch, now: float) -> Tick:
    """Sample ``nvml`` and feed ``watch`` at monotonic ``now`` (s). Never raises an NVML error:
    a lost GPU comes back as ``gpu_lost`` in ``events`` (once, then reminders) and in ``error``."""
    try:
        sample = nvml.sample()
    except NvmlError as exc:
        return Tick(None, watch.observe_error(exc, now), exc)
    return Tick(sample, watch.observe(sample, now))
