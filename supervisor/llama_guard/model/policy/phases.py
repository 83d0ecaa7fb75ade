"""The handlers of the server's life outside stops and GPU work: STOPPED, STARTING (readiness, load
timeout and stall, exits while loading), READY/DRAINING (probes, planned restarts, exits), BACKOFF. Pure.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from llama_guard.model.actions import Action, Emit
from llama_guard.model.inputs import (
    Boot,
    Drained,
    Exited,
    HealthOk,
    Input,
    Line,
    LoadProgress,
    NotOnGpu,
    Probe,
    RestartRequest,
    Spawned,
    SpawnFailed,
    Tick,
)
from llama_guard.model.judgement import (
    answered,
    completion_failed,
    failure_signature,
    naming_model,
    progress_signals,
    silent_too_long,
)
from llama_guard.model.phase_state import Starting
from llama_guard.model.policy.lines import alloc_recovered, fault_line, limit_line, on_starting_line
from llama_guard.model.policy.port import exited_port_taken
from llama_guard.model.policy.steps import (
    HUNG_GRACE_S,
    Result,
    count_failure,
    exit_asked,
    exit_daemon,
    exit_fields,
    fail,
    start,
    stop,
)
from llama_guard.model.policy.stop import alloc_fatal
from llama_guard.model.policy.traffic import on_traffic
from llama_guard.model.policy.verdicts import crash_repeat
from llama_guard.model.policy.window import (
    drain,
    drain_timed_out,
    drained,
    health_answered,
    restart_meanwhile,
    restart_while_loading,
)
from llama_guard.model.server_log import Family, classify_line
from llama_guard.model.types import AfterStop, RestartCause, State, exit_signal, exit_text
from llama_guard.vocab.exitcodes import EXIT_CONFIG
from llama_guard.vocab.phases import Phase


def on_stopped(state: State, event: Input, now: float) -> Result:
    if isinstance(event, Boot):
        return start(state, now)
    return state, []


def on_starting(state: State, event: Input, now: float) -> Result:
    p = state.params
    if isinstance(event, Spawned):
        new = replace(state, pid=event.pid, started_at=now, deadline=now + p.load_timeout_s,
                      last_progress_at=now)
        return new, [Emit("server_starting", {"server_pid": event.pid, "argv": " ".join(event.argv)})]
    if isinstance(event, SpawnFailed):
        if not event.fatal:
            return count_failure(fail(state, RestartCause.SPAWN_FAILED, event.reason), now,
                                 judged=False)
        new, actions = exit_daemon(state, EXIT_CONFIG, event.reason)
        return new, [Emit("server_boot_failure", {"cause": event.reason}), *actions]
    if isinstance(event, RestartRequest):
        return restart_while_loading(state, event, now)
    if state.pid is None:
        return state, []
    if isinstance(event, NotOnGpu) and event.pid == state.pid:
        new = fail(state, RestartCause.GPU_UNAVAILABLE, f"GPU unavailable: {event.reason}")
        new, actions = stop(new, now, AfterStop.FAILURE, "not on the GPU")
        return new, [Emit("server_gpu_unavailable", {"server_pid": state.pid, "line": event.reason,
                                                     "cause": event.reason}), *actions]
    if isinstance(event, HealthOk) and event.pid == state.pid:
        return health_answered(state, event, now)
    if isinstance(event, LoadProgress) and event.pid == state.pid:
        return replace(state, last_progress_at=now), []
    if isinstance(event, Line) and event.pid == state.pid:
        return on_starting_line(replace(state, last_progress_at=now), event, now)
    if isinstance(event, Exited) and event.pid == state.pid:
        return _exited_while_loading(state, event, now)
    if isinstance(event, Tick) and (stalled := _load_stalled(state, now)) is not None:
        return stalled
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        new = fail(state, RestartCause.LOAD_TIMEOUT, "load timeout")
        new, actions = stop(new, now, AfterStop.FAILURE, "load timeout")
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
    new = fail(state, RestartCause.LOAD_STALLED, reason)
    new, actions = stop(new, now, AfterStop.FAILURE, "load stalled")
    loading = now - (state.started_at if state.started_at is not None else now)
    return new, [Emit("server_load_stalled", {"server_pid": state.pid, "stalled_s": round(quiet, 1),
                                              "load_stall_s": p.load_stall_s, "loading_s": round(loading, 1),
                                              "phase": "loading"}), *actions]


def _exited_while_loading(state: State, event: Exited, now: float) -> Result:
    """An exit before the first ready: a taken port (retried within a bound), a configuration
    failure, a fatal OOM, or a failure counted — a verdict when the previous starts ended the same
    way (:mod:`.repeat`)."""
    assert state.pid is not None
    if state.alloc_failure:
        return alloc_fatal(state, event, now, "loading")
    if state.port_taken and state.port_taken_since is not None:
        return exited_port_taken(state, event, now)
    fields = exit_fields(event.pid, event.returncode, state.last_error)
    boot_cause = state.phase_data.boot_cause if isinstance(state.phase_data, Starting) else ""
    if boot_cause:
        cause = naming_model(boot_cause, state.params.model_path)
        new, actions = exit_daemon(state, EXIT_CONFIG, cause)
        model = {"model": state.params.model_path} if cause != boot_cause else {}
        return new, [Emit("server_boot_failure", {"cause": cause, **model, **fields}), *actions]
    exited = Emit("server_exited", {**fields, "phase": "loading"})
    new = replace(fail(state, RestartCause.CRASH, f"exited while loading: {exit_text(event.returncode)}"),
                  exit_signal=exit_signal(event.returncode))
    new, actions = count_failure(new, now)
    return new, [exited, *actions]


def on_serving(state: State, event: Input, now: float) -> Result:
    p = state.params
    pid = state.pid
    assert pid is not None
    if isinstance(event, Line) and event.pid == pid:
        fatal = fault_line(state, event, now, "")
        if fatal is not None:
            return fatal
        if event.verdict.family is Family.RESOURCE_LIMIT:
            return limit_line(state, event)
        if event.verdict.family is Family.ALLOC_FAILED:
            # A runtime pool OOM may be answered as one request's HTTP 500: judged by what follows.
            return replace(state, alloc_failure=state.alloc_failure or event.text.strip()), []
        if event.verdict.family is Family.ALLOC_RECOVERED:
            return replace(state, alloc_failure=""), alloc_recovered(state, event.text.strip())
        return state, []
    if (isinstance(event, Exited) and event.pid == pid and state.phase is Phase.DRAINING
            and state.after_stop is AfterStop.EXIT):
        # It died while it drained before the daemon's exit: nothing to restart.
        asked = exit_asked(state)
        new, actions = exit_daemon(state, asked.code, asked.reason)
        fields = exit_fields(pid, event.returncode, state.last_error)
        return new, [Emit("server_exited", {**fields, "phase": state.phase.value}), *actions]
    if isinstance(event, Exited) and event.pid == pid and state.alloc_failure:
        return alloc_fatal(state, event, now, state.phase.value)
    if isinstance(event, Exited) and event.pid == pid:
        fields = exit_fields(pid, event.returncode, state.last_error)
        new = replace(fail(state, RestartCause.CRASH, f"exited: {fields['exit_text']}"),
                      exit_signal=exit_signal(event.returncode))
        # A crash is restarted; the same crash again within the window is said, with the request
        # kind its exception names (a SIGKILL comes from outside: not the server's own crash).
        signature = "" if event.returncode == -signal.SIGKILL or not state.last_error else failure_signature(
            exit_text(event.returncode), state.last_error)
        new, repeated = crash_repeat(new, now, signature, classify_line(state.last_error).request_kind)
        new, actions = count_failure(new, now)
        return new, [Emit("server_exited", {**fields, "phase": state.phase.value}), *repeated, *actions]
    if isinstance(event, Probe) and event.pid == pid:
        return _on_probe(state, event, now)
    traffic = on_traffic(state, event, now)
    if traffic is not None:
        return traffic
    if isinstance(event, Tick):
        if (state.phase is Phase.READY and not state.stable and state.ready_at is not None
                and now - state.ready_at >= p.stable_after_s):
            return replace(state, stable=True, next_backoff_s=p.backoff_initial_s), []
        if state.phase is Phase.DRAINING and state.deadline is not None and now >= state.deadline:
            return drain_timed_out(state, now)
        return state, []
    if isinstance(event, RestartRequest):
        if state.phase is Phase.DRAINING:
            return restart_meanwhile(state, event)
        return drain(state, event, now)
    if isinstance(event, Drained) and event.pid == pid and state.phase is Phase.DRAINING:
        return drained(state, now)
    return state, []


def _on_probe(state: State, event: Probe, now: float) -> Result:
    # Liveness rests on progress, not on the HTTP loop answering: a server whose CPU time, output
    # or counters move is working even when its probes time out (a busy loop); only a round with
    # neither an answer nor progress is a strike (a SIGSTOPped or wedged server).
    moving = progress_signals(event, state.params)
    if event.progressed and state.stalls:
        state = replace(state, stalls=0)  # the token counters moved: a stalled stream was not a wedged decode
    recovered: list[Action] = []
    if state.alloc_failure and event.health_ok:
        recovered = alloc_recovered(state, "the server still serves (the failing request got an error)")
        state = replace(state, alloc_failure="")
    failed, silent = completion_failed(event), silent_too_long(event, state.params)
    # A confirming round (the front door holds requests after a run of 5xx answers): a failing canary
    # confirms the clients' errors at once; any other round releases the hold (no further run, no hold).
    confirmed = failed and event.confirm and state.confirming
    client_errors = state.http_errors
    if event.confirm and state.confirming and not failed:
        state = replace(state, http_errors=0)
    if not (failed or silent) and (answered(event) or moving):
        return (replace(state, strikes=0) if state.strikes else state), recovered
    strikes = state.strikes + 1
    if strikes < state.params.hang_strikes and not silent and not confirmed:
        return replace(state, strikes=strikes), recovered
    assert state.pid is not None
    if failed:  # it answers, and says its completions fail: not a hang
        # Judged broken: its graceful stop cannot help the clients (a wedged server may ignore SIGTERM).
        reason = f"completion_error: HTTP {event.canary_status}: {event.canary_error}"
        new = replace(fail(state, RestartCause.COMPLETION_ERROR, reason), strikes=strikes)
        new, actions = stop(new, now, AfterStop.FAILURE, reason, grace_s=HUNG_GRACE_S)
        return new, [*recovered, Emit("server_completion_error", {
            "server_pid": state.pid, "failures": strikes, "status_code": event.canary_status,
            "error": event.canary_error, "phase": state.phase.value,
            "client_errors": client_errors if confirmed else 0}), *actions]
    reason = event.detail or ("/health failed" if not event.health_ok else "canary completion failed")
    if silent:
        reason += (f"; no HTTP answer at all for {event.silent_s:.0f} s (silent_limit_s "
                   f"{state.params.silent_limit_s:.0f} s), whatever its CPU time says ({', '.join(moving) or 'no'} "
                   "progress signal)")
    else:
        reason += "; no progress (CPU time, output lines, token counters, GPU use) since the last probe"
    new = replace(fail(state, RestartCause.HANG, f"hang: {reason}"), strikes=strikes)
    new, actions = stop(new, now, AfterStop.FAILURE, "hang", grace_s=HUNG_GRACE_S)
    return new, [*recovered, Emit("server_hang", {"server_pid": state.pid, "failures": strikes, "reason": reason,
                                                  "phase": state.phase.value}), *actions]


def on_backoff(state: State, event: Input, now: float) -> Result:
    due = isinstance(event, Tick) and state.deadline is not None and now >= state.deadline
    if due or isinstance(event, RestartRequest):
        reason = event.reason if isinstance(event, RestartRequest) else f"after {state.failure.text}"
        new, actions = start(replace(state, restarts=state.restarts + 1), now)
        return new, [Emit("server_restart", {"reason": reason, "restart_count": len(state.failures),
                                             "restart_cause": state.failure.cause.value}),
                     *actions]
    return state, []
