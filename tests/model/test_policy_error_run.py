"""The pure policy on a run of 5xx client answers (``[front].hold_after_errors``): the front door holds
new requests while one liveness round confirms at once; a failing canary is the verdict and the server
judged broken gets the short grace of a hung one; anything else releases the hold, and a bad client's
500s never restart a healthy server. The e2e test with a wedged server: tests/e2e/test_wedged_e2e.py."""

from __future__ import annotations

from dataclasses import replace

from harness import emitted, names
from harness import ready as policy_ready
from llama_guard.front.admission import CONFIRMING, Admission, Gate, gate_of
from llama_guard.model.actions import ConfirmCompletions, Terminate
from llama_guard.model.inputs import Probe, RequestCompleted, UpstreamError
from llama_guard.model.policy import decide
from llama_guard.model.policy.steps import HUNG_GRACE_S
from llama_guard.model.types import AfterStop, Params, RestartCause, State
from llama_guard.vocab.phases import Phase

P = Params(hang_strikes=3, stop_grace_s=15.0, hold_after_errors=3)
FAILED = Probe(100, True, False, busy=False, progressed=False, canary_status=500,
               canary_error="llama_decode failed: compute error", confirm=True)
ANSWERED = Probe(100, True, True, busy=False, progressed=False, confirm=True)


def errors(state: State, n: int, status: int = 500, at: float = 2.0) -> tuple[State, list[str], list[object]]:
    """``n`` 5xx answers of ``status`` from server 100; the state, the event names, all actions."""
    seen: list[str] = []
    every: list[object] = []
    for i in range(n):
        state, actions = decide(state, UpstreamError(100, status), at + i / 10)
        seen += names(actions)
        every += actions
    return state, seen, every


def test_a_run_of_500s_holds_new_requests_and_asks_for_a_confirming_round() -> None:
    state, seen, actions = errors(policy_ready(P), 2)
    assert not state.confirming and gate_of(state) is Gate.OPEN and seen == []
    state, seen, actions = errors(state, 1)
    assert state.confirming and gate_of(state) is Gate.HOLD and state.phase is Phase.READY
    assert seen == ["server_http_errors"] and ConfirmCompletions(100) in actions
    assert emitted(actions, "server_http_errors").fields["held"] is True  # type: ignore[arg-type]
    # Once: further 500s of answers already in flight neither report nor ask again.
    state, seen, actions = errors(state, 2)
    assert state.confirming and seen == [] and actions == []


def test_a_failing_canary_confirms_the_run_at_once_and_the_stop_is_short() -> None:
    state, _, _ = errors(policy_ready(P), 3)
    state, actions = decide(state, FAILED, 3.0)
    assert state.phase is Phase.STOPPING and state.after_stop is AfterStop.FAILURE
    assert state.failure.cause is RestartCause.COMPLETION_ERROR and Terminate(100) in actions
    assert state.grace_s == HUNG_GRACE_S < P.stop_grace_s  # it may ignore SIGTERM: no 15 s wait for that
    event = emitted(actions, "server_completion_error")  # type: ignore[arg-type]
    assert event.fields["failures"] == 1 and event.fields["client_errors"] == 3 and event.fields["status_code"] == 500
    assert gate_of(state) is Gate.HOLD  # the held requests wait for the next server


def test_a_canary_that_answers_releases_the_hold_and_a_bad_clients_500s_restart_nothing() -> None:
    state, _, _ = errors(policy_ready(P), 3)
    state, actions = decide(state, ANSWERED, 3.0)
    assert state.phase is Phase.READY and not state.confirming and gate_of(state) is Gate.OPEN and actions == []
    # Run after run from one client that makes llama-server answer 500 at will: held and released each time.
    for run in range(3):
        state, seen, _ = errors(state, 3, at=4.0 + run)
        assert state.confirming and seen == ["server_http_errors"]
        state, _ = decide(state, ANSWERED, 4.5 + run)
        assert state.phase is Phase.READY and gate_of(state) is Gate.OPEN


def test_a_round_that_cannot_confirm_releases_the_hold() -> None:
    # The canary not sent (a request processing), or timed out: no verdict from the run, the hold ends;
    # a timed-out canary is the usual strike.
    busy = Probe(100, True, None, busy=True, progressed=True, confirm=True)
    timed_out = Probe(100, True, False, busy=False, progressed=False, confirm=True)
    for probe, strikes in ((busy, 0), (timed_out, 1)):
        state, _, _ = errors(policy_ready(P), 3)
        state, actions = decide(state, probe, 3.0)
        assert state.phase is Phase.READY and gate_of(state) is Gate.OPEN and state.strikes == strikes, probe
        assert "server_completion_error" not in names(actions)


def test_only_a_confirming_round_ends_the_hold() -> None:
    # A round that began before the run was complete says nothing about it.
    state, _, _ = errors(policy_ready(P), 3)
    state, _ = decide(state, replace(ANSWERED, confirm=False), 3.0)
    assert state.confirming
    state, _ = decide(state, replace(FAILED, confirm=False), 3.1)
    assert state.phase is Phase.READY and state.confirming and state.strikes == 1  # one strike of hang_strikes


def test_a_completed_request_ends_the_run() -> None:
    state, _, _ = errors(policy_ready(P), 2)
    state, _ = decide(state, RequestCompleted(100), 3.0)
    state, seen, _ = errors(state, 2)
    assert not state.confirming and seen == []
    state, _, _ = errors(state, 1)
    assert state.confirming
    state, _ = decide(state, RequestCompleted(100), 3.5)  # one in flight before the hold succeeded
    assert not state.confirming and gate_of(state) is Gate.OPEN


def test_501_never_counts_and_the_hold_needs_the_canary() -> None:
    # 501: a feature llama-server was not started for (embeddings, slot actions): the request's own doing.
    state, seen, _ = errors(policy_ready(P), 10, status=501)
    assert state.http_errors == 0 and seen == []
    for status in (502, 503):  # other 5xx of the same kind count
        state, seen, _ = errors(policy_ready(P), 3, status=status)
        assert state.confirming and seen == ["server_http_errors"]
    # Without the canary no round can confirm: reported, never held.
    state, seen, actions = errors(policy_ready(replace(P, canary=False)), 3)
    assert seen == ["server_http_errors"] and not state.confirming and gate_of(state) is Gate.OPEN
    assert not any(isinstance(a, ConfirmCompletions) for a in actions)
    # 0: off, neither reported nor held.
    state, seen, _ = errors(policy_ready(replace(P, hold_after_errors=0)), 10)
    assert seen == [] and not state.confirming


def test_the_hold_is_named_in_the_front_doors_episode() -> None:
    state, _, _ = errors(policy_ready(P), 3)
    episodes: list[object] = []
    admission = Admission(lambda: 0.0, episodes.append)
    admission.update(state)
    assert admission.gate is Gate.HOLD and admission.episode.phases == [CONFIRMING]
