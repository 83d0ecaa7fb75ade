"""The supervision policy: a pure ``decide(state, event, now) -> (state, actions)``.

No I/O and no clock reads happen here: the daemon feeds observations (:class:`Input`
subclasses) and a monotonic ``now`` in seconds, and carries out the returned actions
(:class:`Action` subclasses). Every restart, stop, backoff and give-up rule lives in this
module, so it can be tested by setting a state and calling :func:`decide`.

Phases follow design.md: STOPPED → STARTING → READY ⇄ DRAINING → STOPPING → BACKOFF → STARTING …,
ending in EXITED. "Started" is not "ready": READY only after ``/health`` answered 200.

Size (~500 lines): the phase handlers of one state machine read best side by side; the GPU rules
(faults, the reset decision, VRAM admission) are in :mod:`llama_guard.core.policy_gpu` and the steps
every phase takes (stop, spawn, exit, count a failure) in :mod:`llama_guard.core.policy_steps`.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from llama_guard.core.judgement import (
    answered,
    completion_failed,
    failure_signature,
    incompatibility,
    progress_signals,
    silent_too_long,
)
from llama_guard.core.policy_gpu import (
    _begin_reset,
    _on_gpu_fault,
    _on_resetting,
    _on_waiting_vram,
    _start,
    _stop_for_fault,
)
from llama_guard.core.policy_steps import _SERVING, Result, _count_failure, _exit, _exit_fields, _stop
from llama_guard.core.server_log import ERROR_FAMILIES, Family, LineClass
from llama_guard.core.types import (
    Action,
    AfterStop,
    Boot,
    Drained,
    Emit,
    Exited,
    GpuFault,
    HealthOk,
    Input,
    Kill,
    Line,
    LoadProgress,
    NotifyReady,
    NotOnGpu,
    ParamsChanged,
    Phase,
    PlannedRestart,
    PlannedStop,
    Probe,
    ResetTrigger,
    RestartCause,
    RestartRequest,
    Spawned,
    SpawnFailed,
    StartDrain,
    State,
    StopRequest,
    Terminate,
    Tick,
    exit_text,
)
from llama_guard.exitcodes import EXIT_CONFIG, EXIT_OK

#: The event that reports a graceful restart of each cause.
RESTART_EVENT: dict[RestartCause, str] = {
    RestartCause.OPERATOR: "restart_requested",
    RestartCause.SCHEDULE: "scheduled_restart",
    RestartCause.DECAY: "decay_restart",
    RestartCause.CONFIG_CHANGE: "restart_requested",
}



def decide(state: State, event: Input, now: float) -> Result:
    """The next state and the actions to carry out, for ``event`` observed at monotonic ``now``."""
    if state.phase is Phase.EXITED:
        return state, []
    if isinstance(event, Line) and event.pid == state.pid and event.verdict.family in ERROR_FAMILIES:
        state = replace(state, last_error=event.text.strip())
    if isinstance(event, StopRequest):
        return _on_stop_request(state, event, now)
    if isinstance(event, ParamsChanged):
        return _on_params(state, event, now)
    if isinstance(event, GpuFault):
        return _on_gpu_fault(state, event, now)
    handler = _HANDLERS.get(state.phase)
    if handler is None:
        return state, []
    return handler(state, event, now)


# ---------------------------------------------------------------- helpers


def _fault_event(state: State, verdict: LineClass, text: str) -> tuple[str, dict[str, object]] | None:
    """The event for a fatal GPU line, or None when the line is not fatal."""
    assert state.pid is not None
    if verdict.family is Family.OOM:
        return "server_oom", {"server_pid": state.pid, "line": text.strip(), "cause": verdict.cause}
    if verdict.family is Family.GPU_FATAL:
        return "server_cuda_error", {"server_pid": state.pid, "line": text.strip(), "cause": verdict.cause}
    return None


# ---------------------------------------------------------------- per phase

def _on_stopped(state: State, event: Input, now: float) -> Result:
    if isinstance(event, Boot):
        return _start(state, now)
    return state, []


def _on_starting(state: State, event: Input, now: float) -> Result:
    p = state.params
    if isinstance(event, Spawned):
        new = replace(state, pid=event.pid, started_at=now, deadline=now + p.load_timeout_s,
                      last_progress_at=now)
        return new, [Emit("server_starting", {"server_pid": event.pid, "argv": " ".join(event.argv)})]
    if isinstance(event, SpawnFailed):
        if not event.fatal:
            return _count_failure(replace(state, last_failure=event.reason), now)
        new, actions = _exit(state, EXIT_CONFIG, event.reason)
        return new, [Emit("server_boot_failure", {"cause": event.reason}), *actions]
    if isinstance(event, RestartRequest):
        if event.cause is not RestartCause.CONFIG_CHANGE:
            # Restarting a load does not make it faster: a plain request waits for READY.
            return state, [Emit("restart_requested", {"server_pid": state.pid, "reason": event.reason,
                                                      "ignored": "the server is still loading"})]
        # Changed server flags: the process being started has the old argv (even before its pid is
        # known: the stop then waits for the spawn to answer).
        new, actions = _stop(state, now, AfterStop.RESTART, event.reason)
        planned: list[Action] = [PlannedRestart(state.pid, event.cause, event.reason, 0.0)]
        if state.pid is not None:
            planned.append(PlannedStop(state.pid, drained=False))
        return new, [Emit(RESTART_EVENT[event.cause], {"server_pid": state.pid, "reason": event.reason,
                                                       "cause": event.cause.value}), *planned, *actions]
    if state.pid is None:
        return state, []
    if isinstance(event, NotOnGpu) and event.pid == state.pid:
        new = replace(state, last_failure=f"GPU unavailable: {event.reason}")
        new, actions = _stop(new, now, AfterStop.FAILURE, "not on the GPU")
        return new, [Emit("server_gpu_unavailable", {"server_pid": state.pid, "line": event.reason,
                                                     "cause": event.reason}), *actions]
    if isinstance(event, HealthOk) and event.pid == state.pid:
        load_s = now - (state.started_at if state.started_at is not None else now)
        recovered = _alloc_recovered(state, "the server became ready")
        new = replace(state, phase=Phase.READY, ready_at=now, deadline=None, strikes=0, stable=False,
                      alloc_failure="", boot_signature="")
        fields: dict[str, object] = {"server_pid": state.pid, "load_s": load_s}
        if event.port_pid is not None and event.port_pid != state.pid:
            # A wrapper script: the port belongs to a process it forked.
            fields["port_pid"] = event.port_pid
            fields["port_owner"] = (f"descendant pid {event.port_pid}"
                                    f"{f' ({event.port_comm})' if event.port_comm else ''} of pid {state.pid}")
        return new, [*recovered, Emit("server_ready", fields), NotifyReady()]
    if isinstance(event, LoadProgress) and event.pid == state.pid:
        return replace(state, last_progress_at=now), []
    if isinstance(event, Line) and event.pid == state.pid:
        return _on_starting_line(replace(state, last_progress_at=now), event, now)
    if isinstance(event, Exited) and event.pid == state.pid:
        return _exited_while_loading(state, event, now)
    if isinstance(event, Tick) and (stalled := _load_stalled(state, now)) is not None:
        return stalled
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        new = replace(state, last_failure="load timeout", boot_signature="")
        new, actions = _stop(new, now, AfterStop.FAILURE, "load timeout")
        return new, [Emit("server_load_timeout", {"server_pid": state.pid, "load_timeout_s": p.load_timeout_s}),
                     *actions]
    return state, []


def _load_stalled(state: State, now: float) -> Result | None:
    """Stop a load that showed no progress signal for ``load_stall_s``; None while it progresses."""
    p = state.params
    if p.load_stall_s <= 0 or state.last_progress_at is None or now - state.last_progress_at < p.load_stall_s:
        return None
    quiet = now - state.last_progress_at
    reason = f"load stalled: no output line, CPU time or HTTP answer for {quiet:.0f} s"
    new = replace(state, last_failure=reason, boot_signature="")
    new, actions = _stop(new, now, AfterStop.FAILURE, "load stalled")
    loading = now - (state.started_at if state.started_at is not None else now)
    return new, [Emit("server_load_stalled", {"server_pid": state.pid, "stalled_s": round(quiet, 1),
                                              "load_stall_s": p.load_stall_s, "loading_s": round(loading, 1),
                                              "phase": "loading"}), *actions]


def _alloc_recovered(state: State, how: str) -> list[Action]:
    """The warning for an allocation failure the server came through (nothing when none is pending)."""
    if not state.alloc_failure:
        return []
    return [Emit("server_alloc_recovered", {"server_pid": state.pid, "line": state.alloc_failure,
                                            "recovery": how, "phase": state.phase.value})]


def _alloc_fatal(state: State, event: Exited, now: float, phase: str) -> Result:
    """The server exited after an allocation failure it did not recover from: a fatal OOM."""
    assert state.pid is not None
    fields = _exit_fields(state.pid, event.returncode, state.last_error)
    reason = f"server_oom: {state.alloc_failure}"
    oom = Emit("server_oom", {"server_pid": state.pid, "line": state.alloc_failure,
                              "cause": state.alloc_failure, "phase": phase, **{
                                  k: v for k, v in fields.items() if k != "server_pid"}})
    new = replace(state, last_failure=reason, alloc_failure="", boot_signature="", reset_reason=reason)
    p = state.params
    # As for an OOM line that stops the server: at load on a watched GPU, first see whether another
    # process holds the VRAM; else a reset when reset_on has "oom"; else a failure.
    if phase == "loading" and p.vram_admission:
        new, actions = _finish_stop(replace(new, after_stop=AfterStop.VRAM_CHECK), now)
    elif p.reset_possible and ResetTrigger.OOM in p.reset_on:
        new, actions = _finish_stop(replace(new, after_stop=AfterStop.RESET), now)
    else:
        new, actions = _count_failure(new, now)
    return new, [oom, Emit("server_exited", {**fields, "phase": phase}), *actions]


def _exited_while_loading(state: State, event: Exited, now: float) -> Result:
    """An exit before the first ready: a configuration failure, a fatal OOM, or a failure that, when
    the previous start ended the same way, is deterministic (a boot failure, exit 78)."""
    assert state.pid is not None
    if state.alloc_failure:
        return _alloc_fatal(state, event, now, "loading")
    fields = _exit_fields(event.pid, event.returncode, state.last_error)
    if state.boot_cause:
        new, actions = _exit(state, EXIT_CONFIG, state.boot_cause)
        return new, [Emit("server_boot_failure", {"cause": state.boot_cause, **fields}), *actions]
    exited = Emit("server_exited", {**fields, "phase": "loading"})
    # A SIGKILL comes from outside (the kernel's OOM killer, an operator): not the binary's own doing.
    signature = "" if event.returncode == -signal.SIGKILL else failure_signature(
        exit_text(event.returncode), state.last_error)
    if signature and signature == state.boot_signature:
        named = state.last_error or exit_text(event.returncode)
        cause = (f"llama-server fails the same way before it is ready on consecutive starts "
                 f"({exit_text(event.returncode)}): {named}")
        new, actions = _exit(replace(state, boot_signature=""), EXIT_CONFIG, cause)
        return new, [exited, Emit("server_boot_failure", {"cause": cause, "line": state.last_error,
                                                          "consecutive_starts": 2, **fields}), *actions]
    failure = f"exited while loading: {fields['exit_text']}"
    new = replace(state, last_failure=failure, boot_signature=signature)
    new, actions = _count_failure(new, now)
    return new, [exited, *actions]


def _incompatible(state: State, now: float, verdict: LineClass, text: str) -> Result:
    """Stop for good: the binary, the driver or the card cannot run this server (exit 78)."""
    reason = f"{verdict.cause}; fix: {verdict.limit}"
    emit = Emit("server_gpu_incompatible", {"server_pid": state.pid, "line": text.strip(),
                                            "cause": verdict.cause, "fix": verdict.limit})
    if state.phase is Phase.STOPPING:
        new = replace(state, after_stop=AfterStop.EXIT, exit_code=EXIT_CONFIG, exit_reason=reason,
                      pending_event=None, last_failure=reason)
        return new, [emit]
    new, actions = _stop(replace(state, last_failure=reason), now, AfterStop.EXIT, reason,
                         code=EXIT_CONFIG, reason=reason)
    return new, [emit, *actions]


def _fault_line(state: State, event: Line, now: float, phase: str) -> Result | None:
    """Stop for a fatal GPU line (OOM, GPU error, abort, a fault no restart can fix); None when the
    line is not fatal."""
    verdict = event.verdict
    if verdict.family is Family.GPU_INCOMPATIBLE:
        return _incompatible(state, now, verdict, event.text)
    trigger = ResetTrigger.OOM if verdict.family is Family.OOM else ResetTrigger.CUDA_ERROR
    fault = _fault_event(state, verdict, event.text)
    if fault is not None:
        name, fields = fault
        new = replace(state, last_failure=f"{name}: {verdict.cause}")
        new, actions = _stop_for_fault(new, now, trigger, f"{name}: {verdict.cause}")
        if phase:
            fields = {**fields, "phase": phase}
        return new, [Emit(name, fields), *actions]
    if verdict.family is Family.GPU_ABORT:
        new = replace(state, last_failure=verdict.cause, pending_event=("server_cuda_error", verdict.cause))
        return _stop_for_fault(new, now, trigger, verdict.cause)
    return None


def _limit_line(state: State, event: Line) -> Result:
    """Report a resource-limit line once per limit and server."""
    verdict = event.verdict
    if verdict.limit in state.reported_limits:
        return state, []
    new = replace(state, reported_limits=state.reported_limits | {verdict.limit})
    return new, [Emit("resource_exhausted", {"server_pid": state.pid, "limit": verdict.limit,
                                             "reason": verdict.cause, "line": event.text.strip(),
                                             "config_problem": True})]


def _on_starting_line(state: State, event: Line, now: float) -> Result:
    verdict = event.verdict
    fatal = _fault_line(state, event, now, "loading")
    if fatal is not None:
        return fatal
    if verdict.family is Family.ALLOC_FAILED:
        return replace(state, alloc_failure=state.alloc_failure or event.text.strip()), []
    if verdict.family is Family.ALLOC_RECOVERED:
        return replace(state, alloc_failure=""), _alloc_recovered(state, event.text.strip())
    incompatible = incompatibility(verdict)
    if incompatible is not None and state.params.require_gpu:
        return _incompatible(state, now, incompatible, event.text)
    if verdict.family is Family.GPU_UNAVAILABLE and state.params.require_gpu:
        new = replace(state, last_failure=f"GPU unavailable: {verdict.cause}")
        new, actions = _stop(new, now, AfterStop.FAILURE, "GPU unavailable")
        return new, [Emit("server_gpu_unavailable", {"server_pid": state.pid, "line": event.text.strip(),
                                                     "cause": verdict.cause}), *actions]
    if verdict.family is Family.BOOT_CONFIG and not state.boot_cause:
        return replace(state, boot_cause=verdict.cause), []
    if verdict.family is Family.RESOURCE_LIMIT:
        new, report = _limit_line(state, event)
        if verdict.limit != "RLIMIT_MEMLOCK" and not new.boot_cause:
            return replace(new, boot_cause=f"{verdict.cause} ({verdict.limit})"), report
        return new, report
    return state, []


def _on_serving(state: State, event: Input, now: float) -> Result:
    p = state.params
    pid = state.pid
    assert pid is not None
    if isinstance(event, Line) and event.pid == pid:
        fatal = _fault_line(state, event, now, "")
        if fatal is not None:
            return fatal
        if event.verdict.family is Family.RESOURCE_LIMIT:
            return _limit_line(state, event)
        if event.verdict.family is Family.ALLOC_FAILED:
            # A runtime pool OOM may be answered as one request's HTTP 500: judged by what follows.
            return replace(state, alloc_failure=state.alloc_failure or event.text.strip()), []
        if event.verdict.family is Family.ALLOC_RECOVERED:
            return replace(state, alloc_failure=""), _alloc_recovered(state, event.text.strip())
        return state, []
    if isinstance(event, Exited) and event.pid == pid and state.alloc_failure:
        return _alloc_fatal(state, event, now, state.phase.value)
    if isinstance(event, Exited) and event.pid == pid:
        fields = _exit_fields(pid, event.returncode, state.last_error)
        new = replace(state, last_failure=f"exited: {fields['exit_text']}")
        new, actions = _count_failure(new, now)
        return new, [Emit("server_exited", {**fields, "phase": state.phase.value}), *actions]
    if isinstance(event, Probe) and event.pid == pid:
        return _on_probe(state, event, now)
    if isinstance(event, Tick):
        if (state.phase is Phase.READY and not state.stable and state.ready_at is not None
                and now - state.ready_at >= p.stable_after_s):
            return replace(state, stable=True, next_backoff_s=p.backoff_initial_s), []
        if state.phase is Phase.DRAINING and state.deadline is not None and now >= state.deadline:
            new, actions = _stop(state, now, AfterStop.RESTART, state.fault)
            return new, [Emit("drain_timeout", {"server_pid": pid, "drain_timeout_s": p.drain_timeout_s,
                                                "reason": state.fault}), PlannedStop(pid, drained=False), *actions]
        return state, []
    if isinstance(event, RestartRequest):
        if state.phase is Phase.DRAINING:
            return state, []
        uptime = now - (state.ready_at or now)
        emit = Emit(RESTART_EVENT[event.cause], {"server_pid": pid, "reason": event.reason,
                                                 "cause": event.cause.value, "uptime_s": uptime})
        planned = PlannedRestart(pid, event.cause, event.reason, uptime)
        if not event.drain:
            new, actions = _stop(state, now, AfterStop.RESTART, event.reason)
            return new, [emit, planned, PlannedStop(pid, drained=False), *actions]
        new = replace(state, phase=Phase.DRAINING, deadline=now + p.drain_timeout_s, fault=event.reason)
        return new, [emit, planned, StartDrain(pid)]
    if isinstance(event, Drained) and event.pid == pid and state.phase is Phase.DRAINING:
        new, actions = _stop(state, now, AfterStop.RESTART, state.fault)
        return new, [PlannedStop(pid, drained=True), *actions]
    return state, []


def _on_probe(state: State, event: Probe, now: float) -> Result:
    # Liveness rests on progress, not on the HTTP loop answering: a server whose CPU time, output
    # or counters move is working even when its probes time out (a busy loop); only a round with
    # neither an answer nor progress is a strike (a SIGSTOPped or wedged server).
    moving = progress_signals(event, state.params)
    recovered: list[Action] = []
    if state.alloc_failure and event.health_ok:
        recovered = _alloc_recovered(state, "the server still serves (the failing request got an error)")
        state = replace(state, alloc_failure="")
    failed, silent = completion_failed(event), silent_too_long(event, state.params)
    if not (failed or silent) and (answered(event) or moving):
        return (replace(state, strikes=0) if state.strikes else state), recovered
    strikes = state.strikes + 1
    if strikes < state.params.hang_strikes and not silent:
        return replace(state, strikes=strikes), recovered
    assert state.pid is not None
    if failed:  # it answers, and says its completions fail: not a hang
        reason = f"completion_error: HTTP {event.canary_status}: {event.canary_error}"
        new, actions = _stop(replace(state, strikes=strikes, last_failure=reason), now, AfterStop.FAILURE, reason)
        return new, [*recovered, Emit("server_completion_error", {
            "server_pid": state.pid, "failures": strikes, "status_code": event.canary_status,
            "error": event.canary_error, "phase": state.phase.value}), *actions]
    reason = event.detail or ("/health failed" if not event.health_ok else "canary completion failed")
    if silent:
        reason += (f"; no HTTP answer at all for {event.silent_s:.0f} s (silent_limit_s "
                   f"{state.params.silent_limit_s:.0f} s), whatever its CPU time says ({', '.join(moving) or 'no'} "
                   "progress signal)")
    else:
        reason += "; no progress (CPU time, output lines, token counters, GPU use) since the last probe"
    new = replace(state, strikes=strikes, last_failure=f"hang: {reason}")
    new, actions = _stop(new, now, AfterStop.FAILURE, "hang")
    return new, [*recovered, Emit("server_hang", {"server_pid": state.pid, "failures": strikes, "reason": reason,
                                                  "phase": state.phase.value}), *actions]


def _on_stopping(state: State, event: Input, now: float) -> Result:
    p = state.params
    if state.pid is None:
        # A stop was requested before the spawn answered.
        if isinstance(event, Spawned):
            return replace(state, pid=event.pid, deadline=now + p.stop_grace_s), [Terminate(event.pid)]
        if isinstance(event, SpawnFailed):
            return _finish_stop(state, now)
        return state, []
    if (isinstance(event, Line) and event.pid == state.pid and event.verdict.family is Family.GPU_INCOMPATIBLE
            and state.after_stop is not AfterStop.EXIT):
        return _incompatible(state, now, event.verdict, event.text)
    if isinstance(event, Line) and event.pid == state.pid and state.pending_event is not None:
        fault = _fault_event(state, event.verdict, event.text)
        if fault is not None:
            name, fields = fault
            reason = f"{name}: {event.verdict.cause}"
            new = replace(state, pending_event=None, last_failure=reason)
            # The abort line can come before the message (seen on an H200): the message decides
            # whether this fault calls for a reset.
            trigger = ResetTrigger.OOM if event.verdict.family is Family.OOM else ResetTrigger.CUDA_ERROR
            p = state.params
            if (new.after_stop is AfterStop.FAILURE and trigger is ResetTrigger.OOM and p.vram_admission
                    and state.ready_at is None):  # an OOM while loading: perhaps another process's VRAM
                new = replace(new, after_stop=AfterStop.VRAM_CHECK, reset_reason=reason)
            elif new.after_stop is AfterStop.FAILURE and p.reset_possible and trigger in p.reset_on:
                new = replace(new, after_stop=AfterStop.RESET, reset_reason=reason)
            return new, [Emit(name, fields)]
        return state, []
    if isinstance(event, Exited) and event.pid == state.pid:
        actions: list[Action] = []
        fields = _exit_fields(state.pid, event.returncode, state.last_error)
        if state.killed and event.returncode == -signal.SIGKILL:
            fields["exit_text"] = "killed by SIGKILL (sent by llama-guard)"
        if state.pending_event is not None:
            name, cause = state.pending_event
            actions.append(Emit(name, {"server_pid": state.pid, "line": cause, "cause": cause, **fields}))
        actions.append(Emit("server_stopped", {**fields, "reason": state.fault}))
        new, more = _finish_stop(replace(state, pending_event=None), now)
        return new, actions + more
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        if not state.killed:
            new = replace(state, killed=True, deadline=now + p.kill_wait_s)
            return new, [Emit("server_stop_timeout", {"server_pid": state.pid, "grace_s": p.stop_grace_s}),
                         Kill(state.pid)]
        # SIGKILL did not end it either (uninterruptible sleep in the driver): stop waiting.
        return _finish_stop(replace(state, last_failure="server did not exit after SIGKILL"), now)
    return state, []


def _finish_stop(state: State, now: float) -> Result:
    if state.after_stop is AfterStop.EXIT:
        return _exit(state, state.exit_code, state.exit_reason or "stopped")
    if state.after_stop is AfterStop.RESET:
        return _begin_reset(state, now)
    if state.after_stop is AfterStop.VRAM_CHECK:
        return _start(replace(state, pid=None, vram_after_oom=True), now)
    if state.after_stop is AfterStop.RESTART:
        new, actions = _start(replace(state, restarts=state.restarts + 1), now)
        return new, [Emit("server_restart", {"server_pid": state.pid, "reason": state.fault}), *actions]
    return _count_failure(state, now)


def _on_backoff(state: State, event: Input, now: float) -> Result:
    due = isinstance(event, Tick) and state.deadline is not None and now >= state.deadline
    if due or isinstance(event, RestartRequest):
        reason = event.reason if isinstance(event, RestartRequest) else f"after {state.last_failure}"
        new, actions = _start(replace(state, restarts=state.restarts + 1), now)
        return new, [Emit("server_restart", {"reason": reason, "restart_count": len(state.failures)}),
                     *actions]
    return state, []


def _on_stop_request(state: State, event: StopRequest, now: float) -> Result:
    emit = Emit("daemon_stopping", {"reason": event.reason, "server_pid": state.pid})
    if state.phase is Phase.RESETTING:
        # A reset is never abandoned half done: exit when it reports (bounded by its deadline).
        return replace(state, after_stop=AfterStop.EXIT, exit_code=EXIT_OK, exit_reason=event.reason), [emit]
    if state.phase in (Phase.STOPPED, Phase.BACKOFF, Phase.WAITING_VRAM):
        new, actions = _exit(state, EXIT_OK, event.reason)
        return new, [emit, *actions]
    if state.phase is Phase.STOPPING:
        new = replace(state, after_stop=AfterStop.EXIT, exit_code=EXIT_OK, exit_reason=event.reason)
        if event.immediate and state.pid is not None and not state.killed:
            return replace(new, killed=True, deadline=now + state.params.kill_wait_s), [emit, Kill(state.pid)]
        return new, []
    new, actions = _stop(state, now, AfterStop.EXIT, event.reason, code=EXIT_OK, reason=event.reason)
    if event.immediate and state.pid is not None:
        new = replace(new, killed=True, deadline=now + state.params.kill_wait_s)
        actions = [Kill(state.pid)]
    return new, [emit, *actions]


def _on_params(state: State, event: ParamsChanged, now: float) -> Result:
    state = replace(state, params=event.params)
    if event.server_changed and state.phase in (*_SERVING, Phase.STARTING):
        return decide(state, RestartRequest("configuration changed", cause=RestartCause.CONFIG_CHANGE), now)
    return state, []


# ---------------------------------------------------------------- GPU faults and the reset


# ---------------------------------------------------------------- VRAM admission


_HANDLERS = {
    Phase.WAITING_VRAM: _on_waiting_vram,
    Phase.RESETTING: _on_resetting,
    Phase.STOPPED: _on_stopped,
    Phase.STARTING: _on_starting,
    Phase.READY: _on_serving,
    Phase.DRAINING: _on_serving,
    Phase.STOPPING: _on_stopping,
    Phase.BACKOFF: _on_backoff,
}
