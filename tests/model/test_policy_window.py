"""The planned window around a new llama-server build (model/policy/window.py): drain → measure the old
build → stop → start → measure the new one → keep (release the held clients) or roll back at once.
Pure policy: every step of the sequence, every way the trial ends, and what interrupts it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import emitted, line, names, ready
from llama_guard.front.admission import Gate, gate_of
from llama_guard.model.actions import ExitDaemon, Kill, MeasureSpeed, NotifyReady, Spawn, StartDrain, Terminate
from llama_guard.model.inputs import (
    Drained,
    Exited,
    HealthOk,
    ParamsChanged,
    RestartRequest,
    Spawned,
    SpeedMeasured,
    StopRequest,
    Tick,
    TrialAsked,
)
from llama_guard.model.policy import decide
from llama_guard.model.types import (
    AfterStop,
    Params,
    Phase,
    RestartCause,
    State,
    Trial,
    TrialResult,
    TrialStage,
)

P = Params(trial_runs=2, trial_tokens=16, max_slowdown_pct=25.0, stop_grace_s=4, drain_timeout_s=300,
           max_restarts=5)
NEW_BUILD = ParamsChanged(P, server_changed=True, new_build=True)


def measuring_old(params: Params = P) -> State:
    """The old server (pid 100) drained after a reload that names a new build: TRIAL, measured."""
    s, acts = decide(ready(params), replace(NEW_BUILD, params=params), 5.0)
    assert s.phase is Phase.DRAINING and StartDrain(100) in acts
    assert s.trial == Trial(TrialStage.OLD)
    s, acts = decide(s, Drained(100), 6.0)
    assert s.phase is Phase.TRIAL and acts == [MeasureSpeed(100, params.trial_runs, params.trial_tokens)]
    assert gate_of(s) is Gate.HOLD  # the front door still holds the clients
    return s


def measuring_new(old_tps: float | None = 100.0, params: Params = P, error: str = "") -> State:
    """The old build measured at ``old_tps`` and stopped, the new one (pid 200) loaded: TRIAL again."""
    s, acts = decide(measuring_old(params), SpeedMeasured(100, old_tps, error), 7.0)
    assert s.phase is Phase.STOPPING and acts == [Terminate(100)] and s.after_stop is AfterStop.RESTART
    s, acts = decide(s, Exited(100, 0), 8.0)
    assert s.phase is Phase.STARTING and Spawn() in acts
    assert s.trial == Trial(TrialStage.NEW, old_tps=old_tps, old_error=error, spawned=True)
    s, _ = decide(s, Spawned(200), 8.1)
    s, acts = decide(s, HealthOk(200, 201, "llama-server"), 10.0)
    assert s.phase is Phase.TRIAL and acts == [MeasureSpeed(200, params.trial_runs, params.trial_tokens)]
    assert NotifyReady() not in acts and gate_of(s) is Gate.HOLD
    return s


def test_a_new_build_within_the_limit_is_kept_and_the_clients_released() -> None:
    s, acts = decide(measuring_new(100.0), SpeedMeasured(200, 80.0), 12.0)  # -20 %, limit 25 %
    assert s.phase is Phase.READY and NotifyReady() in acts and gate_of(s) is Gate.OPEN
    ready_event = emitted(acts, "server_ready").fields
    assert ready_event["port_pid"] == 201 and "restart_to_ready_s" in ready_event
    assert ready_event["load_s"] == pytest.approx(1.9) and ready_event["trial_s"] == pytest.approx(2.0)
    assert s.trial is None and s.last_trial == TrialResult(100.0, 80.0, kept=True, max_slowdown_pct=25.0)
    assert s.last_trial.slowdown_pct == pytest.approx(20.0)


def test_a_faster_new_build_is_kept() -> None:
    s, _ = decide(measuring_new(50.0), SpeedMeasured(200, 60.0), 12.0)
    assert s.phase is Phase.READY and s.last_trial is not None and s.last_trial.kept
    assert s.last_trial.slowdown_pct == pytest.approx(-20.0)


@pytest.mark.parametrize(("old", "new", "shown"), [(100.0, 70.0, "-30 %"), (12.5, 1.0, "-92 %")])
def test_a_new_build_slower_than_the_limit_is_rolled_back_at_once(old: float, new: float, shown: str) -> None:
    s, acts = decide(measuring_new(old), SpeedMeasured(200, new), 12.0)
    assert s.phase is Phase.STOPPING and acts == [Terminate(200)] and s.after_stop is AfterStop.RESTART
    assert gate_of(s) is Gate.HOLD  # the clients stay held: released only once the old build serves again
    cause = f"slower: {new:.1f} tok/s vs {old:.1f} tok/s ({shown}, limit 25 %)"
    assert s.failure.cause is RestartCause.TRIAL and s.failure.text == cause and s.stop_reason == cause
    assert s.last_trial == TrialResult(old, new, kept=False, cause=cause, max_slowdown_pct=25.0)
    s, acts = decide(s, Exited(200, 0), 13.0)
    assert s.phase is Phase.STARTING and Spawn() in acts and s.trial is None  # the last good build: no trial
    assert emitted(acts, "server_restart").fields["restart_cause"] == "trial"
    s, _ = decide(s, Spawned(300), 13.1)
    s, acts = decide(s, HealthOk(300), 15.0)
    assert s.phase is Phase.READY and NotifyReady() in acts and s.last_trial is not None
    assert not s.last_trial.kept  # the figures of the trial stay for status and /metrics


def test_a_new_build_whose_measurement_fails_is_rolled_back() -> None:
    s, acts = decide(measuring_new(100.0), SpeedMeasured(200, None, "completion failed: HTTP 500"), 12.0)
    assert s.phase is Phase.STOPPING and acts == [Terminate(200)]
    assert s.failure.text == "its trial failed: completion failed: HTTP 500"


def test_without_a_figure_of_the_old_build_the_new_one_is_kept_by_its_answer() -> None:
    s, acts = decide(measuring_new(None, error="timed out"), SpeedMeasured(200, 3.0), 12.0)
    assert s.phase is Phase.READY and NotifyReady() in acts
    assert s.last_trial is not None and s.last_trial.kept and s.last_trial.slowdown_pct is None
    assert s.last_trial.cause == "no figure of the old build to compare with (timed out)"


def test_no_trial_when_trial_runs_is_0_or_the_build_is_the_same() -> None:
    off = replace(P, trial_runs=0)
    s, _ = decide(ready(off), ParamsChanged(off, server_changed=True, new_build=True), 5.0)
    assert s.phase is Phase.DRAINING and s.trial is None
    s, _ = decide(ready(P), ParamsChanged(P, server_changed=True), 5.0)
    assert s.trial is None
    s, acts = decide(s, Drained(100), 6.0)
    assert s.phase is Phase.STOPPING and acts == [Terminate(100)]


def test_a_new_build_while_the_server_loads_has_no_old_server_to_measure() -> None:
    from harness import started

    s, _ = decide(started(P), NEW_BUILD, 2.0)
    assert s.phase is Phase.STOPPING and s.trial is None


def test_the_old_build_exits_as_it_is_measured_the_new_one_follows_compared_with_nothing() -> None:
    s, acts = decide(measuring_old(), Exited(100, -11), 7.0)
    assert "server_exited" in names(acts) and emitted(acts, "server_exited").fields["phase"] == "trial"
    assert s.phase is Phase.BACKOFF and s.trial == Trial(TrialStage.NEW, old_error="the old build exited as it "
                                                                                    "was measured")
    s, acts = decide(s, Tick(), 1000.0)
    assert s.phase is Phase.STARTING and s.trial is not None and s.trial.spawned


def test_the_new_build_exits_as_it_is_measured_a_failure_and_no_trial_after() -> None:
    s, _ = decide(measuring_new(), Exited(200, -11), 11.0)
    assert s.phase is Phase.BACKOFF and "killed by SIGSEGV" in s.failure.text and "new build" in s.failure.text
    s, _ = decide(s, Tick(), 1000.0)
    assert s.phase is Phase.STARTING and s.trial is None  # the start after rolls back: not measured


def test_a_fatal_line_during_the_trial_stops_the_server() -> None:
    s, acts = decide(measuring_new(), line(200, "CUDA error: out of memory"), 11.0)
    assert s.phase is Phase.STOPPING and Terminate(200) in acts and s.trial is None
    s, acts = decide(measuring_old(), line(100, "CUDA error: out of memory"), 7.0)
    assert s.phase is Phase.STOPPING and s.trial == Trial(TrialStage.OLD)


def test_harmless_lines_and_other_servers_answers_change_nothing() -> None:
    s = measuring_new()
    for event in (line(200, "srv  log_server_r: request: GET /health 127.0.0.1 200"), SpeedMeasured(100, 1.0),
                  Exited(100, 0), Tick()):
        assert decide(s, event, 11.0) == (s, [])


def test_a_restart_asked_during_the_trial_is_the_one_under_way() -> None:
    s = measuring_new()
    after, acts = decide(s, RestartRequest("SIGUSR1 (llama-guard restart)"), 11.0)
    assert after == s and "under_way" in emitted(acts, "restart_requested").fields


def test_a_restart_asked_while_the_new_build_loaded_comes_once_it_is_kept() -> None:
    s, acts = decide(measuring_old(), SpeedMeasured(100, 100.0), 7.0)
    s, _ = decide(s, Exited(100, 0), 8.0)
    s, _ = decide(s, Spawned(200), 8.1)
    s, _ = decide(s, RestartRequest("SIGUSR1 (llama-guard restart)", cause=RestartCause.OPERATOR), 9.0)
    assert s.deferred_restart is not None
    s, _ = decide(s, HealthOk(200), 10.0)
    assert s.phase is Phase.TRIAL
    s, acts = decide(s, SpeedMeasured(200, 100.0), 12.0)
    assert s.phase is Phase.DRAINING and NotifyReady() in acts and StartDrain(200) in acts


def test_a_stop_during_the_trial_stops_the_server_and_exits() -> None:
    s, acts = decide(measuring_new(), StopRequest("SIGTERM received"), 11.0)
    assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.EXIT and Terminate(200) in acts
    assert gate_of(s) is Gate.CLOSED  # held requests get the stop's 503 at once, as in a drain's stop
    assert emitted(acts, "daemon_stopping").fields["reason"] == (
        "SIGTERM received; the trial of a new build is abandoned while measuring the new build (no outcome recorded)")
    s, acts = decide(measuring_old(), StopRequest("SIGTERM received", immediate=True), 7.0)
    assert Kill(100) in acts
    assert "abandoned while measuring the serving build" in emitted(acts, "daemon_stopping").fields["reason"]
    s, acts = decide(s, Exited(100, -9), 8.0)
    assert isinstance(acts[-1], ExitDaemon) and s.phase is Phase.EXITED


def test_a_second_spawn_ends_a_trial() -> None:
    trial = Trial(TrialStage.NEW, old_tps=1.0)
    assert trial.at_spawn() == replace(trial, spawned=True)
    assert replace(trial, spawned=True).at_spawn() is None
    assert Trial(TrialStage.OLD).at_spawn() is None


def test_a_build_found_replaced_at_a_start_is_measured_against_the_recorded_figure() -> None:
    from harness import started

    s = replace(started(P), pid=None)  # the spawn not answered yet: the build port asks before it
    s = decide(s, TrialAsked(40.0), 2.0)[0]
    assert s.trial == Trial(TrialStage.NEW, old_tps=40.0, spawned=True)
    s, _ = decide(s, Spawned(200), 2.1)
    s, acts = decide(s, HealthOk(200), 4.0)
    assert s.phase is Phase.TRIAL and acts == [MeasureSpeed(200, P.trial_runs, P.trial_tokens)]
    s, acts = decide(s, SpeedMeasured(200, 10.0), 6.0)
    assert s.phase is Phase.STOPPING and s.failure.text == "slower: 10.0 tok/s vs 40.0 tok/s (-75 %, limit 25 %)"


def test_a_trial_asked_outside_a_start_or_with_trials_off_changes_nothing() -> None:
    from harness import started

    assert decide(ready(P), TrialAsked(40.0), 2.0) == (ready(P), [])
    off = started(replace(P, trial_runs=0))
    assert decide(off, TrialAsked(40.0), 2.0) == (off, [])
    on_trial = measuring_new(100.0)
    assert decide(on_trial, TrialAsked(40.0), 11.0) == (on_trial, [])


def test_a_plain_planned_window_top_to_bottom_and_what_its_slot_saves_are_for() -> None:
    """The window's sequence without a trial (``llama-guard restart``): drain, (saves), stop, start,
    (restores), release — each step the next input's answer; the saves after the drain are labelled
    by the window (a planned restart, a window lent to tune, the daemon's exit)."""
    from llama_guard.model.inputs import LendAsked
    from llama_guard.model.policy.window import slot_save_reason

    s, acts = decide(ready(P), RestartRequest("operator", cause=RestartCause.OPERATOR), 5.0)
    assert s.phase is Phase.DRAINING and acts[-1] == StartDrain(100) and s.deadline == 5.0 + P.drain_timeout_s
    assert slot_save_reason(s) == "planned restart"
    s, acts = decide(s, Drained(100), 6.0)
    assert s.phase is Phase.STOPPING and acts == [Terminate(100)]
    s, acts = decide(s, Exited(100, 0), 7.0)
    assert s.phase is Phase.STARTING and names(acts) == ["server_stopped", "server_restart"] and Spawn() in acts
    s, _ = decide(s, Spawned(200), 7.1)
    s, acts = decide(s, HealthOk(200), 9.0)
    assert s.phase is Phase.READY and acts[-1] == NotifyReady() and gate_of(s) is Gate.OPEN
    lent, _ = decide(ready(P), LendAsked(4242, 60.0), 5.0)
    assert lent.phase is Phase.DRAINING and slot_save_reason(lent) == "planned restart"
    exiting, _ = decide(ready(replace(P, exit_drain_s=30)), StopRequest("SIGTERM received"), 5.0)
    assert exiting.phase is Phase.DRAINING and slot_save_reason(exiting) == "llama-guard stopping"
