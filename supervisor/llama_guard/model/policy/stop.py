"""Stopping a server and what comes after it (:class:`~llama_guard.model.types.AfterStop`): the
STOPPING phase, a stop request, the exit after an unrecovered allocation failure. A planned window's
drain and its start after the stop are :mod:`.window`'s. Pure.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from llama_guard.model.actions import Action, Emit, Kill, Terminate
from llama_guard.model.inputs import Exited, Input, Line, SlotsSaved, Spawned, SpawnFailed, StopRequest, Tick
from llama_guard.model.phase_state import Stopping
from llama_guard.model.policy.gpu import begin_reset
from llama_guard.model.policy.lend import grant
from llama_guard.model.policy.lines import FATAL_FAMILIES, fault_event, incompatible
from llama_guard.model.policy.reset_stop import stop_during_reset
from llama_guard.model.policy.steps import (
    Result,
    after_fault,
    count_failure,
    end_save,
    exit_asked,
    exit_daemon,
    exit_fields,
    fail,
    start,
    stop,
)
from llama_guard.model.policy.verdicts import unkillable, watchdog_hit
from llama_guard.model.policy.window import drain_before_exit, start_again
from llama_guard.model.server_log import Family
from llama_guard.model.types import AfterStop, Exit, RestartCause, State, TrialStage
from llama_guard.vocab.exitcodes import EXIT_OK
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger


def on_stopping(state: State, event: Input, now: float) -> Result:
    p = state.params
    if state.pid is None:
        # A stop was requested before the spawn answered.
        if isinstance(event, Spawned):
            return replace(state, pid=event.pid, deadline=now + p.stop_grace_s, grace_s=p.stop_grace_s), \
                [Terminate(event.pid)]
        if isinstance(event, SpawnFailed):
            return finish_stop(state, now)
        return state, []
    if state.saving and not state.killed and (
            (isinstance(event, SlotsSaved) and event.pid == state.pid)
            or (isinstance(event, Tick) and state.deadline is not None and now >= state.deadline)):
        return end_save(state, now)
    if (isinstance(event, Line) and event.pid == state.pid and event.verdict.family is Family.GPU_INCOMPATIBLE
            and state.after_stop is not AfterStop.EXIT):
        return incompatible(state, now, event.verdict, event.text)
    if isinstance(event, Line) and event.pid == state.pid and state.pending_event is not None:
        fault = fault_event(state, event.verdict, event.text)
        if fault is not None:
            name, fields = fault
            reason = f"{name}: {event.verdict.cause}"
            # The abort line can come before the message (seen on an H200): the message decides
            # the cause and whether this fault calls for a reset.
            restart_cause, trigger = FATAL_FAMILIES[event.verdict.family]
            new = replace(fail(state, restart_cause, reason, event.text.strip()), pending_event=None)
            if trigger is None:  # the launch watchdog: a restart only, even after an abort line (an exit asked
                # for meanwhile stays the exit)
                after_stop = AfterStop.EXIT if new.after_stop is AfterStop.EXIT else AfterStop.FAILURE
                new, repeated = watchdog_hit(replace(new, after_stop=after_stop), now, event.verdict.cause)
                return new, [Emit(name, fields), *repeated]
            if new.after_stop is AfterStop.FAILURE:
                after = after_fault(state.params, trigger, loading=state.ready_at is None)
                if after is not AfterStop.FAILURE:
                    new = replace(new, after_stop=after, phase_data=Stopping(state.stop_reason, reason))
            return new, [Emit(name, fields)]
        return state, []
    if isinstance(event, Exited) and event.pid == state.pid:
        actions: list[Action] = []
        fields = exit_fields(state.pid, event.returncode, state.last_error)
        if state.killed and event.returncode == -signal.SIGKILL:
            fields["exit_text"] = "killed by SIGKILL (sent by llama-guard)"
        if state.pending_event is not None:
            name, cause = state.pending_event
            actions.append(Emit(name, {"server_pid": state.pid, "line": cause, "cause": cause, **fields}))
        actions.append(Emit("server_stopped", {**fields, "reason": state.stop_reason}))
        new, more = finish_stop(replace(state, pending_event=None, saving=False), now)
        return new, actions + more
    if isinstance(event, Tick) and state.deadline is not None and now >= state.deadline:
        if not state.killed:
            new = replace(state, killed=True, deadline=now + p.kill_wait_s)
            return new, [Emit("server_stop_timeout", {"server_pid": state.pid, "grace_s": state.grace_s}),
                         Kill(state.pid)]
        # SIGKILL did not end it either (uninterruptible sleep in the driver): a verdict, no
        # reset and no second server.
        return unkillable(state)
    return state, []


def finish_stop(state: State, now: float, reset_trigger: str | None = None) -> Result:
    """The stopped server is gone: carry out ``state.after_stop`` (exit, reset, VRAM check, restart, a
    failure). ``reset_trigger``: the fault a reset or VRAM check is for (None: the stop's own,
    :attr:`Stopping.reset_trigger`)."""
    stopping = state.stopping
    trigger = reset_trigger if reset_trigger is not None else stopping.reset_trigger if stopping else ""
    if state.after_stop is AfterStop.EXIT:
        asked = exit_asked(state)
        return exit_daemon(state, asked.code, asked.reason or "stopped")
    if state.after_stop is AfterStop.RESET:
        return begin_reset(state, now, trigger)
    if state.after_stop is AfterStop.VRAM_CHECK:
        return start(replace(state, pid=None), now, after_oom=trigger)
    if state.after_stop is AfterStop.LEND:
        return grant(state, now)
    if state.after_stop is AfterStop.RESTART:
        return start_again(state, now)  # a planned window's start
    return count_failure(state, now)


def alloc_fatal(state: State, event: Exited, now: float, phase: str) -> Result:
    """The server exited after an allocation failure it did not recover from: a fatal OOM."""
    assert state.pid is not None
    fields = exit_fields(state.pid, event.returncode, state.last_error)
    reason = f"server_oom: {state.alloc_failure}"
    oom = Emit("server_oom", {"server_pid": state.pid, "line": state.alloc_failure,
                              "cause": state.alloc_failure, "phase": phase, **{
                                  k: v for k, v in fields.items() if k != "server_pid"}})
    new = replace(fail(state, RestartCause.OOM, reason), alloc_failure="", boot_signature="")
    # As for an OOM line that stops the server (after_fault): VRAM check, reset or a failure.
    after = after_fault(state.params, ResetTrigger.OOM, loading=phase == "loading")
    new, actions = finish_stop(replace(new, after_stop=after), now, reset_trigger=reason)
    return new, [oom, Emit("server_exited", {**fields, "phase": phase}), *actions]


def on_stop_request(state: State, event: StopRequest, now: float) -> Result:
    if state.phase is Phase.RESETTING:
        return stop_during_reset(state, event, now)
    reason = event.reason
    if state.phase is Phase.TRIAL and state.trial is not None:
        measured = "the serving build" if state.trial.stage is TrialStage.OLD else "the new build"
        reason += f"; the trial of a new build is abandoned while measuring {measured} (no outcome recorded)"
    emit = Emit("daemon_stopping", {"reason": reason, "server_pid": state.pid})
    if state.phase in (Phase.STOPPED, Phase.BACKOFF, Phase.WAITING_VRAM, Phase.LENT):
        new, actions = exit_daemon(state, EXIT_OK, event.reason)
        return new, [emit, *actions]
    if state.phase in (Phase.READY, Phase.DRAINING) and not event.immediate and state.params.exit_drain_s > 0:
        return drain_before_exit(state, event, now)
    if state.phase is Phase.STOPPING:
        new = replace(state, after_stop=AfterStop.EXIT, exit=Exit(EXIT_OK, event.reason))
        if event.immediate and state.pid is not None and not state.killed:
            return replace(new, killed=True, deadline=now + state.params.kill_wait_s), [emit, Kill(state.pid)]
        return new, []
    new, actions = stop(state, now, AfterStop.EXIT, event.reason, exit=Exit(EXIT_OK, event.reason))
    if event.immediate and state.pid is not None:
        new = replace(new, killed=True, deadline=now + state.params.kill_wait_s)
        actions = [Kill(state.pid)]
    return new, [emit, *actions]
