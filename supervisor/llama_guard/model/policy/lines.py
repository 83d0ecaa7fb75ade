"""The policy's answer to a classified server line (:class:`~llama_guard.model.inputs.Line`): fatal GPU
lines (OOM, CUDA error, abort, incompatible), allocation failures and recoveries, resource limits and
the boot-configuration lines of a loading server. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Action, Emit
from llama_guard.model.inputs import Line
from llama_guard.model.judgement import incompatibility
from llama_guard.model.phase_state import Starting
from llama_guard.model.policy.port import on_port_line
from llama_guard.model.policy.steps import Result, after_fault, fail, stop
from llama_guard.model.policy.verdicts import watchdog_hit
from llama_guard.model.server_log import Family, LineClass
from llama_guard.model.types import AfterStop, Exit, RestartCause, State
from llama_guard.vocab.events import EventName
from llama_guard.vocab.exitcodes import EXIT_CONFIG
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger


def fault_event(state: State, verdict: LineClass, text: str) -> tuple[EventName, dict[str, object]] | None:
    """The event for a fatal GPU line, or None when the line is not fatal."""
    assert state.pid is not None
    if verdict.family is Family.OOM:
        return "server_oom", {"server_pid": state.pid, "line": text.strip(), "cause": verdict.cause}
    if verdict.family is Family.GPU_FATAL:
        return "server_cuda_error", {"server_pid": state.pid, "line": text.strip(), "cause": verdict.cause}
    if verdict.family is Family.GPU_WATCHDOG:
        return "server_cuda_error", {"server_pid": state.pid, "line": text.strip(), "cause": verdict.cause,
                                     "reset": "no: the watchdog ended one channel's work, the GPU is fine"}
    if verdict.family is Family.DEVICE_LOST:
        return "gpu_lost", {"server_pid": state.pid, "line": text.strip(), "reason": verdict.cause,
                            "cause": verdict.cause}
    return None


#: A fatal GPU line's family: the restart cause its failure is recorded with, and its
#: ``[recovery].reset_on`` trigger (None: never a reset — the launch watchdog ended one channel's
#: work, the GPU is fine). The one mapping, wherever the line is seen (loading, serving, stopping).
FATAL_FAMILIES: dict[Family, tuple[RestartCause, ResetTrigger | None]] = {
    Family.OOM: (RestartCause.OOM, ResetTrigger.OOM),
    Family.GPU_FATAL: (RestartCause.CUDA_ERROR, ResetTrigger.CUDA_ERROR),
    Family.GPU_WATCHDOG: (RestartCause.CUDA_ERROR, None),
    Family.DEVICE_LOST: (RestartCause.GPU_LOST, ResetTrigger.GPU_LOST),
    Family.GPU_ABORT: (RestartCause.CUDA_ERROR, ResetTrigger.CUDA_ERROR),
}


def stop_for_fault(state: State, now: float, trigger: ResetTrigger, reason: str) -> Result:
    """Stop after a GPU fault; what follows the stop is :func:`~.steps.after_fault`'s call."""
    after = after_fault(state.params, trigger, loading=state.phase is Phase.STARTING)
    if after is AfterStop.FAILURE:
        return stop(state, now, AfterStop.FAILURE, reason)
    return stop(state, now, after, reason, reset_trigger=reason)


def incompatible(state: State, now: float, verdict: LineClass, text: str) -> Result:
    """Stop for good: the binary, the driver or the card cannot run this server (exit 78)."""
    reason = f"{verdict.cause}; fix: {verdict.limit}"
    emit = Emit("server_gpu_incompatible", {"server_pid": state.pid, "line": text.strip(),
                                            "cause": verdict.cause, "fix": verdict.limit})
    if state.phase is Phase.STOPPING:
        new = replace(fail(state, state.failure.cause, reason, state.failure.line), after_stop=AfterStop.EXIT,
                      exit=Exit(EXIT_CONFIG, reason), pending_event=None)
        return new, [emit]
    new, actions = stop(fail(state, state.failure.cause, reason), now, AfterStop.EXIT, reason,
                        exit=Exit(EXIT_CONFIG, reason))
    return new, [emit, *actions]


def fault_line(state: State, event: Line, now: float, phase: str) -> Result | None:
    """Stop for a fatal GPU line (OOM, GPU error, abort, a fault no restart can fix); None when the
    line is not fatal."""
    verdict = event.verdict
    if verdict.family is Family.GPU_INCOMPATIBLE:
        return incompatible(state, now, verdict, event.text)
    fault = fault_event(state, verdict, event.text)
    if fault is not None:
        name, fields = fault
        cause, trigger = FATAL_FAMILIES[verdict.family]
        new = fail(state, cause, f"{name}: {verdict.cause}", event.text.strip())
        repeated: list[Emit] = []
        if trigger is None:  # restart only, never a reset; said when it repeats
            new, actions = stop(new, now, AfterStop.FAILURE, f"{name}: {verdict.cause}")
            new, repeated = watchdog_hit(new, now, verdict.cause)
        else:
            new, actions = stop_for_fault(new, now, trigger, f"{name}: {verdict.cause}")
        if phase:
            fields = {**fields, "phase": phase}
        return new, [Emit(name, fields), *repeated, *actions]
    if verdict.family is Family.GPU_ABORT:
        cause, trigger = FATAL_FAMILIES[Family.GPU_ABORT]
        assert trigger is not None  # an abort line may call for a reset (FATAL_FAMILIES)
        new = replace(fail(state, cause, verdict.cause, event.text.strip()),
                      pending_event=("server_cuda_error", verdict.cause))
        return stop_for_fault(new, now, trigger, verdict.cause)
    return None


def limit_line(state: State, event: Line) -> Result:
    """Report a resource-limit line once per limit and server."""
    verdict = event.verdict
    if verdict.limit in state.reported_limits:
        return state, []
    new = replace(state, reported_limits=state.reported_limits | {verdict.limit})
    return new, [Emit("resource_exhausted", {"server_pid": state.pid, "limit": verdict.limit,
                                             "reason": verdict.cause, "line": event.text.strip(),
                                             "config_problem": True})]


def alloc_recovered(state: State, how: str) -> list[Action]:
    """The warning for an allocation failure the server came through (nothing when none is pending)."""
    if not state.alloc_failure:
        return []
    return [Emit("server_alloc_recovered", {"server_pid": state.pid, "line": state.alloc_failure,
                                            "recovery": how, "phase": state.phase.value})]


def on_cpu(state: State, event: Line) -> Result:
    """The server was asked to offload layers but says it found no usable GPU: it runs on the CPU.
    Not required to run on a GPU (the GPU watch is off, or require_server_on_gpu is false): it
    keeps running, reported once per server (``server_on_cpu``) whatever the GPU watch says."""
    if state.params.offload_layers <= 0 or state.on_cpu_reported:
        return state, []
    return replace(state, on_cpu_reported=True), [Emit("server_on_cpu", {
        "server_pid": state.pid, "n_gpu_layers": state.params.offload_layers, "line": event.text.strip(),
        "cause": event.verdict.cause,
        "fix": "make a GPU visible to llama-server (a CUDA build, the driver, CUDA_VISIBLE_DEVICES), or set "
               "[server].n_gpu_layers = 0 to run on the CPU on purpose"})]


def on_starting_line(state: State, event: Line, now: float) -> Result:
    verdict = event.verdict
    fatal = fault_line(state, event, now, "loading")
    if fatal is not None:
        return fatal
    if verdict.family is Family.ALLOC_FAILED:
        return replace(state, alloc_failure=state.alloc_failure or event.text.strip()), []
    if verdict.family is Family.ALLOC_RECOVERED:
        return replace(state, alloc_failure=""), alloc_recovered(state, event.text.strip())
    unfit = incompatibility(verdict)
    if unfit is not None and state.params.require_gpu:
        return incompatible(state, now, unfit, event.text)
    if verdict.family is Family.GPU_UNAVAILABLE and not state.params.require_gpu:
        return on_cpu(state, event)
    if verdict.family is Family.GPU_UNAVAILABLE and state.params.require_gpu:
        new = fail(state, RestartCause.GPU_UNAVAILABLE, f"GPU unavailable: {verdict.cause}", event.text.strip())
        new, actions = stop(new, now, AfterStop.FAILURE, "GPU unavailable")
        return new, [Emit("server_gpu_unavailable", {"server_pid": state.pid, "line": event.text.strip(),
                                                     "cause": verdict.cause}), *actions]
    if verdict.family is Family.PORT_IN_USE:
        return on_port_line(state, event, now)
    named = isinstance(state.phase_data, Starting) and state.phase_data.boot_cause
    if verdict.family is Family.BOOT_CONFIG and not named:
        return replace(state, phase_data=Starting(verdict.cause)), []
    if verdict.family is Family.RESOURCE_LIMIT:
        new, report = limit_line(state, event)
        if verdict.limit != "RLIMIT_MEMLOCK" and not named:
            return replace(new, phase_data=Starting(f"{verdict.cause} ({verdict.limit})")), report
        return new, report
    return state, []
