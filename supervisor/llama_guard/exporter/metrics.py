"""Prometheus metrics (``prometheus-client``), served on ``[metrics].listen`` (off when unset) by
:class:`~llama_guard.exporter.listener.MetricsListener` on the daemon's loop.

:class:`MetricsSource` is a watcher (:class:`llama_guard.model.watcher.Watcher`) and an event sink: it
counts every emitted event (wiring makes it a sink of the emitter, which the policy's ``Emit``
actions and the watchers' own events both go through), times the phases (from the records the loop
publishes, ``on_transition``) and reads
the live policy state, the GPU watcher's last sample and the limits watcher's last usage reading
(typed accessors) when Prometheus scrapes, so the daemon needs nothing but the source in its list.
Its :meth:`MetricsSource.snapshot` (``status.json``'s ``"metrics"``) keeps restart causes and the
wall-clock time the server became ready for ``llama-guard status``.

Names follow Prometheus conventions: ``llama_guard_`` prefix, units in names (``_seconds``, ``_bytes``,
``_celsius``, ``_watts``), counters end in ``_total``. See docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from llama_guard.core.listen_wait import bind_waiting
from llama_guard.core.offload import Lane, LaneKind
from llama_guard.exporter.fleet import SlotReading, build_info, gpu_capacity, read_slots, slot_metrics
from llama_guard.gpu.readings import EXPORTED_CLOCK_EVENTS, GpuSample
from llama_guard.host.build import Build, commit_of
from llama_guard.limits.usage import UsageSample
from llama_guard.model.transition import Transition
from llama_guard.model.types import State
from llama_guard.model.watcher import Context, Watcher
from llama_guard.vocab.phases import Phase

if TYPE_CHECKING:
    from llama_guard.exporter.listener import MetricsListener

WAIT_FIELDS = ("waited_s", "vram_wait_s")  # Emit fields that carry a VRAM wait in seconds
NOT_COUNTED = frozenset({"server_line", "server_probe"})  # debug chatter, one per line/probe
# Upper bounds (seconds) of the restart-time histograms: a small model restarts in well under a
# second, a 27B-class one in tens of seconds, a cold read of a large file in minutes.
RESTART_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# The restart times, each: the event and field that carry it, the histogram's name and help.
RESTART_TIMES = (
    ("server_ready", "restart_to_ready_s", "llama_guard_restart_to_ready_seconds",
     "from a restart's beginning (the old server's stop or exit) to the new server's /health 200"),
    ("restart_first_token", "restart_to_first_token_s", "llama_guard_restart_to_first_token_seconds",
     "from a restart's beginning to the first byte of a 2xx answer to a request held across it"),
)


class Histogram:
    """Observations (seconds) counted into RESTART_BUCKETS_S, as Prometheus histograms count them."""

    def __init__(self) -> None:
        self.counts = [0] * len(RESTART_BUCKETS_S)  # per bucket, not cumulative
        self.count = 0
        self.total_s = 0.0
        self.last_s: float | None = None

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.last_s = seconds
        for i, bound in enumerate(RESTART_BUCKETS_S):
            if seconds <= bound:
                self.counts[i] += 1
                break

    def family(self, name: str, text: str) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, n in zip(RESTART_BUCKETS_S, self.counts, strict=True):
            running += n
            cumulative.append((repr(bound), float(running)))  # "0.25", "10.0": as prometheus-client writes ``le``
        cumulative.append(("+Inf", float(self.count)))
        return HistogramMetricFamily(name, text, buckets=cumulative, sum_value=self.total_s)


class MetricsSource(Watcher, Collector):
    """Counts events, times phases, and exports everything on scrape. ``gpu_sample``: the GPU
    watcher's latest NVML sample; ``usage``: the limits watcher's latest reading of the server;
    ``build``: the serving llama-server build; ``slot_files``: the committed slot files (each None when
    unknown; ``slot_files`` is called on the scrape's lane thread and may read the disk). ``llama-guard
    bench``'s last result is read from ``[runtime].dir``; llama-server's slots before each scrape (:meth:`refresh`)."""

    name = "metrics"

    def __init__(self, *, gpu_sample: Callable[[], GpuSample | None] = lambda: None,
                 usage: Callable[[], UsageSample | None] = lambda: None,
                 build: Callable[[], Build | None] = lambda: None,
                 slot_files: Callable[[], int | None] = lambda: None, serve: bool = True) -> None:
        self._gpu_sample = gpu_sample
        self._usage = usage
        self._build = build
        self._slot_files = slot_files
        self._slots: SlotReading | None = None  # the last scrape's read of llama-server's /slots
        self.serve = serve
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.ctx: Context | None = None
        self.events: Counter[str] = Counter()
        self.restarts: Counter[str] = Counter()
        self.resets: Counter[tuple[str, str]] = Counter()
        self.phase_time: dict[str, tuple[int, float]] = {}  # phase -> (count, sum seconds) of finished stays
        self.vram_wait: tuple[int, float] = (0, 0.0)
        self.restart_times = {field: Histogram() for _, field, _, _ in RESTART_TIMES}
        self._phase: Phase | None = None
        # The policy's state as the loop's last record left it (before the first step: the initial STOPPED).
        self._state = State()
        self._phase_since = 0.0
        self.ready_since_wall: float | None = None
        self.listening: tuple[str, int] | None = None
        self._listener: MetricsListener | None = None
        self._proc = Lane(LaneKind.PROC)  # who holds the port, while it waits for it

    # -- Watcher ---------------------------------------------------------------------------------
    async def start(self, ctx: Context) -> str | None:
        self.ctx = ctx
        self._phase, self._phase_since = self._state.phase, ctx.clock()
        address = ctx.config.metrics.address
        if address is not None and self.serve:
            # Imported here: aiohttp's server is loaded only when something listens.
            from llama_guard.exporter.listener import MetricsListener

            # /livez and /readyz beside /metrics (the front door serves them too, when it is on).
            listener = MetricsListener(self.registry, lambda: self._state, ctx.clock, refresh=self.refresh)
            # A port another process holds is waited for, as the front door's and llama-server's are.
            bound = await bind_waiting(ctx, self._proc, lambda: listener.listen(*address), setting="[metrics].listen",
                                       value=ctx.config.metrics.listen, address=address, taken="metrics_port_taken")
            if isinstance(bound, str):
                return bound
            self.listening = bound
            self._listener = listener
        return None

    async def refresh(self) -> None:
        """Before a scrape's render, on the loop: read llama-server's slots (None when no server is ready
        or it does not answer in time: those series are then absent)."""
        self._slots = None if self.ctx is None else await read_slots(self.ctx, self._state)

    def on_transition(self, ctx: Context, step: Transition) -> None:
        self._state = step.after
        self._track_phase(step.after.phase, step.at)

    def write(self, record: dict[str, Any]) -> None:
        """:class:`llama_guard.output.eventlog.EventSink`: every emitted event, the policy's and the
        watchers' own (``gpu_temperature_high`` …); wiring attaches the source to the emitter."""
        name = str(record.get("event", ""))
        if name and name not in NOT_COUNTED:
            self.count(name, record)

    def count(self, name: str, fields: Mapping[str, Any]) -> None:
        """Count event ``name``; a ``server_restart`` also by its ``restart_cause`` (set by the policy,
        a :class:`~llama_guard.model.types.RestartCause` value)."""
        self.events[name] += 1
        if name == "server_restart":
            self.restarts[str(fields.get("restart_cause") or "unknown")] += 1
        elif name == "gpu_reset":
            self.resets[(str(fields.get("outcome", "?")), str(fields.get("trigger", "")))] += 1
        elif name == "server_ready":
            self.ready_since_wall = time.time()
            self.restart_times["restart_to_first_token_s"].last_s = None  # the new restart's is not known yet
        for event, field, _, _ in RESTART_TIMES:
            value = fields.get(field)
            if name == event and isinstance(value, (int, float)):
                self.restart_times[field].observe(float(value))
        for key in WAIT_FIELDS:
            value = fields.get(key)
            if isinstance(value, (int, float)):
                self.vram_wait = (self.vram_wait[0] + 1, self.vram_wait[1] + float(value))

    def _track_phase(self, phase: Phase, now: float) -> None:
        """The phase is ``phase`` at monotonic ``now``: a stay in the previous one ends."""
        if phase is not self._phase:
            if self._phase is not None:
                count, total = self.phase_time.get(self._phase.value, (0, 0.0))
                self.phase_time[self._phase.value] = (count + 1, total + max(0.0, now - self._phase_since))
            if self._phase is Phase.READY:
                self.ready_since_wall = None
            self._phase, self._phase_since = phase, now

    def snapshot(self) -> dict[str, Any] | None:
        return {"listen": None if self.listening is None else f"{self.listening[0]}:{self.listening[1]}",
                "ready_since": self.ready_since_wall, "restarts_by_cause": dict(self.restarts),
                "resets": [{"outcome": o, "trigger": t, "count": n} for (o, t), n in self.resets.items()],
                "events": dict(self.events),
                "last_restart": {field: hist.last_s for field, hist in self.restart_times.items()}}

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
            self._listener = None

    # -- Collector -------------------------------------------------------------------------------
    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        ctx = self.ctx
        if ctx is None:
            return
        state, now = self._state, ctx.clock()
        yield build_info()
        phase = GaugeMetricFamily("llama_guard_phase", "1 for the daemon's current phase", labels=["phase"])
        for p in Phase:
            phase.add_metric([p.value], 1.0 if p is state.phase else 0.0)
        yield phase
        yield GaugeMetricFamily("llama_guard_server_ready", "1 while llama-server is ready", value=float(
            state.phase is Phase.READY))
        since = GaugeMetricFamily("llama_guard_ready_duration_seconds", "seconds since the server became ready "
                                  "(0 when not ready)", value=max(0.0, now - state.ready_at)
                                  if state.phase is Phase.READY and state.ready_at is not None else 0.0)
        yield since
        yield GaugeMetricFamily("llama_guard_phase_duration_seconds", "seconds in the current phase",
                                value=max(0.0, now - self._phase_since))
        restarts = CounterMetricFamily("llama_guard_restarts", "server restarts by the cause that led to them",
                                       labels=["cause"])
        for cause, n in sorted(self.restarts.items()):
            restarts.add_metric([cause], float(n))
        yield restarts
        resets = CounterMetricFamily("llama_guard_gpu_resets", "GPU reset attempts by outcome and trigger",
                                     labels=["outcome", "trigger"])
        for (outcome, trigger), n in sorted(self.resets.items()):
            resets.add_metric([outcome, trigger], float(n))
        yield resets
        events = CounterMetricFamily("llama_guard_events", "health events emitted, by name", labels=["event"])
        for name, n in sorted(self.events.items()):
            events.add_metric([name], float(n))
        yield events
        budget_left = GaugeMetricFamily("llama_guard_gpu_reset_budget_remaining",
                                        "GPU resets still allowed in [recovery].reset_window_s")
        window = ctx.config.recovery.reset_window_s
        used = sum(1 for t in state.resets if now - t <= window)
        budget_left.add_metric([], float(max(0, ctx.config.recovery.max_resets - used)))
        yield budget_left
        yield GaugeMetricFamily("llama_guard_gpu_lost", "1 while the GPU is lost", value=float(state.gpu_lost))
        # Read on the scrape's lane thread: asyncio.all_tasks tolerates the loop adding tasks meanwhile.
        yield GaugeMetricFamily("llama_guard_asyncio_tasks", "asyncio tasks of the daemon's loop not done yet "
                                "(flat on a box that runs for months: benchmarks/bench_soak.py)",
                                value=float(len(asyncio.all_tasks(ctx.loop))))
        phases = SummaryMetricFamily("llama_guard_phase_seconds", "finished stays in each phase (draining = "
                                     "drain duration, resetting_gpu = reset, starting = load)", labels=["phase"])
        for name, (count, total) in sorted(self.phase_time.items()):
            phases.add_metric([name], count_value=count, sum_value=total)
        yield phases
        for _, field, metric, text in RESTART_TIMES:
            yield self.restart_times[field].family(metric, text)
        yield SummaryMetricFamily("llama_guard_vram_wait_seconds", "waits for the previous server's VRAM",
                                  count_value=self.vram_wait[0], sum_value=self.vram_wait[1])
        yield from self._peer_metrics()
        reading = self._slots
        current = reading is not None and state.phase is Phase.READY and reading.pid == state.pid
        yield from slot_metrics(reading if current else None, self._slot_files())
        build = self._build()
        if build is not None:
            info = GaugeMetricFamily("llama_guard_server_build_info", "1 for the serving llama-server build: its "
                                     "release (SemVer or build number and commit), git commit, --version text "
                                     "and SHA-256", labels=["release", "commit", "version", "sha256", "binary"])
            info.add_metric([build.release, commit_of(build.version), build.version, build.sha256, str(build.path)],
                            1.0)
            yield info
        trial = state.last_trial
        if trial is not None:
            tps = GaugeMetricFamily("llama_guard_upgrade_trial_tokens_per_second", "the last upgrade trial's "
                                    "median decode tokens/s of each build (old: the one serving before, new: "
                                    "the one tried)", labels=["build"])
            for which, value in (("old", trial.old_tps), ("new", trial.new_tps)):
                if value is not None:
                    tps.add_metric([which], value)
            yield tps
            yield GaugeMetricFamily("llama_guard_upgrade_trial_kept", "1 when the last upgrade trial kept the new "
                                    "build, 0 when it rolled back", value=float(trial.kept))
        yield from self._bench_metrics(ctx.config.runtime.dir)

    def _peer_metrics(self) -> Iterator[Any]:
        sample = self._gpu_sample()
        if sample is not None:
            labels, gpu_id = ["gpu"], [str(sample.identity.index)]
            for metric, value, scale, text in (
                    ("llama_guard_gpu_temperature_celsius", sample.temperature_c, 1.0, "GPU temperature"),
                    ("llama_guard_gpu_power_watts", sample.power_mw, 1e-3, "GPU power draw"),
                    ("llama_guard_gpu_power_limit_watts", sample.power_limit_mw, 1e-3, "enforced power limit"),
                    ("llama_guard_gpu_memory_used_bytes", sample.memory_used_bytes, 1.0, "VRAM used (all processes)"),
                    ("llama_guard_gpu_memory_total_bytes", sample.memory_total_bytes, 1.0, "VRAM total")):
                if value is not None:
                    yield _gauge(metric, text, labels, gpu_id, value * scale)
            yield from gpu_capacity(sample, labels, gpu_id)
            server_pid = self._state.pid
            if server_pid is not None and sample.processes is not None:
                # NVML's per-process figure for llama-server's pid (0 until it appears on the GPU); the rest of
                # llama_guard_gpu_memory_used_bytes is other processes and the driver's own.
                held = sum(p.used_bytes or 0 for p in sample.processes if p.pid == server_pid)
                yield _gauge("llama_guard_server_vram_bytes", "VRAM held by llama-server (NVML, its pid)", labels,
                             gpu_id, float(held))
            reasons = sample.clock_event_reasons
            if reasons is not None:
                fam = GaugeMetricFamily("llama_guard_gpu_throttle_reason", "1 when the clock event reason is active",
                                        labels=["gpu", "reason"])
                for bit, reason in EXPORTED_CLOCK_EVENTS.items():
                    fam.add_metric([*gpu_id, reason], float(bool(reasons & bit)))
                yield fam
        usage = self._usage()
        fam = GaugeMetricFamily("llama_guard_rlimit_used", "the server's use of a limited resource",
                                labels=["limit"])
        lim = GaugeMetricFamily("llama_guard_rlimit_soft", "the server's soft limit (-1 unlimited)",
                                labels=["limit"])
        if usage is not None:
            for limit, used, soft in (("RLIMIT_NOFILE", usage.fds, usage.nofile_limit),
                                      ("RLIMIT_NPROC", usage.threads, usage.nproc_limit)):
                if used is not None:
                    fam.add_metric([limit], float(used))
                if soft is not None:
                    lim.add_metric([limit], float(soft))
        yield fam
        yield lim

    def _bench_metrics(self, runtime_dir: Path) -> Iterator[Any]:
        from llama_guard.tune.bench import read_recorded

        bench = read_recorded(runtime_dir)
        if not bench:
            return
        for metric, key, text in (("llama_guard_bench_eval_tokens_per_second", "eval_tokens_per_s",
                                   "last bench: median eval (generation) speed"),
                                  ("llama_guard_bench_prompt_tokens_per_second", "prompt_tokens_per_s",
                                   "last bench: median prompt (prefill) speed")):
            value = (bench.get(key) or {}).get("median")
            if isinstance(value, (int, float)):
                yield GaugeMetricFamily(metric, text, value=float(value))
        ceiling = bench.get("ceiling") or {}
        if isinstance(ceiling.get("ceiling_tokens_per_s"), (int, float)):
            yield GaugeMetricFamily("llama_guard_bench_ceiling_tokens_per_second",
                                    "last bench: bandwidth ceiling", value=float(ceiling["ceiling_tokens_per_s"]))
        if isinstance(bench.get("finished"), (int, float)):
            yield GaugeMetricFamily("llama_guard_bench_timestamp_seconds", "when the last bench finished (Unix time)",
                                    value=float(bench["finished"]))


def _gauge(name: str, text: str, labels: list[str], values: list[str], value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, text, labels=labels)
    fam.add_metric(values, float(value))
    return fam
