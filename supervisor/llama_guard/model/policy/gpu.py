"""The policy's GPU rules: faults (a lost GPU, Xids judged by scope and owner) and the reset decision
(facts in, skip / refuse / run / escalate out; only a reset that ran spends ``max_resets``). Pure.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Emit, InspectGpu, RunReset
from llama_guard.model.inputs import GpuFault, Input, ResetDone, ResetFacts, Tick
from llama_guard.model.phase_state import Resetting, Stopping
from llama_guard.model.policy.reset_stop import reset_started
from llama_guard.model.policy.steps import (
    SERVING,
    Result,
    count_failure,
    end_save,
    exit_asked,
    exit_daemon,
    fail,
    stop,
)
from llama_guard.model.policy.verdicts import RECOVERY_ADVICE, needs_reboot, recovery_step, watchdog_hit
from llama_guard.model.types import (
    AfterStop,
    Exit,
    GpuFaultKind,
    ResetOutcome,
    RestartCause,
    State,
    XidAction,
    XidScope,
    enter,
)
from llama_guard.vocab.exitcodes import EXIT_GPU_UNRECOVERABLE, EXIT_OK
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger


def on_gpu_fault(state: State, event: GpuFault, now: float) -> Result:
    if event.kind is not GpuFaultKind.XID:
        return _act_on_gpu_fault(state, event, now)
    judged, ours = _judge_xid(state, event)
    fields: dict[str, object] = {
        "gpu_index": event.gpu_index, "xid": event.xid, "meaning": event.reason.removeprefix(f"Xid {event.xid}: "),
        "action": judged.action.value,
        "table_action": event.action.value, "scope": event.scope.value, "source": event.origin.value,
        "xid_pid": event.faulting_pid, "xid_name": event.faulting_name, "ours": ours,
        "server_pid": state.pid, "line": event.line}
    if event.action is XidAction.FOLLOW_RECOVERY_ACTION:
        fields["recovery_action"] = "unknown" if event.recovery is None else event.recovery.name.lower()
    new, actions = _act_on_gpu_fault(state, judged, now)
    if (judged.watchdog and judged.action is XidAction.RESTART and state.phase is not Phase.STOPPING
            and new.phase is Phase.STOPPING):
        new, repeated = watchdog_hit(new, now, event.reason)
        actions = [*actions, *repeated]
    return new, [Emit("gpu_xid", fields), *actions]


def _judge_xid(state: State, event: GpuFault) -> tuple[GpuFault, bool | None]:
    """An application Xid acts only when the faulting pid is our server; a device Xid always.

    Returns the fault with the action to take and whether it was ours (None: no pid was named —
    NVML's event without a matching kernel line; the server's own output then tells whether it
    was hit, so such an application Xid is reported only).
    """
    ours = None if event.faulting_pid is None else event.faulting_pid == state.pid
    if event.scope is XidScope.APP and ours is not True:
        return replace(event, action=XidAction.EVENT_ONLY), ours
    if event.action is XidAction.FOLLOW_RECOVERY_ACTION:
        return replace(event, action=recovery_step(event.recovery)), ours
    return event, ours


def _act_on_gpu_fault(state: State, event: GpuFault, now: float) -> Result:
    p = state.params
    lost = event.kind is GpuFaultKind.GPU_LOST or event.action is XidAction.RESET_ONCE_THEN_ESCALATE
    if event.action is XidAction.EVENT_ONLY:
        return state, []
    if event.action is XidAction.REBOOT:
        advice = "" if event.recovery is None else f" (the driver asks: {RECOVERY_ADVICE[event.recovery]})"
        return needs_reboot(state, now, f"{event.reason}{advice}: a GPU reset cannot help",
                            {"gpu_index": event.gpu_index, "server_pid": state.pid, "line": event.line})
    if state.phase is Phase.RESETTING:
        # Never reset while a reset is running; but remember a loss, so that a reset that is then
        # skipped does not restart the server onto a lost GPU.
        if lost and not state.gpu_lost:
            return replace(state, gpu_lost=True), []
        return state, []
    if event.action is XidAction.RESTART:
        if state.phase in SERVING or state.phase is Phase.STARTING:
            new = fail(state, RestartCause.XID, event.reason)
            return stop(new, now, AfterStop.FAILURE, event.reason)
        return state, []
    trigger = ResetTrigger.GPU_LOST if event.kind is GpuFaultKind.GPU_LOST else ResetTrigger.XID
    cause = RestartCause.GPU_LOST if event.kind is GpuFaultKind.GPU_LOST else RestartCause.XID
    state = replace(fail(state, cause, event.reason), gpu_lost=state.gpu_lost or lost)
    can_reset = p.reset_possible and trigger in p.reset_on
    if state.phase is Phase.STOPPING:
        if state.saving and not state.killed and not event.kv_readable:
            return end_save(state, now)  # what the slots hold can no longer be read, or trusted
        if state.after_stop in (AfterStop.FAILURE, AfterStop.RESTART, AfterStop.VRAM_CHECK, AfterStop.LEND):
            after = AfterStop.RESET if can_reset else AfterStop.EXIT
            code = EXIT_OK if can_reset else EXIT_GPU_UNRECOVERABLE
            return replace(state, after_stop=after, phase_data=Stopping(state.stop_reason, event.reason),
                           exit=Exit(code, event.reason)), []
        return state, []
    if state.pid is not None:
        if can_reset:
            return stop(state, now, AfterStop.RESET, event.reason, save_s=reset_save_s(state, event),
                        reset_trigger=event.reason)
        # No reset allowed: stop cleanly and do not restart onto a GPU that is not verified.
        return stop(state, now, AfterStop.EXIT, event.reason,
                    exit=Exit(EXIT_GPU_UNRECOVERABLE, f"GPU fault and no reset configured: {event.reason}"))
    if state.phase in (Phase.BACKOFF, Phase.STOPPED, Phase.WAITING_VRAM):
        if can_reset:
            return begin_reset(state, now, event.reason)
        new, actions = exit_daemon(state, EXIT_GPU_UNRECOVERABLE, f"GPU fault and no reset configured: {event.reason}")
        return new, actions
    return state, []


def reset_save_s(state: State, event: GpuFault) -> float:
    """How long the slots may take to be saved before the stop for a reset (0: no save). Only a
    serving server, after a fault that leaves the GPU answering and its memory as it was (the Xid
    table's ``kv_readable``), is asked (within ``Params.reset_save_s``): a lost GPU or a halted
    firmware cannot be read, an uncorrected memory error may have changed the KV cache, a loading
    server holds nothing yet, and a stop on its way to the daemon's exit is not followed by a start."""
    exiting = state.phase is Phase.DRAINING and state.after_stop is AfterStop.EXIT
    if state.phase not in SERVING or exiting or state.gpu_lost or not event.kv_readable:
        return 0.0
    return state.params.reset_save_s


def gpu_index_of(state: State) -> int | None:
    return state.gpu_index if state.gpu_index is not None else state.params.gpu_index


def begin_reset(state: State, now: float, trigger: str) -> Result:
    """Enter RESETTING (inspect the GPU first) for ``trigger`` (the fault, in words: the reset events'
    ``trigger``), unless the reset budget of the window is spent.

    The budget counts only reset commands that ran (:func:`_on_reset_facts`): a skipped reset
    leaves it untouched.
    """
    p = state.params
    recent = tuple(t for t in state.resets if now - t < p.reset_window_s)
    if len(recent) >= p.max_resets:
        reason = (f"{len(recent)} GPU resets within {p.reset_window_s:.0f} s already; "
                  "not resetting again (a reboot is the operator's call)")
        emit = Emit("gpu_reset", {"outcome": ResetOutcome.REFUSED.value, "reason": reason,
                                  "trigger": trigger, "gpu_index": gpu_index_of(state)})
        return _after_no_reset(replace(state, resets=recent), now, emit, reason, trigger)
    new = replace(state, phase=enter(state, Phase.RESETTING), phase_data=Resetting(trigger), resets=recent,
                  deadline=now + p.reset_deadline_s,
                  after_stop=AfterStop.FAILURE if state.after_stop is AfterStop.RESET else state.after_stop)
    return new, [reset_started(state, now, trigger), InspectGpu(state.pid, trigger)]


def _resetting(state: State) -> Resetting:
    """RESETTING's own state (every way into RESETTING sets it: :func:`begin_reset`)."""
    assert isinstance(state.phase_data, Resetting)
    return state.phase_data


def _after_no_reset(state: State, now: float, emit: Emit, reason: str, trigger: str) -> Result:
    """No reset was run (skipped or refused) for ``trigger``: a lost GPU escalates (exit 69), anything
    else restarts the server only (counted as a failure)."""
    if state.after_stop is AfterStop.EXIT:  # a stop request came meanwhile
        asked = exit_asked(state)
        new, actions = exit_daemon(state, asked.code, asked.reason or "stopped")
        return new, [emit, *actions]
    if state.gpu_lost:
        why = f"the GPU is lost and was not reset ({reason}); reboot the host"
        new, actions = exit_daemon(state, EXIT_GPU_UNRECOVERABLE, why)
        return new, [emit, Emit("gpu_lost", {"reason": why, "gpu_index": gpu_index_of(state)}), *actions]
    why = f"{trigger or reason} (no GPU reset: {reason})"
    new = replace(fail(state, state.failure.cause, why), pid=None)
    new, actions = count_failure(new, now)
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
    trigger = _resetting(state).trigger
    skip = _skip_reason(facts, state.pid)
    if skip is None and state.after_stop is AfterStop.EXIT:
        skip = "a stop was requested before the reset command ran", {}
    if skip is not None:
        reason, extra = skip
        emit = Emit("gpu_reset", {"outcome": ResetOutcome.SKIPPED.value, "reason": reason,
                                  "trigger": trigger, "gpu_index": gpu_index_of(state), **extra})
        return _after_no_reset(state, now, emit, f"reset skipped: {reason}", trigger)
    new = replace(state, resets=(*state.resets, now), phase_data=Resetting(trigger, command_at=now))
    return new, [RunReset(gpu_index_of(new), trigger)]


def on_resetting(state: State, event: Input, now: float) -> Result:
    if isinstance(event, ResetFacts):
        return _on_reset_facts(state, event, now)
    if isinstance(event, ResetDone):
        trigger = _resetting(state).trigger
        state = replace(state, phase_data=Resetting(trigger))
        outcome = ResetOutcome.SUCCEEDED if event.ok else ResetOutcome.FAILED
        fields = {**event.fields, "outcome": outcome.value, "reason": event.detail, "trigger": trigger,
                  "reset_count": len(state.resets), "gpu_index": event.gpu_index, "command": event.command,
                  "exit_status": event.exit_status, "output": event.output}
        emit = Emit("gpu_reset", fields)
        if state.after_stop is AfterStop.EXIT:  # a stop request came during the reset
            asked = exit_asked(state)
            new, actions = exit_daemon(state, asked.code, asked.reason or "stopped")
            return new, [emit, *actions]
        if outcome is ResetOutcome.SUCCEEDED:
            new, actions = count_failure(replace(state, gpu_lost=False, pid=None), now)
            return new, [emit, *actions]
        reason = f"GPU reset failed: {event.detail}; reboot the host"
        new, actions = exit_daemon(state, EXIT_GPU_UNRECOVERABLE, reason)
        lost = Emit("gpu_lost", {"reason": reason, "gpu_index": event.gpu_index})
        return new, [emit, lost, *actions]
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        reason = f"the reset did not finish within {state.params.reset_deadline_s:.0f} s; reboot the host"
        new, actions = exit_daemon(state, EXIT_GPU_UNRECOVERABLE, reason)
        return new, [Emit("gpu_reset", {"outcome": ResetOutcome.TIMED_OUT.value, "reason": reason,
                                        "gpu_index": gpu_index_of(state)}), *actions]
    return state, []
