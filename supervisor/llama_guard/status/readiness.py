"""Why the server is not ready, and for about how long: ``/readyz``'s ``cause`` and ``Retry-After``.

Both are read from the policy's state only (the phase, what its stop is for, the last failure's cause,
the deadlines the policy set), so a load balancer, a router or Kubernetes learns what the supervisor
itself decided, never a guess of its own.

The estimate (:func:`ready_in_s`, seconds) is the bound the policy set on the step under way (the drain's
deadline, the backoff's wait, the stop's grace, the reset's deadline, the window lent to tune, the VRAM
wait, a build trial's measurements: ``[upgrade].trial_timeout_s`` each) plus the next server's load,
estimated by the last load seen (``State.load_s``: spawn to ``/health``, slot restore included;
:data:`UNKNOWN_LOAD_S` before any server was ready). A step the policy bounds from above (a drain, a
stop's grace, a measurement) may end sooner: the estimate never promises readiness earlier than the
supervisor could deliver it, and a router probing again at ``Retry-After`` finds the box ready or a new
estimate.
"""

from __future__ import annotations

import enum

from llama_guard.model.phase_state import WaitingVram
from llama_guard.model.policy.window import RESTART_EVENT
from llama_guard.model.types import AfterStop, State, TrialStage
from llama_guard.vocab.phases import Phase

#: Seconds assumed for a server's load before any was seen to load (no ``State.load_s`` yet): a
#: router asked to look again this soon learns the real estimate from the next answer.
UNKNOWN_LOAD_S = 5.0

#: The restart causes that are plans (an operator, the schedule, a decay trigger, a reload that changed
#: the server's flags), not failures: the causes of a drained restart.
PLANNED = frozenset(RESTART_EVENT)

#: The phases in which the stop under way (``State.after_stop``) says what follows it.
_STOPPING = (Phase.DRAINING, Phase.STOPPING, Phase.RESETTING)


class NotReady(enum.Enum):
    """Why ``/readyz`` answers 503 (its body's ``cause``): what the supervisor is doing, typed from the
    policy's state."""

    STARTING = "starting"                # the daemon's first server loads (or is about to be started)
    PLANNED_RESTART = "planned_restart"  # a planned restart: draining, stopping, or the next server loading
    RECOVERING = "recovering"            # a failure: the server is stopped, backing off, or the next one loads
    GPU_RESET = "gpu_reset"              # the GPU is being reset (or the server stopped for a reset)
    WAITING_FOR_VRAM = "waiting_for_vram"  # another process holds the VRAM the server needs
    BUILD_TRIAL = "build_trial"          # a new llama-server build's decode speed is measured before it serves
    LENT_TO_TUNE = "lent_to_tune"        # the GPU is lent to `llama-guard tune` (a bounded window)
    STOPPING = "stopping"                # the daemon is stopping (a signal or a verdict): it will not serve again


def is_ready(state: State) -> bool:
    """Whether the server is ready for clients (``/readyz`` 200)."""
    return state.phase is Phase.READY and state.pid is not None


def not_ready_cause(state: State) -> NotReady:
    """Why the server of ``state`` is not ready (``state`` must not be ready)."""
    phase, after = state.phase, state.after_stop
    stopping = phase in _STOPPING
    if phase is Phase.EXITED or (stopping and after is AfterStop.EXIT):
        return NotReady.STOPPING
    if phase is Phase.LENT or (stopping and after is AfterStop.LEND):
        return NotReady.LENT_TO_TUNE
    if phase is Phase.TRIAL or state.trial is not None:
        return NotReady.BUILD_TRIAL
    if phase is Phase.RESETTING or (stopping and after is AfterStop.RESET):
        return NotReady.GPU_RESET
    if phase is Phase.WAITING_VRAM or (stopping and after is AfterStop.VRAM_CHECK):
        return NotReady.WAITING_FOR_VRAM
    if phase is Phase.STOPPED or (phase is Phase.STARTING and state.restarts == 0):
        return NotReady.STARTING
    if state.failure.cause in PLANNED and phase is not Phase.BACKOFF:
        return NotReady.PLANNED_RESTART
    return NotReady.RECOVERING


def ready_in_s(state: State, now: float) -> float:
    """About how many seconds until the server of ``state`` is ready, at monotonic ``now`` (see the
    module's docstring); 0.0 when it is ready."""
    if is_ready(state):
        return 0.0
    load = state.load_s if state.load_s is not None else UNKNOWN_LOAD_S

    def left(until: float | None) -> float:
        return max(0.0, until - now) if until is not None else 0.0

    phase, params, trial = state.phase, state.params, state.trial
    measure = params.trial_timeout_s
    if phase is Phase.TRIAL and trial is not None:
        if trial.stage is TrialStage.NEW:  # the new build, loaded, is measured: then it serves (or rolls back)
            return left((trial.answered_at if trial.answered_at is not None else now) + measure)
        # the old build measured and stopped; the new one loaded and measured
        return measure + params.stop_grace_s + load + measure
    new_measured = measure if trial is not None else 0.0  # a trial under way: the new build is measured too
    if phase is Phase.STARTING:
        begun = now - state.started_at if state.started_at is not None else 0.0
        return max(0.0, load - begun) + new_measured
    if phase is Phase.LENT:
        return left(state.lend.until if state.lend is not None else None) + load
    if phase is Phase.WAITING_VRAM:
        waiting = state.phase_data if isinstance(state.phase_data, WaitingVram) else None
        return left(waiting.until if waiting is not None and waiting.until is not None else state.deadline) + load
    step = left(state.deadline)
    if phase in _STOPPING:
        if state.after_stop is AfterStop.LEND and state.lend is not None:
            step += state.lend.bound_s
        elif state.after_stop is AfterStop.RESET and phase is not Phase.RESETTING:
            step += params.reset_deadline_s
        if phase is Phase.DRAINING:
            step += params.stop_grace_s  # the drained server's stop follows the drain
            if trial is not None:
                step += measure  # the drained old build is measured before its stop
    return step + load + new_measured
