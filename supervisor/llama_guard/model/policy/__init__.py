"""The supervision policy: one pure ``decide(state, event, now) -> (state, actions)``.

No I/O and no clock reads happen in this package: the daemon feeds observations (:class:`Input`
subclasses) and a monotonic ``now`` in seconds, and carries out the returned actions
(:class:`Action` subclasses). Every restart, stop, reset, backoff and give-up rule lives here, so it
can be tested by setting a state and calling :func:`decide`.

Phases: STOPPED → (WAITING_VRAM →) STARTING → READY ⇄ DRAINING → STOPPING → BACKOFF → STARTING …,
with RESETTING after a GPU fault, ending in EXITED. "Started" is not "ready": READY only after
``/health`` answered 200.

The modules, one job each: :mod:`.phases` (STOPPED, STARTING, READY/DRAINING, BACKOFF),
:mod:`.lines` (classified server lines), :mod:`.stop` (STOPPING and what follows a stop),
:mod:`.gpu` (GPU faults, Xids, the reset), :mod:`.vram` (VRAM admission and the driver's recovery
action before a start), :mod:`.verdicts` (what no restart or reset mends: a reboot, a server that
outlives SIGKILL; faults said when they repeat), :mod:`.traffic` (client traffic as the front door
reports it: completions, stalls, 5xx), :mod:`.steps` (start, stop, spawn, exit, count a failure;
:func:`~.steps.after_fault`, the OOM decision), :mod:`.repeat` (the same failure on consecutive
starts: a verdict), :mod:`.port` (a port another process holds), :mod:`.reset_stop` (a stop
during a GPU reset; the event that announces one), :mod:`.window` (the planned window, top to bottom,
every step's decision: asked, drain, slot saves, the trial of a new build, stop, start, slot restores,
keep or roll back, the release of the held clients; the drain before the daemon's exit) and
:mod:`.lend` (the GPU lent to ``llama-guard tune``: LENT, granted and ended; its drain and stop are the
window's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from llama_guard.model.inputs import (
    BuildInfo,
    CrashesCharged,
    Exited,
    GpuFault,
    Input,
    LendAsked,
    LendReturned,
    Line,
    ParamsChanged,
    PortHolder,
    RestartRequest,
    StopRequest,
    TrialAsked,
)
from llama_guard.model.policy.gpu import on_gpu_fault, on_resetting
from llama_guard.model.policy.lend import on_lend_asked, on_lent, on_returned_early, refuse_restart, withdrawn
from llama_guard.model.policy.phases import on_backoff, on_serving, on_starting, on_stopped
from llama_guard.model.policy.port import on_port_holder
from llama_guard.model.policy.repeat import on_crashes_charged
from llama_guard.model.policy.steps import SERVING, VRAM_CHECK_TIMEOUT_S, Result
from llama_guard.model.policy.stop import on_stop_request, on_stopping
from llama_guard.model.policy.vram import on_waiting_vram
from llama_guard.model.policy.window import restart_meanwhile, trial_asked, trial_step, trial_wanted
from llama_guard.model.server_log import ERROR_FAMILIES
from llama_guard.model.types import AfterStop, RestartCause, State
from llama_guard.vocab.phases import Phase

__all__ = ["VRAM_CHECK_TIMEOUT_S", "Result", "decide"]


def decide(state: State, event: Input, now: float) -> Result:
    """The next state and the actions to carry out, for ``event`` observed at monotonic ``now``."""
    new, actions = withdrawn(state, *_decide(state, event, now))
    if state.phase in SERVING and new.phase not in (*SERVING, Phase.EXITED):
        new = replace(new, restart_at=now)  # the serving server stopped serving: a restart begins
    return new, actions


def _decide(state: State, event: Input, now: float) -> Result:
    if state.phase is Phase.EXITED:
        return state, []
    if isinstance(event, Line) and event.pid == state.pid and event.verdict.family in ERROR_FAMILIES:
        state = replace(state, last_error=event.text.strip())
    if isinstance(event, Exited) and event.pid == state.pid and event.last_line:
        state = replace(state, last_line=event.last_line)
    if isinstance(event, StopRequest):
        return on_stop_request(state, event, now)
    if isinstance(event, LendAsked):
        return on_lend_asked(state, event, now)
    if isinstance(event, LendReturned) and state.phase is not Phase.LENT:
        return on_returned_early(state, event)
    if isinstance(event, RestartRequest) and state.lend is not None and state.after_stop is AfterStop.LEND:
        return refuse_restart(state, event, now)
    if isinstance(event, ParamsChanged):
        return _on_params(state, event, now)
    if isinstance(event, GpuFault):
        return on_gpu_fault(state, event, now)
    if isinstance(event, PortHolder):  # answers whenever it comes (the server may be gone by then)
        return on_port_holder(state, event, now)
    if isinstance(event, BuildInfo):
        return replace(state, build=event.text), []
    if isinstance(event, TrialAsked):
        return trial_asked(state, event), []
    if isinstance(event, CrashesCharged):
        return on_crashes_charged(state, event, now)
    if isinstance(event, RestartRequest) and state.phase in _RESTART_UNDER_WAY:
        return restart_meanwhile(state, event)
    return _HANDLERS[state.phase](state, event, now)


def _on_params(state: State, event: ParamsChanged, now: float) -> Result:
    """New parameters (a reload); changed server flags restart a loading or serving server."""
    state = trial_wanted(replace(state, params=event.params), event)
    if event.server_changed and state.phase in (*SERVING, Phase.STARTING):
        return decide(state, RestartRequest("configuration changed", cause=RestartCause.CONFIG_CHANGE), now)
    return state, []


#: The phases in which a restart asked for is either the one under way or refused (the daemon ends); a
#: changed configuration's restart is the start's own business there too (it spawns with the new flags).
_RESTART_UNDER_WAY = frozenset({Phase.STOPPED, Phase.WAITING_VRAM, Phase.RESETTING, Phase.STOPPING, Phase.TRIAL})

#: Each phase's handler (every phase but EXITED, which ignores every input).
_HANDLERS: dict[Phase, Callable[[State, Input, float], Result]] = {
    Phase.WAITING_VRAM: on_waiting_vram,
    Phase.RESETTING: on_resetting,
    Phase.STOPPED: on_stopped,
    Phase.STARTING: on_starting,
    Phase.READY: on_serving,
    Phase.DRAINING: on_serving,
    Phase.STOPPING: on_stopping,
    Phase.BACKOFF: on_backoff,
    Phase.TRIAL: trial_step,
    Phase.LENT: on_lent,
}
