"""Policy rules on real client traffic, as the front door reports it (pure; no I/O, no clock reads).

Real traffic is the first liveness signal: a generation or embedding answered in full whose answer
proves the server decoded (never a mere 2xx: a ``/health`` poller proves nothing) is progress (it
clears the hang strikes, and the liveness round after it sends no canary); a response that had begun
and then got no event for ``[front].stall_timeout_s`` (or that a slot took and that sent no first
event within ``[front].first_event_timeout_s``) is a stall — ``hang_strikes`` stalls with no progress
in between (no completed request, no movement of the token counters) are a hang, found by the traffic
itself. 5xx answers are counted, never a reason to restart on their own: a client can make
llama-server answer 500 at will, and one bad client must not restart the server for everyone. A run of
``hold_after_errors`` of them with no request completed between is reported and, with the canary on,
makes the front door hold new requests (:attr:`State.confirming`) while one liveness round confirms at
once (:class:`ConfirmCompletions`): its canary failing too is the verdict (:mod:`.phases`), so that a
wedged server (``/health`` 200, every completion 500) costs its clients that run, not ``hang_strikes``
rounds of 500s. 501 (a feature the server was not started for) says nothing about the server and
never counts.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Action, ConfirmCompletions, Emit
from llama_guard.model.inputs import FirstToken, Input, RequestCompleted, StreamStalled, UpstreamError
from llama_guard.model.policy.steps import Result, fail, stop
from llama_guard.model.types import AfterStop, RestartCause, State

#: The 5xx status a client's request earns alone (llama-server was not started for what it asks).
NOT_IMPLEMENTED = 501


def on_traffic(state: State, event: Input, now: float) -> Result | None:
    """The transition for a traffic input about the current server while it serves; None when
    ``event`` is no traffic input of this server."""
    if isinstance(event, RequestCompleted) and event.pid == state.pid:
        return replace(state, last_request_at=now, strikes=0, stalls=0, http_errors=0), []
    if isinstance(event, FirstToken) and event.pid == state.pid:
        if state.restart_at is None:  # not the first answer after a restart: nothing to time
            return state, []
        return replace(state, restart_at=None), [Emit("restart_first_token", {
            "server_pid": state.pid, "restart_to_first_token_s": round(now - state.restart_at, 3)})]
    if isinstance(event, StreamStalled) and event.pid == state.pid:
        return _stalled(state, event, now)
    if isinstance(event, UpstreamError) and event.pid == state.pid and event.status != NOT_IMPLEMENTED:
        new = replace(state, http_errors=state.http_errors + 1)
        if new.http_errors != state.params.hold_after_errors:
            return new, []
        held = new.confirming
        actions: list[Action] = [Emit("server_http_errors", {"server_pid": state.pid, "errors": new.http_errors,
                                                             "status": event.status, "held": held})]
        if held:
            actions.append(ConfirmCompletions(state.pid))
        return new, actions
    return None


def _stalled(state: State, event: StreamStalled, now: float) -> Result:
    p = state.params
    stalls = state.stalls + 1
    emit = Emit("server_stream_stalled", {"server_pid": state.pid, "stalled_s": round(event.stalled_s, 1),
                                          "stalls": stalls, "hang_strikes": p.hang_strikes})
    if stalls < p.hang_strikes:
        return replace(state, stalls=stalls), [emit]
    reason = (f"{stalls} streaming responses got no event for {event.stalled_s:.0f} s each, with no request "
              "completed and no token counter moving in between")
    new = replace(fail(state, RestartCause.HANG, f"hang: {reason}"), stalls=stalls)
    new, actions = stop(new, now, AfterStop.FAILURE, "hang")
    hang = Emit("server_hang", {"server_pid": state.pid, "failures": stalls, "reason": reason,
                                "phase": state.phase.value})
    return new, [emit, hang, *actions]
