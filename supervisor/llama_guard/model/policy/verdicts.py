"""The policy's rules for faults that a restart or a reset cannot mend, and for faults that are
only worth a word when they repeat. Pure, like the rest of the policy (:mod:`.gpu`, :mod:`.lines`,
:mod:`.phases`, :mod:`.stop` and :mod:`.vram` call these); no I/O, no clock reads.

* What the driver's *recovery action* (NVML's ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` field, or the
  text of Xid 154) asks for, as the step the policy takes and the advice it gives.
* A GPU that needs a reboot (off the bus, the driver cannot initialise it, the driver asks for a
  reboot or a drain): stop the server, no reset, no new server, exit 69 with the advice.
* A server that outlived SIGKILL (stuck in the driver): no new server, no reset, exit 69 naming
  a reboot.
* The launch watchdog on one channel: restart only; said when it repeats within the window.
* A crash after ready: said when the same crash repeats within the window, naming the request
  kind its exception text points at.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Emit
from llama_guard.model.policy.steps import Result, exit_asked, exit_daemon, fail, stop
from llama_guard.model.types import AfterStop, Exit, RecoveryAction, State, XidAction
from llama_guard.vocab.exitcodes import EXIT_GPU_UNRECOVERABLE
from llama_guard.vocab.phases import Phase

R = RecoveryAction

#: The step each recovery action calls for (None: the field said nothing new).
RECOVERY_STEP: dict[RecoveryAction, XidAction] = {
    R.NONE: XidAction.EVENT_ONLY,
    R.GPU_RESET: XidAction.RESET,
    R.NODE_REBOOT: XidAction.REBOOT,
    R.SYSTEM_REBOOT: XidAction.REBOOT,
    R.BUS_RESET: XidAction.REBOOT,
    R.DRAIN_P2P: XidAction.REBOOT,
    R.DRAIN_AND_RESET: XidAction.REBOOT,
    R.RECOVER_IMEX_DOMAIN: XidAction.REBOOT,
}

#: What the operator is told to do for a recovery action llama-guard does not carry out itself.
RECOVERY_ADVICE: dict[RecoveryAction, str] = {
    R.NONE: "nothing to do",
    R.GPU_RESET: "reset the GPU (nvidia-smi --gpu-reset) once no process uses it",
    R.NODE_REBOOT: "reboot the host",
    R.SYSTEM_REBOOT: "reboot the host (a full power cycle)",
    R.BUS_RESET: "the GPU needs a PCI bus reset: reboot the host",
    R.DRAIN_P2P: ("stop the jobs that use peer-to-peer (NVLink/P2P) traffic with this GPU, then reset it "
                  "or reboot the host"),
    R.DRAIN_AND_RESET: "stop every process on this GPU, then reset it (nvidia-smi --gpu-reset) or reboot the host",
    R.RECOVER_IMEX_DOMAIN: "recover the IMEX domain of this GPU (nvidia-imex), or reboot the host",
}

def recovery_step(recovery: RecoveryAction | None) -> XidAction:
    """The step for Xid 154 with ``recovery`` (None: neither the line nor NVML said; a reset, as the
    Xid that usually comes before it asks)."""
    return XidAction.RESET if recovery is None else RECOVERY_STEP[recovery]


def needs_reboot(state: State, now: float, reason: str, fields: dict[str, object]) -> Result:
    """The GPU cannot come back without the operator (a reboot, a drain): stop the server, never
    reset, never start another; exit 69 once it is gone. ``fields`` are the ``gpu_lost`` event's."""
    why = reason if "reboot" in reason else f"{reason}; reboot the host"
    if state.phase is Phase.RESETTING:
        # A reset under way finishes (never abandoned half done): unless it verifies the GPU, the
        # loss escalates then (the reset's own rules).
        return replace(state, gpu_lost=True), []
    emit = Emit("gpu_lost", {**fields, "reason": why, "reset": "not attempted (a reset cannot help)"})
    if state.phase is Phase.STOPPING:
        return replace(fail(state, state.failure.cause, why, state.failure.line), after_stop=AfterStop.EXIT,
                       exit=Exit(EXIT_GPU_UNRECOVERABLE, why), pending_event=None), [emit]
    if state.pid is not None:
        new, actions = stop(fail(state, state.failure.cause, why), now, AfterStop.EXIT, why,
                            exit=Exit(EXIT_GPU_UNRECOVERABLE, why))
        return new, [emit, *actions]
    new, actions = exit_daemon(state, EXIT_GPU_UNRECOVERABLE, why)
    return new, [emit, *actions]


def recovery_fields(recovery: RecoveryAction, source: str, gpu_index: int | None) -> dict[str, object]:
    """The ``gpu_recovery_action`` event's fields: the action, where it was read, the advice."""
    return {"gpu_index": gpu_index, "recovery_action": recovery.name.lower(), "recovery_code": recovery.value,
            "source": source, "advice": RECOVERY_ADVICE[recovery]}


def unkillable(state: State) -> Result:
    """SIGKILL did not end the server within ``kill_wait_s``: it is stuck in the kernel (a GPU
    driver call, typically). A second server would find the GPU and the port taken and a reset
    refuses a GPU in use, so: no new server, no reset, exit 69 naming a reboot (a stop that was
    asked for keeps its own exit code)."""
    pid = state.pid
    waited = state.params.kill_wait_s
    why = (f"llama-server pid {pid} outlived SIGKILL for {waited:.0f} s (stuck in the kernel, likely the GPU "
           "driver); no new server and no GPU reset while it holds the GPU; reboot the host")
    emit = Emit("server_unkillable", {"server_pid": pid, "waited_s": waited, "holds": "it is still alive",
                                      "advice": "reboot the host"})
    if state.after_stop is AfterStop.EXIT:  # a stop was asked for (or a verdict given): keep its code
        asked = exit_asked(state)
        new, actions = exit_daemon(fail(state, state.failure.cause, why), asked.code, asked.reason or why)
    else:
        new, actions = exit_daemon(fail(state, state.failure.cause, why), EXIT_GPU_UNRECOVERABLE, why)
    return new, [emit, *actions]


def watchdog_hit(state: State, now: float, cause: str) -> tuple[State, list[Emit]]:
    """Count one launch-watchdog stop; from the second within ``restart_window_s`` say it repeats."""
    p = state.params
    hits = (*(t for t in state.watchdog_hits if now - t < p.restart_window_s), now)
    state = replace(state, watchdog_hits=hits)
    if len(hits) < 2:
        return state, []
    return state, [Emit("gpu_watchdog_repeated", {
        "server_pid": state.pid, "count": len(hits), "window_s": p.restart_window_s, "cause": cause,
        "advice": ("a kernel keeps running past the driver's launch timeout: a display attached to this GPU "
                   "(its watchdog), a too-large batch or ubatch, or a sick GPU; check the kernel log's Xids")})]


def crash_repeat(state: State, now: float, signature: str, request_kind: str) -> tuple[State, list[Emit]]:
    """Remember one crash after ready (``signature``: its exception or last error line); when the
    same one came before within ``restart_window_s`` say so, naming the request kind."""
    if not signature:
        return state, []
    p = state.params
    crashes = (*((t, s) for t, s in state.crashes if now - t < p.restart_window_s), (now, signature))
    state = replace(state, crashes=crashes)
    count = sum(1 for _, s in crashes if s == signature)
    if count < 2:
        return state, []
    kind = request_kind or "unknown (the exception names no request kind)"
    return state, [Emit("server_crash_repeated", {
        "server_pid": state.pid, "count": count, "window_s": p.restart_window_s, "line": signature,
        "request_kind": kind})]


__all__ = ["RECOVERY_ADVICE", "RECOVERY_STEP", "crash_repeat", "needs_reboot", "recovery_fields", "recovery_step",
           "unkillable", "watchdog_hit"]
