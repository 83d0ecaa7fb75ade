"""Planned restarts: cron parsing, next fire across zones and DST, jitter, skip and misfire rules."""

from __future__ import annotations

import random
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from llama_guard.config import ConfigError, load_config
from llama_guard.config.cron import ScheduleError, fire_after, parse_cron, resolve_timezone, validate_cron
from llama_guard.config.sections import ScheduleConfig
from llama_guard.restarts.schedule import Outcome, PlannedRestarts, planned_restarts
from llama_guard.vocab.events import CATALOG, render_message

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
TOKYO = ZoneInfo("Asia/Tokyo")


def utc(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def fires(expr: str, tz: ZoneInfo | timezone, start: datetime, n: int) -> list[datetime]:
    cron = parse_cron(expr, tz)
    out: list[datetime] = []
    t = start
    for _ in range(n):
        nxt = fire_after(cron, t)
        assert nxt is not None
        out.append(nxt)
        t = nxt
    return out


# --- parsing ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("expr", "needle"), [
    ("* * * *", "got 4 fields"),
    ("* * * * * *", "got 6 fields"),
    ("61 * * * *", "61"),
    ("0 24 * * *", "24"),
    ("0 4 32 * *", "32"),
    ("0 4 * 13 *", "13"),
    ("0 4 * * 8", "day-of-week '8'"),
    ("0 4 * * funday", "funday"),
    ("0 4 * * sat-mon", "runs backwards"),
    ("0 4 * * 2/2", "needs '*' or a range"),
    ("0 4 30 2 *", "never fires"),
    ("half past four", "fields"),
])
def test_bad_cron_names_the_expression(expr: str, needle: str) -> None:
    with pytest.raises(ScheduleError) as info:
        parse_cron(expr)
    assert repr(expr) in str(info.value)
    assert needle in str(info.value)


def test_empty_cron_disables_and_spacing_is_normalised() -> None:
    assert validate_cron("") == ""
    assert validate_cron("   ") == ""
    assert validate_cron(" 30  4 * *   * ") == "30 4 * * *"


def test_config_rejects_bad_cron_and_timezone() -> None:
    with pytest.raises(ValueError, match=r"invalid restart_cron '61 4 \* \* \*'"):
        ScheduleConfig(restart_cron="61 4 * * *")
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        ScheduleConfig(timezone="Mars/Olympus")
    cfg = ScheduleConfig(restart_cron="", timezone=" UTC ")
    assert cfg.restart_cron == ""
    assert cfg.timezone == "UTC"


def test_load_config_reports_bad_cron_as_config_error(tmp_path: Path) -> None:
    path = tmp_path / "lg.toml"
    path.write_text('[schedule]\nrestart_cron = "30 4 * *"\ntimezone = "Nowhere/City"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = "\n".join(info.value.lines)
    assert "schedule.restart_cron" in text
    assert "'30 4 * *'" in text
    assert "schedule.timezone" in text
    assert "Nowhere/City" in text


def test_day_of_week_numbers_follow_cron_not_apscheduler() -> None:
    # 2026-01-01 is a Thursday. cron(8): 0 and 7 are Sunday (APScheduler's from_crontab says Monday).
    for expr in ("0 4 * * 0", "0 4 * * 7", "0 4 * * sun", "0 4 * * SUN"):
        got = fires(expr, UTC, utc(2026, 1, 1), 2)
        assert [d.strftime("%a %d") for d in got] == ["Sun 04", "Sun 11"], expr
    got = fires("0 4 * * 1-5", UTC, utc(2026, 1, 2, 5), 3)  # Fri 05:00 → Mon, Tue, Wed
    assert [d.strftime("%a") for d in got] == ["Mon", "Tue", "Wed"]
    got = fires("0 4 * * 5-7", UTC, utc(2026, 1, 1, 5), 4)
    assert [d.strftime("%a") for d in got] == ["Fri", "Sat", "Sun", "Fri"]
    got = fires("0 4 * * */2", UTC, utc(2026, 1, 1, 5), 4)  # 0,2,4,6 = Sun, Tue, Thu, Sat
    assert [d.strftime("%a") for d in got] == ["Sat", "Sun", "Tue", "Thu"]


def test_day_of_month_or_day_of_week_like_cron() -> None:
    # Both restricted → either matches (cron(8)), not both (APScheduler's from_crontab).
    got = fires("0 4 1 * mon", UTC, utc(2026, 1, 1), 3)
    assert [d.strftime("%a %d") for d in got] == ["Thu 01", "Mon 05", "Mon 12"]


# --- next fire across zones and DST ---------------------------------------------------------

def test_next_fire_in_several_zones() -> None:
    now = utc(2026, 1, 15, 12)
    for tz, expected_utc in ((BERLIN, utc(2026, 1, 16, 3, 30)),
                             (NEW_YORK, utc(2026, 1, 16, 9, 30)),
                             (TOKYO, utc(2026, 1, 15, 19, 30)),
                             (UTC, utc(2026, 1, 16, 4, 30))):
        sched = PlannedRestarts("30 4 * * *", now_wall=now, timezone=tz.key if isinstance(tz, ZoneInfo) else "UTC")
        nxt = sched.next_fire(now)
        assert nxt is not None
        assert nxt == expected_utc, tz
        assert (nxt.astimezone(tz).hour, nxt.astimezone(tz).minute) == (4, 30)


def test_nightly_keeps_wall_time_across_dst_changes() -> None:
    spring = fires("30 4 * * *", BERLIN, utc(2026, 3, 27, 12), 3)
    assert [d.astimezone(UTC).strftime("%d %H:%M") for d in spring] == ["28 03:30", "29 02:30", "30 02:30"]
    assert all(d.astimezone(BERLIN).strftime("%H:%M") == "04:30" for d in spring)
    autumn = fires("30 4 * * *", BERLIN, utc(2026, 10, 23, 12), 3)
    assert [d.astimezone(UTC).strftime("%d %H:%M") for d in autumn] == ["24 02:30", "25 03:30", "26 03:30"]


def test_nonexistent_wall_time_fires_an_hour_later_on_spring_forward() -> None:
    # 2026-03-29 02:00 → 03:00 in Berlin: 02:30 does not exist that day.
    got = fires("30 2 * * *", BERLIN, utc(2026, 3, 28, 12), 3)
    local = [d.astimezone(BERLIN) for d in got]
    assert [d.strftime("%d %H:%M %z") for d in local] == ["29 03:30 +0200", "30 02:30 +0200", "31 02:30 +0200"]
    assert got == sorted(got)


def test_repeated_wall_time_fires_once_on_fall_back() -> None:
    # 2026-10-25 03:00 CEST → 02:00 CET in Berlin: 02:30 happens twice; a fixed-time job runs once.
    got = fires("30 2 * * *", BERLIN, utc(2026, 10, 24, 12), 2)
    assert [d.astimezone(UTC).strftime("%d %H:%M") for d in got] == ["25 00:30", "26 01:30"]


def test_hourly_schedule_fires_in_both_repeated_hours() -> None:
    got = fires("30 * * * *", BERLIN, utc(2026, 10, 24, 23, 45), 4)
    assert [d.astimezone(UTC).strftime("%H:%M") for d in got] == ["00:30", "01:30", "02:30", "03:30"]
    assert [d.astimezone(BERLIN).strftime("%H:%M") for d in got] == ["02:30", "02:30", "03:30", "04:30"]


def test_new_york_dst() -> None:
    # US spring forward 2026-03-08 02:00 → 03:00.
    got = fires("15 2 * * *", NEW_YORK, utc(2026, 3, 7, 12), 2)
    assert [d.astimezone(NEW_YORK).strftime("%d %H:%M") for d in got] == ["08 03:15", "09 02:15"]


def test_host_timezone_is_used_for_empty_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import tzlocal

    monkeypatch.setattr(tzlocal, "get_localzone", lambda: TOKYO)
    assert resolve_timezone("") is TOKYO
    sched = PlannedRestarts("0 0 * * *", now_wall=utc(2026, 1, 1, 12), timezone="")
    assert sched.next_fire(utc(2026, 1, 1, 12)) == utc(2026, 1, 1, 15)  # Tokyo midnight


def test_naive_datetimes_are_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        PlannedRestarts("30 4 * * *", now_wall=datetime(2026, 1, 1))
    sched = PlannedRestarts("30 4 * * *", now_wall=utc(2026, 1, 1), timezone="UTC")
    with pytest.raises(ValueError, match="aware"):
        sched.due(datetime(2026, 1, 1, 5), None)


# --- the decision -------------------------------------------------------------------------

def make(now: datetime, **kwargs: object) -> PlannedRestarts:
    params: dict[str, object] = {"timezone": "UTC", "min_uptime_s": 3600.0, "misfire_grace_s": 900.0}
    params.update(kwargs)
    return PlannedRestarts("30 4 * * *", now_wall=now, **params)  # type: ignore[arg-type]


LONG_AGO = utc(2025, 12, 1)


def test_disabled_schedule_never_fires() -> None:
    sched = PlannedRestarts("", now_wall=utc(2026, 1, 1), timezone="UTC")
    assert not sched.enabled
    assert sched.next_fire(utc(2026, 1, 1)) is None
    for hour in range(48):
        assert sched.due(utc(2026, 1, 1) + timedelta(hours=hour), LONG_AGO).outcome is Outcome.WAIT


def test_fires_once_per_night_with_one_second_ticks() -> None:
    start = utc(2026, 1, 1, 4, 0)
    sched = make(start)
    decisions = []
    t = start
    while t < utc(2026, 1, 2, 5):
        d = sched.due(t, LONG_AGO)
        if d.outcome is not Outcome.WAIT:
            decisions.append((t, d))
        t += timedelta(seconds=30)
    assert [(t.strftime("%d %H:%M"), d.outcome) for t, d in decisions] == [
        ("01 04:30", Outcome.RESTART), ("02 04:30", Outcome.RESTART)]
    first = decisions[0][1]
    assert first.restart
    assert first.event is None  # the policy emits scheduled_restart
    assert first.fire_time == utc(2026, 1, 1, 4, 30)
    assert first.next_fire == utc(2026, 1, 2, 4, 30)
    assert "30 4 * * *" in first.reason


def test_wait_before_fire() -> None:
    now = utc(2026, 1, 1, 4, 29, 50)
    sched = make(now)
    assert sched.due(now, LONG_AGO).outcome is Outcome.WAIT
    assert sched.due(now + timedelta(seconds=9.9), LONG_AGO).outcome is Outcome.WAIT
    assert sched.due(now + timedelta(seconds=10), LONG_AGO).outcome is Outcome.RESTART
    assert sched.due(now + timedelta(seconds=11), LONG_AGO).outcome is Outcome.WAIT


def test_jitter_is_bounded_deterministic_and_never_early() -> None:
    start = utc(2026, 1, 1)
    planned = []
    for seed in range(200):
        sched = make(start, jitter_s=120.0, rng=random.Random(seed))
        nxt = sched.next_fire(start)
        assert nxt is not None
        delay = (nxt - utc(2026, 1, 1, 4, 30)).total_seconds()
        assert 0.0 <= delay <= 120.0
        planned.append(delay)
    assert max(planned) - min(planned) > 60  # it really spreads a fleet
    a = make(start, jitter_s=120.0, rng=random.Random(7)).next_fire(start)
    b = make(start, jitter_s=120.0, rng=random.Random(7)).next_fire(start)
    assert a == b
    # The decision waits for the jittered instant, and reports the jitter.
    sched = make(start, jitter_s=120.0, rng=random.Random(7))
    assert a is not None
    assert sched.due(a - timedelta(seconds=0.5), LONG_AGO).outcome is Outcome.WAIT
    d = sched.due(a, LONG_AGO)
    assert d.outcome is Outcome.RESTART
    assert d.planned_time == a
    assert d.jitter_s == pytest.approx((a - utc(2026, 1, 1, 4, 30)).total_seconds())
    assert "jitter" in d.reason


def test_each_fire_draws_its_own_jitter() -> None:
    start = utc(2026, 1, 1)
    sched = make(start, jitter_s=600.0, rng=random.Random(3))
    jitters = []
    t = start
    for _ in range(5):
        nxt = sched.next_fire(t)
        assert nxt is not None
        d = sched.due(nxt, LONG_AGO)
        assert d.outcome is Outcome.RESTART
        jitters.append(d.jitter_s)
        t = nxt
    assert len(set(jitters)) == 5


def test_skip_after_recent_restart() -> None:
    now = utc(2026, 1, 1, 4, 30)
    sched = make(utc(2026, 1, 1))
    started = now - timedelta(minutes=20)  # crash recovery 20 min before the fire
    d = sched.due(now, started)
    assert d.outcome is Outcome.SKIP_RECENT_START
    assert not d.restart
    assert d.event == "scheduled_restart_skipped"
    assert d.uptime_s == pytest.approx(1200.0)
    assert "1200 s ago" in d.reason
    assert "min_uptime_s 3600" in d.reason
    # Skipped, not retried: nothing more until tomorrow's fire, which runs.
    assert sched.due(now + timedelta(hours=2), started).outcome is Outcome.WAIT
    assert sched.due(utc(2026, 1, 2, 4, 30), started).outcome is Outcome.RESTART


def test_uptime_exactly_min_uptime_restarts() -> None:
    now = utc(2026, 1, 1, 4, 30)
    sched = make(utc(2026, 1, 1))
    assert sched.due(now, now - timedelta(seconds=3600)).outcome is Outcome.RESTART


def test_skip_when_not_serving() -> None:
    now = utc(2026, 1, 1, 4, 30)
    sched = make(utc(2026, 1, 1))
    d = sched.due(now, LONG_AGO, serving=False)
    assert d.outcome is Outcome.SKIP_NOT_SERVING
    assert d.event == "scheduled_restart_skipped"


def test_misfire_within_grace_runs_once() -> None:
    sched = make(utc(2026, 1, 1))
    late = utc(2026, 1, 1, 4, 40)  # host woke 10 min after the fire; grace 15 min
    d = sched.due(late, LONG_AGO)
    assert d.outcome is Outcome.RESTART
    assert d.lateness_s == pytest.approx(600.0)
    assert sched.due(late + timedelta(seconds=1), LONG_AGO).outcome is Outcome.WAIT


def test_misfire_past_grace_is_reported_and_skipped_to_next_fire() -> None:
    sched = make(utc(2026, 1, 1))
    woke = utc(2026, 1, 1, 9, 0)  # host slept through 04:30
    assert sched.next_fire(woke) == utc(2026, 1, 2, 4, 30)  # what status shows: not a past time
    d = sched.due(woke, LONG_AGO)
    assert d.outcome is Outcome.MISSED
    assert d.event == "scheduled_restart_missed"
    assert d.missed == 1
    assert d.fire_time == utc(2026, 1, 1, 4, 30)
    assert d.lateness_s == pytest.approx(4.5 * 3600)
    assert d.next_fire == utc(2026, 1, 2, 4, 30)
    assert "missed 1 fire" in d.reason
    assert sched.due(woke + timedelta(seconds=1), LONG_AGO).outcome is Outcome.WAIT
    assert sched.due(utc(2026, 1, 2, 4, 30), LONG_AGO).outcome is Outcome.RESTART


def test_misfire_over_several_days_is_one_report() -> None:
    sched = make(utc(2026, 1, 1))
    d = sched.due(utc(2026, 1, 4, 12), LONG_AGO)  # suspended for three and a half days
    assert d.outcome is Outcome.MISSED
    assert d.missed == 4
    assert d.fire_time == utc(2026, 1, 4, 4, 30)
    assert d.next_fire == utc(2026, 1, 5, 4, 30)


def test_several_passed_fires_within_grace_coalesce() -> None:
    sched = PlannedRestarts("*/5 * * * *", now_wall=utc(2026, 1, 1, 4, 1), timezone="UTC",
                            min_uptime_s=0, misfire_grace_s=900)
    d = sched.due(utc(2026, 1, 1, 4, 12), LONG_AGO)  # 04:05 and 04:10 passed, 04:05 is 7 min late
    assert d.outcome is Outcome.RESTART
    assert d.missed == 1
    assert d.next_fire == utc(2026, 1, 1, 4, 15)
    assert sched.due(utc(2026, 1, 1, 4, 12, 1), LONG_AGO).outcome is Outcome.WAIT


def test_zero_grace_misses_anything_late() -> None:
    sched = make(utc(2026, 1, 1), misfire_grace_s=0.0)
    assert sched.due(utc(2026, 1, 1, 4, 30, 1), LONG_AGO).outcome is Outcome.MISSED


def test_clock_stepped_back_does_not_fire_twice() -> None:
    sched = make(utc(2026, 1, 1))
    assert sched.due(utc(2026, 1, 1, 4, 30), LONG_AGO).outcome is Outcome.RESTART
    # NTP steps the clock back ten minutes: 04:30 comes round again but was handled.
    for second in range(0, 1200, 10):
        assert sched.due(utc(2026, 1, 1, 4, 20) + timedelta(seconds=second), LONG_AGO).outcome is Outcome.WAIT


def test_daemon_down_at_fire_time_with_persisted_cursor() -> None:
    handled = utc(2026, 1, 1, 4, 30)
    # Daemon restarted at 04:31 the next day, server just started with it: the skip rule applies.
    now = utc(2026, 1, 2, 4, 31)
    sched = make(now, last_handled_wall=handled)
    d = sched.due(now, now - timedelta(seconds=20))
    assert d.outcome is Outcome.SKIP_RECENT_START
    assert d.fire_time == utc(2026, 1, 2, 4, 30)
    # Without the persisted cursor the passed fire is simply unknown: next is tomorrow's.
    fresh = make(now)
    assert fresh.due(now, now - timedelta(seconds=20)).outcome is Outcome.WAIT
    assert fresh.next_fire(now) == utc(2026, 1, 3, 4, 30)


def test_decision_fields_render_in_the_event_catalog() -> None:
    sched = make(utc(2026, 1, 1))
    d = sched.due(utc(2026, 1, 1, 9), LONG_AGO)
    assert d.event in CATALOG
    fields = d.fields()
    assert fields["fire_time"] == "2026-01-01T04:30:00+00:00"
    assert fields["missed"] == 1
    message = render_message(d.event, fields)
    assert message.startswith("planned restart missed: schedule '30 4 * * *' (UTC)")


def test_from_config() -> None:
    cfg = ScheduleConfig(restart_cron="0 3 * * 0", timezone="Europe/Berlin", jitter_s=30,
                         min_uptime_s=10, misfire_grace_s=60)
    sched = planned_restarts(cfg, now_wall=utc(2026, 1, 1), rng=random.Random(0))
    nxt = sched.next_fire(utc(2026, 1, 1))
    assert nxt is not None
    assert nxt.astimezone(BERLIN).strftime("%a %H:%M") == "Sun 03:00"
    assert 0 <= (nxt - utc(2026, 1, 4, 2)).total_seconds() <= 30
    assert sched.misfire_grace_s == 60


def test_due_across_fall_back_with_local_clock_readings() -> None:
    # The injected clock may hand out datetimes in the schedule's own zone: during the repeated
    # hour, equal wall times with different folds must still compare as different instants.
    sched = PlannedRestarts("30 * * * *", now_wall=utc(2026, 10, 24, 23, 45), timezone="Europe/Berlin",
                            min_uptime_s=0)
    fired = []
    t = utc(2026, 10, 24, 23, 45)
    while t < utc(2026, 10, 25, 3, 45):
        local_now = t.astimezone(BERLIN)
        d = sched.due(local_now, LONG_AGO)
        if d.restart:
            fired.append(t.strftime("%H:%M"))
        t += timedelta(minutes=1)
    assert fired == ["00:30", "01:30", "02:30", "03:30"]
