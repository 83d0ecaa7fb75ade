"""The policy's rule for a port taken by another process: a transient conflict, retried within
``port_wait_s``, and only then a configuration error (exit 78) — naming the holder either way.

After a kill -9 of the server, a client's ephemeral socket or a quick other service can hold the
port for a while; a port that served a minute ago is no configuration error. The daemon answers
:class:`~llama_guard.model.actions.FindPortHolder` with the holder (pid, name: typed facts); the
policy reports it (``server_port_taken``), retries every ``port_retry_s`` without counting a crash
failure, and gives its verdict once the port stayed taken for ``port_wait_s``. Pure.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Emit, FindPortHolder
from llama_guard.model.inputs import Exited, Line, PortHolder
from llama_guard.model.policy.steps import Result, exit_daemon, exit_fields, fail
from llama_guard.model.types import RestartCause, State, enter
from llama_guard.vocab.exitcodes import EXIT_CONFIG
from llama_guard.vocab.phases import Phase


def holder_text(holder: tuple[int | None, str] | None) -> str:
    """How a port's holder ``(pid, name)`` is named to people (None: not identified)."""
    if holder is None:
        return "a process llama-guard could not identify"
    pid, name = holder
    return f"pid {pid} ({name or '?'})" if pid else f"a process of another user ({name or '?'})"


def on_port_line(state: State, event: Line, now: float) -> Result:
    """The server says its port is taken: find who holds it (once per server)."""
    if state.port_taken:
        return state, []
    if state.port_taken_since is None:  # the first start that finds it taken: nobody known yet
        state = replace(state, port_taken_since=now, port_holder=None)
    new = replace(state, port_taken=True)
    return new, [FindPortHolder(state.params.port)]


def on_port_holder(state: State, event: PortHolder, now: float) -> Result:
    """The holder of the port, as the daemon found it: reported (``server_port_taken``)."""
    if event.port != state.params.port or state.port_taken_since is None:
        return state, []
    new = replace(state, port_holder=(event.pid, event.name) if event.pid is not None else None)
    waited = now - state.port_taken_since
    return new, [Emit("server_port_taken", {
        "port": event.port, "holder_pid": event.pid, "holder_name": event.name, "holder": holder_text(new.port_holder),
        "waited_s": round(waited, 1), "port_wait_s": state.params.port_wait_s, "server_pid": state.pid})]


def exited_port_taken(state: State, event: Exited, now: float) -> Result:
    """The server exited because its port was taken: retry after ``port_retry_s`` while the port
    has been taken for less than ``port_wait_s``; then exit 78 naming the holder."""
    p = state.params
    assert state.pid is not None and state.port_taken_since is not None
    fields = exit_fields(state.pid, event.returncode, state.last_error)
    exited = Emit("server_exited", {**fields, "phase": "loading"})
    waited = now - state.port_taken_since
    holder = holder_text(state.port_holder)
    if waited >= p.port_wait_s:
        cause = (f"port {p.port} is held by {holder}, still after {waited:.0f} s of retries; fix: stop that "
                 f"process or choose another [server].port")
        new, actions = exit_daemon(replace(state, port_taken_since=None), EXIT_CONFIG, cause)
        return new, [exited, Emit("server_boot_failure", {"cause": cause, "port": p.port, "holder": holder,
                                                          "waited_s": round(waited, 1), **fields}), *actions]
    wait = min(p.port_retry_s, max(0.0, p.port_wait_s - waited))
    reason = f"port {p.port} held by {holder}"
    new = replace(fail(state, RestartCause.PORT_TAKEN, reason), phase=enter(state, Phase.BACKOFF), phase_data=None,
                  pid=None, deadline=now + wait)
    return new, [exited, Emit("server_backoff", {
        "backoff_s": wait, "restart_count": len(state.failures), "max_restarts": p.max_restarts,
        "window_s": p.restart_window_s, "last_failure": f"{reason} (retrying until it has been taken "
                                                          f"{p.port_wait_s:.0f} s; not counted as a crash)"})]
