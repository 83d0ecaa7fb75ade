"""The supervision policy: a pure ``decide(state, event, now) -> (state, actions)``.

No I/O and no clock reads happen here: the daemon feeds observations (:class:`Input`
subclasses) and a monotonic ``now`` in seconds, and carries out the returned actions
(:class:`Action` subclasses). Every restart, stop, backoff and give-up rule lives in this
module, so it can be tested by setting a state and calling :func:`decide`.

Phases follow design.md: STOPPED → STARTING → READY ⇄ DRAINING → STOPPING → BACKOFF → STARTING …,
ending in EXITED. "Started" is not "ready": READY only after ``/health`` answered 200.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from llama_guard.core.judgement import answered, failure_signature, incompatibility, progress_signals
from llama_guard.core.server_log import ERROR_FAMILIES, Family, LineClass
from llama_guard.core.types import (
    Action,
    AfterStop,
    Boot,
    CheckVram,
    Drained,
    Emit,
    ExitDaemon,
    Exited,
    GpuFault,
    GpuFaultKind,
    HealthOk,
    Input,
    InspectGpu,
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
    ResetDone,
    ResetFacts,
    ResetOutcome,
    ResetTrigger,
    RestartCause,
    RestartRequest,
    RunReset,
    Spawn,
    Spawned,
    SpawnFailed,
    StartDrain,
    State,
    StopRequest,
    Terminate,
    Tick,
    VramFacts,
    XidAction,
    XidScope,
    exit_text,
)
from llama_guard.exitcodes import EXIT_CONFIG, EXIT_CRASH_LOOP, EXIT_GPU_UNRECOVERABLE, EXIT_OK


def _exit_fields(pid: int, returncode: int | None, last_error: str = "") -> dict[str, object]:
    """The fields of an exit event; ``last_error`` (the server's last error/abort line) is kept in
    ``last_error`` and appended to ``exit_text``."""
    fields: dict[str, object] = {"server_pid": pid, "exit_text": exit_text(returncode)}
    if returncode is not None and returncode < 0:
        fields["signal"] = -returncode
    elif returncode is not None:
        fields["exit_status"] = returncode
    if last_error:
        fields["last_error"] = last_error
        fields["exit_text"] = f"{fields['exit_text']} after: {last_error}"
    return fields


Result = tuple[State, list[Action]]

#: The event that reports a graceful restart of each cause.
RESTART_EVENT: dict[RestartCause, str] = {
    RestartCause.OPERATOR: "restart_requested",
    RestartCause.SCHEDULE: "scheduled_restart",
    RestartCause.DECAY: "decay_restart",
    RestartCause.CONFIG_CHANGE: "restart_requested",
}

_SERVING = (Phase.READY, Phase.DRAINING)


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

def _stop(state: State, now: float, after: AfterStop, fault: str, *,
          code: int = EXIT_OK, reason: str = "") -> Result:
    """Begin stopping the current server (SIGTERM now, SIGKILL at the grace deadline)."""
    new = replace(state, phase=Phase.STOPPING, after_stop=after, fault=fault,
                  deadline=now + state.params.stop_grace_s, killed=False,
                  exit_code=code, exit_reason=reason or state.exit_reason)
    if state.pid is None:
        return new, []
    return new, [Terminate(state.pid)]


def _spawn(state: State) -> Result:
    return (replace(state, phase=Phase.STARTING, pid=None, started_at=None, ready_at=None, deadline=None,
                    strikes=0, boot_cause="", fault="", pending_event=None, stable=False, killed=False,
                    reported_limits=frozenset(), last_progress_at=None, alloc_failure="", last_error=""),
            [Spawn()])


def _exit(state: State, code: int, reason: str) -> Result:
    return (replace(state, phase=Phase.EXITED, pid=None, deadline=None, exit_code=code, exit_reason=reason),
            [ExitDaemon(code, reason)])


def _count_failure(state: State, now: float) -> Result:
    """After a failed server: back off, or give up when the window holds too many failures."""
    p = state.params
    recent = (*(t for t in state.failures if now - t < p.restart_window_s), now)
    state = replace(state, failures=recent, pid=None)
    if len(recent) > p.max_restarts:
        new, actions = _exit(state, EXIT_CRASH_LOOP, f"crash loop: {state.last_failure}")
        emit = Emit("crash_loop", {"restart_count": len(recent), "window_s": p.restart_window_s,
                                   "max_restarts": p.max_restarts, "last_failure": state.last_failure})
        return new, [emit, *actions]
    if state.stable or (len(recent) == 1 and state.next_backoff_s <= p.backoff_initial_s):
        # A server that had run stably (or the first failure in the window) restarts at once; the
        # backoff starts with the next failure.
        wait = 0.0
        following = p.backoff_initial_s
    else:
        wait = state.next_backoff_s
        following = min(wait * p.backoff_factor, p.backoff_max_s)
    new = replace(state, phase=Phase.BACKOFF, deadline=now + wait, next_backoff_s=following)
    return new, [Emit("server_backoff", {"backoff_s": wait, "restart_count": len(recent),
                                         "max_restarts": p.max_restarts, "window_s": p.restart_window_s,
                                         "last_failure": state.last_failure})]


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
    if answered(event) or moving:
        return (replace(state, strikes=0) if state.strikes else state), recovered
    strikes = state.strikes + 1
    if strikes < state.params.hang_strikes:
        return replace(state, strikes=strikes), recovered
    reason = event.detail or ("/health failed" if not event.health_ok else "canary completion failed")
    reason += "; no progress (CPU time, output lines, token counters) since the last probe"
    new = replace(state, strikes=strikes, last_failure=f"hang: {reason}")
    new, actions = _stop(new, now, AfterStop.FAILURE, "hang")
    assert state.pid is not None
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

def _stop_for_fault(state: State, now: float, trigger: ResetTrigger, reason: str) -> Result:
    """Stop after a GPU fault: with a reset afterwards when ``trigger`` is in ``reset_on``; an OOM
    while loading on a watched GPU first checks whether another process holds the VRAM."""
    p = state.params
    if trigger is ResetTrigger.OOM and state.phase is Phase.STARTING and p.vram_admission:
        return _stop(replace(state, reset_reason=reason), now, AfterStop.VRAM_CHECK, reason)
    if p.reset_possible and trigger in p.reset_on:
        return _stop(replace(state, reset_reason=reason), now, AfterStop.RESET, reason)
    return _stop(state, now, AfterStop.FAILURE, reason)


def _on_gpu_fault(state: State, event: GpuFault, now: float) -> Result:
    if event.kind is not GpuFaultKind.XID:
        return _act_on_gpu_fault(state, event, now)
    judged, ours = _judge_xid(state, event)
    emit = Emit("gpu_xid", {
        "gpu_index": event.gpu_index, "xid": event.xid, "meaning": event.reason.removeprefix(f"Xid {event.xid}: "),
        "action": judged.action.value,
        "table_action": event.action.value, "scope": event.scope.value, "source": event.origin.value,
        "xid_pid": event.faulting_pid, "xid_name": event.faulting_name, "ours": ours,
        "server_pid": state.pid, "line": event.line})
    new, actions = _act_on_gpu_fault(state, judged, now)
    return new, [emit, *actions]


def _judge_xid(state: State, event: GpuFault) -> tuple[GpuFault, bool | None]:
    """An application Xid acts only when the faulting pid is our server; a device Xid always.

    Returns the fault with the action to take and whether it was ours (None: no pid was named —
    NVML's event without a matching kernel line; the server's own output then tells whether it
    was hit, so such an application Xid is reported only).
    """
    ours = None if event.faulting_pid is None else event.faulting_pid == state.pid
    if event.scope is XidScope.APP and ours is not True:
        return replace(event, action=XidAction.EVENT_ONLY), ours
    return event, ours


def _act_on_gpu_fault(state: State, event: GpuFault, now: float) -> Result:
    p = state.params
    lost = event.kind is GpuFaultKind.GPU_LOST or event.action is XidAction.RESET_ONCE_THEN_ESCALATE
    if event.action is XidAction.EVENT_ONLY:
        return state, []
    if state.phase is Phase.RESETTING:
        # Never reset while a reset is running; but remember a loss, so that a reset that is then
        # skipped does not restart the server onto a lost GPU.
        if lost and not state.gpu_lost:
            return replace(state, gpu_lost=True), []
        return state, []
    if event.action is XidAction.RESTART:
        if state.phase in _SERVING or state.phase is Phase.STARTING:
            new = replace(state, last_failure=event.reason)
            return _stop(new, now, AfterStop.FAILURE, event.reason)
        return state, []
    trigger = ResetTrigger.GPU_LOST if event.kind is GpuFaultKind.GPU_LOST else ResetTrigger.XID
    state = replace(state, gpu_lost=state.gpu_lost or lost, last_failure=event.reason)
    can_reset = p.reset_possible and trigger in p.reset_on
    if state.phase is Phase.STOPPING:
        if state.after_stop in (AfterStop.FAILURE, AfterStop.RESTART, AfterStop.VRAM_CHECK):
            after = AfterStop.RESET if can_reset else AfterStop.EXIT
            code = EXIT_OK if can_reset else EXIT_GPU_UNRECOVERABLE
            return replace(state, after_stop=after, reset_reason=event.reason, exit_code=code,
                           exit_reason=event.reason), []
        return state, []
    if state.pid is not None:
        if can_reset:
            return _stop(replace(state, reset_reason=event.reason), now, AfterStop.RESET, event.reason)
        # No reset allowed: stop cleanly and do not restart onto a GPU that is not verified.
        return _stop(state, now, AfterStop.EXIT, event.reason, code=EXIT_GPU_UNRECOVERABLE,
                     reason=f"GPU fault and no reset configured: {event.reason}")
    if state.phase in (Phase.BACKOFF, Phase.STOPPED, Phase.WAITING_VRAM):
        if can_reset:
            return _begin_reset(replace(state, reset_reason=event.reason), now)
        new, actions = _exit(state, EXIT_GPU_UNRECOVERABLE, f"GPU fault and no reset configured: {event.reason}")
        return new, actions
    return state, []


def _gpu_index(state: State) -> int | None:
    return state.gpu_index if state.gpu_index is not None else state.params.gpu_index


def _begin_reset(state: State, now: float) -> Result:
    """Enter RESETTING (inspect the GPU first), unless the reset budget of the window is spent.

    The budget counts only reset commands that ran (:func:`_on_reset_facts`): a skipped reset
    leaves it untouched.
    """
    p = state.params
    recent = tuple(t for t in state.resets if now - t < p.reset_window_s)
    if len(recent) >= p.max_resets:
        reason = (f"{len(recent)} GPU resets within {p.reset_window_s:.0f} s already; "
                  "not resetting again (a reboot is the operator's call)")
        emit = Emit("gpu_reset", {"outcome": ResetOutcome.REFUSED.value, "reason": reason,
                                  "trigger": state.reset_reason, "gpu_index": _gpu_index(state)})
        return _after_no_reset(replace(state, resets=recent), now, emit, reason)
    new = replace(state, phase=Phase.RESETTING, resets=recent, deadline=now + p.reset_deadline_s,
                  after_stop=AfterStop.FAILURE if state.after_stop is AfterStop.RESET else state.after_stop)
    return new, [InspectGpu(state.pid, state.reset_reason)]


def _after_no_reset(state: State, now: float, emit: Emit, reason: str) -> Result:
    """No reset was run (skipped or refused): a lost GPU escalates (exit 69), anything else
    restarts the server only (counted as a failure)."""
    if state.after_stop is AfterStop.EXIT:  # a stop request came meanwhile
        new, actions = _exit(state, state.exit_code, state.exit_reason or "stopped")
        return new, [emit, *actions]
    if state.gpu_lost:
        why = f"the GPU is lost and was not reset ({reason}); reboot the host"
        new, actions = _exit(state, EXIT_GPU_UNRECOVERABLE, why)
        return new, [emit, Emit("gpu_lost", {"reason": why, "gpu_index": _gpu_index(state)}), *actions]
    new = replace(state, pid=None, last_failure=f"{state.reset_reason or reason} (no GPU reset: {reason})")
    new, actions = _count_failure(new, now)
    return new, [emit, *actions]


def _skip_reason(facts: ResetFacts, previous_pid: int | None) -> tuple[str, dict[str, object]] | None:
    """Why the reset cannot be run now, with event fields; None when nothing stands in its way."""
    index = "?" if facts.gpu_index is None else facts.gpu_index
    if not facts.previous_released:
        return (f"llama-server pid {previous_pid} still holds GPU {index} after {facts.waited_s:.0f} s",
                {"server_pid": previous_pid})
    if not facts.can_run:
        return facts.cannot_run or "the reset command cannot run here", {}
    if facts.holders:
        first = facts.holders[0]
        mib = "" if first.used_mib is None else f", {first.used_mib} MiB"
        return (f"pid {first.pid} ({first.name}{mib}) holds GPU {index}; restarting the server without a reset",
                {"foreign_pid": first.pid, "foreign_name": first.name, "foreign_mib": first.used_mib})
    return None


def _on_reset_facts(state: State, facts: ResetFacts, now: float) -> Result:
    """Skip, or run the reset command (only a command that runs spends the budget)."""
    state = replace(state, gpu_index=facts.gpu_index if facts.gpu_index is not None else state.gpu_index)
    skip = _skip_reason(facts, state.pid)
    if skip is None and state.after_stop is AfterStop.EXIT:
        skip = "a stop was requested before the reset command ran", {}
    if skip is not None:
        reason, extra = skip
        emit = Emit("gpu_reset", {"outcome": ResetOutcome.SKIPPED.value, "reason": reason,
                                  "trigger": state.reset_reason, "gpu_index": _gpu_index(state), **extra})
        return _after_no_reset(state, now, emit, f"reset skipped: {reason}")
    new = replace(state, resets=(*state.resets, now))
    return new, [RunReset(_gpu_index(new), state.reset_reason)]


def _on_resetting(state: State, event: Input, now: float) -> Result:
    if isinstance(event, ResetFacts):
        return _on_reset_facts(state, event, now)
    if isinstance(event, ResetDone):
        outcome = ResetOutcome.SUCCEEDED if event.ok else ResetOutcome.FAILED
        fields = {**event.fields, "outcome": outcome.value, "reason": event.detail, "trigger": state.reset_reason,
                  "reset_count": len(state.resets), "gpu_index": event.gpu_index, "command": event.command,
                  "exit_status": event.exit_status, "output": event.output}
        emit = Emit("gpu_reset", fields)
        if state.after_stop is AfterStop.EXIT:  # a stop request came during the reset
            new, actions = _exit(state, state.exit_code, state.exit_reason or "stopped")
            return new, [emit, *actions]
        if outcome is ResetOutcome.SUCCEEDED:
            new, actions = _count_failure(replace(state, gpu_lost=False, pid=None), now)
            return new, [emit, *actions]
        reason = f"GPU reset failed: {event.detail}; reboot the host"
        new, actions = _exit(state, EXIT_GPU_UNRECOVERABLE, reason)
        lost = Emit("gpu_lost", {"reason": reason, "gpu_index": event.gpu_index})
        return new, [emit, lost, *actions]
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        reason = f"the reset did not finish within {state.params.reset_deadline_s:.0f} s; reboot the host"
        new, actions = _exit(state, EXIT_GPU_UNRECOVERABLE, reason)
        return new, [Emit("gpu_reset", {"outcome": ResetOutcome.TIMED_OUT.value, "reason": reason,
                                        "gpu_index": _gpu_index(state)}), *actions]
    return state, []


# ---------------------------------------------------------------- VRAM admission

# A VRAM check that does not answer within this is skipped (the start goes on). The daemon bounds
# each check below it (VRAM_CHECK_TIMEOUT_S): the first check of a start also reads the model's GGUF
# for the need estimate, seconds of CPU on a large tokenizer.
VRAM_ANSWER_S = 30.0
VRAM_CHECK_TIMEOUT_S = 25.0


def _start(state: State, now: float) -> Result:
    """Start a server: on a watched GPU, check its free VRAM first (:class:`CheckVram`)."""
    if not state.params.vram_admission:
        return _spawn(replace(state, vram_after_oom=False))
    new = replace(state, phase=Phase.WAITING_VRAM, pid=None, deadline=now + VRAM_ANSWER_S,
                  vram_wait_until=None, vram_short="", vram_facts_at=None)
    return new, [CheckVram()]


def _vram_shortfall(state: State, facts: VramFacts) -> dict[str, object] | None:
    """The ``gpu_vram_wait`` fields when another process holds VRAM this server needs, else None.

    Short: free < need (measured at the last good start, or ``[gpu].expected_vram_mib``); with the
    need unknown, the server having run out of memory at load is the evidence.
    """
    if not facts.holders:
        return None
    if facts.need_mib is not None and facts.free_mib is not None:
        if facts.free_mib >= facts.need_mib:
            return None
        missing = f"{facts.need_mib - facts.free_mib} MiB missing (llama-server needs {facts.need_mib} MiB, " \
                  f"{facts.free_mib} MiB free)"
    elif state.vram_after_oom:
        free = "?" if facts.free_mib is None else facts.free_mib
        missing = f"llama-server ran out of GPU memory at load ({free} MiB free)"
    else:
        return None
    top = max(facts.holders, key=lambda h: h.used_mib or 0)
    return {"gpu_index": facts.gpu_index, "foreign_pid": top.pid, "foreign_name": top.name,
            "foreign_mib": top.used_mib, "free_mib": facts.free_mib, "need_mib": facts.need_mib,
            "missing": missing, "timeout_s": state.params.vram_wait_timeout_s,
            "holders": ", ".join(f"pid {h.pid} ({h.name}, {h.used_mib} MiB)" for h in facts.holders)}


def _admit(state: State, now: float) -> Result:
    """The VRAM is there (or cannot be judged): start, unless an OOM at load is left unexplained."""
    if state.vram_after_oom and state.vram_wait_until is None:
        # The OOM was not another process's doing: what it would have been without the check.
        p = state.params
        state = replace(state, vram_after_oom=False)
        if p.reset_possible and ResetTrigger.OOM in p.reset_on:
            return _begin_reset(replace(state, after_stop=AfterStop.RESET), now)
        return _count_failure(state, now)
    return _spawn(replace(state, vram_after_oom=False, vram_wait_until=None, vram_short="", vram_facts_at=None))


def _vram_timed_out(state: State, now: float) -> Result:
    """The wait's deadline passed: a failure, named after the latest facts (and their age when
    the checks since then failed or did not answer)."""
    p = state.params
    reason = f"VRAM still held after {p.vram_wait_timeout_s:.0f} s: {state.vram_short}"
    if state.vram_facts_at is not None and now - state.vram_facts_at > 2 * p.vram_poll_s + 1.0:
        reason += f" (as read {now - state.vram_facts_at:.0f} s before; the VRAM checks since then failed)"
    new = replace(state, vram_wait_until=None, vram_after_oom=False, vram_short="", vram_facts_at=None,
                  last_failure=reason)
    return _count_failure(new, now)


def _on_waiting_vram(state: State, event: Input, now: float) -> Result:
    p = state.params
    waiting = state.vram_wait_until is not None
    if isinstance(event, VramFacts):
        if event.error and waiting:  # a failed check (reported) tells nothing: keep waiting
            if state.vram_wait_until is not None and now >= state.vram_wait_until:
                return _vram_timed_out(state, now)
            return replace(state, deadline=now + p.vram_poll_s), []
        short = _vram_shortfall(state, event)
        if short is None:
            return _admit(state, now)
        text = f"{short['holders']}: {short['missing']}"
        if not waiting:  # the wait begins: no failure is counted, no reset
            new = replace(state, vram_wait_until=now + p.vram_wait_timeout_s, deadline=now + p.vram_poll_s,
                          vram_short=text, vram_facts_at=now)
            return new, [Emit("gpu_vram_wait", short)]
        state = replace(state, vram_short=text, vram_facts_at=now)
        if state.vram_wait_until is not None and now >= state.vram_wait_until:
            return _vram_timed_out(state, now)
        return replace(state, deadline=now + p.vram_poll_s), []
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        if state.vram_wait_until is None:  # the check never answered: go on without it
            return _admit(state, now)
        if now >= state.vram_wait_until:
            return _vram_timed_out(state, now)
        return replace(state, deadline=now + p.vram_poll_s), [CheckVram()]
    return state, []


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
