"""Deterministic failures: a server that fails the same way on consecutive starts — before it is
ready, or right after (before it ran ``stable_after_s``) — is a verdict (exit 78, the line and the
fix named), not a restart loop that ends in a crash-loop exit that systemd restarts again.

Pure, like the rest of the policy; :func:`repeat_verdict` is asked by every counted failure
(:func:`llama_guard.model.policy.steps.count_failure`). The chain of identical failures is broken by a
different failure, by a failure that says nothing about the binary (a SIGKILL from outside, an out
of memory, a busy GPU, a taken port: other processes can cause those and go away) and by a server
that stayed up ``stable_after_s``: the same message once or twice a day under load is a restart
within the rolling window, never a verdict.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from llama_guard.model.actions import Action, Emit, ReadBuild
from llama_guard.model.inputs import CrashesCharged
from llama_guard.model.judgement import failure_signature
from llama_guard.model.server_log import Family, classify_line
from llama_guard.model.types import RestartCause, State
from llama_guard.vocab.events import EventName
from llama_guard.vocab.phases import Phase

# Failures another process can cause and end (the chain is broken, never a verdict).
_TRANSIENT_FAMILIES = frozenset({Family.OOM, Family.ALLOC_FAILED})
_TRANSIENT_CAUSES = frozenset({RestartCause.OOM, RestartCause.PORT_TAKEN})

FIX_GPU = ("make the GPU visible to llama-server (driver loaded, CUDA_VISIBLE_DEVICES, the unit's DeviceAllow), "
           "or set [server].n_gpu_layers = 0 to run on the CPU on purpose")
FIX_STALL = ("the load stops at the same line on every start: check the model file and the storage it is read "
             "from (a hung mount, a failing disk), or raise [health].load_stall_s if this model loads that "
             "long without output")
FIX_BUILD = ("a fault of this llama-server build with this model and these flags: use another llama.cpp build "
             "(the build is named), or change the setting that reaches the failing code")
FIX_BOOT = ("the server's own line says why it cannot start: fix the [server] setting it names (`llama-guard "
            "check` checks them), or use another llama.cpp build if the fault is this build's")


#: Signals by which the CPU refuses the build's own code (an instruction this CPU lacks, a fault in
#: an accelerated path such as AMX tile setup): the same binary dies the same way on every start,
#: at whatever line its output reached, so these chain whatever was printed. SIGABRT is not here:
#: an abort names its cause in a line, and the line-based chain judges it.
FAULT_SIGNALS = frozenset({signal.SIGILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE})
FIX_ILLEGAL = ("it was built for CPU instructions this machine cannot run (rebuild with GGML_NATIVE=OFF, e.g. "
               "CMAKE_ARGS=-DGGML_NATIVE=OFF; a native build runs only on the CPU kind that built it)")
FIX_FAULT = ("a fault of this build on this machine: a native build made for another CPU (rebuild with "
             "GGML_NATIVE=OFF, or run it with --no-repack in [server].extra_args), or a CUDA build made for "
             "another driver or GPU (rebuild it on this host); the build is named")


def _fault_signal(state: State) -> int | None:
    """The CPU-fault signal that ended the server (None: another ending)."""
    return state.exit_signal if state.exit_signal in FAULT_SIGNALS else None


def _line(state: State) -> str:
    """The line that names the failure: the one that decided it (a fault, no GPU: the lines after it
    depend on how fast the stop was), else the last error line, else the last line printed."""
    return state.failure.line or state.last_error or state.last_line


def _signature(state: State) -> str:
    """This failure, comparable across starts ("" when it says nothing about the binary)."""
    if state.stable:
        return ""
    if state.failure.cause in _TRANSIENT_CAUSES:
        return ""
    if state.failure.cause is RestartCause.CRASH and state.exit_signal == signal.SIGKILL:
        return ""  # killed from outside (the kernel's OOM killer, an operator): not the binary's doing
    for line in {state.failure.line, state.last_error} - {""}:
        found = classify_line(line)
        if found.family in _TRANSIENT_FAMILIES or found.held_elsewhere:
            return ""
    when = "before ready" if state.ready_at is None else "after ready"
    if _fault_signal(state) is not None:
        return f"{when} | killed by a CPU fault signal"
    return f"{when} | {failure_signature(state.failure.text, _line(state))}"


def _fix(state: State) -> str:
    if state.fault_signals:
        return FIX_ILLEGAL if signal.SIGILL in state.fault_signals else FIX_FAULT
    family = classify_line(state.last_error).family if state.last_error else Family.HARMLESS
    if state.failure.cause is RestartCause.GPU_UNAVAILABLE or family is Family.GPU_UNAVAILABLE:
        return FIX_GPU
    if state.failure.cause in (RestartCause.LOAD_STALLED, RestartCause.LOAD_TIMEOUT):
        return FIX_STALL
    return FIX_BUILD if state.ready_at is not None else FIX_BOOT


def repeat_verdict(state: State, now: float) -> tuple[State, Emit | None, list[Action]]:
    """Record this failure in the chain of identical ones; the verdict event once the chain holds
    ``identical_failures`` (``server_boot_failure`` before ready, ``server_failure_repeated`` after),
    else None; and :class:`ReadBuild` one failure before, so that the verdict can name the build.
    The state keeps the chain (``boot_signature``, ``identical``, ``identical_since``). ``now``:
    monotonic seconds; a chain younger than ``repeat_confirm_s`` is not confirmed yet (the start
    that confirms it is held back until then by :func:`~llama_guard.model.policy.steps.count_failure`),
    so that a fault that goes away within that time is ridden out."""
    signature = _signature(state)
    if not signature:
        return replace(state, boot_signature="", identical=0, fault_signals=frozenset()), None, []
    count = state.identical + 1 if signature == state.boot_signature else 1
    since = state.identical_since if count > 1 else now
    fault = _fault_signal(state)
    chained = state.fault_signals if count > 1 else frozenset()
    state = replace(state, fault_signals=chained | {fault} if fault is not None else frozenset())
    if count >= state.params.identical_failures and now - since < state.params.repeat_confirm_s:
        count = state.params.identical_failures - 1  # too soon to confirm: the next start does
    state = replace(state, boot_signature=signature, identical=count, identical_since=since)
    if count < state.params.identical_failures:
        ask: list[Action] = [ReadBuild()] if count == state.params.identical_failures - 1 and not state.build else []
        return state, None, ask
    line = _line(state)
    when = "before it is ready" if state.ready_at is None else "soon after it became ready"
    build = f"; build: {state.build or 'unknown'}"
    if state.fault_signals:
        cause = f"{_fault_cause(state.fault_signals)} on {count} consecutive starts {when}: {_fix(state)}{build}"
    else:
        cause = (f"llama-server fails the same way {when} on {count} consecutive starts "
                 f"({state.failure.text}): {line or state.failure.text}{build}; fix: {_fix(state)}")
    fields: dict[str, object] = {"cause": cause, "line": line, "failure": state.failure.text,
                                 "consecutive_starts": count, "fix": _fix(state), "build": state.build,
                                 "server_pid": state.pid}
    name: EventName = "server_boot_failure" if state.ready_at is None else "server_failure_repeated"
    if state.fault_signals:
        fields["signals"] = sorted(signal.Signals(n).name for n in state.fault_signals)
    return replace(state, boot_signature="", identical=0, fault_signals=frozenset()), Emit(name, fields), []


def on_crashes_charged(state: State, event: CrashesCharged, now: float) -> tuple[State, list[Action]]:
    """Crashes the front door charged to a client request (:class:`CrashesCharged`: it was the one
    suspect sent to the last of them) are that request's failures, not the server's: they leave the
    crash-loop window (``max_restarts`` in ``restart_window_s``), the backoff is what the failures
    left would have made it (``next_backoff_s``; a backoff wait the last of them began ends now), and
    the chain of identical failures is broken (a client that sends one crashing prompt after another
    never makes a verdict that ends the daemon; a start held back to confirm that chain,
    ``repeat_confirm_s``, goes now) — the request is refused from now on."""
    p = state.params
    charged = frozenset(event.pids)
    kept = tuple((t, pid) for t, pid in state.failures if pid not in charged)
    if len(kept) == len(state.failures) and not state.identical:
        return state, []
    last_charged = bool(state.failures) and state.failures[-1][1] in charged
    held = state.identical == p.identical_failures - 1
    backoff = min(state.next_backoff_s, p.backoff_max_s,
                  p.backoff_initial_s * p.backoff_factor ** max(0, len(kept) - 1))
    state = replace(state, failures=kept, next_backoff_s=backoff, boot_signature="", identical=0,
                    fault_signals=frozenset())
    if (held or last_charged) and state.phase is Phase.BACKOFF and state.deadline is not None and state.deadline > now:
        state = replace(state, deadline=now)
    return state, []


def _fault_cause(signals: frozenset[int]) -> str:
    """How the server died, in words: "llama-server dies with an illegal instruction (SIGILL, also
    SIGSEGV)", or by the fault signals it died of."""
    names = sorted(signal.Signals(n).name for n in signals)
    if signal.SIGILL in signals:
        others = [n for n in names if n != "SIGILL"]
        also = f", also {', '.join(others)}" if others else ""
        return f"llama-server dies with an illegal instruction (SIGILL{also})"
    return f"llama-server dies by {', '.join(names)} at the same point"
