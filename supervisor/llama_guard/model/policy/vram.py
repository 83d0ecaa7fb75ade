"""VRAM admission before each start: wait while another process holds what this server needs, with
a deadline; an OOM at load that no other process explains goes on as :func:`after_fault` says. The
same check carries NVML's recovery-action field: a GPU that asks for a reset is reset first, one that
asks for a reboot or a drain gets no server (exit 69). Pure.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import CheckVram, Emit
from llama_guard.model.inputs import Input, Tick, VramFacts
from llama_guard.model.phase_state import WaitingVram
from llama_guard.model.policy.gpu import begin_reset
from llama_guard.model.policy.steps import Result, after_fault, count_failure, fail, restart_for, spawn
from llama_guard.model.policy.verdicts import RECOVERY_ADVICE, needs_reboot, recovery_fields, recovery_step
from llama_guard.model.types import AfterStop, RecoveryAction, RestartCause, State, XidAction
from llama_guard.vocab.triggers import ResetTrigger


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
    elif _waiting(state).after_oom:
        free = "?" if facts.free_mib is None else facts.free_mib
        missing = f"llama-server ran out of GPU memory at load ({free} MiB free)"
    else:
        return None
    top = max(facts.holders, key=lambda h: h.used_mib or 0)
    return {"gpu_index": facts.gpu_index, "foreign_pid": top.pid, "foreign_name": top.name,
            "foreign_mib": top.used_mib, "free_mib": facts.free_mib, "need_mib": facts.need_mib,
            "missing": missing, "timeout_s": state.params.vram_wait_timeout_s,
            "holders": ", ".join(f"pid {h.pid} ({h.name}, {h.used_mib} MiB)" for h in facts.holders)}


def _waiting(state: State) -> WaitingVram:
    """WAITING_VRAM's own state (every way into WAITING_VRAM sets it: :func:`~.steps.start`)."""
    assert isinstance(state.phase_data, WaitingVram)
    return state.phase_data


def _admit(state: State, now: float) -> Result:
    """The VRAM is there (or cannot be judged): start, unless an OOM at load is left unexplained."""
    waiting = _waiting(state)
    if waiting.after_oom and waiting.until is None:
        # The OOM was not another process's doing: what it would have been without the check.
        if after_fault(state.params, ResetTrigger.OOM, loading=False) is AfterStop.RESET:
            return begin_reset(replace(state, after_stop=AfterStop.RESET), now, waiting.after_oom)
        return count_failure(state, now)
    return spawn(state)


def _vram_timed_out(state: State, now: float) -> Result:
    """The wait's deadline passed: a failure, named after the latest facts (and their age when
    the checks since then failed or did not answer)."""
    p = state.params
    waiting = _waiting(state)
    reason = f"VRAM still held after {p.vram_wait_timeout_s:.0f} s: {waiting.short}"
    if waiting.facts_at is not None and now - waiting.facts_at > 2 * p.vram_poll_s + 1.0:
        reason += f" (as read {now - waiting.facts_at:.0f} s before; the VRAM checks since then failed)"
    return count_failure(fail(state, RestartCause.VRAM_WAIT, reason), now, judged=False)


def _recovery_before_start(state: State, facts: VramFacts, now: float) -> Result:
    """NVML's recovery-action field, read before this start, asks for something (an Xid that went by
    unseen, a daemon started after the fault): a reset when it asks for one and one may run (and the
    window's reset budget is not spent); else no start: exit 69 with the driver's advice."""
    assert facts.recovery is not None
    emit = Emit("gpu_recovery_action", recovery_fields(facts.recovery, "nvml", facts.gpu_index))
    reason = f"NVML says GPU {facts.gpu_index} needs: {RECOVERY_ADVICE[facts.recovery]}"
    p = state.params
    if recovery_step(facts.recovery) is XidAction.RESET:
        if not (p.reset_possible and ResetTrigger.XID in p.reset_on):
            reason += " (no reset is configured or allowed by [recovery].reset_on)"
        elif len([t for t in state.resets if now - t < p.reset_window_s]) >= p.max_resets:
            reason += f" (the {p.max_resets} GPU resets allowed within {p.reset_window_s:.0f} s are spent)"
        else:
            new, actions = begin_reset(replace(restart_for(state, RestartCause.XID), pid=None,
                                               after_stop=AfterStop.FAILURE), now, reason)
            return new, [emit, *actions]
    new, actions = needs_reboot(replace(state, pid=None), now, reason,
                                {"gpu_index": facts.gpu_index, "server_pid": None})
    return new, [emit, *actions]


def on_waiting_vram(state: State, event: Input, now: float) -> Result:
    p = state.params
    until = _waiting(state).until  # None: not waiting (yet)
    if isinstance(event, VramFacts) and event.recovery not in (None, RecoveryAction.NONE):
        return _recovery_before_start(state, event, now)
    if isinstance(event, VramFacts):
        if event.error and until is not None:  # a failed check (reported) tells nothing: keep waiting
            if now >= until:
                return _vram_timed_out(state, now)
            return replace(state, deadline=now + p.vram_poll_s), []
        short = _vram_shortfall(state, event)
        if short is None:
            return _admit(state, now)
        text = f"{short['holders']}: {short['missing']}"
        if until is None:  # the wait begins: no failure is counted, no reset
            new = replace(state, deadline=now + p.vram_poll_s, phase_data=replace(
                _waiting(state), until=now + p.vram_wait_timeout_s, short=text, facts_at=now))
            return new, [Emit("gpu_vram_wait", short)]
        state = replace(state, phase_data=replace(_waiting(state), short=text, facts_at=now))
        if now >= until:
            return _vram_timed_out(state, now)
        return replace(state, deadline=now + p.vram_poll_s), []
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        if until is None:  # the check never answered: go on without it
            return _admit(state, now)
        if now >= until:
            return _vram_timed_out(state, now)
        return replace(state, deadline=now + p.vram_poll_s), [CheckVram()]
    return state, []
