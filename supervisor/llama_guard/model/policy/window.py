"""The planned window: what a planned restart does, top to bottom — the nightly schedule, a decay
trigger, ``llama-guard restart``, a reload that changes the server's flags, and a reload that names a
new llama-server build (whose window is a trial: it is kept only when it decodes about as fast as the
old build did on this box). The front door holds the clients throughout (every phase but READY holds
them). Pure. In order:

1. **drain** (READY → DRAINING, :func:`drain`): no new request reaches the server; the ones in flight
   finish, bounded by ``[schedule].drain_timeout_s`` (:func:`drain_timed_out`). Once drained the
   server's watch saves its slots, then answers Drained (:func:`drained`).
2. **[measure old]** (DRAINING → TRIAL, :func:`trial_after_drain`) when a reload named a new build
   (:func:`trial_wanted`): the serving build's decode tokens/s (:class:`MeasureSpeed`, answered by
   :class:`SpeedMeasured`), measured as ``llama-guard bench`` does, shortened by ``[upgrade].trial_runs``
   and ``trial_tokens``.
3. **stop** (→ STOPPING, :func:`~.steps.stop`) and **start** once it is gone
   (:func:`~.stop.finish_stop`: the build port picks the executable); the slots are **restored** once
   the new server answers ``/health``, before it is called ready.
4. **[measure new → keep | roll back]** (STARTING → TRIAL, :func:`health_answered`; :func:`on_trial`):
   the new build measured the same way, then :func:`judge`: kept when it decoded within
   ``[upgrade].max_slowdown_pct`` of the old figure (or answered, when there is no old figure to
   compare with); otherwise rolled back at once (TRIAL → STOPPING, a restart whose start the build
   port gives the last good build). A failed measurement, an exit or a fatal line of the new build
   ends its trial too.
5. **release** (→ READY, :func:`release`): the server is called ready, the front door lets the held
   clients through.

A build replaced in place and found at a start (planned or not) has no old server to measure: the
build port asks for its trial (:func:`trial_asked`) with the last good build's figure recorded at its
last trial on this box; with none recorded it is judged by load and answer, and its probation.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Action, Emit, MeasureSpeed, NotifyReady, StartDrain
from llama_guard.model.inputs import (
    Exited,
    HealthOk,
    Input,
    Line,
    ParamsChanged,
    RestartRequest,
    SpeedMeasured,
    TrialAsked,
)
from llama_guard.model.phase_state import Stopping
from llama_guard.model.policy.lines import alloc_recovered, fault_line
from llama_guard.model.policy.steps import (
    Result,
    count_failure,
    exit_fields,
    fail,
    restart_event,
    restart_for,
    stop,
)
from llama_guard.model.policy.stop import end_exit_drain
from llama_guard.model.types import (
    AfterStop,
    RestartCause,
    State,
    Trial,
    TrialResult,
    TrialStage,
    enter,
    exit_signal,
    exit_text,
)
from llama_guard.vocab.phases import Phase


def drain(state: State, event: RestartRequest, now: float) -> Result:
    """A planned restart of the ready server (the schedule, a decay trigger, an operator, changed
    flags): drain it first (DRAINING, bounded by ``[schedule].drain_timeout_s``) — or, asked without a
    drain, stop it at once."""
    pid = state.pid
    assert pid is not None
    state = restart_for(state, event.cause)
    uptime = now - (state.ready_at or now)
    emit = Emit(restart_event(event.cause), {"server_pid": pid, "reason": event.reason,
                                             "cause": event.cause.value, "uptime_s": uptime})
    if not event.drain:
        new, actions = stop(state, now, AfterStop.RESTART, event.reason)
        return new, [emit, *actions]
    new = replace(state, phase=enter(state, Phase.DRAINING), phase_data=Stopping(event.reason),
                  deadline=now + state.params.drain_timeout_s, after_stop=AfterStop.RESTART)
    return new, [emit, StartDrain(pid)]


def planned_after(state: State) -> AfterStop:
    """What follows a planned drain: a window lent to tune (:mod:`.lend`), else a restart."""
    return AfterStop.LEND if state.after_stop is AfterStop.LEND else AfterStop.RESTART


def drained(state: State, now: float) -> Result:
    """No request in flight any more (the slots saved): the old build's trial when one is asked,
    else the stop (or, before the daemon's exit, the exit's stop)."""
    if state.after_stop is AfterStop.EXIT:
        return end_exit_drain(state, now, drained=True)
    return trial_after_drain(state) or stop(state, now, planned_after(state), state.stop_reason)


def drain_timed_out(state: State, now: float) -> Result:
    """The drain outlasted its deadline: stop the server with its requests (``drain_timeout``)."""
    if state.after_stop is AfterStop.EXIT:
        return end_exit_drain(state, now, drained=False)
    new, actions = stop(state, now, planned_after(state), state.stop_reason)
    return new, [Emit("drain_timeout", {"server_pid": state.pid, "drain_timeout_s": state.params.drain_timeout_s,
                                        "reason": state.stop_reason}), *actions]


def trial_wanted(state: State, event: ParamsChanged) -> State:
    """A reload that names a new build while the server is ready: its drained restart measures the
    old build first (no trial when ``trial_runs`` is 0, or no server serves to be measured)."""
    if not event.new_build or state.phase is not Phase.READY or event.params.trial_runs < 1:
        return state
    return replace(state, trial=Trial(TrialStage.OLD))


def trial_asked(state: State, event: TrialAsked) -> State:
    """A start runs a build found replaced in place (the build port asks, with the last good build's
    recorded figure): it is measured once it answers, as a reload's new build is (no trial when
    ``trial_runs`` is 0, when a trial is under way, or when no start is)."""
    if state.phase is not Phase.STARTING or state.trial is not None or state.params.trial_runs < 1:
        return state
    return replace(state, trial=Trial(TrialStage.NEW, old_tps=event.tokens_per_s, spawned=True))


def _measure(state: State) -> list[Action]:
    assert state.pid is not None
    return [MeasureSpeed(state.pid, state.params.trial_runs, state.params.trial_tokens)]


def trial_after_drain(state: State) -> Result | None:
    """The drained server is the old build of a trial: measure it before its stop (None: no trial)."""
    if state.trial is None or state.trial.stage is not TrialStage.OLD:
        return None
    return replace(state, phase=enter(state, Phase.TRIAL), deadline=None), _measure(state)


def health_answered(state: State, event: HealthOk, now: float) -> Result:
    """A loading server answered ``/health`` (its slots restored): a new build on trial is measured
    first (TRIAL), any other server is released."""
    if state.trial is not None and state.trial.stage is TrialStage.NEW:
        return replace(state, phase=enter(state, Phase.TRIAL), phase_data=None, deadline=None, ready_owner=(
            event.port_pid, event.port_comm), trial=replace(state.trial, answered_at=now)), _measure(state)
    return release(state, event, now)


def release(state: State, event: HealthOk, now: float) -> Result:
    """The server is ready (READY): the front door lets the held clients through; ``server_ready`` with
    the load time and, after a restart, the time since the old server stopped serving."""
    assert state.pid is not None
    answered = state.trial.answered_at if state.trial is not None else None
    load_s = (answered if answered is not None else now) - (state.started_at if state.started_at is not None else now)
    recovered = alloc_recovered(state, "the server became ready")
    new = replace(state, phase=enter(state, Phase.READY), phase_data=None, ready_at=now, deadline=None, strikes=0,
                  stable=False, alloc_failure="", port_taken_since=None, port_holder=None, trial=None,
                  ready_owner=None, load_s=load_s)
    fields: dict[str, object] = {"server_pid": state.pid, "load_s": load_s}
    if answered is not None:
        fields["trial_s"] = round(now - answered, 3)  # the new build's measurement, after its load
    if state.restart_at is not None:
        fields["restart_to_ready_s"] = round(now - state.restart_at, 3)
    if event.port_pid is not None and event.port_pid != state.pid:
        # A wrapper script: the port belongs to a process it forked.
        fields["port_pid"] = event.port_pid
        fields["port_owner"] = (f"descendant pid {event.port_pid}"
                                f"{f' ({event.port_comm})' if event.port_comm else ''} of pid {state.pid}")
    return new, [*recovered, Emit("server_ready", fields), NotifyReady()]


def on_trial(state: State, event: Input, now: float) -> Result:
    """TRIAL: a build's decode speed is being measured, the front door holding the clients."""
    trial, pid = state.trial, state.pid
    assert trial is not None and pid is not None
    if isinstance(event, SpeedMeasured) and event.pid == pid:
        if trial.stage is TrialStage.OLD:
            measured = Trial(TrialStage.NEW, old_tps=event.tokens_per_s, old_error=event.error)
            return stop(replace(state, trial=measured), now, AfterStop.RESTART, state.stop_reason)
        return judge(state, event, now)
    if isinstance(event, Line) and event.pid == pid:
        fatal = fault_line(state, event, now, "")
        if fatal is not None:
            new, actions = fatal
            return replace(new, trial=None if trial.stage is TrialStage.NEW else trial), actions
        return state, []
    if isinstance(event, Exited) and event.pid == pid:
        fields = exit_fields(pid, event.returncode, state.last_error)
        which = "the new build" if trial.stage is TrialStage.NEW else "the old build"
        new = replace(fail(state, RestartCause.CRASH, f"exited during the trial of {which}: "
                           f"{exit_text(event.returncode)}"), exit_signal=exit_signal(event.returncode))
        if trial.stage is TrialStage.OLD:  # the new build still comes, compared with nothing
            new = replace(new, trial=Trial(TrialStage.NEW, old_error="the old build exited as it was measured"))
        new, actions = count_failure(new, now)
        return new, [Emit("server_exited", {**fields, "phase": Phase.TRIAL.value}), *actions]
    return state, []


def judge(state: State, event: SpeedMeasured, now: float) -> Result:
    """The new build measured: keep it (release) when it decoded within ``max_slowdown_pct`` of the
    old figure, or answered when there is no old figure; else roll back at once (a restart whose
    start the build port gives the last good build)."""
    trial = state.trial
    assert trial is not None
    limit = state.params.max_slowdown_pct
    old, new_tps = trial.old_tps, event.tokens_per_s
    if new_tps is None:
        cause = f"its trial failed: {event.error}"
    elif old is not None and old > 0 and (old - new_tps) / old * 100.0 > limit:
        cause = (f"slower: {new_tps:.1f} tok/s vs {old:.1f} tok/s "
                 f"(-{(old - new_tps) / old * 100.0:.0f} %, limit {limit:g} %)")
    else:
        note = "" if old is not None else f"no figure of the old build to compare with ({trial.old_error or 'none'})"
        result = TrialResult(old, new_tps, kept=True, cause=note, max_slowdown_pct=limit)
        owner = state.ready_owner or (None, "")
        return release(replace(state, last_trial=result), HealthOk(event.pid, owner[0], owner[1]), now)
    result = TrialResult(old, new_tps, kept=False, cause=cause, max_slowdown_pct=limit)
    new = replace(fail(state, RestartCause.TRIAL, cause), last_trial=result)
    return stop(new, now, AfterStop.RESTART, cause)
