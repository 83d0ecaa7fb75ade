"""The pure policy of a window lent to ``llama-guard tune`` (model/policy/lend.py): asked for while the server
serves, granted once it is drained and stopped (LENT), ended by tune's return, its process's end or the
bound (SIGTERM to tune, then SIGKILL), refused in every other case with a reason and no change. Before,
tune refused to run at all while a daemon served its configuration. The e2e tests: tests/e2e/test_tune_window_e2e.py."""

from __future__ import annotations

import signal
from dataclasses import replace

from harness import emitted, names
from harness import ready as policy_ready
from harness import started as policy_started
from llama_guard.front.admission import Gate, gate_of
from llama_guard.model.actions import AnswerLend, Kill, SignalTune, Spawn, StartDrain, Terminate
from llama_guard.model.inputs import (
    Drained,
    Exited,
    GpuFault,
    LendAsked,
    LendReturned,
    RestartRequest,
    StopRequest,
    Tick,
)
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, GpuFaultKind, LendEnd, Params, State, XidAction
from llama_guard.vocab.phases import Phase

P = Params(stop_grace_s=4, kill_wait_s=2, drain_timeout_s=20, backoff_initial_s=1)
TUNE = 4242
ASK = LendAsked(TUNE, 180.0)


def lent(params: Params = P) -> State:
    """A state whose server 100 was drained and stopped for tune at 6.0: LENT until 186.0."""
    s, acts = decide(policy_ready(params), ASK, 5.0)
    assert s.phase is Phase.DRAINING and StartDrain(100) in acts and names(acts) == ["lend_requested"]
    s, acts = decide(s, Drained(100), 5.5)
    assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.LEND and Terminate(100) in acts
    s, acts = decide(s, Exited(100, 0), 6.0)
    assert s.phase is Phase.LENT and s.pid is None and s.deadline == 186.0
    assert AnswerLend(TUNE, True, bound_s=180.0) in acts and "lend_granted" in names(acts)
    assert Spawn() not in acts and s.failures == ()
    return s


def test_a_window_is_drained_stopped_granted_and_returned_then_a_server_starts() -> None:
    s = lent()
    s, acts = decide(s, LendReturned(TUNE, LendEnd.DONE), 60.0)
    assert s.phase is Phase.STARTING and Spawn() in acts and s.lend is None
    assert emitted(acts, "lend_returned").fields == {"tune_pid": TUNE, "end": "done", "lent_s": 54.0}


def test_the_drain_timeout_still_lends_the_window() -> None:
    s, _ = decide(policy_ready(P), ASK, 5.0)
    s, acts = decide(s, Tick(), 25.5)
    assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.LEND and "drain_timeout" in names(acts)


def test_the_end_of_tunes_process_ends_the_window_and_another_pid_does_not() -> None:
    s = lent()
    same, acts = decide(s, LendReturned(999, LendEnd.EXITED), 30.0)
    assert same == s and acts == []
    s, acts = decide(s, LendReturned(TUNE, LendEnd.EXITED), 30.0)
    assert s.phase is Phase.STARTING and emitted(acts, "lend_returned").fields["end"] == "exited"


def test_the_bound_sends_sigterm_then_sigkill_and_starts_a_server() -> None:
    s = lent()
    same, acts = decide(s, Tick(), 100.0)  # before the bound: nothing
    assert same == s and acts == []
    s, acts = decide(s, Tick(), 186.0)
    assert s.phase is Phase.LENT and SignalTune(TUNE, signal.SIGTERM) in acts and "lend_timeout" in names(acts)
    assert s.deadline == 186.0 + 4 + 2
    s, acts = decide(s, Tick(), 192.0)
    assert SignalTune(TUNE, signal.SIGKILL) in acts and s.phase is Phase.STARTING and Spawn() in acts
    assert emitted(acts, "lend_returned").fields["end"] == "timed_out"


def test_tune_returning_it_after_the_sigterm_ends_it_at_once() -> None:
    s, _ = decide(lent(), Tick(), 186.0)
    s, acts = decide(s, LendReturned(TUNE, LendEnd.STOPPED), 187.0)
    assert s.phase is Phase.STARTING and emitted(acts, "lend_returned").fields["end"] == "stopped"


def test_a_second_tune_is_refused_while_a_window_is_asked_for_or_lent() -> None:
    draining, _ = decide(policy_ready(P), ASK, 5.0)
    for s in (draining, lent()):
        new, acts = decide(s, LendAsked(5555, 60.0), 7.0)
        assert new == s
        answer = next(a for a in acts if isinstance(a, AnswerLend))
        assert answer.pid == 5555 and not answer.granted and str(TUNE) in answer.reason
        assert emitted(acts, "lend_refused").fields["tune_pid"] == 5555


def test_a_window_is_refused_unless_the_server_serves() -> None:
    loading = policy_started(P, 100, 0.0)
    stopped = replace(loading, phase=Phase.STOPPED, phase_data=None, pid=None)
    for s in (loading, stopped):
        new, acts = decide(s, ASK, 1.0)
        assert new == s and AnswerLend(TUNE, False, f"llama-server is {s.phase.value}: a window is lent only "
                                                    "from a serving (ready) server") in acts


def test_tune_gone_during_the_drain_cancels_the_window_and_the_server_serves_on() -> None:
    """Before: the drain became a planned restart, its ``restart_cause`` left at ``crash``."""
    ready = policy_ready(P)
    s, _ = decide(ready, ASK, 5.0)
    s, acts = decide(s, LendReturned(TUNE, LendEnd.EXITED, "its connection closed"), 5.2)
    assert s.phase is Phase.READY and s.pid == 100 and s.lend is None and s.after_stop is AfterStop.FAILURE
    assert s.deadline is None and s.ready_at == ready.ready_at and gate_of(s) is Gate.OPEN
    assert names(acts) == ["lend_cancelled"] and not [a for a in acts if isinstance(a, (Terminate, Spawn))]
    assert emitted(acts, "lend_cancelled").fields == {
        "tune_pid": TUNE, "end": "exited", "server_pid": 100, "outcome": "the drain is undone: the server serves on",
        "cause": f"tune pid {TUNE} is gone before the window was granted: its connection closed"}
    same, acts = decide(s, Drained(100), 5.5)  # the drain watch's late answer changes nothing
    assert same == s and acts == []
    # an end for a window nobody asked for changes nothing
    same, acts = decide(s, LendReturned(TUNE, LendEnd.DONE), 7.0)
    assert same == s and acts == []


def test_tune_gone_during_the_stop_for_its_window_restarts_with_that_cause() -> None:
    s, _ = decide(policy_ready(P), ASK, 5.0)
    s, _ = decide(s, Drained(100), 5.5)
    assert s.phase is Phase.STOPPING
    s, acts = decide(s, LendReturned(TUNE, LendEnd.STOPPED), 5.6)
    assert s.after_stop is AfterStop.RESTART and s.lend is None
    assert "its stop was under way" in emitted(acts, "lend_cancelled").fields["outcome"]
    assert "it ended (stopped)" in emitted(acts, "lend_cancelled").fields["cause"]
    s, acts = decide(s, Exited(100, 0), 6.0)
    assert s.phase is Phase.STARTING and Spawn() in acts
    assert emitted(acts, "server_restart").fields["restart_cause"] == "lend_cancelled"


def test_tune_gone_after_its_drain_became_anothers_is_forgotten() -> None:
    """The daemon's exit took the drain over (its refusal posted meanwhile is not seen yet)."""
    s, _ = decide(policy_ready(P), ASK, 5.0)
    s = replace(s, after_stop=AfterStop.EXIT)
    s, acts = decide(s, LendReturned(TUNE, LendEnd.EXITED, "its process ended"), 5.6)
    assert s.lend is None and s.after_stop is AfterStop.EXIT and s.phase is Phase.DRAINING
    assert emitted(acts, "lend_cancelled").fields["outcome"] == "nothing was lent"


def test_a_stop_of_the_daemon_during_the_drain_refuses_the_window() -> None:
    s, _ = decide(policy_ready(replace(P, exit_drain_s=5.0)), ASK, 5.0)
    s, acts = decide(s, StopRequest("SIGTERM received"), 5.5)
    assert s.after_stop is AfterStop.EXIT and s.lend is None
    answer = next(a for a in acts if isinstance(a, AnswerLend))
    assert not answer.granted and "draining" in answer.reason


def test_a_crash_during_the_drain_refuses_the_window() -> None:
    s, _ = decide(policy_ready(P), ASK, 5.0)
    s, acts = decide(s, Exited(100, -11), 5.5)
    assert s.lend is None and s.phase is not Phase.LENT
    assert any(isinstance(a, AnswerLend) and not a.granted for a in acts)


def test_a_gpu_fault_while_stopping_for_the_window_resets_instead() -> None:
    s, _ = decide(policy_ready(replace(P, reset_possible=True)), ASK, 5.0)
    s, _ = decide(s, Drained(100), 5.5)
    s, acts = decide(s, GpuFault(GpuFaultKind.XID, "xid 79", action=XidAction.RESET), 5.6)
    assert s.after_stop is AfterStop.RESET and s.lend is None
    assert any(isinstance(a, AnswerLend) and not a.granted for a in acts)


def test_a_restart_asked_while_lent_is_refused_and_a_stop_exits() -> None:
    s = lent()
    new, acts = decide(s, RestartRequest("SIGUSR1 (llama-guard restart)"), 10.0)
    assert new == s and "lent to tune" in str(emitted(acts, "restart_requested").fields["refused"])
    new, acts = decide(s, StopRequest("SIGTERM received"), 10.0)
    assert new.phase is Phase.EXITED and Kill not in map(type, acts)


def test_the_status_line_names_the_tune_and_the_window_left() -> None:
    from llama_guard.status.snapshot import status_line

    assert status_line(lent(), 100.0, None) == "lent_to_tune, to tune pid 4242 for at most 86 s more"


def test_a_restart_asked_while_the_window_is_asked_for_is_refused_not_said_to_be_under_way() -> None:
    draining, _ = decide(policy_ready(P), ASK, 5.0)
    stopping, _ = decide(draining, Drained(100), 5.5)
    for s in (draining, stopping):
        new, acts = decide(s, RestartRequest("SIGUSR1 (llama-guard restart)"), 5.6)
        assert new == s
        assert "drain and stop are under way" in str(emitted(acts, "restart_requested").fields["refused"])
