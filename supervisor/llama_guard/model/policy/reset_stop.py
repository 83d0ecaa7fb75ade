"""The policy's rules for a stop (SIGTERM/SIGINT) that comes during a GPU reset, and the event
that says a reset has begun and what it waits for. Pure, like the rest of the policy.

A reset command killed half way can leave the GPU unusable until a reboot, so a stop never
interrupts it: the daemon exits when the command returns (bounded by the reset's deadline; the
daemon tells systemd how long that is, ``EXTEND_TIMEOUT_USEC``). Before the command has started
(while the reset waits for the old server to leave the GPU and for other processes to let go)
nothing has been done to the GPU: the reset is given up and the daemon exits at once. A second
signal changes neither: it kills a *server* at once; during a reset there is none.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Emit
from llama_guard.model.inputs import StopRequest
from llama_guard.model.phase_state import Resetting
from llama_guard.model.policy.steps import Result, exit_daemon
from llama_guard.model.types import AfterStop, Exit, ResetOutcome, State
from llama_guard.vocab.exitcodes import EXIT_OK


def reset_started(state: State, now: float, trigger: str) -> Emit:
    """``gpu_reset_started``: the reset of GPU ``gpu_index`` begins, for ``trigger``, and waits for
    (in order) the stopped server to leave the GPU, other processes to let go, then the command —
    each bounded; the whole sequence ends by ``deadline_s`` seconds from now."""
    p = state.params
    index = state.gpu_index if state.gpu_index is not None else p.gpu_index
    leave = (f"llama-server pid {state.pid} to leave the GPU (up to {p.vram_release_s:.0f} s), "
             if state.pid is not None else "")
    waits = (f"{leave}other processes to let go of it (up to {p.foreign_wait_s:.0f} s), then the reset "
             f"command (up to {p.reset_timeout_s:.0f} s{', twice with persistence mode off' if p.reset_retry else ''})")
    return Emit("gpu_reset_started", {"gpu_index": index, "trigger": trigger, "server_pid": state.pid,
                                      "waits_for": waits, "deadline_s": round(p.reset_deadline_s, 1)})


def stop_during_reset(state: State, event: StopRequest, now: float) -> Result:
    """SIGTERM/SIGINT while RESETTING: exit at once while the reset has not run anything yet
    (``gpu_reset`` skipped), else exit when the command returns — never interrupt it, a second
    signal included (``daemon_stopping`` says what it waits for and at most how long)."""
    index = state.gpu_index if state.gpu_index is not None else state.params.gpu_index
    resetting = state.phase_data
    assert isinstance(resetting, Resetting)  # set as RESETTING is entered (gpu.begin_reset)
    if resetting.command_at is None:
        skipped = Emit("gpu_reset", {"outcome": ResetOutcome.SKIPPED.value, "gpu_index": index,
                                     "reason": "a stop was requested before the reset command ran",
                                     "trigger": resetting.trigger})
        new, actions = exit_daemon(state, EXIT_OK, event.reason)
        return new, [Emit("daemon_stopping", {"reason": event.reason, "server_pid": None}), skipped, *actions]
    left = max(0.0, (state.deadline if state.deadline is not None else now) - now)
    running = now - resetting.command_at
    second = "a second signal does not interrupt it either; " if event.immediate else ""
    waiting = (f"waiting for the GPU {index} reset command (running for {running:.0f} s, at most {left:.0f} s "
               f"more): it is never interrupted ({second}a reset killed half way can leave the GPU unusable "
               "until a reboot); exiting when it returns")
    new = replace(state, after_stop=AfterStop.EXIT, exit=Exit(EXIT_OK, event.reason))
    return new, [Emit("daemon_stopping", {"reason": f"{event.reason}; {waiting}", "server_pid": None,
                                          "waiting_for": "gpu_reset", "wait_s": round(left, 1),
                                          "immediate": event.immediate})]
