"""Cron expressions and time zones: parsing and validating ``[schedule].restart_cron`` and
``[schedule].timezone``, and the next fire after an instant (:func:`fire_after`). Validated by the
configuration; the planned-restart schedule that acts on the fires is
:mod:`llama_guard.restarts.schedule`.

The computation is APScheduler's *trigger* (:class:`~apscheduler.triggers.cron.CronTrigger`, a pure
"next fire time after T" function that handles time zones and DST), corrected where it disagrees
with cron(8).

Cron dialect
------------
Standard 5-field crontab: ``minute hour day-of-month month day-of-week``, with ``*``, lists,
ranges, ``*/n`` steps and month/day names. Two places where APScheduler 3's
``CronTrigger.from_crontab`` disagrees with cron(8) are corrected here, which is why the
expression is split by :func:`parse_cron` rather than handed to ``from_crontab``:

* day-of-week numbers: cron's ``0`` (and ``7``) is Sunday; ``from_crontab`` reads ``0`` as Monday
  and rejects ``7``. The field is translated to day names before APScheduler sees it.
* day-of-month *and* day-of-week both restricted (e.g. ``0 4 1 * mon``): cron fires when *either*
  matches; ``from_crontab`` requires both. Such an expression becomes an ``OrTrigger`` of two.

Time zones and DST
------------------
Fire times are computed in ``[schedule].timezone`` (an IANA name; ``""`` = the host's zone, read
with :mod:`tzlocal` as APScheduler does). On the spring-forward day a wall time that does not exist
(02:30 in Europe/Berlin) fires one hour later by the wall clock (03:30 local, the same instant as
"02:30 at the old offset"). On the fall-back day a wall time that occurs twice fires once, at its
first occurrence, unless the hour field is ``*`` (an hourly schedule fires in both hours), the
rule cron(8) uses for fixed-time versus interval jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

__all__ = [
    "ParsedCron",
    "ScheduleError",
    "fire_after",
    "parse_cron",
    "resolve_timezone",
    "validate_cron",
    "validate_timezone",
]

_ONE_US = timedelta(microseconds=1)
_DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_CRON_HELP = "expected 5 fields 'minute hour day-of-month month day-of-week', e.g. '30 4 * * *'"
# A reference instant for "does this expression ever fire" (any date after it will do).
_EPOCH_2000 = datetime(2000, 1, 1, tzinfo=timezone.utc)


class ScheduleError(ValueError):
    """A cron expression or time zone that cannot be used; the message names the bad value."""


class _Trigger(Protocol):
    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime | None:
        ...


# --------------------------------------------------------------------------------------------
# Time zones


def resolve_timezone(name: str) -> tzinfo:
    """The :class:`tzinfo` for IANA zone ``name``; ``""`` is the host's zone.

    The host's zone is read with :func:`tzlocal.get_localzone` (``$TZ``, then ``/etc/localtime``),
    falling back to UTC when the host has none configured.

    Raises :class:`ScheduleError` naming ``name`` when it is not a known IANA zone.
    """
    if not name.strip():
        try:
            import tzlocal

            return tzlocal.get_localzone()
        except Exception:  # tzlocal raises several types for a misconfigured host
            return timezone.utc
    try:
        return ZoneInfo(name.strip())
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ScheduleError(
            f"unknown time zone {name!r}: expected an IANA name such as 'Europe/Berlin' or 'UTC', "
            "or '' for the host's zone") from exc


def validate_timezone(name: str) -> str:
    """Return ``name`` stripped if :func:`resolve_timezone` accepts it; else raise :class:`ScheduleError`.

    ``""`` (the host's zone) is always accepted (:func:`resolve_timezone` falls back to UTC) and is not
    read here: the host's zone is read only where a schedule uses it.
    """
    if name.strip():
        resolve_timezone(name)
    return name.strip()


# --------------------------------------------------------------------------------------------
# Cron parsing


def _day_number(token: str, expr: str) -> int:
    low = token.lower()
    if low in _DAY_NAMES:
        return _DAY_NAMES.index(low)
    if token.isdigit() and 0 <= int(token) <= 7:
        return int(token)
    raise ScheduleError(f"invalid restart_cron {expr!r}: day-of-week {token!r} is not 0-7 or sun..sat")


def _translate_dow(field_text: str, expr: str) -> str:
    """cron(8)'s day-of-week field (0 and 7 = Sunday) as a list of names for APScheduler."""
    if field_text in ("*", "?"):
        return "*"
    days: set[int] = set()
    for item in field_text.split(","):
        base, _, step_text = item.partition("/")
        step = 1
        if step_text:
            if not step_text.isdigit() or int(step_text) < 1:
                raise ScheduleError(f"invalid restart_cron {expr!r}: bad day-of-week step {item!r}")
            step = int(step_text)
        if base in ("*", "?"):
            lo, hi = 0, 6
        elif "-" in base:
            lo_text, _, hi_text = base.partition("-")
            lo, hi = _day_number(lo_text, expr), _day_number(hi_text, expr)
            if hi == 0 and lo > 0:  # "fri-sun": Sunday as the end of a range is day 7
                hi = 7
            if lo > hi:
                raise ScheduleError(f"invalid restart_cron {expr!r}: day-of-week range {base!r} runs backwards")
        elif step_text:
            raise ScheduleError(
                f"invalid restart_cron {expr!r}: day-of-week step {item!r} needs '*' or a range before '/'")
        else:
            lo = hi = _day_number(base, expr)
        days.update(day % 7 for day in range(lo, hi + 1, step))
    if len(days) == 7:
        return "*"
    return ",".join(_DAY_NAMES[day] for day in sorted(days))


@dataclass(frozen=True)
class ParsedCron:
    """A validated cron expression: its text, zone and the APScheduler trigger that computes it."""

    expr: str
    tz: tzinfo
    trigger: _Trigger
    hourly: bool  # the hour field is "*": repeated wall times on the fall-back day fire twice


def parse_cron(expr: str, tz: tzinfo | None = None) -> ParsedCron:
    """Parse a standard 5-field cron expression evaluated in ``tz`` (default UTC).

    Raises :class:`ScheduleError` naming ``expr`` for a wrong number of fields, a value out of
    range, an unknown name, or an expression that can never fire (``0 0 30 2 *``).

    APScheduler is imported here, not with the module: a daemon with no ``restart_cron`` never loads
    it, and one with a schedule loads it when its configuration is validated, at start.
    """
    from apscheduler.triggers.combining import OrTrigger  # type: ignore[import-untyped]
    from apscheduler.triggers.cron import CronTrigger  # type: ignore[import-untyped]

    zone = timezone.utc if tz is None else tz
    fields = expr.split()
    if len(fields) != 5:
        raise ScheduleError(f"invalid restart_cron {expr!r}: got {len(fields)} fields; {_CRON_HELP}")
    minute, hour, dom, month, dow = fields
    names = _translate_dow(dow, expr)
    dom_any = dom.startswith(("*", "?"))
    dow_any = dow.startswith(("*", "?"))
    try:
        if not dom_any and not dow_any:  # cron(8): either day field may match
            trigger: _Trigger = OrTrigger([
                CronTrigger(minute=minute, hour=hour, day=dom, month=month, day_of_week="*", timezone=zone),
                CronTrigger(minute=minute, hour=hour, day="*", month=month, day_of_week=names, timezone=zone),
            ])
        else:
            trigger = CronTrigger(minute=minute, hour=hour, day="*" if dom in ("*", "?") else dom,
                                  month=month, day_of_week=names, timezone=zone)
    except ValueError as exc:
        raise ScheduleError(f"invalid restart_cron {expr!r}: {exc}; {_CRON_HELP}") from exc
    if trigger.get_next_fire_time(None, _EPOCH_2000) is None:
        raise ScheduleError(f"invalid restart_cron {expr!r}: it never fires")
    return ParsedCron(expr=" ".join(fields), tz=zone, trigger=trigger, hourly=hour == "*")


def validate_cron(expr: str) -> str:
    """Return ``expr`` normalised (``""`` for disabled, else single-spaced) or raise :class:`ScheduleError`."""
    if not expr.strip():
        return ""
    return parse_cron(expr).expr


def _repeated_wall_time(when: datetime) -> bool:
    """True for the second occurrence of a wall time repeated by a fall-back DST change."""
    if when.fold != 1:
        return False
    return when.replace(fold=0).utcoffset() != when.utcoffset()


def fire_after(cron: ParsedCron, after: datetime) -> datetime | None:
    """The first cron fire strictly after the aware instant ``after``, in the cron's zone.

    Applies the DST rules described in the module docstring. ``None`` if it never fires again.
    """
    # All comparisons and arithmetic in UTC: Python ignores ``fold`` (and so DST) when comparing
    # or subtracting two datetimes that share one tzinfo object.
    after_utc = after.astimezone(timezone.utc)
    probe = after_utc + _ONE_US
    for _ in range(16):  # a handful of DST skips at most
        found = cron.trigger.get_next_fire_time(None, probe.astimezone(cron.tz))
        if found is None:
            return None
        # Normalise through UTC ("02:30+01:00" on the spring-forward day becomes 03:30+02:00);
        # astimezone() to the datetime's own tzinfo object would return it unchanged.
        found_utc = found.astimezone(timezone.utc)
        local = found_utc.astimezone(cron.tz)
        if found_utc <= after_utc or (not cron.hourly and _repeated_wall_time(local)):
            probe = max(found_utc, after_utc) + _ONE_US
            continue
        return local
    return None  # pragma: no cover - would need 16 consecutive DST anomalies
