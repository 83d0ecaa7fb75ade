"""Turn GPU samples into health events: pure, with hysteresis and slow reminders.

:class:`GpuWatch` is fed ``(sample, now)`` (``now`` in monotonic seconds) and returns the events
to emit as ``(name, fields)`` tuples; it never reads a clock, NVML or the OS. The daemon calls
:meth:`GpuWatch.observe` from its sampling thread every ``[gpu].sample_interval_s`` and
:meth:`GpuWatch.observe_error` when :meth:`llama_guard.gpu.nvml.Nvml.sample` raised.

Each condition fires once when it starts (after its sustain time), repeats as a reminder every
``reminder_s`` while it lasts, and clears only past its hysteresis (a lower threshold, or a
time it must stay off) — so a reading wobbling around a threshold makes no storm.

Also here, for the policy: :func:`server_on_gpu`, :func:`vram_released`, :func:`foreign_processes`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from llama_guard.config.gpu import GpuConfig
from llama_guard.gpu.nvml import Nvml
from llama_guard.gpu.nvml_errors import LOST_ERRORS, NvmlError, Suspended, describe
from llama_guard.gpu.readings import GpuProcess, GpuSample
from llama_guard.vocab.events import EventName
from llama_guard.vocab.units import MIB

Event = tuple[EventName, dict[str, Any]]
_GPU = GpuConfig()


@dataclass(frozen=True)
class WatchSettings:
    """Thresholds of the GPU events; :meth:`from_config` reads them from ``[gpu]`` (config/gpu.py
    declares each: its type, default and bounds; the defaults here are that section's).

    Temperatures in °C, power as a fraction of the enforced limit, times in seconds.
    """

    temperature_warn_c: int = _GPU.temperature_warn_c
    slowdown_margin_c: int = _GPU.slowdown_margin_c
    temperature_hysteresis_c: int = _GPU.temperature_hysteresis_c
    power_warn_fraction: float = _GPU.power_warn_fraction
    power_hysteresis_fraction: float = 0.05  # not configurable
    power_sustain_s: float = _GPU.power_sustain_s
    throttle_sustain_s: float = _GPU.throttle_sustain_s
    clear_after_s: float = 30.0  # not configurable
    reminder_s: float = _GPU.reminder_interval_s
    driver_version: str = _GPU.driver_version
    foreign_grace_s: float = _GPU.vram_release_timeout_s

    @classmethod
    def from_config(cls, gpu: GpuConfig) -> WatchSettings:
        """Settings from a ``[gpu]`` section."""
        return cls(
            temperature_warn_c=gpu.temperature_warn_c,
            slowdown_margin_c=gpu.slowdown_margin_c,
            temperature_hysteresis_c=gpu.temperature_hysteresis_c,
            power_warn_fraction=gpu.power_warn_fraction,
            power_sustain_s=gpu.power_sustain_s,
            throttle_sustain_s=gpu.throttle_sustain_s,
            reminder_s=gpu.reminder_interval_s,
            driver_version=gpu.driver_version,
            foreign_grace_s=gpu.vram_release_timeout_s,
        )

    def temperature_threshold_c(self, slowdown_c: int | None) -> int:
        """The warning temperature: ``temperature_warn_c``, lowered to ``slowdown - margin`` when
        the GPU's own slowdown threshold is known and closer."""
        if slowdown_c is None or slowdown_c <= 0:
            return self.temperature_warn_c
        return min(self.temperature_warn_c, slowdown_c - self.slowdown_margin_c)


class Step(enum.Enum):
    """What a :class:`Condition` update asks for."""

    FIRE = "fire"
    REMIND = "remind"
    CLEAR = "clear"


class Condition:
    """A debounced on/off condition with hysteresis and a reminder.

    ``update(on, off, now)``: ``on`` must hold for ``sustain_on_s`` before FIRE; while active,
    ``off`` must hold for ``sustain_off_s`` before CLEAR (``on`` and ``off`` may both be false: the
    hysteresis band, where nothing changes); REMIND every ``reminder_s`` while active.
    """

    def __init__(self, sustain_on_s: float = 0.0, sustain_off_s: float = 0.0, reminder_s: float = 3600.0):
        self.sustain_on_s = sustain_on_s
        self.sustain_off_s = sustain_off_s
        self.reminder_s = reminder_s
        self.active = False
        self._on_since: float | None = None
        self._off_since: float | None = None
        self._last_emit = 0.0

    def update(self, on: bool, off: bool, now: float) -> Step | None:
        """Advance with one observation; returns the step to report, if any."""
        if not self.active:
            self._off_since = None
            if not on:
                self._on_since = None
                return None
            if self._on_since is None:
                self._on_since = now
            if now - self._on_since >= self.sustain_on_s:
                self.active = True
                self._last_emit = now
                return Step.FIRE
            return None
        self._on_since = None
        if off:
            if self._off_since is None:
                self._off_since = now
            if now - self._off_since >= self.sustain_off_s:
                self.active = False
                self._off_since = None
                return Step.CLEAR
            return None
        self._off_since = None
        if now - self._last_emit >= self.reminder_s:
            self._last_emit = now
            return Step.REMIND
        return None


def process_name(pid: int) -> str | None:
    """The name of process ``pid`` (psutil: ``/proc/<pid>/comm``, widened from its cmdline when
    the kernel cut it at 15 characters), or None when it is gone or unreadable."""
    try:
        return psutil.Process(pid).name() or None
    except psutil.Error:
        return None


class GpuWatch:
    """The GPU event rules. Feed :meth:`observe` / :meth:`observe_error`; tell it the server pid
    with :meth:`set_server_pid`. ``proc_name(pid)`` names a foreign process (default: /proc)."""

    def __init__(self, settings: WatchSettings | None = None, *,
                 proc_name: Callable[[int], str | None] = process_name) -> None:
        self.settings = st = settings or WatchSettings()
        self._proc_name = proc_name
        self.temperature = Condition(0.0, 0.0, st.reminder_s)
        self.power = Condition(st.power_sustain_s, st.clear_after_s, st.reminder_s)
        self.throttle = Condition(st.throttle_sustain_s, st.clear_after_s, st.reminder_s)
        self.persistence = Condition(0.0, 0.0, st.reminder_s)
        self.persistence_step: Step | None = None  # what the last sample did to the persistence condition
        self.lost = Condition(0.0, 0.0, st.reminder_s)
        self._foreign: dict[int, Condition] = {}
        self._server_pid: int | None = None
        self._recent_ours: dict[int, float] = {}  # previous server pids -> when they stopped being ours
        self._driver_reported: str | None = None
        self.last_sample: GpuSample | None = None

    # -- what the daemon tells us ------------------------------------------------------------------
    def set_server_pid(self, pid: int | None, now: float) -> None:
        """The current llama-server pid (None when none runs). A previous pid stays "ours" for
        ``foreign_grace_s`` so its VRAM release is not reported as a foreign process."""
        if self._server_pid is not None and self._server_pid != pid:
            self._recent_ours[self._server_pid] = now
        self._server_pid = pid
        if pid is not None:
            self._recent_ours.pop(pid, None)

    def own_pids(self, now: float) -> frozenset[int]:
        """The pids that count as ours at ``now``: the server and recently replaced servers."""
        grace = self.settings.foreign_grace_s
        pids = {p for p, since in self._recent_ours.items() if now - since < grace}
        if self._server_pid is not None:
            pids.add(self._server_pid)
        return frozenset(pids)

    # -- the rules ---------------------------------------------------------------------------------
    def observe(self, sample: GpuSample, now: float) -> list[Event]:
        """Events for one successful sample at monotonic time ``now`` (seconds)."""
        self.last_sample = sample
        events: list[Event] = []
        base: dict[str, Any] = {"gpu_index": sample.identity.index, "gpu_uuid": sample.identity.uuid}
        step = self.lost.update(False, True, now)
        if step is Step.CLEAR:
            events.append(("gpu_recovered", {**base, "reason": "NVML answers again"}))
        events += self._temperature(sample, base, now)
        events += self._power(sample, base, now)
        events += self._throttle(sample, base, now)
        events += self._persistence(sample, base, now)
        events += self._foreign_processes(sample, base, now)
        events += self._driver(sample, base)
        self._recent_ours = {p: t for p, t in self._recent_ours.items()
                             if now - t < self.settings.foreign_grace_s}
        return events

    def observe_error(self, exc: NvmlError, now: float, gpu_index: int | None = None) -> list[Event]:
        """Events for a failed sample: ``gpu_lost`` (once, then a reminder) for the lost family
        (:data:`~llama_guard.gpu.nvml.LOST_ERRORS`); nothing for other errors (the caller logs them)."""
        if not isinstance(exc, LOST_ERRORS):
            return []
        step = self.lost.update(True, False, now)
        if step is None:
            return []
        if gpu_index is None and self.last_sample is not None:
            gpu_index = self.last_sample.identity.index
        return [("gpu_lost", {"gpu_index": gpu_index, "reason": describe(exc),
                              "error": type(exc).__name__, "nvml_code": exc.code,
                              "reminder": step is Step.REMIND})]

    def _temperature(self, s: GpuSample, base: dict[str, Any], now: float) -> list[Event]:
        if s.temperature_c is None:
            return []
        threshold = self.settings.temperature_threshold_c(s.temp_slowdown_c)
        step = self.temperature.update(s.temperature_c >= threshold,
                                       s.temperature_c <= threshold - self.settings.temperature_hysteresis_c,
                                       now)
        fields = {**base, "gpu_temp_c": s.temperature_c, "threshold_c": threshold,
                  "slowdown_c": s.temp_slowdown_c, "shutdown_c": s.temp_shutdown_c}
        return _step_event(step, "gpu_temperature_high", "gpu_temperature_ok", fields)

    def _power(self, s: GpuSample, base: dict[str, Any], now: float) -> list[Event]:
        if s.power_mw is None or not s.power_limit_mw:
            return []
        fraction = s.power_mw / s.power_limit_mw
        warn = self.settings.power_warn_fraction
        step = self.power.update(fraction >= warn,
                                 fraction < warn - self.settings.power_hysteresis_fraction, now)
        fields = {**base, "gpu_power_w": s.power_mw / 1000, "gpu_power_limit_w": s.power_limit_mw / 1000,
                  "fraction": round(fraction, 3)}
        return _step_event(step, "gpu_power_high", "gpu_power_ok", fields)

    def _throttle(self, s: GpuSample, base: dict[str, Any], now: float) -> list[Event]:
        if s.clock_event_reasons is None:
            return []
        names = s.throttle_names
        step = self.throttle.update(bool(names), not names, now)
        fields = {**base, "reasons": ", ".join(names) or "none",
                  "clock_event_reasons": s.clock_event_reasons}
        return _step_event(step, "gpu_throttled", "gpu_throttle_ok", fields)

    def _persistence(self, s: GpuSample, base: dict[str, Any], now: float) -> list[Event]:
        if s.persistence_mode is None:
            return []
        step = self.persistence.update(not s.persistence_mode, s.persistence_mode, now)
        self.persistence_step = step
        fields = {**base, "advice": "systemctl enable --now nvidia-persistenced"}
        return _step_event(step, "gpu_persistence_off", None, fields)

    def _foreign_processes(self, s: GpuSample, base: dict[str, Any], now: float) -> list[Event]:
        if s.processes is None:
            return []
        events: list[Event] = []
        foreign = {p.pid: p for p in foreign_processes(s, self.own_pids(now))}
        for pid in sorted(set(foreign) | set(self._foreign)):
            cond = self._foreign.setdefault(pid, Condition(0.0, 0.0, self.settings.reminder_s))
            proc = foreign.get(pid)
            step = cond.update(proc is not None, proc is None, now)
            if step is None:
                continue
            fields = {**base, "foreign_pid": pid, "foreign_name": self._proc_name(pid) or "?"}
            if proc is not None:
                fields["foreign_bytes"] = proc.used_bytes
                fields["foreign_mib"] = "?" if proc.used_bytes is None else round(proc.used_bytes / MIB)
            if step is Step.CLEAR:
                del self._foreign[pid]
            events += _step_event(step, "gpu_foreign_process", "gpu_foreign_process_gone", fields)
        return events

    def _driver(self, s: GpuSample, base: dict[str, Any]) -> list[Event]:
        version, expected = s.driver_version, self.settings.driver_version
        if not version or not expected or version == self._driver_reported:
            return []
        self._driver_reported = version
        if driver_in_series(version, expected):
            return []
        return [("gpu_driver_version", {**base, "driver_version": version, "expected": expected})]


def _step_event(step: Step | None, fire: EventName, clear: EventName | None, fields: dict[str, Any]) -> list[Event]:
    if step is None:
        return []
    if step is Step.CLEAR:
        return [] if clear is None else [(clear, fields)]
    return [(fire, {**fields, "reminder": step is Step.REMIND})]


def driver_in_series(version: str, expected: str) -> bool:
    """Whether driver ``version`` (``"535.183.01"``) matches ``expected``: comma-separated series or
    prefixes compared by dotted components (``"535"``, ``"535.183"``)."""
    have = version.strip().split(".")
    for want in (w.strip() for w in expected.split(",")):
        parts = want.split(".") if want else []
        if parts and have[: len(parts)] == parts:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Helpers for the policy (pure)
# ---------------------------------------------------------------------------------------------
def foreign_processes(sample: GpuSample, own_pids: Iterable[int]) -> list[GpuProcess]:
    """Processes on the GPU that are not ours; empty when the list is unavailable."""
    own = set(own_pids)
    return [p for p in (sample.processes or ()) if p.pid not in own]


def server_on_gpu(sample: GpuSample, pid: int) -> bool | None:
    """Whether ``pid`` holds a context on the GPU; None when the process list is unavailable.

    Caveat: NVML reports pids of the host's pid namespace; a daemon in a container with its own
    pid namespace never sees its server's pid here (then do not require it: ``require_server_on_gpu``).
    """
    pids = sample.pids()
    return None if pids is None else pid in pids


def vram_released(sample: GpuSample, prev_pid: int, *, baseline_used_bytes: int | None = None,
                  slack_bytes: int = 512 * MIB) -> bool | None:
    """Whether the previous server's VRAM is back: its pid left the process list and, when a
    ``baseline_used_bytes`` (memory used before that server started) is given, used memory is
    within ``slack_bytes`` of it. None when the process list is unavailable.

    The daemon polls it with a deadline of ``[gpu].vram_release_timeout_s`` (monotonic) and emits
    ``gpu_vram_not_released`` when the deadline passes first.
    """
    pids = sample.pids()
    if pids is None:
        return None
    if prev_pid in pids:
        return False
    if baseline_used_bytes is None or sample.memory_used_bytes is None:
        return True
    return sample.memory_used_bytes <= baseline_used_bytes + slack_bytes


@dataclass(frozen=True)
class SampleVerdict:
    """What one tick saw: the sample (None when NVML failed), the events to emit, and the error."""

    sample: GpuSample | None
    events: list[Event] = field(default_factory=list)
    error: NvmlError | None = None
    lost: bool = False             # the error says the GPU is lost (LOST_ERRORS)
    persistence_off: bool = False  # this sample reported persistence mode off (first time or reminder)


def sample_once(nvml: Nvml, watch: GpuWatch, now: float) -> SampleVerdict:
    """Sample ``nvml`` and feed ``watch`` at monotonic ``now`` (s). Never raises an NVML error:
    a lost GPU comes back as ``gpu_lost`` in ``events`` (once, then reminders) and in ``error``;
    a session suspended for a reset gives no sample and no events."""
    try:
        sample = nvml.sample()
    except Suspended:  # released on purpose (a reset runs): nothing to observe
        return SampleVerdict(None, [], None)
    except NvmlError as exc:
        return SampleVerdict(None, watch.observe_error(exc, now), exc, lost=isinstance(exc, LOST_ERRORS))
    watch.persistence_step = None
    events = watch.observe(sample, now)
    return SampleVerdict(sample, events, persistence_off=watch.persistence_step in (Step.FIRE, Step.REMIND))
