"""Measured decay of a long-running llama-server (the record of planned restarts: :mod:`.history`).

Pure trackers, fed by the daemon's samplers with an injected monotonic clock (seconds):

* :class:`GrowthTracker` — a memory figure (the server's VRAM from NVML's process list, or its
  anonymous memory ``RssAnon + VmSwap`` from ``/proc/PID/status``, in MiB) growing more than a
  bound over its own baseline after load (plus, for memory, the host prompt cache's cap);
* :class:`SpeedTracker` — generation speed (predicted tokens per second of generation time, from
  ``/metrics`` counters ``llamacpp:tokens_predicted_total`` and
  ``llamacpp:tokens_predicted_seconds_total``) falling more than a fraction below its own early
  average;
* :class:`DecayMonitor` — the three together, configured from ``[schedule]``, firing at most once
  per server process.

Every observation returns a :class:`DecayDecision` carrying the measurements that justify it;
``fire`` is True exactly once, when a threshold is crossed for ``confirm`` consecutive samples or
windows. The trackers always measure (their figures feed :class:`RestartRecord`); a threshold of 0
only keeps them from firing.

Baselines
---------
A fresh server's memory grows while it warms up (CUDA pools, lazily allocated compute buffers,
mmapped model pages touched by the first requests). Samples taken in the first ``warmup_s`` after
a start are ignored; the baseline is the median of the next ``baseline_samples`` samples. For speed,
the baseline is the first window of at least ``window_tokens`` predicted tokens after the warm-up.

Counter precision
-----------------
llama-server writes ``/metrics`` values with C++ ``operator<<`` on a double: six significant digits
(``1.23457e+06``). Past a million tokens a counter moves in steps of 10 or more, so a speed window
only closes once both deltas are at least 100× the rounding step (≤ 1 % error); windows grow as
the counters do.

Caveat: speed depends on load — longer contexts and more parallel slots lower per-stream tokens/s.
The comparison is the server against its own early self over windows of thousands of tokens, and
needs ``confirm`` consecutive slow windows; it is opt-in for that reason.

Prometheus text is parsed by :func:`llama_guard.core.prometheus.parse_metrics`.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from llama_guard.core.prometheus import MetricsError, parse_metrics

if TYPE_CHECKING:
    from llama_guard.config.sections import ScheduleConfig

__all__ = [
    "TOKENS_PREDICTED",
    "TOKENS_PREDICTED_SECONDS",
    "DecayDecision",
    "DecayMonitor",
    "GrowthTracker",
    "MetricsError",
    "SpeedTracker",
    "Trigger",
    "parse_metrics",
    "predicted_counters",
]

TOKENS_PREDICTED = "llamacpp:tokens_predicted_total"
TOKENS_PREDICTED_SECONDS = "llamacpp:tokens_predicted_seconds_total"
_MAX_ERROR_FRACTION = 0.01


def predicted_counters(metrics: Mapping[str, float]) -> tuple[float, float]:
    """``(tokens_predicted_total, tokens_predicted_seconds_total)`` from :func:`parse_metrics` output.

    Raises :class:`MetricsError` naming the missing counter (the server needs ``--metrics``).
    """
    missing = [name for name in (TOKENS_PREDICTED, TOKENS_PREDICTED_SECONDS) if name not in metrics]
    if missing:
        raise MetricsError(f"/metrics lacks {', '.join(missing)} (is llama-server running with --metrics?)")
    return metrics[TOKENS_PREDICTED], metrics[TOKENS_PREDICTED_SECONDS]


def _print_step(value: float) -> float:
    """Worst-case rounding of ``value`` printed with 6 significant digits (C++ ostream default)."""
    magnitude = abs(value)
    if magnitude == 0:
        return 0.0
    return 0.5 * 10.0 ** (math.floor(math.log10(magnitude)) - 5)


class Trigger(enum.Enum):
    """Which decay measurement a decision is about."""

    VRAM_GROWTH = "vram_growth"
    RSS_GROWTH = "rss_growth"
    SPEED_DROP = "speed_drop"


@dataclass(frozen=True)
class DecayDecision:
    """One observation's verdict. ``fire`` asks for a drained restart; ``measurements`` justify it
    (units in the key names: ``_mib``, ``_tps`` tokens/s, ``_s`` seconds, ``_fraction``)."""

    trigger: Trigger
    fire: bool
    reason: str
    measurements: Mapping[str, float | int | None] = field(default_factory=dict)

    def fields(self) -> dict[str, object]:
        """Event fields for ``decay_detected``: trigger, reason and the measurements."""
        return {"trigger": self.trigger.value, "reason": self.reason, **self.measurements}


class GrowthTracker:
    """A memory figure (MiB) growing past ``bound_mib`` over its post-load baseline.

    ``bound_mib`` 0 measures without firing. ``warmup_s``: seconds after :meth:`reset` whose
    samples are ignored; ``baseline_samples``: how many samples after that form the baseline
    (their median); ``confirm``: consecutive samples over the bound needed to fire.
    ``allowance_mib``: growth the server makes by design on top of the bound (the host prompt
    cache filling up to ``--cache-ram``: a plateau, not a leak); ``math.inf`` (no cap) measures
    without firing, since growth is then no evidence of a leak.
    Raises ``ValueError`` for negative or zero counts.
    """

    def __init__(self, trigger: Trigger, *, bound_mib: float, warmup_s: float = 600.0,
                 baseline_samples: int = 5, confirm: int = 3, allowance_mib: float = 0.0) -> None:
        if bound_mib < 0 or warmup_s < 0 or baseline_samples < 1 or confirm < 1 or allowance_mib < 0:
            raise ValueError("bound_mib, warmup_s and allowance_mib must be >= 0; baseline_samples and confirm >= 1")
        self.trigger = trigger
        self.bound_mib = bound_mib
        self.allowance_mib = allowance_mib
        self.warmup_s = warmup_s
        self.baseline_samples = baseline_samples
        self.confirm = confirm
        self.reset(None)

    def reset(self, start_mono: float | None) -> None:
        """Forget everything: a new server process started at ``start_mono`` (None: at the next sample)."""
        self._start = start_mono
        self._early: list[float] = []
        self.baseline_mib: float | None = None
        self.last_mib: float | None = None
        self.peak_mib: float | None = None
        self._over = 0
        self.fired = False

    def observe(self, now_mono: float, value_mib: float) -> DecayDecision:
        """Take one sample (MiB at ``now_mono`` seconds) and decide."""
        if self._start is None:
            self._start = now_mono
        self.last_mib = value_mib
        name = self.trigger.value
        age = now_mono - self._start
        if age < self.warmup_s:
            return DecayDecision(self.trigger, False, f"{name}: warming up ({age:.0f} of {self.warmup_s:.0f} s)",
                                 {"current_mib": value_mib, "age_s": age})
        if self.baseline_mib is None:
            self._early.append(value_mib)
            if len(self._early) < self.baseline_samples:
                return DecayDecision(self.trigger, False, f"{name}: collecting baseline "
                                     f"({len(self._early)} of {self.baseline_samples} samples)",
                                     {"current_mib": value_mib, "age_s": age})
            self.baseline_mib = float(statistics.median(self._early))
        self.peak_mib = value_mib if self.peak_mib is None else max(self.peak_mib, value_mib)
        growth = value_mib - self.baseline_mib
        measurements: dict[str, float | int | None] = {
            "baseline_mib": self.baseline_mib, "current_mib": value_mib, "growth_mib": growth,
            "bound_mib": self.bound_mib, "age_s": age}
        if self.bound_mib <= 0:
            return DecayDecision(self.trigger, False, f"{name}: measuring only (no bound set)", measurements)
        if math.isinf(self.allowance_mib):
            return DecayDecision(self.trigger, False, f"{name}: measuring only (the host prompt cache has no "
                                 "size limit, --cache-ram -1: its growth cannot be told from a leak)", measurements)
        measurements["allowance_mib"] = self.allowance_mib
        if self.fired:
            return DecayDecision(self.trigger, False, f"{name}: already fired; waiting for the restart",
                                 measurements)
        self._over = self._over + 1 if growth > self.bound_mib + self.allowance_mib else 0
        measurements["consecutive"] = self._over
        what = "VRAM" if self.trigger is Trigger.VRAM_GROWTH else "anonymous memory (RSS + swap)"
        allowed = f" + {self.allowance_mib:.0f} MiB host prompt cache" if self.allowance_mib else ""
        text = (f"{what} {value_mib:.0f} MiB is {growth:.0f} MiB over its post-load baseline "
                f"{self.baseline_mib:.0f} MiB (bound {self.bound_mib:.0f} MiB{allowed})")
        if self._over >= self.confirm:
            self.fired = True
            return DecayDecision(self.trigger, True, f"{name}: {text} for {self._over} samples", measurements)
        return DecayDecision(self.trigger, False, f"{name}: {text}" if self._over else f"{name}: within bound",
                             measurements)


class SpeedTracker:
    """Generation speed (tokens/s) falling more than ``drop_fraction`` below its early average.

    ``drop_fraction`` 0 measures without firing; 0.25 fires when windows run 25 % slower than the
    baseline. ``warmup_s``: seconds after :meth:`reset` whose tokens are not measured;
    ``window_tokens``: the least predicted tokens per window; ``confirm``: consecutive slow
    windows needed to fire. Raises ``ValueError`` for out-of-range parameters.
    """

    def __init__(self, *, drop_fraction: float, warmup_s: float = 600.0, window_tokens: int = 4096,
                 confirm: int = 3) -> None:
        if not 0 <= drop_fraction < 1 or warmup_s < 0 or window_tokens < 1 or confirm < 1:
            raise ValueError("drop_fraction must be in [0, 1); warmup_s >= 0; window_tokens, confirm >= 1")
        self.drop_fraction = drop_fraction
        self.warmup_s = warmup_s
        self.window_tokens = window_tokens
        self.confirm = confirm
        self.reset(None)

    def reset(self, start_mono: float | None) -> None:
        """Forget everything: a new server process started at ``start_mono`` (None: at the next sample)."""
        self._start = start_mono
        self._prev: tuple[float, float] | None = None       # last counters seen
        self._win_start: tuple[float, float] | None = None  # counters when the open window began
        self.baseline_tps: float | None = None
        self.last_window_tps: float | None = None
        self.windows = 0
        self._slow = 0
        self.fired = False

    def _age(self, now_mono: float) -> float:
        if self._start is None:
            self._start = now_mono
        return now_mono - self._start

    def _warming(self, age: float) -> DecayDecision:
        return DecayDecision(Trigger.SPEED_DROP, False,
                             f"speed_drop: warming up ({age:.0f} of {self.warmup_s:.0f} s)", {"age_s": age})

    def _open(self, tokens: float, seconds: float) -> DecayDecision:
        return DecayDecision(Trigger.SPEED_DROP, False, "speed_drop: window open",
                             {"window_tokens": tokens, "window_seconds": seconds})

    def _closes(self, tokens: float, seconds: float, error_tokens: float, error_seconds: float) -> bool:
        return (tokens >= self.window_tokens and seconds > 0
                and error_tokens <= _MAX_ERROR_FRACTION * tokens
                and error_seconds <= _MAX_ERROR_FRACTION * seconds)

    def observe_counters(self, now_mono: float, tokens_total: float, seconds_total: float) -> DecayDecision:
        """Take the cumulative ``/metrics`` counters at ``now_mono`` and decide.

        A window spans from the counters at its start to the current ones, so its rounding error
        is that of two printed values however many samples it covers. Counters that go backwards
        mean a new server process: the tracker resets itself.
        """
        prev = self._prev
        current = (tokens_total, seconds_total)
        if prev is not None and (tokens_total < prev[0] or seconds_total < prev[1]):
            self.reset(now_mono)
            self._prev = self._win_start = current
            return DecayDecision(Trigger.SPEED_DROP, False, "speed_drop: counters went backwards "
                                 "(new server process); tracker reset", {"tokens_total": tokens_total})
        self._prev = current
        age = self._age(now_mono)
        if age < self.warmup_s or self._win_start is None:
            self._win_start = current  # tokens generated so far are not measured
            return self._warming(age) if age < self.warmup_s else self._open(0.0, 0.0)
        start = self._win_start
        tokens, seconds = tokens_total - start[0], seconds_total - start[1]
        error_tokens = _print_step(tokens_total) + _print_step(start[0])
        error_seconds = _print_step(seconds_total) + _print_step(start[1])
        if not self._closes(tokens, seconds, error_tokens, error_seconds):
            return self._open(tokens, seconds)
        self._win_start = current
        return self._window_closed(age, tokens, seconds)

    def _window_closed(self, age: float, tokens: float, seconds: float) -> DecayDecision:
        tps = tokens / seconds
        window = {"window_tokens": tokens, "window_seconds": seconds}
        self.last_window_tps = tps
        self.windows += 1
        if self.baseline_tps is None:
            self.baseline_tps = tps
            return DecayDecision(Trigger.SPEED_DROP, False, f"speed_drop: baseline {tps:.1f} tokens/s",
                                 {"baseline_tps": tps, **window})
        drop = 1.0 - tps / self.baseline_tps
        measurements: dict[str, float | int | None] = {
            "baseline_tps": self.baseline_tps, "current_tps": tps, "drop_fraction": drop,
            "bound_fraction": self.drop_fraction, "age_s": age, **window}
        if self.drop_fraction <= 0:
            return DecayDecision(Trigger.SPEED_DROP, False, "speed_drop: measuring only (no bound set)",
                                 measurements)
        if self.fired:
            return DecayDecision(Trigger.SPEED_DROP, False, "speed_drop: already fired; waiting for the restart",
                                 measurements)
        self._slow = self._slow + 1 if drop > self.drop_fraction else 0
        measurements["consecutive"] = self._slow
        text = (f"generation speed {tps:.1f} tokens/s is {drop:.0%} below its early average "
                f"{self.baseline_tps:.1f} tokens/s (bound {self.drop_fraction:.0%})")
        if self._slow >= self.confirm:
            self.fired = True
            return DecayDecision(Trigger.SPEED_DROP, True, f"speed_drop: {text} for {self._slow} windows",
                                 measurements)
        return DecayDecision(Trigger.SPEED_DROP, False,
                             f"speed_drop: {text}" if self._slow else "speed_drop: within bound", measurements)


class DecayMonitor:
    """The three trackers for one server process; at most one ``fire`` per process.

    Call :meth:`reset` when a server process starts, then feed samples; a decision with
    ``fire`` True asks for one drained restart. Raises ``ValueError`` for bad parameters.
    """

    def __init__(self, *, vram_growth_mib: float = 0.0, rss_growth_mib: float = 0.0,
                 speed_drop_fraction: float = 0.0, warmup_s: float = 600.0, baseline_samples: int = 5,
                 confirm: int = 3, window_tokens: int = 4096, host_cache_mib: float = 0.0) -> None:
        self.vram = GrowthTracker(Trigger.VRAM_GROWTH, bound_mib=vram_growth_mib, warmup_s=warmup_s,
                                  baseline_samples=baseline_samples, confirm=confirm)
        # The host prompt cache lives in the server's anonymous memory: its cap is growth by design.
        self.rss = GrowthTracker(Trigger.RSS_GROWTH, bound_mib=rss_growth_mib, warmup_s=warmup_s,
                                 baseline_samples=baseline_samples, confirm=confirm, allowance_mib=host_cache_mib)
        self.speed = SpeedTracker(drop_fraction=speed_drop_fraction, warmup_s=warmup_s,
                                  window_tokens=window_tokens, confirm=confirm)
        self.fired: DecayDecision | None = None

    @classmethod
    def from_config(cls, config: ScheduleConfig, host_cache_mib: float = 0.0) -> DecayMonitor:
        """Build from ``[schedule]``'s decay keys; ``host_cache_mib``: the server's host prompt
        cache cap (:func:`llama_guard.config.argv.host_cache_cap_mib`)."""
        return cls(vram_growth_mib=config.vram_growth_mib, rss_growth_mib=config.rss_growth_mib,
                   speed_drop_fraction=config.speed_drop_fraction, warmup_s=config.decay_warmup_s,
                   baseline_samples=config.decay_baseline_samples, confirm=config.decay_confirm,
                   window_tokens=config.speed_window_tokens, host_cache_mib=host_cache_mib)

    @property
    def enabled(self) -> bool:
        """True when any threshold is set."""
        return self.vram.bound_mib > 0 or self.rss.bound_mib > 0 or self.speed.drop_fraction > 0

    def reset(self, start_mono: float | None) -> None:
        """A new server process started at ``start_mono`` (monotonic seconds)."""
        for tracker in (self.vram, self.rss, self.speed):
            tracker.reset(start_mono)
        self.fired = None

    def _latch(self, decision: DecayDecision) -> DecayDecision:
        if decision.fire:
            if self.fired is not None:
                return replace(decision, fire=False, reason=decision.reason + " (another trigger already fired)")
            self.fired = decision
        return decision

    def observe_vram(self, now_mono: float, vram_mib: float) -> DecayDecision:
        """The server pid's VRAM use (MiB, NVML process list) at ``now_mono``."""
        return self._latch(self.vram.observe(now_mono, vram_mib))

    def observe_rss(self, now_mono: float, rss_mib: float) -> DecayDecision:
        """The server's anonymous memory (MiB: ``RssAnon + VmSwap``, so a leak paged out to swap still
        counts; see docs/schedule.md)."""
        return self._latch(self.rss.observe(now_mono, rss_mib))

    def observe_metrics(self, now_mono: float, metrics_text: str) -> DecayDecision:
        """The body of ``GET /metrics``. Raises :class:`MetricsError` if unparsable or lacking counters."""
        tokens, seconds = predicted_counters(parse_metrics(metrics_text))
        return self._latch(self.speed.observe_counters(now_mono, tokens, seconds))

    def snapshot(self) -> dict[str, float | None]:
        """Current figures for ``llama-guard status`` and for :class:`RestartRecord` (MiB, tokens/s)."""
        return {
            "vram_mib": self.vram.last_mib, "vram_baseline_mib": self.vram.baseline_mib,
            "rss_mib": self.rss.last_mib, "rss_baseline_mib": self.rss.baseline_mib,
            "tokens_per_s": self.speed.last_window_tps, "tokens_per_s_baseline": self.speed.baseline_tps,
        }
