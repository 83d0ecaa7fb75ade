"""SIGTERM/SIGINT while llama-server serves behind the front door: the requests in flight may finish
(DRAINING, bounded by ``[front].stop_drain_s``), new ones are refused at once, then the server is stopped and the daemon
exits 0 — whatever happens during the drain (a crash, a fault, a second signal). Pure policy."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from harness import line, names
from harness import ready as policy_ready
from llama_guard.config import Config
from llama_guard.core.service import STOP_MARGIN_S, NullNotifier, StopTimeout
from llama_guard.front.admission import Gate, gate_of
from llama_guard.front.source import CLOSE_TIMEOUT_S
from llama_guard.model.actions import ExitDaemon, Kill, Spawn, StartDrain, Terminate
from llama_guard.model.inputs import Drained, Exited, RestartRequest, StopRequest, Tick
from llama_guard.model.params import params_from
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, Params, Phase, RestartCause, State
from llama_guard.vocab.exitcodes import EXIT_OK

P = Params(stop_grace_s=4, kill_wait_s=2, drain_timeout_s=300, exit_drain_s=30, hang_strikes=2)
TERM = StopRequest("SIGTERM received")
UNIT = Path(__file__).resolve().parents[2] / "deploy" / "systemd" / "llama-guard.service"


def draining(now: float = 5.0, params: Params = P) -> State:
    s, acts = decide(policy_ready(params), TERM, now)
    assert s.phase is Phase.DRAINING and s.after_stop is AfterStop.EXIT and s.deadline == now + params.exit_drain_s
    assert acts[-1] == StartDrain(100) and not any(isinstance(a, (Terminate, Kill)) for a in acts)
    assert "stop_drain_s" in str(acts[0]) and gate_of(s) is Gate.CLOSED  # new requests: 503 at once
    return s


def test_requests_in_flight_finish_then_the_server_stops_and_the_daemon_exits_0() -> None:
    s, acts = decide(draining(), Drained(100), 7.0)
    assert s.phase is Phase.STOPPING and acts == [Terminate(100)] and s.deadline == 7.0 + P.stop_grace_s
    s, acts = decide(s, Exited(100, 0), 7.5)
    assert s.phase is Phase.EXITED and acts[-1] == ExitDaemon(EXIT_OK, "SIGTERM received")
    assert not any(isinstance(a, Spawn) for a in acts)


def test_a_drain_that_outlasts_stop_drain_s_is_cut_and_said() -> None:
    s = draining()
    assert decide(s, Tick(), 5.0 + P.exit_drain_s - 0.1) == (s, [])
    s, acts = decide(s, Tick(), 5.0 + P.exit_drain_s)
    assert names(acts) == ["stop_drain_timeout"] and Terminate(100) in acts and s.after_stop is AfterStop.EXIT
    s, acts = decide(s, Exited(100, -15), 36.0)
    assert acts[-1] == ExitDaemon(EXIT_OK, "SIGTERM received")


def test_a_second_signal_kills_the_server_at_once() -> None:
    s, acts = decide(draining(), StopRequest("SIGINT received", immediate=True), 6.0)
    assert Kill(100) in acts and s.phase is Phase.STOPPING and s.after_stop is AfterStop.EXIT


def test_a_crash_during_the_drain_ends_in_the_exit_not_a_restart() -> None:
    s, acts = decide(draining(), Exited(100, -11), 6.0)
    assert s.phase is Phase.EXITED and names(acts) == ["server_exited"] and acts[-1] == ExitDaemon(EXIT_OK,
                                                                                                  "SIGTERM received")


def test_a_fault_during_the_drain_stops_the_server_and_still_exits_0() -> None:
    s, acts = decide(draining(), line(100, "CUDA error: out of memory"), 6.0)
    assert Terminate(100) in acts and s.after_stop is AfterStop.EXIT and s.exit.code == EXIT_OK
    s, acts = decide(s, Exited(100, -15), 7.0)
    assert acts[-1] == ExitDaemon(EXIT_OK, "SIGTERM received") and not any(isinstance(a, Spawn) for a in acts)


def test_sigterm_during_a_planned_drain_keeps_that_drain_and_ends_in_the_exit() -> None:
    s, acts = decide(policy_ready(P), RestartRequest("SIGUSR1", cause=RestartCause.OPERATOR), 2.0)
    assert s.phase is Phase.DRAINING and s.after_stop is AfterStop.RESTART and gate_of(s) is Gate.HOLD
    s, acts = decide(s, TERM, 3.0)
    assert s.after_stop is AfterStop.EXIT and s.deadline == 3.0 + P.exit_drain_s and StartDrain(100) not in acts
    s, acts = decide(s, Drained(100), 4.0)
    assert acts == [Terminate(100)]  # no planned restart: the daemon exits after this stop


def test_stop_drain_s_0_stops_at_once() -> None:
    s, acts = decide(policy_ready(replace(P, exit_drain_s=0)), TERM, 5.0)
    assert s.phase is Phase.STOPPING and Terminate(100) in acts


def test_the_shipped_stop_fits_in_the_units_timeout_stop_sec() -> None:
    shipped = Config()
    unit = re.search(r"^TimeoutStopSec=(\d+)s$", UNIT.read_text(), re.M)
    assert unit is not None
    # The drain, SIGTERM → grace → SIGKILL → its wait, then the front door's connections closed.
    worst = (shipped.front.stop_drain_s + shipped.recovery.stop_grace_s + Params().kill_wait_s + CLOSE_TIMEOUT_S
             + 1.0)
    assert worst < int(unit.group(1)), (worst, unit.group(1))


def test_only_the_front_door_drains_on_stop() -> None:
    off = Config()
    on = Config.model_validate({"front": {"listen": "127.0.0.1:18080"}})
    assert params_from(off).exit_drain_s == 0.0
    assert params_from(on).exit_drain_s == on.front.stop_drain_s > 0


class _Notifier(NullNotifier):
    def __init__(self) -> None:
        self.extended: list[int] = []

    def extend_timeout(self, usec: int) -> None:
        self.extended.append(usec)


def test_systemd_is_told_the_drain_and_the_stop_after_it() -> None:
    notifier = _Notifier()
    now = 50.0
    StopTimeout(notifier, lambda: now).extend(draining(now=40.0))  # deadline 70: 20 s of drain left
    left = 20.0 + P.stop_grace_s + P.kill_wait_s + STOP_MARGIN_S
    assert notifier.extended == [int(left * 1_000_000)]
