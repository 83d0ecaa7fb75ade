"""Following each planned restart — scheduled, decay, or requested (``llama-guard restart``,
SIGUSR1) — through the records the loop publishes (:class:`~llama_guard.model.transition.Transition`),
into its :class:`~llama_guard.restarts.history.RestartRecord`.

It begins (a drain, or a stop at once), its server is stopped (drained or not) or dies while it
drains (a crash, seen by the watcher's ``on_exit``), the new server is ready. The record (uptime,
drained or timed out, seconds unavailable = what clients saw: SIGTERM → READY, or with the front
door on the drain's start → READY, since it holds their requests from then; tokens/s and VRAM
before, from the decay monitor) is reported as ``planned_restart_done`` when the new server is
ready; its "after" figures (the new server's baselines) are filled in later. Times are the loop's
monotonic seconds; ``requested_at`` is an aware wall-clock datetime.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from llama_guard.model.transition import Transition
from llama_guard.model.types import RestartCause
from llama_guard.model.watcher import Context
from llama_guard.restarts.decay import DecayMonitor
from llama_guard.restarts.history import RestartHistory, RestartRecord

#: The restart record's ``kind`` for each cause (a decay restart records its trigger instead).
_KIND = {RestartCause.SCHEDULE: "scheduled", RestartCause.DECAY: "decay", RestartCause.OPERATOR: "requested",
         RestartCause.CONFIG_CHANGE: "requested"}


@dataclass
class _Pending:
    """A planned restart between its drain and the new server's READY."""

    pid: int | None
    stop_mono: float | None = None
    held_from: float | None = None  # with the front door on: its requests are held from the drain's start


class RestartFollower:
    """The record of each planned restart, from its start to the new server's baselines."""

    def __init__(self, history: RestartHistory | None = None) -> None:
        self.history = history or RestartHistory()
        self.decay_trigger: str | None = None  # the decay trigger a restart was asked for, until it begins
        self._pending: _Pending | None = None
        self._after_pid: int | None = None  # the server whose baselines are the last record's "after"

    def follows(self, pid: int | None) -> bool:
        """Whether a planned restart of server ``pid`` is under way."""
        return self._pending is not None and self._pending.pid == pid

    def begin(self, step: Transition, monitor: DecayMonitor, *, wall: datetime, front_on: bool) -> None:
        """A planned restart of ``step.before``'s server begins (at wall-clock ``wall``): its record is
        opened; ``front_on``: the front door holds the clients' requests from now."""
        cause = step.after.failure.cause
        kind = _KIND.get(cause, cause.value)
        if cause is RestartCause.DECAY and self.decay_trigger is not None:
            kind = self.decay_trigger  # the trigger that fired: vram_growth, rss_growth, speed_drop
        self.decay_trigger = None
        ready_at = step.before.ready_at
        self.history.begin(RestartRecord(
            kind=kind, reason=step.after.stop_reason, requested_at=wall,
            uptime_s=step.at - ready_at if ready_at is not None else 0.0,
            tokens_per_s_before=monitor.speed.last_window_tps, vram_mib_before=monitor.vram.last_mib))
        self._pending = _Pending(pid=step.before.pid, held_from=step.at if front_on else None)
        self._after_pid = None

    def stopped(self, step: Transition, monitor: DecayMonitor) -> None:
        """``step`` may be the planned stop of the followed server: drained or not, with the figures
        just before."""
        pending = self._pending
        if step.planned_stop and pending is not None and pending.pid == step.before.pid and pending.stop_mono is None:
            pending.stop_mono = step.at
            self.history.update_last(drained=step.drained, tokens_per_s_before=monitor.speed.last_window_tps,
                                     vram_mib_before=monitor.vram.last_mib)

    def exited(self, pid: int, now: float) -> None:
        """Server ``pid`` ended: before its stop was asked for, a crash while draining."""
        pending = self._pending
        if pending is not None and pending.pid == pid and pending.stop_mono is None:
            pending.stop_mono = now
            self.history.update_last(drained=False, server_exited=True)

    def ready(self, ctx: Context, pid: int | None) -> None:
        """Server ``pid`` is ready: a new server after a followed stop closes the record
        (``planned_restart_done``)."""
        pending = self._pending
        if pending is not None and pending.stop_mono is not None and pid != pending.pid:
            self._pending = None
            since = pending.held_from if pending.held_from is not None else pending.stop_mono
            record = self.history.update_last(unavailable_s=round(ctx.clock() - since, 3))
            if record is not None:
                ctx.emit("planned_restart_done", server_pid=pid, **record.fields())
            self._after_pid = pid

    def fill_after(self, server_pid: int | None, monitor: DecayMonitor) -> None:
        """The new server's (``server_pid``) baselines are the "after" figures of the last planned restart."""
        if self._after_pid is None or self._after_pid != server_pid:
            return
        last = self.history.last()
        if last is None:
            return
        changes: dict[str, float] = {}
        if last.tokens_per_s_after is None and monitor.speed.baseline_tps is not None:
            changes["tokens_per_s_after"] = round(monitor.speed.baseline_tps, 3)
        if last.vram_mib_after is None and monitor.vram.baseline_mib is not None:
            changes["vram_mib_after"] = round(monitor.vram.baseline_mib, 1)
        if changes:
            self.history.update_last(**changes)
        if monitor.speed.baseline_tps is not None and monitor.vram.baseline_mib is not None:
            self._after_pid = None
