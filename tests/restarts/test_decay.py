"""Decay triggers with scripted samples, /metrics parsing, and the planned-restart record."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from llama_guard.config.sections import ScheduleConfig
from llama_guard.core.prometheus import MetricsError, parse_metrics
from llama_guard.restarts.decay import (
    TOKENS_PREDICTED,
    TOKENS_PREDICTED_SECONDS,
    DecayMonitor,
    GrowthTracker,
    SpeedTracker,
    Trigger,
    predicted_counters,
)
from llama_guard.restarts.history import RestartHistory, RestartRecord
from llama_guard.vocab.events import CATALOG, render_message

# What llama-server's /metrics really prints (llama.cpp server: HELP, TYPE, value per metric;
# values via C++ ostream, so 6 significant digits and exponents past a million).
METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 41
# HELP llamacpp:prompt_seconds_total Prompt process time
# TYPE llamacpp:prompt_seconds_total counter
llamacpp:prompt_seconds_total 0.31229
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 1234
# HELP llamacpp:tokens_predicted_seconds_total Predict process time
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 11.9634
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 1275
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode 1
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s.
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 131.29
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s.
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 103.15
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.0507812
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def metrics_text(tokens: float, seconds: float) -> str:
    """The two counters printed the way llama-server prints them (6 significant digits)."""
    return (
        "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.\n"
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        f"llamacpp:tokens_predicted_total {tokens:.6g}\n"
        "# HELP llamacpp:tokens_predicted_seconds_total Predict process time\n"
        "# TYPE llamacpp:tokens_predicted_seconds_total counter\n"
        f"llamacpp:tokens_predicted_seconds_total {seconds:.6g}\n"
    )


# --- /metrics parsing ------------------------------------------------------------------------

def test_parse_real_metrics() -> None:
    values = parse_metrics(METRICS)
    assert values[TOKENS_PREDICTED] == 1234.0
    assert values[TOKENS_PREDICTED_SECONDS] == pytest.approx(11.9634)
    assert values["llamacpp:predicted_tokens_seconds"] == pytest.approx(103.15)
    assert values["llamacpp:requests_processing"] == 0.0
    tokens, seconds = predicted_counters(values)
    assert tokens == 1234.0
    assert seconds == pytest.approx(11.9634)


def test_parse_exponent_values_and_labels() -> None:
    text = (
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        "llamacpp:tokens_predicted_total 1.23457e+06\n"
        "# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter\n"
        'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 17\n'
    )
    values = parse_metrics(text)
    assert values[TOKENS_PREDICTED] == 1234570.0
    assert values['llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 17.0


def test_parse_minimal_untyped_line() -> None:
    assert parse_metrics("llamacpp:tokens_predicted_total 1234\n") == {TOKENS_PREDICTED: 1234.0}


def test_malformed_metrics_raise() -> None:
    with pytest.raises(MetricsError):
        parse_metrics("llamacpp:tokens_predicted_total not-a-number\n")


def test_missing_counters_are_named() -> None:
    with pytest.raises(MetricsError, match=r"tokens_predicted_seconds_total.*--metrics"):
        predicted_counters(parse_metrics("llamacpp:tokens_predicted_total 5\n"))


# --- memory growth ---------------------------------------------------------------------------

def feed(tracker: GrowthTracker, samples: list[tuple[float, float]]) -> list[bool]:
    return [tracker.observe(t, v).fire for t, v in samples]


def test_vram_growth_fires_after_confirmed_samples_over_baseline() -> None:
    tr = GrowthTracker(Trigger.VRAM_GROWTH, bound_mib=1000, warmup_s=60, baseline_samples=3, confirm=3)
    tr.reset(0.0)
    # Warm-up: big lazy allocations, ignored.
    assert feed(tr, [(0, 6000), (30, 9500)]) == [False, False]
    assert tr.baseline_mib is None
    # Baseline: median of 8000, 8100, 7900 = 8000.
    assert feed(tr, [(60, 8000), (70, 8100), (80, 7900)]) == [False, False, False]
    assert tr.baseline_mib == 8000
    # A single spike does not fire; the run of three does.
    assert feed(tr, [(90, 9100), (100, 8500)]) == [False, False]
    d1 = tr.observe(110, 9050)
    d2 = tr.observe(120, 9100)
    assert (d1.fire, d2.fire) == (False, False)
    d3 = tr.observe(130, 9200)
    assert d3.fire
    assert d3.trigger is Trigger.VRAM_GROWTH
    assert d3.measurements["baseline_mib"] == 8000
    assert d3.measurements["current_mib"] == 9200
    assert d3.measurements["growth_mib"] == 1200
    assert d3.measurements["bound_mib"] == 1000
    assert d3.measurements["consecutive"] == 3
    assert "VRAM 9200 MiB is 1200 MiB over its post-load baseline 8000 MiB" in d3.reason
    # It fires once per process, then again only after reset().
    assert not tr.observe(140, 9999).fire
    tr.reset(200.0)
    assert tr.baseline_mib is None
    assert not tr.observe(200, 9999).fire


def test_growth_exactly_at_bound_does_not_fire() -> None:
    tr = GrowthTracker(Trigger.RSS_GROWTH, bound_mib=500, warmup_s=0, baseline_samples=1, confirm=1)
    tr.reset(0.0)
    assert not tr.observe(0, 2000).fire
    assert not tr.observe(1, 2500).fire
    d = tr.observe(2, 2501)
    assert d.fire
    assert d.reason.startswith("rss_growth: anonymous memory (RSS + swap) 2501 MiB")


def test_zero_bound_measures_but_never_fires() -> None:
    tr = GrowthTracker(Trigger.VRAM_GROWTH, bound_mib=0, warmup_s=0, baseline_samples=1, confirm=1)
    assert not any(feed(tr, [(0, 100), (1, 10_000), (2, 20_000), (3, 30_000)]))
    assert tr.baseline_mib == 100
    assert tr.last_mib == 30_000


def test_growth_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="baseline_samples"):
        GrowthTracker(Trigger.VRAM_GROWTH, bound_mib=1, baseline_samples=0)


# --- speed -----------------------------------------------------------------------------------

def script_speed(tracker: SpeedTracker, phases: list[tuple[int, float]], *, start_tokens: float = 0.0,
                 step_tokens: float = 1000.0) -> list[tuple[bool, float | None]]:
    """Feed counters as ``phases`` of (number of 1000-token steps, tokens/s); one sample per 10 s."""
    out = []
    tokens, seconds, now = start_tokens, 0.0, 0.0
    tracker.observe_counters(now, tokens, seconds)
    for steps, tps in phases:
        for _ in range(steps):
            tokens += step_tokens
            seconds += step_tokens / tps
            now += 10.0
            d = tracker.observe_counters(now, float(f"{tokens:.6g}"), float(f"{seconds:.6g}"))
            out.append((d.fire, tracker.last_window_tps))
    return out


def test_speed_drop_fires_after_confirmed_slow_windows() -> None:
    tr = SpeedTracker(drop_fraction=0.25, warmup_s=0, window_tokens=2000, confirm=2)
    tr.reset(0.0)
    # baseline window at 100 tok/s, then 90 (10 % slower: fine), then 60 (40 % slower) twice.
    results = script_speed(tr, [(2, 100.0), (2, 90.0), (2, 60.0), (2, 60.0)])
    fires = [fire for fire, _ in results]
    assert fires == [False] * 7 + [True]
    assert tr.baseline_tps == pytest.approx(100.0, rel=1e-3)
    assert tr.last_window_tps == pytest.approx(60.0, rel=1e-3)
    assert tr.windows == 4


def test_speed_decision_carries_measurements() -> None:
    tr = SpeedTracker(drop_fraction=0.2, warmup_s=0, window_tokens=1000, confirm=1)
    tr.reset(0.0)
    tr.observe_counters(0, 0, 0)
    tr.observe_counters(10, 1000, 10)   # baseline 100 tok/s
    d = tr.observe_counters(20, 2000, 30)  # 1000 tokens in 20 s = 50 tok/s
    assert d.fire
    assert d.trigger is Trigger.SPEED_DROP
    assert d.measurements["baseline_tps"] == pytest.approx(100.0)
    assert d.measurements["current_tps"] == pytest.approx(50.0)
    assert d.measurements["drop_fraction"] == pytest.approx(0.5)
    assert d.measurements["bound_fraction"] == 0.2
    assert "50.0 tokens/s is 50% below its early average 100.0 tokens/s" in d.reason


def test_speed_recovering_window_resets_the_count() -> None:
    tr = SpeedTracker(drop_fraction=0.25, warmup_s=0, window_tokens=1000, confirm=2)
    tr.reset(0.0)
    results = script_speed(tr, [(1, 100.0), (1, 50.0), (1, 100.0), (1, 50.0), (1, 100.0)])
    assert not any(fire for fire, _ in results)


def test_speed_warmup_tokens_do_not_form_the_baseline() -> None:
    tr = SpeedTracker(drop_fraction=0.25, warmup_s=25, window_tokens=1000, confirm=1)
    tr.reset(0.0)
    # First two samples (t=10, 20) are inside the 25 s warm-up at a cold-start 40 tok/s.
    script_speed(tr, [(2, 40.0), (1, 100.0), (1, 100.0)])
    assert tr.baseline_tps == pytest.approx(100.0)


def test_idle_server_closes_no_window() -> None:
    tr = SpeedTracker(drop_fraction=0.25, warmup_s=0, window_tokens=1000, confirm=1)
    tr.reset(0.0)
    for t in range(100):
        d = tr.observe_counters(float(t), 500.0, 5.0)
        assert not d.fire
    assert tr.windows == 0


def test_counter_reset_resets_the_tracker() -> None:
    tr = SpeedTracker(drop_fraction=0.25, warmup_s=0, window_tokens=1000, confirm=1)
    tr.reset(0.0)
    script_speed(tr, [(2, 100.0)])
    assert tr.baseline_tps is not None
    d = tr.observe_counters(100.0, 10.0, 0.1)
    assert "backwards" in d.reason
    assert tr.baseline_tps is None


def test_six_digit_counters_extend_the_window() -> None:
    # At 12 million tokens llama-server prints 1.2e+07-ish values in steps of 10 tokens, and after
    # 123456 s of generation the seconds counter moves in whole seconds. A 1000-token window would
    # carry an error of up to ~2 %; the tracker waits until the rounding is below 1 %.
    tr = SpeedTracker(drop_fraction=0.25, warmup_s=0, window_tokens=1000, confirm=1)
    tr.reset(0.0)
    tokens, seconds = 12_000_000.0, 123_456.0
    tr.observe_counters(0, float(f"{tokens:.6g}"), float(f"{seconds:.6g}"))
    closed_at = None
    for step in range(1, 50):
        tokens += 1000
        seconds += 10.0
        tr.observe_counters(step * 10.0, float(f"{tokens:.6g}"), float(f"{seconds:.6g}"))
        if tr.windows and closed_at is None:
            closed_at = step
    assert closed_at is not None
    assert closed_at == 10  # 10 000 tokens and 100 s: rounding (100 tokens, 1 s) is 1 %
    assert tr.baseline_tps == pytest.approx(100.0, rel=0.01)


def test_speed_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="drop_fraction"):
        SpeedTracker(drop_fraction=1.0)


# --- the monitor -----------------------------------------------------------------------------

def test_monitor_from_config_fires_once_per_process() -> None:
    cfg = ScheduleConfig(vram_growth_mib=500, rss_growth_mib=500, speed_drop_fraction=0.5,
                         decay_warmup_s=0, decay_baseline_samples=1, decay_confirm=1, speed_window_tokens=100)
    mon = DecayMonitor.from_config(cfg)
    assert mon.enabled
    mon.reset(0.0)
    assert not mon.observe_vram(0, 8000).fire
    assert not mon.observe_rss(0, 3000).fire
    first = mon.observe_vram(1, 9000)
    assert first.fire
    second = mon.observe_rss(1, 4000)
    assert not second.fire
    assert "another trigger already fired" in second.reason
    assert mon.fired == first
    fields = first.fields()
    assert fields["trigger"] == "vram_growth"
    assert fields["growth_mib"] == 1000
    assert "decay_detected" in CATALOG
    assert "degraded: vram_growth: VRAM 9000 MiB" in render_message("decay_detected", {"server_pid": 7, **fields})
    mon.reset(100.0)
    assert mon.fired is None


def test_monitor_reads_metrics_text() -> None:
    mon = DecayMonitor(speed_drop_fraction=0.2, warmup_s=0, confirm=1, window_tokens=500)
    mon.reset(0.0)
    assert not mon.observe_metrics(0, metrics_text(0, 0)).fire
    assert not mon.observe_metrics(10, metrics_text(1000, 10)).fire  # baseline 100 tok/s
    d = mon.observe_metrics(20, METRICS.replace("1234\n", "2000\n").replace("11.9634", "30"))
    assert d.fire  # 1000 tokens in 20 s
    assert mon.snapshot()["tokens_per_s"] == pytest.approx(50.0)
    with pytest.raises(MetricsError):
        mon.observe_metrics(30, "# nothing here\n")


def test_monitor_disabled_by_default() -> None:
    mon = DecayMonitor.from_config(ScheduleConfig())
    assert not mon.enabled
    mon.reset(0.0)
    for t in range(0, 5000, 10):
        assert not mon.observe_vram(float(t), 1000.0 + t).fire


def test_config_rejects_bad_decay_values() -> None:
    with pytest.raises(ValueError, match="speed_drop_fraction"):
        ScheduleConfig(speed_drop_fraction=1.5)
    with pytest.raises(ValueError, match="vram_growth_mib"):
        ScheduleConfig(vram_growth_mib=-1)


# --- restart records -------------------------------------------------------------------------

def record(i: int) -> RestartRecord:
    return RestartRecord(kind="scheduled", reason=f"night {i}",
                         requested_at=datetime(2026, 1, i, 4, 30, tzinfo=timezone.utc), uptime_s=86400.0 * i,
                         tokens_per_s_before=90.0, vram_mib_before=9100.0)


def test_history_ring_keeps_the_last_n() -> None:
    hist = RestartHistory(3)
    for i in range(1, 6):
        hist.begin(record(i))
    assert [r.reason for r in hist.records()] == ["night 3", "night 4", "night 5"]


def test_record_lifecycle_and_event() -> None:
    hist = RestartHistory(5)
    assert hist.update_last(drained=True) is None
    hist.begin(record(1))
    assert hist.records()[0].outcome == "pending"
    hist.update_last(drained=False, unavailable_s=4.25)
    done = hist.update_last(tokens_per_s_after=101.5, vram_mib_after=8000.0)
    assert done is not None
    assert done.outcome == "drain_timeout"
    assert done.summary() == "90.0 tokens/s → 101.5 tokens/s, VRAM 9100.0 MiB → 8000.0 MiB"
    message = render_message("planned_restart_done", done.fields())
    assert message == ("planned restart (scheduled) done, drain_timeout: up 86400 s before, unavailable 4.2 s; "
                       "90.0 tokens/s → 101.5 tokens/s, VRAM 9100.0 MiB → 8000.0 MiB")
    with pytest.raises(TypeError):
        hist.update_last(no_such_field=1)


def test_history_to_json_for_the_snapshot() -> None:
    hist = RestartHistory(4)
    hist.begin(record(1))
    hist.begin(record(2))
    hist.update_last(drained=True, unavailable_s=3.0)
    items = json.loads(json.dumps(hist.to_json()))
    assert [item["requested_at"] for item in items] == [r.requested_at.isoformat() for r in hist.records()]
    assert items[1]["requested_at"] == "2026-01-02T04:30:00+00:00"
    assert (items[1]["drained"], items[1]["unavailable_s"]) == (True, 3.0)
