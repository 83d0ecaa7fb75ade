"""The pure policy's save before the stop for a GPU reset: a serving server on a GPU that still answers
with its memory intact (the Xid table's ``kv_readable``) is asked to save its slots (SaveSlots) and
SIGTERMed once they are saved or ``reset_save_s`` passed; a lost GPU, any other reset Xid (memory
errors, firmware faults), a loading server or a stop on its way to the exit saves nothing.

Each test sets a state and feeds observations to :func:`decide`; no processes, no clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import names, started
from harness import ready as policy_ready
from llama_guard.gpu.xid import XID_TABLE, xid_info
from llama_guard.model.actions import Action, InspectGpu, Kill, SaveSlots, StartDrain, Terminate
from llama_guard.model.inputs import Drained, Exited, GpuFault, RestartRequest, SlotsSaved, StopRequest, Tick
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, GpuFaultKind, Params, RestartCause, State, XidAction, XidOrigin
from llama_guard.vocab.exitcodes import EXIT_OK
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

SAVE_S = 5.0
P = Params(stop_grace_s=4, kill_wait_s=2, drain_timeout_s=20, exit_drain_s=10, reset_possible=True,
           reset_on=frozenset({ResetTrigger.GPU_LOST, ResetTrigger.XID}), max_resets=2, reset_window_s=1000,
           reset_deadline_s=50, reset_save_s=SAVE_S)
LOST = GpuFault(GpuFaultKind.GPU_LOST, "GPU is lost (GPU is lost)")


def xid(n: int) -> GpuFault:
    """Xid ``n`` from NVML as the GPU watcher posts it: its table row (action, scope, kv_readable)."""
    info = xid_info(n)
    return GpuFault(GpuFaultKind.XID, f"Xid {n}: {info.meaning}", info.action, n, info.scope, None, None,
                    XidOrigin.NVML, 0, kv_readable=info.kv_readable)


NVLINK = xid(74)  # a device fault that leaves the GPU answering and its memory as it was
ECC = xid(48)  # double-bit ECC: the KV cache may be wrong
GSP = xid(119)  # the GPU's firmware does not answer: nothing can be read


def ready(params: Params = P) -> State:
    return policy_ready(params, 100, 1.0)


def saving(s: State, fault: GpuFault, now: float = 5.0) -> tuple[State, list[Action]]:
    """``fault`` on serving server 100: its slots are saved first, nothing is signalled yet."""
    s, acts = decide(s, fault, now)
    assert s.phase is Phase.STOPPING and s.saving and s.after_stop is AfterStop.RESET, acts
    assert SaveSlots(100) in acts and not [a for a in acts if isinstance(a, (Terminate, Kill))]
    assert s.deadline == pytest.approx(now + SAVE_S)
    return s, acts


def terminated_now(s: State, acts: list[Action], now: float) -> None:
    assert Terminate(100) in acts and not s.saving, acts
    assert s.deadline == pytest.approx(now + P.stop_grace_s)


class TestSavedFirst:
    def test_a_device_xid_on_a_serving_server_saves_then_stops_then_resets(self) -> None:
        s, acts = saving(ready(), NVLINK)
        assert names(acts) == ["gpu_xid"]
        s, acts = decide(s, Tick(), 6.0)  # within the bound: nothing
        assert acts == [] and s.saving
        s, acts = decide(s, SlotsSaved(100), 6.5)
        terminated_now(s, acts, 6.5)
        s, acts = decide(s, Exited(100, 0), 7.0)
        assert s.phase is Phase.RESETTING and names(acts) == ["server_stopped", "gpu_reset_started"]
        assert InspectGpu(100, s.phase_data.trigger) in acts

    def test_saves_past_their_bound_do_not_hold_the_reset(self) -> None:
        s, _ = saving(ready(), NVLINK)
        s, acts = decide(s, Tick(), 5.0 + SAVE_S)
        terminated_now(s, acts, 5.0 + SAVE_S)
        s, acts = decide(s, SlotsSaved(100), 11.0)  # late: changes nothing
        assert acts == [] and s.deadline == pytest.approx(5.0 + SAVE_S + P.stop_grace_s)

    def test_the_answer_of_another_server_is_not_this_ones(self) -> None:
        s, _ = saving(ready(), NVLINK)
        s, acts = decide(s, SlotsSaved(99), 6.0)
        assert acts == [] and s.saving

    def test_a_server_draining_for_a_planned_restart_is_saved_for_the_reset(self) -> None:
        s, acts = decide(ready(), RestartRequest("planned", cause=RestartCause.OPERATOR), 2.0)
        assert StartDrain(100) in acts
        s, _ = saving(s, NVLINK)
        s, acts = decide(s, Drained(100), 6.0)  # the drain's own answer no longer stops anything
        assert acts == [] and s.saving

    def test_a_server_that_exits_during_the_saves_goes_to_the_reset(self) -> None:
        s, _ = saving(ready(), NVLINK)
        s, acts = decide(s, Exited(100, -11), 6.0)
        assert s.phase is Phase.RESETTING and not s.saving and "gpu_reset_started" in names(acts)


class TestNotSaved:
    @pytest.mark.parametrize("fault", [LOST, ECC, GSP], ids=["lost", "xid48", "xid119"])
    def test_a_lost_gpu_a_memory_error_or_a_firmware_fault_stops_at_once(self, fault: GpuFault) -> None:
        s, acts = decide(ready(), fault, 5.0)
        assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.RESET
        terminated_now(s, acts, 5.0)
        assert SaveSlots(100) not in acts

    def test_no_save_when_the_carry_over_is_off(self) -> None:
        s, acts = decide(ready(replace(P, reset_save_s=0.0)), NVLINK, 5.0)
        terminated_now(s, acts, 5.0)

    def test_a_loading_server_holds_nothing_to_save(self) -> None:
        s = started(P, 100, 0.0)
        s, acts = decide(s, NVLINK, 5.0)
        assert s.phase is Phase.STOPPING and Terminate(100) in acts and SaveSlots(100) not in acts

    def test_a_drain_before_the_exit_saves_nothing_for_a_reset_that_will_not_come(self) -> None:
        s, _ = decide(ready(), StopRequest("SIGTERM received"), 2.0)
        assert s.phase is Phase.DRAINING and s.after_stop is AfterStop.EXIT
        s, acts = decide(s, NVLINK, 5.0)
        assert s.after_stop is AfterStop.EXIT
        terminated_now(s, acts, 5.0)


class TestDuringTheSaves:
    @pytest.mark.parametrize("fault", [LOST, ECC, GSP], ids=["lost", "xid48", "xid119"])
    def test_a_fault_that_leaves_nothing_readable_ends_the_saves_at_once(self, fault: GpuFault) -> None:
        s, _ = saving(ready(), NVLINK)
        s, acts = decide(s, fault, 6.0)
        terminated_now(s, acts, 6.0)
        assert s.after_stop is AfterStop.RESET and s.gpu_lost is (fault is LOST)

    def test_another_fault_that_leaves_the_memory_readable_lets_the_saves_finish(self) -> None:
        s, _ = saving(ready(), NVLINK)
        s, acts = decide(s, NVLINK, 6.0)
        assert [a for a in acts if isinstance(a, (Terminate, Kill))] == [] and s.saving

    def test_a_stop_request_lets_the_saves_finish_then_exits(self) -> None:
        s, _ = saving(ready(), NVLINK)
        s, acts = decide(s, StopRequest("SIGTERM received"), 6.0)
        assert s.after_stop is AfterStop.EXIT and s.saving and acts == []
        s, acts = decide(s, SlotsSaved(100), 7.0)
        terminated_now(s, acts, 7.0)
        s, acts = decide(s, Exited(100, 0), 8.0)
        assert s.phase is Phase.EXITED and s.exit.code == EXIT_OK

    def test_a_second_signal_kills_at_once_and_the_saves_no_longer_count(self) -> None:
        s, _ = saving(ready(), NVLINK)
        s, acts = decide(s, StopRequest("SIGTERM received", immediate=True), 6.0)
        assert Kill(100) in acts and s.killed
        s, acts = decide(s, SlotsSaved(100), 6.5)
        assert acts == []
        s, acts = decide(s, Tick(), 6.0 + P.kill_wait_s)  # SIGKILL did not end it: not a SIGTERM now
        assert Terminate(100) not in acts and s.phase is Phase.EXITED


def test_only_reset_xids_say_the_kv_cache_is_readable() -> None:
    """A save before the stop is asked for only on a reset: no other row of the table claims it."""
    readable = [info for info in XID_TABLE.values() if info.kv_readable]
    assert readable and all(info.action is XidAction.RESET for info in readable)
