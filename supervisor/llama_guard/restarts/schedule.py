"""Planned (nightly) restarts: jitter, skip and misfire rules over the fires of a cron expression
(:mod:`llama_guard.config.cron`: parsing, time zones, DST, the next fire).

Why not APScheduler's scheduler classes
---------------------------------------
APScheduler's ``AsyncIOScheduler`` runs jobs from its own timers and, for a missed run, decides
with its own ``misfire_grace_time``/``coalesce`` logic against the real clock. llama-guard's design
keeps every decision in pure code driven by the daemon's one loop, with the clock injected. So this
module uses only APScheduler's *trigger* (:class:`~apscheduler.triggers.cron.CronTrigger`, a pure
"next fire time after T" function that handles time zones and DST) and owns the rest:
:class:`PlannedRestarts` holds one cursor (the next fire, jitter included) and answers
:meth:`PlannedRestarts.due` whenever the daemon asks. No thread, no task, no clock read.

Jitter
------
Each fire is delayed by a uniform random ``0 … jitter_s`` seconds drawn once, when the fire is
armed, from the injected :class:`random.Random`. It never moves a restart earlier than the cron
time. Seeded generators make it deterministic in tests.

Skip rule
---------
At a (jittered) fire time the restart is skipped, and reported, when the server is not serving
(starting, backing off, already draining), or when it was started — for any reason: daemon start,
crash recovery, a manual restart — less than ``min_uptime_s`` ago. A skipped fire is not retried;
the next fire is the next cron time.

Misfire rule
------------
The daemon calls :meth:`PlannedRestarts.due` about once a second. If it finds the armed fire more
than ``misfire_grace_s`` in the past (the host was suspended, the clock was stepped forward, the
loop was blocked), that fire — and any others that also passed meanwhile — is *missed*: reported
once, not run, and the cursor moves to the first fire after now. A fire found late but within the
grace runs once (several passed fires within the grace coalesce into one restart). The default
grace is 15 minutes: a nightly restart meant for 04:30 should not hit a box that wakes at 09:00.

When the daemon itself was down at the fire time, the server was down with it and starts fresh
with the daemon, so the skip rule covers it. A caller that knows the last fire handled before can
pass it as ``last_handled_wall`` to have such fires reported as missed or skipped explicitly.

Wall clock versus monotonic
---------------------------
Cron times are wall-clock times, so this module takes aware wall-clock datetimes
(``datetime.now(timezone.utc)`` in the daemon, anything aware in tests). A clock stepped backwards
never fires a handled time twice: the cursor only moves forward from the last handled fire.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo

from llama_guard.config.cron import ParsedCron, fire_after, parse_cron, resolve_timezone, validate_timezone
from llama_guard.config.sections import ScheduleConfig
from llama_guard.vocab.events import EventName

__all__ = [
    "Decision",
    "Outcome",
    "PlannedRestarts",
]


# --------------------------------------------------------------------------------------------
# Decisions


class Outcome(enum.Enum):
    """What :meth:`PlannedRestarts.due` decided."""

    WAIT = "wait"                      # nothing due yet
    RESTART = "restart"                # ask the policy for a drained restart now
    SKIP_RECENT_START = "skip_recent_start"  # server started less than min_uptime_s ago
    SKIP_NOT_SERVING = "skip_not_serving"    # server not READY (starting, backing off, draining)
    MISSED = "missed"                  # fire(s) passed more than misfire_grace_s ago


@dataclass(frozen=True)
class Decision:
    """One answer of :meth:`PlannedRestarts.due`, with the figures that justify it.

    Times are aware datetimes in the schedule's zone; durations are seconds.
    ``fire_time`` is the cron time handled (for MISSED: the last one that passed),
    ``planned_time`` that time plus its jitter, ``lateness_s`` how long after ``planned_time``
    the decision was taken, ``uptime_s`` the server's age at that moment (``None`` if unknown),
    ``missed`` how many fires were passed over, ``next_fire`` the nominal next cron time.
    """

    outcome: Outcome
    reason: str
    fire_time: datetime | None = None
    planned_time: datetime | None = None
    jitter_s: float = 0.0
    lateness_s: float = 0.0
    uptime_s: float | None = None
    missed: int = 0
    next_fire: datetime | None = None

    @property
    def restart(self) -> bool:
        """True when the daemon should send ``RestartRequest(reason, cause=RestartCause.SCHEDULE)``."""
        return self.outcome is Outcome.RESTART

    @property
    def event(self) -> EventName | None:
        """The health event to emit for this decision, or ``None``.

        RESTART returns ``None``: the policy emits ``scheduled_restart`` when it starts draining.
        """
        events: dict[Outcome, EventName] = {
            Outcome.SKIP_RECENT_START: "scheduled_restart_skipped",
            Outcome.SKIP_NOT_SERVING: "scheduled_restart_skipped",
            Outcome.MISSED: "scheduled_restart_missed",
        }
        return events.get(self.outcome)

    def fields(self) -> Mapping[str, object]:
        """Event fields (snake_case; journald upper-cases them): reason, times in ISO 8601, seconds."""
        out: dict[str, object] = {
            "reason": self.reason,
            "outcome": self.outcome.value,
            "jitter_s": round(self.jitter_s, 3),
            "lateness_s": round(self.lateness_s, 3),
            "missed": self.missed,
        }
        for name in ("fire_time", "planned_time", "next_fire"):
            value: datetime | None = getattr(self, name)
            out[name] = value.isoformat() if value is not None else ""
        if self.uptime_s is not None:
            out["uptime_s"] = round(self.uptime_s, 3)
        return out


@dataclass(frozen=True)
class _Armed:
    fire_time: datetime     # the nominal cron time, UTC
    planned_time: datetime  # fire_time + jitter, UTC
    jitter_s: float


def _require_aware(value: datetime, name: str) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime (got naive {value.isoformat()})")


@dataclass
class PlannedRestarts:
    """The planned-restart schedule, driven by the daemon's loop with an injected wall clock.

    Build it from ``[schedule]`` (:func:`planned_restarts`); call :meth:`due` about
    once a second from the daemon loop and act on the :class:`Decision`; call :meth:`next_fire`
    for ``llama-guard status``.
    With ``cron=""`` (disabled) every answer is WAIT and :meth:`next_fire` is ``None``.

    Parameters (seconds): ``jitter_s`` (≥ 0) delay drawn per fire; ``min_uptime_s`` skip rule;
    ``misfire_grace_s`` misfire rule. ``rng`` draws the jitter (default: an OS-seeded
    :class:`random.Random`). ``now_wall`` is the construction instant: the first fire armed is the
    first after ``last_handled_wall`` if given (the last fire handled before), else after
    ``now_wall``.

    Raises :class:`ScheduleError` for a bad ``cron`` or ``timezone``, ``ValueError`` for a naive
    datetime or a negative duration.
    """

    cron: str
    now_wall: datetime
    timezone: str = ""
    jitter_s: float = 0.0
    min_uptime_s: float = 3600.0
    misfire_grace_s: float = 900.0
    rng: random.Random = field(default_factory=random.Random)
    last_handled_wall: datetime | None = None
    _parsed: ParsedCron | None = field(init=False, default=None, repr=False)
    _armed: _Armed | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        _require_aware(self.now_wall, "now_wall")
        self.now_wall = self.now_wall.astimezone(timezone.utc)
        for name in ("jitter_s", "min_uptime_s", "misfire_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        validate_timezone(self.timezone)  # a bad zone is refused even while the schedule is off
        self._parsed = parse_cron(self.cron, resolve_timezone(self.timezone)) if self.cron.strip() else None
        start = self.now_wall
        if self.last_handled_wall is not None:
            _require_aware(self.last_handled_wall, "last_handled_wall")
            start = self.last_handled_wall.astimezone(timezone.utc)
        self._arm_after(start)

    # -- queries ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False when ``restart_cron`` is ``""``."""
        return self._parsed is not None

    @property
    def tz(self) -> tzinfo | None:
        """The zone fire times are computed in (``None`` when disabled)."""
        return self._parsed.tz if self._parsed is not None else None

    def next_fire(self, now_wall: datetime) -> datetime | None:
        """When the next planned restart is due, in the schedule's zone; ``None`` if disabled.

        The armed fire (jitter included) unless it will be reported missed at ``now_wall``; then
        the nominal cron time of the first fire after ``now_wall`` (its jitter, up to ``jitter_s``,
        is drawn when it is armed). Pure: does not change the cursor.
        """
        now = _utc(now_wall, "now_wall")
        if self._parsed is None or self._armed is None:
            return None
        lateness = (now - self._armed.planned_time).total_seconds()
        if lateness <= self.misfire_grace_s:
            return self._local(self._armed.planned_time)
        return fire_after(self._parsed, now)

    # -- the decision ------------------------------------------------------------------------

    def due(self, now_wall: datetime, last_start_wall: datetime | None, *, serving: bool = True) -> Decision:
        """Decide at ``now_wall`` whether a planned restart is due.

        ``last_start_wall``: when the current server process was started (any reason), or
        ``None`` if there is none. ``serving``: the server is READY (not starting, backing off or
        draining). Deterministic and free of I/O and clock reads; it advances the internal cursor
        past a fire once it has been handled, so each fire yields exactly one non-WAIT decision.

        Raises ``ValueError`` for naive datetimes.
        """
        now = _utc(now_wall, "now_wall")
        started = None if last_start_wall is None else _utc(last_start_wall, "last_start_wall")
        parsed, armed = self._parsed, self._armed
        if parsed is None or armed is None:
            return Decision(Outcome.WAIT, "planned restarts disabled" if parsed is None
                            else f"schedule {parsed.expr!r} never fires again")
        local = self._local
        if now < armed.planned_time:
            return Decision(Outcome.WAIT, "not yet", fire_time=local(armed.fire_time),
                            planned_time=local(armed.planned_time), jitter_s=armed.jitter_s,
                            next_fire=local(armed.fire_time))
        lateness = (now - armed.planned_time).total_seconds()
        uptime = None if started is None else max(0.0, (now - started).total_seconds())
        where = f"schedule {parsed.expr!r} ({_zone_name(parsed.tz)})"

        # Every fire that passed up to now is handled by this one decision (coalesced).
        passed, last_passed = 1, armed.fire_time
        nxt = _utc_or_none(fire_after(parsed, armed.fire_time))
        while nxt is not None and nxt <= now:
            passed, last_passed = passed + 1, nxt
            nxt = _utc_or_none(fire_after(parsed, nxt))
        self._arm(nxt)
        next_local = local(nxt)

        def make(outcome: Outcome, reason: str, fire_time: datetime, missed: int) -> Decision:
            return Decision(outcome, reason, fire_time=local(fire_time), planned_time=local(armed.planned_time),
                            jitter_s=armed.jitter_s, lateness_s=lateness, uptime_s=uptime,
                            missed=missed, next_fire=next_local)

        if lateness > self.misfire_grace_s:
            return make(
                Outcome.MISSED,
                f"{where}: missed {passed} fire(s), last at {_iso(local(last_passed))}, found "
                f"{lateness:.0f} s late (grace {self.misfire_grace_s:.0f} s); next at {_iso(next_local)}",
                last_passed, passed)
        fired = f"{where} fired for {_iso(local(armed.fire_time))}"
        if not serving:
            return make(Outcome.SKIP_NOT_SERVING, f"{fired}; skipped: the server is not serving",
                        armed.fire_time, passed - 1)
        if uptime is not None and uptime < self.min_uptime_s:
            return make(
                Outcome.SKIP_RECENT_START,
                f"{fired}; skipped: the server started {uptime:.0f} s ago "
                f"(min_uptime_s {self.min_uptime_s:.0f})",
                armed.fire_time, passed - 1)
        jitter = f" + {armed.jitter_s:.1f} s jitter" if armed.jitter_s else ""
        return make(Outcome.RESTART, f"{fired}{jitter}", armed.fire_time, passed - 1)

    # -- internals ---------------------------------------------------------------------------

    def _local(self, when: datetime | None) -> datetime | None:
        if when is None or self._parsed is None:
            return when
        return when.astimezone(self._parsed.tz)

    def _arm_after(self, after: datetime) -> None:
        self._arm(_utc_or_none(fire_after(self._parsed, after)) if self._parsed is not None else None)

    def _arm(self, fire_time: datetime | None) -> None:
        if fire_time is None:
            self._armed = None
            return
        jitter = self.rng.uniform(0.0, self.jitter_s) if self.jitter_s > 0 else 0.0
        self._armed = _Armed(fire_time, fire_time + timedelta(seconds=jitter), jitter)


def _utc(value: datetime, name: str) -> datetime:
    _require_aware(value, name)
    return value.astimezone(timezone.utc)


def _utc_or_none(value: datetime | None) -> datetime | None:
    return None if value is None else value.astimezone(timezone.utc)


def _iso(value: datetime | None) -> str:
    return "never" if value is None else value.isoformat()


def _zone_name(tz: tzinfo) -> str:
    key = getattr(tz, "key", None)
    return key if isinstance(key, str) else str(tz)


def planned_restarts(config: ScheduleConfig, *, now_wall: datetime, rng: random.Random | None = None,
                     last_handled_wall: datetime | None = None) -> PlannedRestarts:
    """The planned-restart clock of ``[schedule]``: restart_cron, timezone, jitter_s, min_uptime_s,
    misfire_grace_s; ``now_wall`` is an aware datetime. Raises ScheduleError on a bad expression."""
    return PlannedRestarts(cron=config.restart_cron, now_wall=now_wall, timezone=config.timezone,
                           jitter_s=config.jitter_s, min_uptime_s=config.min_uptime_s,
                           misfire_grace_s=config.misfire_grace_s, rng=rng or random.Random(),
                           last_handled_wall=last_handled_wall)
