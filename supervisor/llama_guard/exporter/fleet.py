"""The metrics a load balancer or a scheduler acts on (docs/metrics.md): which llama-guard runs, what the box
can take now (free slots, VRAM headroom, a GPU slowed by heat or power) and where conversations' KV caches
are held (in the server's slots, in slot files).

The server's slots are read once per scrape (:class:`SlotReading`, ``GET /slots`` on llama-server's private
port before the render, within :data:`SLOTS_READ_TIMEOUT_S`): they change with every request, so a figure
sampled for another purpose would be stale; the read is a task of llama-server's main loop, answered between
decode steps (docs/liveness.md), and only made while the server is ready.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from llama_guard import __version__
from llama_guard.gpu.readings import THROTTLE_MASK, GpuSample
from llama_guard.model.types import State
from llama_guard.model.watcher import Context
from llama_guard.slots.client import SlotCallError, SlotClient, SlotInfo
from llama_guard.vocab.phases import Phase

# A scrape waits at most this long for llama-server's /slots (seconds): within a scrape_timeout of 1 s.
SLOTS_READ_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class SlotReading:
    """``GET /slots`` of the server ``pid``: one :class:`SlotInfo` per slot."""

    pid: int
    slots: tuple[SlotInfo, ...]

    @property
    def busy(self) -> int:
        """Slots processing a request now."""
        return sum(s.processing for s in self.slots)

    @property
    def conversations(self) -> int:
        """Slots whose KV cache holds a conversation: a task's tokens, not llama-guard's own liveness canary."""
        return sum(1 for s in self.slots if s.id_task is not None and s.n_tokens > 0 and not s.canary)


async def read_slots(ctx: Context, state: State) -> SlotReading | None:
    """The slots of the server ``state`` (the loop's last record) holds ready, or None: no server is ready,
    or it did not answer ``/slots`` within :data:`SLOTS_READ_TIMEOUT_S` (a busy or hung server is the
    liveness watch's business, not the scrape's)."""
    if state.phase is not Phase.READY or state.pid is None:
        return None
    client = SlotClient(ctx.config.server.base_url, ctx.get_api_key, SLOTS_READ_TIMEOUT_S)
    try:
        slots = await client.slots()
    except SlotCallError:
        return None
    finally:
        await client.aclose()
    return SlotReading(state.pid, tuple(slots))


def build_info() -> GaugeMetricFamily:
    """``llama_guard_build_info``: 1, labelled with this llama-guard's version."""
    info = GaugeMetricFamily("llama_guard_build_info", "1 for the running llama-guard: its version",
                             labels=["version"])
    info.add_metric([__version__], 1.0)
    return info


def slot_metrics(reading: SlotReading | None, slot_files: int | None) -> Iterator[GaugeMetricFamily]:
    """Free and busy slots and the conversations held, from this scrape's ``reading`` (absent without one)
    and the committed slot files (``slot_files``; absent when the carry-over is off or unreadable)."""
    held = GaugeMetricFamily("llama_guard_kv_cache_conversations", "conversations whose KV cache is held: in "
                             "llama-server's slots (server) or in slot files for the next server (slot_files)",
                             labels=["place"])
    if reading is not None:
        slots = GaugeMetricFamily("llama_guard_server_slots", "llama-server's slots, by state (busy: processing "
                                  "a request; free: can take one now)", labels=["state"])
        slots.add_metric(["busy"], float(reading.busy))
        slots.add_metric(["free"], float(len(reading.slots) - reading.busy))
        yield slots
        held.add_metric(["server"], float(reading.conversations))
    if slot_files is not None:
        held.add_metric(["slot_files"], float(slot_files))
    yield held


def gpu_capacity(sample: GpuSample, labels: list[str], gpu_id: list[str]) -> Iterator[Any]:
    """VRAM headroom, whether the GPU is slowed now, and its own slowdown temperature (each absent when NVML
    does not say)."""
    if sample.memory_total_bytes is not None and sample.memory_used_bytes is not None:
        fam = GaugeMetricFamily("llama_guard_gpu_memory_free_bytes", "VRAM headroom: total minus used by all "
                                "processes (what another allocation could still take)", labels=labels)
        fam.add_metric(gpu_id, float(max(0, sample.memory_total_bytes - sample.memory_used_bytes)))
        yield fam
    if sample.clock_event_reasons is not None:
        fam = GaugeMetricFamily("llama_guard_gpu_throttled", "1 while a heat or power slowdown holds the GPU's "
                                "clocks down (any reason of llama_guard_gpu_throttle_reason but gpu_idle)",
                                labels=labels)
        fam.add_metric(gpu_id, float(bool(sample.clock_event_reasons & THROTTLE_MASK)))
        yield fam
    if sample.temp_slowdown_c is not None and sample.temp_slowdown_c > 0:
        fam = GaugeMetricFamily("llama_guard_gpu_slowdown_temperature_celsius", "the temperature at which the GPU "
                                "slows itself down (NVML's slowdown threshold)", labels=labels)
        fam.add_metric(gpu_id, float(sample.temp_slowdown_c))
        yield fam
