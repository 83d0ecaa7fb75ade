"""The pure policy: a restart asked for (``llama-guard restart``, SIGUSR1) happens or is refused with a
reason, whatever the phase it comes in — never logged and dropped. Before: while the server loaded or
restored its slots (STARTING) it was "ignored: the server is still loading" and never carried out; while
draining, stopping, resetting or waiting for VRAM it vanished without a word. The e2e test (a slot restore
or a load that lasts, the test double): tests/e2e/test_restart_asked_e2e.py."""

from __future__ import annotations

from dataclasses import replace

from harness import emitted, names
from harness import ready as policy_ready
from harness import started as policy_started
from llama_guard.model.actions import Spawn, StartDrain, Terminate
from llama_guard.model.inputs import Drained, Exited, GpuFault, HealthOk, RestartRequest, StopRequest
from llama_guard.model.phase_state import Resetting, WaitingVram
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, GpuFaultKind, Lend, Params, RestartCause, State
from llama_guard.vocab.phases import Phase

P = Params(hang_strikes=2, stop_grace_s=4, drain_timeout_s=20, backoff_initial_s=1)
ASKED = RestartRequest("SIGUSR1 (llama-guard restart)")


def test_a_restart_asked_while_loading_is_carried_out_once_ready() -> None:
    s = policy_started(P, 100, 0.0)
    s, acts = decide(s, ASKED, 0.5)
    assert s.phase is Phase.STARTING and s.deferred_restart == (RestartCause.OPERATOR, ASKED.reason)
    assert "ready" in str(emitted(acts, "restart_requested").fields["deferred"])
    # Asked twice: still one restart.
    s, _ = decide(s, ASKED, 0.7)
    s, acts = decide(s, HealthOk(100), 30.0)  # e.g. after a slot restore that hung for restore_timeout_s
    assert names(acts)[:2] == ["server_ready", "restart_requested"] and StartDrain(100) in acts
    assert s.phase is Phase.DRAINING and s.after_stop is AfterStop.RESTART and s.deferred_restart is None
    s, acts = decide(s, Drained(100), 30.5)
    assert s.phase is Phase.STOPPING and Terminate(100) in acts
    s, acts = decide(s, Exited(100, 0), 31.0)
    assert Spawn() in acts and s.failures == ()  # a planned restart: no failure counted


def test_a_crash_while_loading_fulfils_the_restart_asked() -> None:
    s, _ = decide(policy_started(P, 100, 0.0), ASKED, 0.5)
    s, acts = decide(s, Exited(100, -11), 1.0)
    assert s.phase is Phase.BACKOFF or Spawn() in acts
    if s.phase is Phase.BACKOFF:
        s, acts = decide(s, RestartRequest("again"), 1.1)  # asked in backoff: the start happens now
    assert s.phase is Phase.STARTING and s.deferred_restart is None


def test_a_plans_restart_while_loading_is_refused_with_its_reason() -> None:
    s = policy_started(P, 100, 0.0)
    new, acts = decide(s, RestartRequest("cron", cause=RestartCause.SCHEDULE), 0.5)
    assert new == s and "fresh" in str(emitted(acts, "restart_requested").fields["refused"])


def test_a_restart_asked_while_a_restart_is_under_way_is_said_to_be_that_one() -> None:
    draining, _ = decide(policy_ready(P), RestartRequest("first"), 5.0)
    stopping, _ = decide(draining, Drained(100), 6.0)
    resetting = replace(stopping, phase=Phase.RESETTING, phase_data=Resetting("Xid 79"), after_stop=AfterStop.RESET)
    waiting = replace(stopping, phase=Phase.WAITING_VRAM, phase_data=WaitingVram(), pid=None)
    for s in (draining, stopping, resetting, waiting):
        new, acts = decide(s, ASKED, 7.0)
        assert new == s, s.phase
        assert s.phase.value in str(emitted(acts, "restart_requested").fields["under_way"])


def test_a_restart_asked_while_the_daemon_stops_is_refused_with_the_reason() -> None:
    stopping, _ = decide(policy_ready(replace(P, exit_drain_s=30.0)), StopRequest("SIGTERM"), 5.0)
    assert stopping.after_stop is AfterStop.EXIT
    new, acts = decide(stopping, ASKED, 6.0)
    assert new == stopping and "stopping" in str(emitted(acts, "restart_requested").fields["refused"])
    # A GPU lost during that drain changes how it stops, not that it ends: still refused.
    lost, _ = decide(stopping, GpuFault(GpuFaultKind.GPU_LOST, "GPU is lost"), 6.5)
    assert "refused" in emitted(decide(lost, ASKED, 7.0)[1], "restart_requested").fields


def test_every_phase_answers_a_restart_asked() -> None:
    # The whole kind: in no phase but EXITED (the daemon is gone) is a restart asked for silent.
    base = policy_ready(P)
    for phase in Phase:
        if phase is Phase.EXITED:
            continue
        s: State = replace(base, phase=phase, lend=Lend(7, 60.0, 68.0) if phase is Phase.LENT else None)
        _, acts = decide(s, ASKED, 8.0)
        assert "restart_requested" in names(acts) or "server_restart" in names(acts), phase
