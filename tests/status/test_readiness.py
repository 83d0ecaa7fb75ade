"""``/readyz``'s typed reason and ``Retry-After`` (status/readiness.py, status/health.py), from states the pure
policy reaches: a first start, a planned restart's drain, stop and load, a crash and its backoff, a stop of the
daemon behind the front door, a window lent to tune, a GPU reset, a VRAM wait, a new build's trial. Before,
``/readyz`` answered ``{"ready": false, "phase": ...}`` and no ``Retry-After``: a router could not tell a drain
for a restart from a daemon that stops, nor when to look again. The end-to-end run: tests/e2e/test_haproxy_e2e.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from harness import ready as policy_ready
from harness import started as policy_started
from llama_guard.model.inputs import Drained, Exited, LendAsked, RestartRequest, StopRequest, Tick
from llama_guard.model.phase_state import WaitingVram
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, Lend, Params, RestartCause, State, Trial, TrialStage
from llama_guard.status.health import health_response, readiness
from llama_guard.status.readiness import UNKNOWN_LOAD_S, NotReady, not_ready_cause, ready_in_s
from llama_guard.vocab.phases import Phase

P = Params(stop_grace_s=4, kill_wait_s=2, drain_timeout_s=20, backoff_initial_s=2, exit_drain_s=30,
           reset_deadline_s=90, trial_timeout_s=60)


def body(state: State, now: float) -> dict[str, object]:
    status, doc = readiness(state, now)
    assert (status == 200) is doc["ready"]
    return doc


def test_ready_answers_200_with_no_cause_and_no_retry_after() -> None:
    s = policy_ready(P, now=1.0)  # spawned at 0.0, /health answered at 1.0: a 1 s load
    assert s.load_s == 1.0
    assert readiness(s, 2.0) == (200, {"ready": True, "phase": "ready", "cause": None, "restart_cause": None,
                                       "retry_after_s": None})
    response = health_response("/readyz", s, 2.0)
    assert response.status == 200 and "Retry-After" not in response.headers


def test_the_first_start_is_starting_with_the_unknown_load_estimate() -> None:
    s = State(params=P)
    assert body(s, 0.0) == {"ready": False, "phase": "stopped", "cause": "starting", "restart_cause": None,
                            "retry_after_s": UNKNOWN_LOAD_S}
    s = policy_started(P, now=10.0)
    assert body(s, 12.0)["cause"] == "starting" and body(s, 12.0)["retry_after_s"] == 3  # 5 s less 2 s loading
    assert body(s, 30.0)["retry_after_s"] == 1  # a load longer than the estimate: look again soon, never 0


def test_a_planned_restart_drains_stops_and_loads_with_the_drain_deadline_in_the_estimate() -> None:
    s = policy_ready(P, now=1.0)
    s, _ = decide(s, RestartRequest("operator", RestartCause.OPERATOR), 5.0)
    assert s.phase is Phase.DRAINING
    # the drain's 20 s left, the stop's 4 s grace, then a load like the last one (1 s)
    assert body(s, 5.0) == {"ready": False, "phase": "draining", "cause": "planned_restart",
                            "restart_cause": "requested", "retry_after_s": 25}
    assert body(s, 15.0)["retry_after_s"] == 15
    response = health_response("/readyz", s, 15.0)
    assert response.status == 503 and response.headers["Retry-After"] == "15"
    assert response.text is not None and json.loads(response.text)["cause"] == "planned_restart"
    s, _ = decide(s, Drained(100), 16.0)
    assert s.phase is Phase.STOPPING and body(s, 16.0)["cause"] == "planned_restart"
    assert body(s, 16.0)["retry_after_s"] == 5  # the stop's 4 s grace and the load
    s, _ = decide(s, Exited(100, 0), 17.0)
    assert s.phase is Phase.STARTING and body(s, 17.0) == {
        "ready": False, "phase": "starting", "cause": "planned_restart", "restart_cause": "requested",
        "retry_after_s": 1}


@pytest.mark.parametrize("cause", [RestartCause.SCHEDULE, RestartCause.DECAY, RestartCause.CONFIG_CHANGE])
def test_every_plan_is_a_planned_restart_named_by_its_cause(cause: RestartCause) -> None:
    s, _ = decide(policy_ready(P, now=1.0), RestartRequest("plan", cause), 5.0)
    assert body(s, 5.0)["cause"] == "planned_restart" and body(s, 5.0)["restart_cause"] == cause.value


def test_a_crash_recovers_at_once_then_backs_off_with_the_wait_in_the_estimate() -> None:
    s = policy_ready(P, now=1.0)
    s, _ = decide(s, Exited(100, -9), 5.0)
    assert s.phase is Phase.BACKOFF and s.deadline == 5.0  # the first failure: no wait
    assert body(s, 5.0) == {"ready": False, "phase": "backoff", "cause": "recovering", "restart_cause": "crash",
                            "retry_after_s": 1}
    s, _ = decide(s, Tick(), 5.0)
    assert s.phase is Phase.STARTING and s.restarts == 1
    assert body(s, 5.0) == {"ready": False, "phase": "starting", "cause": "recovering", "restart_cause": "crash",
                            "retry_after_s": 1}
    s, _ = decide(policy_started(P, pid=101, now=6.0, state=s), Exited(101, -11), 6.5)
    assert s.phase is Phase.BACKOFF and s.deadline == 8.5  # the second: backoff_initial_s
    doc = body(s, 6.5)
    assert doc["cause"] == "recovering" and doc["phase"] == "backoff" and doc["restart_cause"] == "crash"
    assert doc["retry_after_s"] == 3  # the 2 s wait and a 1 s load


def test_a_stop_of_the_daemon_behind_the_front_door_is_stopping() -> None:
    s, _ = decide(policy_ready(P, now=1.0), StopRequest("SIGTERM"), 5.0)
    assert s.phase is Phase.DRAINING and s.after_stop is AfterStop.EXIT
    # the requests in flight may take [front].stop_drain_s (30 s), the stop 4 s, a next daemon's load 1 s
    assert body(s, 5.0) == {"ready": False, "phase": "draining", "cause": "stopping", "restart_cause": None,
                            "retry_after_s": 35}
    assert not_ready_cause(replace(s, phase=Phase.EXITED, phase_data=None)) is NotReady.STOPPING


def test_a_window_lent_to_tune_is_lent_to_tune_until_its_bound() -> None:
    s, _ = decide(policy_ready(P, now=1.0), LendAsked(4242, 180.0), 5.0)
    assert body(s, 5.0)["cause"] == "lent_to_tune"
    assert body(s, 5.0)["retry_after_s"] == 20 + 180 + 4 + 1  # drain, the window's bound, the stop, the load
    s, _ = decide(s, Drained(100), 6.0)
    s, _ = decide(s, Exited(100, 0), 7.0)
    assert s.phase is Phase.LENT
    assert body(s, 7.0) == {"ready": False, "phase": "lent_to_tune", "cause": "lent_to_tune",
                            "restart_cause": None, "retry_after_s": 181}
    s, _ = decide(s, Tick(), 50.0)
    assert body(s, 50.0)["retry_after_s"] == 138


def test_the_other_not_ready_states_name_their_own_cause() -> None:
    ready = policy_ready(P, now=1.0)
    reset = replace(ready, phase=Phase.RESETTING, pid=None, deadline=91.0, after_stop=AfterStop.RESET)
    assert body(reset, 1.0)["cause"] == "gpu_reset" and body(reset, 1.0)["retry_after_s"] == 91
    before_reset = replace(ready, phase=Phase.STOPPING, deadline=5.0, after_stop=AfterStop.RESET)
    assert body(before_reset, 1.0)["cause"] == "gpu_reset"
    assert body(before_reset, 1.0)["retry_after_s"] == 4 + 90 + 1  # the stop, the reset's deadline, the load
    vram = replace(ready, phase=Phase.WAITING_VRAM, pid=None, deadline=3.0, phase_data=WaitingVram(until=61.0))
    assert body(vram, 1.0)["cause"] == "waiting_for_vram" and body(vram, 1.0)["retry_after_s"] == 61
    # a build trial counts its measurements at their bound ([upgrade].trial_timeout_s, 60 s here; before:
    # only a load, 1 s, for a window that measures, stops, loads and measures again)
    new = replace(ready, phase=Phase.TRIAL, trial=Trial(TrialStage.NEW, old_tps=80.0, spawned=True, answered_at=11.0))
    assert body(new, 1.0)["cause"] == "build_trial" and body(new, 41.0)["retry_after_s"] == 30  # 30 s of 60 left
    old = replace(ready, phase=Phase.TRIAL, trial=Trial(TrialStage.OLD))
    assert body(old, 1.0)["retry_after_s"] == 60 + 4 + 1 + 60  # measured, stopped; the new one loaded, measured
    reload = replace(ready.failure, cause=RestartCause.CONFIG_CHANGE)
    old_drained = replace(ready, phase=Phase.DRAINING, trial=Trial(TrialStage.OLD), deadline=21.0,
                          after_stop=AfterStop.RESTART, failure=reload)
    assert body(old_drained, 1.0)["cause"] == "build_trial"
    assert body(old_drained, 1.0)["retry_after_s"] == 20 + 4 + 60 + 1 + 60  # the drain, the stop, both measured
    loading_new = replace(ready, phase=Phase.STARTING, trial=Trial(TrialStage.NEW, spawned=True), started_at=1.0,
                          restarts=1, failure=reload)
    assert body(loading_new, 1.0)["retry_after_s"] == 1 + 60  # its load, then its measurement


def test_every_phase_but_ready_has_a_cause_and_a_retry_after_of_at_least_a_second() -> None:
    base = policy_ready(P, now=1.0)
    for phase in Phase:
        if phase is Phase.READY:
            continue
        state = replace(base, phase=phase, lend=Lend(4242, 60.0, until=61.0) if phase is Phase.LENT else None)
        status, doc = readiness(state, 1.0)
        assert status == 503 and NotReady(doc["cause"]) and isinstance(doc["retry_after_s"], int), phase
        assert doc["retry_after_s"] >= 1 and ready_in_s(state, 1.0) >= 0.0
    assert readiness(replace(base, pid=None), 1.0)[0] == 503  # READY without a server pid is not ready
