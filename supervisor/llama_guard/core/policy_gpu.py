"""The policy's GPU rules: faults (a lost GPU, Xids judged by scope and owner), the reset decision
(facts in, skip / refuse / run / escalate out; only a reset that ran spends ``max_resets``) and the VRAM
admission before each start (wait while another process holds what this server needs). Pure, like the
rest of the policy (:mod:`llama_guard.core.policy`, which dispatches to the handlers here).
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.core.policy_steps import _SERVING, Result, _count_failure, _exit, _spawn, _stop
from llama_guard.core.policy_stop import reset_started
from llama_guard.core.types import (
    AfterStop,
    CheckVram,
    Emit,
    GpuFault,
    GpuFaultKind,
    Input,
    InspectGpu,
    Phase,
    ResetDone,
    ResetFacts,
    ResetOutcome,
    ResetTrigger,
    RunReset,
    State,
    Tick,
    VramFacts,
    XidAction,
    XidScope,
)
from llama_guard.exitcodes import EXIT_GPU_UNRECOVERABLE, EXIT_OK


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
                  after_stop=AfterStop.FAILURE if state.after_stop is AfterStop.RESET else state.after_stop,
                  reset_command_at=None)
    return new, [reset_started(state, now), InspectGpu(state.pid, state.reset_reason)]


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
    new = replace(state, resets=(*state.resets, now), reset_command_at=now)
    return new, [RunReset(_gpu_index(new), state.reset_reason)]


def _on_resetting(state: State, event: Input, now: float) -> Result:
    if isinstance(event, ResetFacts):
        return _on_reset_facts(state, event, now)
    if isinstance(event, ResetDone):
        state = replace(state, reset_command_at=None)
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
    return _count_failure(new, now, judged=False)


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


# A VRAM check that does not answer within this is skipped (the start goes on). The daemon bounds
# each check below it (VRAM_CHECK_TIMEOUT_S): the first check of a start also reads the model's GGUF
# for the need estimate, seconds of CPU on a large tokenizer.
VRAM_ANSWER_S = 30.0


VRAM_CHECK_TIMEOUT_S = 25.0
