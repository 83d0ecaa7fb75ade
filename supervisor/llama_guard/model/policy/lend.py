"""A window of the GPU lent to ``llama-guard tune``: asked for while the server serves, granted once
it is drained (its slots saved, as for a planned restart) and stopped (LENT: no server, the front
door holds clients), ended when tune returns it or its process ends, or when its bound passes (tune
is sent SIGTERM, then SIGKILL ``stop_grace_s + kill_wait_s`` later); then a server is started again
(the configuration reloaded first when the file changed: :mod:`llama_guard.core.lend`). Pure.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from llama_guard.model.actions import Action, AnswerLend, Emit, SignalTune
from llama_guard.model.inputs import Input, LendAsked, LendReturned, RestartRequest, Tick
from llama_guard.model.phase_state import Stopping
from llama_guard.model.policy.steps import Result, restart_for, start
from llama_guard.model.policy.window import begin_drain
from llama_guard.model.types import AfterStop, Lend, LendEnd, RestartCause, State, enter
from llama_guard.vocab.phases import Phase

#: The phases in which a window asked for is on its way (the drain and the stop before the grant).
PENDING = frozenset({Phase.DRAINING, Phase.STOPPING})


def on_lend_asked(state: State, event: LendAsked, now: float) -> Result:
    """Tune asks for the GPU: granted only from a serving server (READY), which is drained first;
    refused (and nothing changes) while another window is asked for or lent, or in any other phase."""
    if state.lend is not None:
        why = (f"the GPU is already lent to tune pid {state.lend.pid}" if state.lend.until is not None
               else f"tune pid {state.lend.pid} already asked for the GPU (its drain is under way)")
        return state, _refuse(event, why)
    if state.phase is not Phase.READY or state.pid is None:
        return state, _refuse(event, f"llama-server is {state.phase.value}: a window is lent only from a "
                                     "serving (ready) server")
    new, drain = begin_drain(replace(state, lend=Lend(event.pid, event.bound_s)), now, AfterStop.LEND,
                             f"lent to tune pid {event.pid}")
    return new, [Emit("lend_requested", {"tune_pid": event.pid, "bound_s": event.bound_s, "server_pid": state.pid}),
                 *drain]


def _refuse(event: LendAsked, why: str) -> list[Action]:
    return [Emit("lend_refused", {"tune_pid": event.pid, "reason": why}), AnswerLend(event.pid, False, why)]


def grant(state: State, now: float) -> Result:
    """The server stopped for the window (``AfterStop.LEND``): LENT until the bound."""
    lend = state.lend
    assert lend is not None
    until = now + lend.bound_s
    new = replace(state, phase=enter(state, Phase.LENT), phase_data=None, pid=None, deadline=until, restart_at=None,
                  lend=replace(lend, until=until))
    return new, [Emit("lend_granted", {"tune_pid": lend.pid, "bound_s": lend.bound_s, "server_pid": state.pid}),
                 AnswerLend(lend.pid, True, bound_s=lend.bound_s)]


def withdrawn(before: State, new: State, actions: list[Action]) -> Result:
    """A window asked for whose drain or stop ended otherwise (a fault, a reset, the daemon's exit): tune
    is told it is refused, and the window forgotten."""
    lend = new.lend
    if lend is None or lend.until is not None or (new.phase in PENDING and new.after_stop is AfterStop.LEND):
        return new, actions
    # The stop under way now, else the drain's or stop's that the window waited for.
    stopped_for = new.stop_reason or before.stop_reason or before.phase.value
    why = f"the drain for the window ended otherwise: {new.phase.value} ({stopped_for})"
    return replace(new, lend=None), [*actions, Emit("lend_refused", {"tune_pid": lend.pid, "reason": why}),
                                     AnswerLend(lend.pid, False, why)]


def on_returned_early(state: State, event: LendReturned) -> Result:
    """Tune ended (or its connection did) before its window was granted: the window is cancelled
    (``lend_cancelled``). A drain under way is undone — the server serves on, not restarted; a stop
    under way (SIGTERM sent) ends in a start, its ``restart_cause`` ``lend_cancelled``."""
    if state.lend is None or event.pid != state.lend.pid or state.lend.until is not None:
        return state, []
    how = event.detail or f"it ended ({event.end.value})"
    fields: dict[str, object] = {"tune_pid": event.pid, "end": event.end.value, "server_pid": state.pid,
                                 "cause": f"tune pid {event.pid} is gone before the window was granted: {how}"}
    if state.after_stop is not AfterStop.LEND:  # its drain or stop is another's now (a fault, the exit)
        return replace(state, lend=None), [Emit("lend_cancelled", {**fields, "outcome": "nothing was lent"})]
    if state.phase is Phase.DRAINING:
        new = replace(state, phase=enter(state, Phase.READY), phase_data=None, lend=None, deadline=None,
                      after_stop=AfterStop.FAILURE)
        return new, [Emit("lend_cancelled", {**fields, "outcome": "the drain is undone: the server serves on"})]
    stopping = state.stopping
    new = replace(restart_for(state, RestartCause.LEND_CANCELLED), lend=None, after_stop=AfterStop.RESTART,
                  phase_data=Stopping(str(fields["cause"]), stopping.reset_trigger if stopping else ""))
    return new, [Emit("lend_cancelled", {**fields, "outcome": "its stop was under way: llama-server starts again"})]


def on_lent(state: State, event: Input, now: float) -> Result:
    """LENT: the window ends when tune returns it (or its process ends), or at its bound."""
    lend = state.lend
    assert lend is not None and lend.until is not None
    if isinstance(event, LendReturned) and event.pid == lend.pid:
        return _end(state, now, event.end)
    if isinstance(event, RestartRequest):
        return refuse_restart(state, event, now)
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        if not lend.asked_to_stop:
            grace = state.params.stop_grace_s + state.params.kill_wait_s
            new = replace(state, deadline=now + grace, lend=replace(lend, asked_to_stop=True))
            return new, [Emit("lend_timeout", {"tune_pid": lend.pid, "bound_s": lend.bound_s, "grace_s": grace}),
                         SignalTune(lend.pid, signal.SIGTERM)]
        new, actions = _end(state, now, LendEnd.TIMED_OUT)
        return new, [SignalTune(lend.pid, signal.SIGKILL), *actions]
    return state, []


def refuse_restart(state: State, event: RestartRequest, now: float) -> Result:
    """A restart asked for while a window is asked for (its drain or stop under way) or lent: refused, said."""
    lend = state.lend
    assert lend is not None
    when = ("its drain and stop are under way" if lend.until is None
            else f"at most {max(0.0, lend.until - now):.0f} s more")
    return state, [Emit("restart_requested", {"server_pid": state.pid, "reason": event.reason, "refused": (
        f"the GPU is lent to tune pid {lend.pid} ({when}); a server starts when it ends")})]


def _end(state: State, now: float, end: LendEnd) -> Result:
    lend = state.lend
    assert lend is not None and lend.until is not None
    lent_s = round(now - (lend.until - lend.bound_s), 3)
    new, actions = start(replace(state, lend=None, deadline=None), now)
    return new, [Emit("lend_returned", {"tune_pid": lend.pid, "end": end.value, "lent_s": lent_s}), *actions]
