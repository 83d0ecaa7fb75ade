"""Steps every phase of the policy takes: start a server (a VRAM check first on a watched GPU), stop
it, spawn one, exit, count a failure (back off or give up on a crash loop), the fields of an exit
event, and :func:`after_fault`, the one place that decides what follows a GPU fault (an OOM: check
the VRAM, reset, or count a failure). Pure, like the rest of the policy: no I/O, no clock reads.
"""

from __future__ import annotations

from dataclasses import replace

from llama_guard.model.actions import Action, CheckVram, Emit, ExitDaemon, SaveSlots, Spawn, Terminate
from llama_guard.model.phase_state import Starting, Stopping, WaitingVram
from llama_guard.model.policy.repeat import repeat_verdict
from llama_guard.model.types import AfterStop, Exit, Failure, Params, RestartCause, State, enter, exit_text
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_CRASH_LOOP
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

Result = tuple[State, list[Action]]
"""What every handler answers: the next state and the actions to carry out, in order."""

# A VRAM check that does not answer within this is skipped (the start goes on). The daemon bounds
# each check below it (VRAM_CHECK_TIMEOUT_S): the first check of a start also reads the model's GGUF
# for the need estimate, seconds of CPU on a large tokenizer.
VRAM_ANSWER_S = 30.0


VRAM_CHECK_TIMEOUT_S = 25.0


#: The phases in which a server serves (liveness probes, drains).
SERVING = (Phase.READY, Phase.DRAINING)

def fail(state: State, cause: RestartCause, text: str, line: str = "") -> State:
    """``state`` with its failure record set: the restart ``cause``, the failure in words, and the
    server's own ``line`` that decided it ("" when none did). The one place a failure is recorded."""
    return replace(state, failure=Failure(cause, text, line))


def restart_for(state: State, cause: RestartCause) -> State:
    """``state`` with the next restart's ``cause`` set (a plan, a reset for an Xid), the last
    failure's words and line kept."""
    return replace(state, failure=replace(state.failure, cause=cause))


def after_fault(params: Params, trigger: ResetTrigger, *, loading: bool) -> AfterStop:
    """What follows the stop for a GPU fault (the one rule, wherever the fault is seen).

    An OOM while loading on a watched GPU (``vram_admission``) first checks whether another process
    holds the VRAM (:attr:`AfterStop.VRAM_CHECK`); otherwise a reset when one can be verified and
    ``trigger`` is in ``[recovery].reset_on``; otherwise the fault is counted as a failure.
    ``loading``: the server had not become ready (false again once the VRAM check has been made).
    """
    if trigger is ResetTrigger.OOM and loading and params.vram_admission:
        return AfterStop.VRAM_CHECK
    if params.reset_possible and trigger in params.reset_on:
        return AfterStop.RESET
    return AfterStop.FAILURE


def exit_fields(pid: int, returncode: int | None, last_error: str = "") -> dict[str, object]:
    """The fields of an exit event; ``last_error`` (the server's last error/abort line) is kept in
    ``last_error`` and appended to ``exit_text``."""
    fields: dict[str, object] = {"server_pid": pid, "exit_text": exit_text(returncode)}
    if returncode is not None and returncode < 0:
        fields["signal"] = -returncode
    elif returncode is not None:
        fields["exit_status"] = returncode
    if last_error:
        fields["last_error"] = last_error
        fields["exit_text"] = f"{fields['exit_text']} after: {last_error}"
    return fields


#: Seconds a server judged hung gets between SIGTERM and SIGKILL. Its graceful stop cannot help (a
#: wedged decode never reaches it; a SIGSTOPped process does not run it; llama-server's "cleaning up
#: before exit" waits for the stuck slot) and every held client waits for it.
HUNG_GRACE_S = 1.0


def stop(state: State, now: float, after: AfterStop, reason: str, *, exit: Exit | None = None,
         grace_s: float | None = None, save_s: float = 0.0, reset_trigger: str = "") -> Result:
    """Begin stopping the current server (SIGTERM now, SIGKILL at the grace deadline: ``grace_s``
    seconds, else ``stop_grace_s``), for ``reason`` (words: ``server_stopped``'s reason). During the
    drain before the daemon's exit a fault changes how, not what: the stop still ends in that exit
    (no restart, no reset). ``save_s`` > 0: first save the slots (:class:`SaveSlots`), SIGTERM once
    they are saved or ``save_s`` seconds passed (:func:`end_save`). ``reset_trigger``: the fault a
    reset after the stop (``after`` RESET or VRAM_CHECK) is for; ``exit``: the daemon's exit that
    follows it (``after`` EXIT)."""
    if state.phase is Phase.DRAINING and state.after_stop is AfterStop.EXIT and after is not AfterStop.EXIT:
        after, exit = AfterStop.EXIT, state.exit
    grace = state.params.stop_grace_s if grace_s is None else min(grace_s, state.params.stop_grace_s)
    new = replace(state, phase=enter(state, Phase.STOPPING), phase_data=Stopping(reason, reset_trigger),
                  after_stop=after, deadline=now + grace, grace_s=grace, killed=False, saving=False,
                  exit=exit or state.exit)
    if state.pid is None:
        return new, []
    if save_s > 0:
        return replace(new, saving=True, deadline=now + save_s), [SaveSlots(state.pid)]
    return new, [Terminate(state.pid)]


def end_save(state: State, now: float) -> Result:
    """The saves before a stop ended (or ran out of time, or the GPU was lost meanwhile): SIGTERM
    now, SIGKILL after ``stop_grace_s``."""
    assert state.pid is not None
    grace = state.params.stop_grace_s
    return replace(state, saving=False, deadline=now + grace, grace_s=grace), [Terminate(state.pid)]


def spawn(state: State) -> Result:
    return (replace(state, phase=enter(state, Phase.STARTING), phase_data=Starting(), pid=None, started_at=None,
                    ready_at=None, deadline=None, strikes=0, pending_event=None, stable=False, killed=False,
                    reported_limits=frozenset(), last_progress_at=None, alloc_failure="", last_error="",
                    last_line="", failure=replace(state.failure, line=""), on_cpu_reported=False, port_taken=False,
                    stalls=0, http_errors=0, deferred_restart=None,
                    trial=None if state.trial is None else state.trial.at_spawn()),
            [Spawn()])


def exit_daemon(state: State, code: int, reason: str) -> Result:
    return (replace(state, phase=enter(state, Phase.EXITED), phase_data=None, pid=None, deadline=None,
                    exit=Exit(code, reason)),
            [ExitDaemon(code, reason)])


def exit_asked(state: State) -> Exit:
    """The daemon's exit that the stop, drain or reset under way ends in (``after_stop`` EXIT: every
    step that sets it sets :attr:`State.exit` too)."""
    assert state.exit is not None
    return state.exit


def count_failure(state: State, now: float, *, judged: bool = True) -> Result:
    """After a failed server: a verdict when it failed the same way on consecutive starts
    (:func:`~llama_guard.model.policy.repeat.repeat_verdict`; ``judged`` False for a start that
    never ran a server), else back off, or give up when the window holds too many failures."""
    ask: list[Action] = []
    if judged:
        state, verdict, ask = repeat_verdict(state, now)
        if verdict is not None:
            new, actions = exit_daemon(state, EXIT_CONFIG, str(verdict.fields["cause"]))
            return new, [verdict, *actions]
    new, actions = _back_off(state, now)
    if judged and new.phase is Phase.BACKOFF and new.identical == new.params.identical_failures - 1:
        # The next start confirms a repeated failure: not before repeat_confirm_s after the first.
        confirm_at = new.identical_since + new.params.repeat_confirm_s
        if new.deadline is not None and new.deadline < confirm_at:
            new = replace(new, deadline=confirm_at)
            actions = [replace(a, fields={**a.fields, "backoff_s": round(confirm_at - now, 3)})
                       if isinstance(a, Emit) and a.name == "server_backoff" else a for a in actions]
    return new, [*ask, *actions]


def _back_off(state: State, now: float) -> Result:
    p = state.params
    recent = (*((t, pid) for t, pid in state.failures if now - t < p.restart_window_s), (now, state.pid))
    state = replace(state, failures=recent, pid=None)
    if len(recent) > p.max_restarts:
        new, actions = exit_daemon(state, EXIT_CRASH_LOOP, f"crash loop: {state.failure.text}")
        emit = Emit("crash_loop", {"restart_count": len(recent), "window_s": p.restart_window_s,
                                   "max_restarts": p.max_restarts, "last_failure": state.failure.text})
        return new, [emit, *actions]
    if state.stable or (len(recent) == 1 and state.next_backoff_s <= p.backoff_initial_s):
        # A server that had run stably (or the first failure in the window) restarts at once; the
        # backoff starts with the next failure.
        wait = 0.0
        following = p.backoff_initial_s
    else:
        wait = state.next_backoff_s
        following = min(wait * p.backoff_factor, p.backoff_max_s)
    new = replace(state, phase=enter(state, Phase.BACKOFF), phase_data=None, deadline=now + wait,
                  next_backoff_s=following)
    return new, [Emit("server_backoff", {"backoff_s": wait, "restart_count": len(recent),
                                         "max_restarts": p.max_restarts, "window_s": p.restart_window_s,
                                         "last_failure": state.failure.text})]


def start(state: State, now: float, *, after_oom: str = "") -> Result:
    """Start a server: on a watched GPU, check its free VRAM first (:class:`CheckVram`). ``after_oom``:
    the OOM at load (in words) this start follows, which the check judges (:class:`WaitingVram`)."""
    if not state.params.vram_admission:
        return spawn(state)
    new = replace(state, phase=enter(state, Phase.WAITING_VRAM), phase_data=WaitingVram(after_oom), pid=None,
                  deadline=now + VRAM_ANSWER_S)
    return new, [CheckVram()]
