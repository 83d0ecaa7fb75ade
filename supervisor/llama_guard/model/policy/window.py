"""The planned window: what a planned restart does, top to bottom — the nightly schedule, a decay
trigger, ``llama-guard restart``, a reload that changes the server's flags, a reload that names a new
llama-server build (whose window is a trial: it is kept only when it decodes about as fast as the old
build did on this box), and the GPU lent to ``llama-guard tune`` (:mod:`.lend`: the same drain and
stop, then LENT in place of the start). Every step is decided here; the other modules call in (the
phase handlers of :mod:`.phases` and :mod:`.stop`, the dispatch of :mod:`llama_guard.model.policy`),
and the daemon carries out the actions. The front door holds the clients throughout (every phase but
READY holds them). Pure. In order:

0. **asked** (:func:`restart_event`; :func:`restart_while_loading` for a loading server,
   :func:`restart_meanwhile` when one is under way; a changed configuration asks with
   ``RestartCause.CONFIG_CHANGE``; :func:`trial_wanted` when the reload names a new build).
1. **drain** (READY → DRAINING, :func:`drain`; :func:`begin_drain`, which the GPU lent to tune
   shares): no new request reaches the server; the ones in flight finish, bounded by
   ``[schedule].drain_timeout_s`` (:func:`drain_timed_out`: the policy is that deadline's one owner).
   :class:`StartDrain` runs the server's drain watch (``ServerWatch.drain``,
   :mod:`llama_guard.core.server`): no request in flight (the front door's count), then
2. **save slots**: the slot port saves every changed slot (``SlotPort.after_drain``,
   :mod:`llama_guard.slots.watcher`, within ``[slots].save_timeout_s``; labelled by
   :func:`slot_save_reason`), idle connections to the server are closed, and it answers Drained
   (:func:`drained`). A drain before the daemon's exit is the same drain ending in the exit
   (:func:`drain_before_exit`, :func:`end_exit_drain`).
3. **[measure old]** (DRAINING → TRIAL, :func:`trial_after_drain`) when a reload named a new build:
   the serving build's decode tokens/s (:class:`MeasureSpeed`, answered by :class:`SpeedMeasured`),
   measured as ``llama-guard bench`` does, shortened by ``[upgrade].trial_runs`` and ``trial_tokens``.
4. **stop** (→ STOPPING, :func:`~.steps.stop`: SIGTERM, SIGKILL after ``stop_grace_s``), and once it
   is gone (:func:`~.stop.finish_stop`)
5. **start** (:func:`start_again`: ``server_restart``, then :func:`~.steps.start`, a VRAM check first
   on a watched GPU; the build port picks the executable, same or new build, and the spawn takes the
   configuration's current flags) — or, for a window lent to tune, LENT (:func:`~.lend.grant`, called
   by :func:`~.stop.finish_stop`).
6. **restore slots**: once the new server answers ``/health`` and runs on the GPU, its server watch
   has the slot port restore and verify the saved slots (``SlotPort.restore``, within
   ``[slots].restore_timeout_s``) before it answers HealthOk (:func:`health_answered`).
7. **[measure new → keep | roll back]** (STARTING → TRIAL, :func:`health_answered`;
   :func:`trial_step`, :func:`on_trial`): the new build measured the same way, then :func:`judge`:
   kept when it decoded within ``[upgrade].max_slowdown_pct`` of the old figure (or answered, when
   there is no old figure to compare with); otherwise rolled back at once (TRIAL → STOPPING, a restart
   whose start the build port gives the last good build). A failed measurement, an exit or a fatal
   line of the new build ends its trial too.
8. **release** (→ READY, :func:`release`): the server is called ready, the front door lets the held
   clients through; an operator's restart asked while it loaded follows now (:func:`restart_deferred`).

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
    StopRequest,
    TrialAsked,
)
from llama_guard.model.phase_state import Stopping
from llama_guard.model.policy.lines import alloc_recovered, fault_line
from llama_guard.model.policy.steps import (
    Result,
    count_failure,
    exit_asked,
    exit_fields,
    fail,
    restart_for,
    start,
    stop,
)
from llama_guard.model.types import (
    AfterStop,
    Exit,
    RestartCause,
    State,
    Trial,
    TrialResult,
    TrialStage,
    enter,
    exit_signal,
    exit_text,
)
from llama_guard.vocab.events import EventName
from llama_guard.vocab.exitcodes import EXIT_OK
from llama_guard.vocab.phases import Phase

# ------------------------------------------------------------------ 0. asked


#: The event that reports a graceful restart of each planned cause.
RESTART_EVENT: dict[RestartCause, EventName] = {
    RestartCause.OPERATOR: "restart_requested",
    RestartCause.SCHEDULE: "scheduled_restart",
    RestartCause.DECAY: "decay_restart",
    RestartCause.CONFIG_CHANGE: "restart_requested",
}


def restart_event(cause: RestartCause) -> EventName:
    """The event name for a graceful restart asked for with ``cause`` (``restart_requested`` for any
    cause that is not a plan)."""
    return RESTART_EVENT.get(cause, "restart_requested")


def restart_while_loading(state: State, event: RestartRequest, now: float) -> Result:
    """A restart asked for while the server loads (STARTING): an operator's is carried out once the
    server is ready (:func:`restart_deferred`), a plan's is refused (the server being started is a
    fresh one), changed server flags stop it at once (it has the old argv)."""
    if event.cause is RestartCause.OPERATOR:
        # Restarting a load does not make it faster: an operator's request (the load may hang, a slot
        # restore too) is carried out once the server is ready (restart_deferred).
        return replace(state, deferred_restart=(event.cause, event.reason)), [Emit("restart_requested", {
            "server_pid": state.pid, "reason": event.reason,
            "deferred": "the server is still loading; it restarts once ready"})]
    if event.cause is not RestartCause.CONFIG_CHANGE:  # a plan: the server being started is a fresh one
        return state, [Emit("restart_requested", {"server_pid": state.pid, "reason": event.reason,
                                                  "refused": "the server is still loading: a fresh one"})]
    # Changed server flags: the process being started has the old argv (even before its pid is
    # known: the stop then waits for the spawn to answer).
    new, actions = stop(restart_for(state, event.cause), now, AfterStop.RESTART, event.reason)
    return new, [Emit(restart_event(event.cause), {"server_pid": state.pid, "reason": event.reason,
                                                   "cause": event.cause.value}), *actions]


def restart_meanwhile(state: State, event: RestartRequest) -> Result:
    """A restart asked for while the server is neither serving, loading nor backing off (draining,
    stopping, resetting the GPU, waiting for VRAM): a stop that ends the daemon refuses it; otherwise
    the restart or start under way is the one asked for. Either way it is said (``restart_requested``)."""
    fields: dict[str, object] = {"server_pid": state.pid, "reason": event.reason}
    if state.phase in (Phase.DRAINING, Phase.STOPPING, Phase.RESETTING) and state.after_stop is AfterStop.EXIT:
        fields["refused"] = f"llama-guard is stopping ({exit_asked(state).reason or 'asked to'}): no server follows"
    else:
        fields["under_way"] = f"a new server is already on its way ({state.phase.value})"
    return state, [Emit("restart_requested", fields)]

# ------------------------------------------------------------------ 1-2. drain, save slots

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
    new, actions = begin_drain(state, now, AfterStop.RESTART, event.reason)
    return new, [emit, *actions]


def begin_drain(state: State, now: float, after: AfterStop, reason: str) -> Result:
    """READY → DRAINING, the one place a planned drain begins (a restart, the GPU lent to tune): its
    deadline ``[schedule].drain_timeout_s`` (the policy alone keeps it), then ``after``; the server's
    drain watch is started (:class:`StartDrain`). ``reason``: why, in words (DRAINING's own state)."""
    assert state.pid is not None
    new = replace(state, phase=enter(state, Phase.DRAINING), phase_data=Stopping(reason),
                  deadline=now + state.params.drain_timeout_s, after_stop=after)
    return new, [StartDrain(state.pid)]


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



def slot_save_reason(state: State) -> str:
    """What the slot saves after a drain are for (``slot_saved``'s ``reason``), from the loop's latest
    state: the daemon's exit, else a planned restart (a window lent to tune is one too)."""
    return "llama-guard stopping" if state.after_stop is AfterStop.EXIT else "planned restart"


def drain_before_exit(state: State, event: StopRequest, now: float) -> Result:
    """SIGTERM/SIGINT while the server serves behind the front door: let the requests in flight finish
    (DRAINING, at most ``stop_drain_s``; a planned drain under way goes on, its deadline cut to that), then stop the
    server and exit 0. New requests are refused at once meanwhile (the front door's gate closes on
    the pending exit); a second signal kills the server at once."""
    assert state.pid is not None
    p = state.params
    deadline = now + p.exit_drain_s
    drain: list[Action] = [StartDrain(state.pid)]
    if state.phase is Phase.DRAINING:
        deadline = min(deadline, state.deadline if state.deadline is not None else deadline)
        drain = []  # its drain watch is running already
    new = replace(state, phase=enter(state, Phase.DRAINING), phase_data=Stopping(event.reason), deadline=deadline,
                  after_stop=AfterStop.EXIT, exit=Exit(EXIT_OK, event.reason))
    emit = Emit("daemon_stopping", {"reason": f"{event.reason}; the requests in flight may finish first (up to "
                                              f"{deadline - now:.0f} s, [front].stop_drain_s)",
                                    "server_pid": state.pid})
    return new, [emit, *drain]


def end_exit_drain(state: State, now: float, drained: bool) -> Result:
    """The drain before the exit ended: every request in flight finished (``drained``), else
    ``stop_drain_s`` ran out (``stop_drain_timeout``). Either way the server is stopped, then the exit."""
    assert state.pid is not None
    new, actions = stop(state, now, AfterStop.EXIT, state.stop_reason, exit=exit_asked(state))
    if drained:
        return new, actions
    return new, [Emit("stop_drain_timeout", {"server_pid": state.pid, "stop_drain_s": state.params.exit_drain_s}),
                 *actions]

# ------------------------------------------------------------------ 3. measure the old build

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


# ------------------------------------------------------------------ 4-5. stop, start


def start_again(state: State, now: float) -> Result:
    """The server stopped for a planned restart is gone (:func:`~.stop.finish_stop`, ``AfterStop.RESTART``;
    a window lent to tune is granted there instead, :func:`~.lend.grant`): the next server's start
    (``server_restart``)."""
    new, actions = start(replace(state, restarts=state.restarts + 1), now)
    return new, [Emit("server_restart", {"server_pid": state.pid, "reason": state.stop_reason,
                                         "restart_cause": state.failure.cause.value}), *actions]

# ------------------------------------------------------------------ 6-8. restore slots, measure the new build, release

def health_answered(state: State, event: HealthOk, now: float) -> Result:
    """A loading server answered ``/health`` (its slots restored): a new build on trial is measured
    first (TRIAL), any other server is released (and an operator's restart asked while it loaded
    follows)."""
    if state.trial is not None and state.trial.stage is TrialStage.NEW:
        return replace(state, phase=enter(state, Phase.TRIAL), phase_data=None, deadline=None, ready_owner=(
            event.port_pid, event.port_comm), trial=replace(state.trial, answered_at=now)), _measure(state)
    return restart_deferred(*release(state, event, now), now)


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



def restart_deferred(state: State, actions: list[Action], now: float) -> Result:
    """A server just released (READY) for which an operator's restart was asked while it loaded:
    that restart now (its drain)."""
    if state.phase is not Phase.READY or state.deferred_restart is None:
        return state, actions
    cause, reason = state.deferred_restart
    new, restart = drain(replace(state, deferred_restart=None), RestartRequest(reason, cause=cause), now)
    return new, [*actions, *restart]


def trial_step(state: State, event: Input, now: float) -> Result:
    """TRIAL (:func:`on_trial`), with a restart asked while it loaded carried out once it is kept."""
    return restart_deferred(*on_trial(state, event, now), now)

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
