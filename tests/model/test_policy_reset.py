"""The GPU-reset paths of the pure policy: OOM / GPU error / lost GPU / Xid → stop → reset → restart or give up.

Each test sets a state and feeds observations to :func:`decide`; no processes, no clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import emitted, line, names
from harness import ready as policy_ready
from llama_guard.gpu.kmsg import KmsgParser, XidRecord
from llama_guard.gpu.xid import XidMatcher, xid_info
from llama_guard.model.actions import (
    Action,
    CheckVram,
    Emit,
    ExitDaemon,
    InspectGpu,
    Kill,
    RunReset,
    Spawn,
    Terminate,
)
from llama_guard.model.inputs import (
    Boot,
    Exited,
    GpuFault,
    GpuHolder,
    HealthOk,
    Line,
    Probe,
    ResetDone,
    ResetFacts,
    Spawned,
    StopRequest,
    Tick,
    VramFacts,
)
from llama_guard.model.policy import decide
from llama_guard.model.types import (
    AfterStop,
    GpuFaultKind,
    Params,
    RecoveryAction,
    State,
    XidAction,
    XidOrigin,
    initial_state,
)
from llama_guard.vocab.exitcodes import EXIT_GPU_UNRECOVERABLE, EXIT_OK
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

P = Params(load_timeout_s=30, hang_strikes=2, backoff_initial_s=1, backoff_factor=2, backoff_max_s=5,
           max_restarts=3, restart_window_s=100, stable_after_s=10, stop_grace_s=4, kill_wait_s=2,
           drain_timeout_s=20, reset_possible=True,
           reset_on=frozenset({ResetTrigger.GPU_LOST, ResetTrigger.XID, ResetTrigger.OOM}),
           max_resets=2, reset_window_s=1000, reset_deadline_s=50,
           reset_save_s=0.0)  # the slots saved before a reset's stop: test_policy_reset_save.py

OOM = "0.01.02.003 E CUDA error: out of memory"
ILLEGAL = "0.01.02.003 E CUDA error: an illegal memory access was encountered"
LOST = GpuFault(GpuFaultKind.GPU_LOST, "GPU is lost (GPU is lost)")


def xid(n: int, action: str, pid: int | None = 100) -> GpuFault:
    """Xid ``n`` as the GPU watcher posts it: its table row, and the kernel's ``pid=`` (100: the
    server of :func:`ready`)."""
    info = xid_info(n)
    assert info.action is XidAction(action)
    return GpuFault(GpuFaultKind.XID, f"Xid {n}: test", info.action, n, info.scope, pid, "llama-server",
                    XidOrigin.KMSG, 0, kv_readable=info.kv_readable)


def but_xid(actions: list[Action]) -> list[Action]:
    """The actions other than the ``gpu_xid`` report (every Xid is reported)."""
    return [a for a in actions if not (isinstance(a, Emit) and a.name == "gpu_xid")]


def ready(pid: int = 100, now: float = 1.0, params: Params = P) -> State:
    return policy_ready(params, pid, now)


def of_type(actions: list[Action], cls: type[Action]) -> list[Action]:
    return [a for a in actions if isinstance(a, cls)]


def stop_for(s: State, event: Line | GpuFault, now: float = 5.0) -> tuple[State, list[Action]]:
    """Feed ``event`` to a serving state: the server must be asked to stop (SIGTERM)."""
    pid = s.pid
    assert pid is not None
    s, acts = decide(s, event, now)
    assert s.phase is Phase.STOPPING and Terminate(pid) in acts, acts
    return s, acts


def into_reset(s: State, event: Line | GpuFault, now: float = 5.0) -> tuple[State, list[Action]]:
    """A fault, then the server's exit: the policy must be RESETTING and have asked for one reset."""
    pid = s.pid
    assert pid is not None
    s, _ = stop_for(s, event, now)
    assert s.after_stop is AfterStop.RESET
    s, acts = decide(s, Exited(pid, -6), now + 0.5)
    assert s.phase is Phase.RESETTING
    assert names(acts) == ["server_stopped", "gpu_reset_started"]
    assert of_type(acts, InspectGpu) == [InspectGpu(pid, s.phase_data.trigger)]
    assert not of_type(acts, Spawn)
    return s, acts


CLEAR = ResetFacts(0, True, 0.2, (), True)
RESET_OK = "GPU 00000000:1A:00.0 was successfully reset."


def run_reset(s: State, now: float, *, failed: str = "", facts: ResetFacts = CLEAR) -> tuple[State, list[Action]]:
    """The GPU inspection finds nothing in the way, the policy runs the command; it succeeds, or
    fails with ``failed`` as its detail."""
    resets = len(s.resets)
    s, acts = decide(s, facts, now)
    assert acts == [RunReset(facts.gpu_index, s.phase_data.trigger)] and len(s.resets) == resets + 1, acts
    done = (ResetDone(0, "nvidia-smi --gpu-reset -i 0", 255, failed, False, failed) if failed
            else ResetDone(0, "nvidia-smi --gpu-reset -i 0", 0, RESET_OK, True, RESET_OK + "; GPU answers and is idle"))
    return decide(s, done, now)


def restart_after_backoff(s: State, new_pid: int, now: float) -> State:
    assert s.phase is Phase.BACKOFF and s.deadline is not None
    s, acts = decide(s, Tick(), s.deadline)
    assert names(acts) == ["server_restart"] and acts[-1] == Spawn()
    s, _ = decide(s, Spawned(new_pid), s.deadline if s.deadline else now)
    s, acts = decide(s, HealthOk(new_pid), now)
    assert s.phase is Phase.READY and names(acts) == ["server_ready"]
    return s


# ------------------------------------------------------------------------------------------- OOM


class TestOomReset:
    def test_oom_stops_resets_then_restarts(self) -> None:
        s, acts = stop_for(ready(), line(100, OOM))
        assert names(acts) == ["server_oom"]
        assert "server_oom" in s.phase_data.reset_trigger
        s, acts = into_reset(ready(), line(100, OOM))
        assert acts[-1] == InspectGpu(100, s.phase_data.trigger)
        assert s.deadline == pytest.approx(5.5 + P.reset_deadline_s)
        # Nothing starts while the reset runs, however long the ticks go on (until its deadline).
        for t in (6.0, 20.0, 55.0):
            s, acts = decide(s, Tick(), t)
            assert acts == [] and s.phase is Phase.RESETTING
        s, acts = run_reset(s, 30.0)
        reset = emitted(acts, "gpu_reset")
        assert reset.fields["outcome"] == "succeeded" and reset.fields["gpu_index"] == 0
        assert reset.fields["exit_status"] == 0 and reset.fields["output"] == RESET_OK
        assert reset.fields["reset_count"] == 1 and "server_oom" in str(reset.fields["trigger"])
        assert names(acts) == ["gpu_reset", "server_backoff"]
        assert not of_type(acts, ExitDaemon)
        s = restart_after_backoff(s, 101, 32.0)
        assert s.pid == 101 and s.resets == (30.0,)  # counted when the command ran

    def test_oom_while_loading_resets_too(self) -> None:
        s, _ = decide(initial_state(P), Boot(), 0.0)
        s, _ = decide(s, Spawned(100), 0.0)
        text = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9216.00 MiB on device 0: "
                "cudaMalloc failed: out of memory")
        s, acts = decide(s, line(100, text), 1.0)
        assert acts == [] and s.phase is Phase.STARTING  # judged by what the process does next
        s, acts = decide(s, Exited(100, 1), 1.2)
        assert emitted(acts, "server_oom").fields["phase"] == "loading"
        assert s.phase is Phase.RESETTING and InspectGpu(100, s.phase_data.trigger) in acts

    @pytest.mark.parametrize("params", [replace(P, reset_possible=False),
                                        replace(P, reset_on=frozenset({ResetTrigger.GPU_LOST, ResetTrigger.XID}))],
                             ids=["reset-not-possible", "oom-not-in-reset_on"])
    def test_oom_without_reset_restarts_only(self, params: Params) -> None:
        s, acts = stop_for(ready(params=params), line(100, OOM))
        assert names(acts) == ["server_oom"] and s.after_stop is AfterStop.FAILURE
        s, acts = decide(s, Exited(100, -6), 5.5)
        assert not of_type(acts, InspectGpu) and s.phase is Phase.BACKOFF
        assert names(acts) == ["server_stopped", "server_backoff"]
        s = restart_after_backoff(s, 101, 8.0)
        assert s.resets == ()

    def test_cuda_error_resets_only_when_configured(self) -> None:
        s, _ = stop_for(ready(), line(100, ILLEGAL))
        assert s.after_stop is AfterStop.FAILURE  # not in the default reset_on
        s, _ = into_reset(ready(params=replace(P, reset_on=P.reset_on | {ResetTrigger.CUDA_ERROR})), line(100, ILLEGAL))
        assert "server_cuda_error" in s.phase_data.trigger

    def test_foreign_process_skips_the_reset_and_restarts_only(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        facts = ResetFacts(0, True, 0.2, (GpuHolder(4242, 81000, "python3"),), True)
        s, acts = decide(s, facts, 6.0)
        assert not of_type(acts, RunReset) and s.resets == ()  # a skipped reset spends no budget
        reset = emitted(acts, "gpu_reset")
        assert reset.fields["outcome"] == "skipped" and reset.fields["foreign_pid"] == 4242
        assert reset.fields["foreign_name"] == "python3" and reset.fields["foreign_mib"] == 81000
        assert reset.fields["gpu_index"] == 0 and "GPU 0" in str(reset.fields["reason"])
        assert not of_type(acts, ExitDaemon) and "gpu_lost" not in names(acts)
        assert "reset skipped" in s.failure.text
        restart_after_backoff(s, 101, 9.0)

    @pytest.mark.parametrize("reason", ["nvidia-smi exited 1: The following GPUs could not be reset: / "
                                        "GPU 00000000:1A:00.0: In use by another client",
                                        "nvidia-smi did not finish within 60 s",
                                        "the GPU does not answer NVML after the reset (ok)"])
    def test_failed_reset_gives_up_with_exit_69(self, reason: str) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        s, acts = run_reset(s, 7.0, failed=reason)
        assert names(acts) == ["gpu_reset", "gpu_lost"]
        assert emitted(acts, "gpu_reset").fields["outcome"] == "failed"
        lost = emitted(acts, "gpu_lost")
        assert reason in str(lost.fields["reason"]) and "reboot" in str(lost.fields["reason"])
        assert lost.fields["gpu_index"] == 0
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason)]
        assert s.phase is Phase.EXITED and not of_type(acts, Spawn)
        # Nothing afterwards brings it back.
        assert decide(s, Tick(), 100.0) == (s, [])
        assert decide(s, ResetDone(0, "x", 0, "late", True, "late"), 100.0) == (s, [])

    def test_reset_that_never_answers_ends_at_its_deadline(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        s, acts = decide(s, Tick(), 5.5 + P.reset_deadline_s - 0.01)
        assert acts == []
        s, acts = decide(s, Tick(), 5.5 + P.reset_deadline_s)
        assert names(acts) == ["gpu_reset"] and emitted(acts, "gpu_reset").fields["outcome"] == "timed out"
        assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and s.phase is Phase.EXITED

    def test_deadline_is_reported_by_next_deadline(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        assert s.next_deadline() == pytest.approx(5.5 + P.reset_deadline_s)

    def test_server_that_survives_sigkill_gets_no_reset_and_no_successor(self) -> None:
        # Stuck in the driver: a reset would refuse a GPU in use and a second server would fail on
        # it; the verdict is a reboot (exit 69), not a reset attempt.
        s, _ = stop_for(ready(), line(100, OOM))
        s, acts = decide(s, Tick(), 5.0 + P.stop_grace_s)
        assert Kill(100) in acts
        s, acts = decide(s, Tick(), 5.0 + P.stop_grace_s + P.kill_wait_s)
        assert s.phase is Phase.EXITED and ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts
        assert "reboot" in s.exit.reason and names(acts) == ["server_unkillable"]
        assert not of_type(acts, InspectGpu) and not of_type(acts, Spawn)


# ------------------------------------------------------------------------------------------- budget


class TestResetBudget:
    def _second_oom(self, params: Params, second_at: float) -> tuple[State, list[Action]]:
        s, _ = into_reset(ready(params=params), line(100, OOM), now=5.0)
        s, _ = run_reset(s, 6.0)
        s = restart_after_backoff(s, 101, 8.0)
        s, _ = stop_for(s, line(101, OOM), second_at)
        return decide(s, Exited(101, -6), second_at + 0.5)

    def test_second_oom_reset_within_the_window_is_refused_and_restarts_only(self) -> None:
        s, acts = self._second_oom(replace(P, max_resets=1), 20.0)
        assert not of_type(acts, InspectGpu) and not of_type(acts, ExitDaemon)
        refused = emitted(acts, "gpu_reset")
        assert refused.fields["outcome"] == "refused" and "1 GPU resets within 1000 s" in str(refused.fields["reason"])
        assert s.phase is Phase.BACKOFF and names(acts) == ["server_stopped", "gpu_reset", "server_backoff"]

    def test_a_reset_outside_the_window_is_allowed_again(self) -> None:
        s, acts = self._second_oom(replace(P, max_resets=1), 5.5 + P.reset_window_s + 1)
        assert s.phase is Phase.RESETTING and of_type(acts, InspectGpu)
        assert s.resets == ()  # the old one fell out of the window
        s, _ = run_reset(s, 5.5 + P.reset_window_s + 2)
        assert len(s.resets) == 1

    def test_default_budget_allows_two_then_refuses(self) -> None:
        s = ready()
        now = 5.0
        for i in range(2):
            s, _ = into_reset(s, line(s.pid or 0, OOM), now)
            s, _ = run_reset(s, now + 1)
            s = restart_after_backoff(s, 101 + i, now + 5)
            now += 10
        s, _ = stop_for(s, line(s.pid or 0, OOM), now)
        s, acts = decide(s, Exited(s.pid or 0, -6), now + 0.5)
        assert not of_type(acts, InspectGpu) and emitted(acts, "gpu_reset").fields["outcome"] == "refused"

    def test_lost_gpu_with_the_budget_spent_gives_up(self) -> None:
        s = replace(ready(params=replace(P, max_resets=1)), resets=(2.0,))
        s, _ = stop_for(s, LOST)
        s, acts = decide(s, Exited(100, -15), 6.0)
        assert names(acts) == ["server_stopped", "gpu_reset", "gpu_lost"]
        refused = emitted(acts, "gpu_reset")
        assert refused.fields["outcome"] == "refused" and refused.fields["gpu_index"] == P.gpu_index
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason)]
        assert not of_type(acts, InspectGpu) and not of_type(acts, Spawn)

    def test_skipped_resets_never_spend_the_budget(self) -> None:
        # The H200 run: another process held all but 150 MiB; each OOM at load led
        # to a reset that was skipped. Any number of skips leaves the whole budget for a real loss.
        holder = ResetFacts(3, True, 0.1, (GpuHolder(5151, 140_000, "python3"),), True)
        s = ready(params=replace(P, gpu_index=3))
        now = 5.0
        for i in range(4):
            s, _ = into_reset(s, line(s.pid or 0, OOM), now)
            s, acts = decide(s, holder, now + 1)
            skipped = emitted(acts, "gpu_reset")
            assert skipped.fields["outcome"] == "skipped" and skipped.fields["gpu_index"] == 3
            assert "GPU 3" in str(skipped.fields["reason"]) and s.resets == ()
            s = restart_after_backoff(replace(s, failures=()), 200 + i, now + 3)
            now += 10
        # A real loss now still gets its reset, and it is the first one counted.
        s, _ = into_reset(s, LOST, now)
        s, acts = run_reset(s, now + 1, facts=ResetFacts(3, True, 0.1, (), True))
        assert emitted(acts, "gpu_reset").fields["outcome"] == "succeeded" and len(s.resets) == 1

    def test_previous_server_still_on_the_gpu_skips_naming_it(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        s, acts = decide(s, ResetFacts(0, False, 30.0, (), True), 40.0)
        skipped = emitted(acts, "gpu_reset")
        assert skipped.fields["outcome"] == "skipped" and skipped.fields["server_pid"] == 100
        assert "pid 100 still holds GPU 0 after 30 s" in str(skipped.fields["reason"])
        assert not of_type(acts, RunReset) and s.phase is Phase.BACKOFF

    def test_zero_resets_allowed_never_resets(self) -> None:
        s, _ = stop_for(ready(params=replace(P, max_resets=0)), line(100, OOM))
        s, acts = decide(s, Exited(100, -6), 6.0)
        assert not of_type(acts, InspectGpu) and s.phase is Phase.BACKOFF


# ------------------------------------------------------------------------------------------- lost GPU and Xid


class TestLostAndXid:
    def test_lost_gpu_resets_and_restarts(self) -> None:
        s, acts = stop_for(ready(), LOST)
        assert s.gpu_lost and names(acts) == []
        s, _ = into_reset(ready(), LOST)
        s, acts = run_reset(s, 7.0)
        assert emitted(acts, "gpu_reset").fields["trigger"] == LOST.reason
        assert not s.gpu_lost and s.phase is Phase.BACKOFF

    def test_lost_gpu_reset_once_then_escalate_success(self) -> None:
        s, _ = into_reset(ready(), LOST)
        assert s.gpu_lost
        s, _ = run_reset(s, 7.0)
        assert s.phase is Phase.BACKOFF and not s.gpu_lost
        restart_after_backoff(s, 101, 10.0)

    def test_lost_gpu_failed_reset_escalates(self) -> None:
        s, _ = into_reset(ready(), LOST)
        s, acts = run_reset(s, 7.0, failed="nvidia-smi exited 255: Unknown Error")
        assert names(acts) == ["gpu_reset", "gpu_lost"]
        assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts

    def test_lost_gpu_skipped_reset_does_not_restart_onto_a_lost_gpu(self) -> None:
        s, _ = into_reset(ready(), LOST)
        s, acts = decide(s, ResetFacts(0, True, 0.1, (), False, "llama-guard is not root"), 7.0)
        assert names(acts) == ["gpu_reset", "gpu_lost"] and not of_type(acts, RunReset)
        assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and not of_type(acts, Spawn)

    def test_xid_48_skipped_reset_restarts(self) -> None:
        s, _ = into_reset(ready(), xid(48, "reset"))
        assert not s.gpu_lost
        s, acts = decide(s, ResetFacts(0, True, 0.1, (GpuHolder(7, None, "x"),), True), 7.0)
        assert s.phase is Phase.BACKOFF and not of_type(acts, ExitDaemon)

    def test_xid_13_restarts_only(self) -> None:
        s, acts = stop_for(ready(), xid(13, "restart"))
        assert s.after_stop is AfterStop.FAILURE and not s.gpu_lost
        s, acts = decide(s, Exited(100, -15), 6.0)
        assert not of_type(acts, InspectGpu) and s.phase is Phase.BACKOFF
        assert "Xid 13" in s.failure.text

    def test_xid_13_while_backing_off_does_nothing(self) -> None:
        s, _ = decide(ready(), Exited(100, 1), 5.0)
        s2, acts = decide(s, xid(13, "restart"), 5.1)
        assert s2 == s and names(acts) == ["gpu_xid"] and emitted(acts, "gpu_xid").fields["action"] == "event_only"

    @pytest.mark.parametrize("phase_state", ["ready", "backoff", "resetting"])
    def test_event_only_xid_changes_nothing(self, phase_state: str) -> None:
        s = ready()
        if phase_state == "backoff":
            s, _ = decide(s, Exited(100, 1), 5.0)
        elif phase_state == "resetting":
            s, _ = into_reset(s, line(100, OOM))
        s2, acts = decide(s, xid(63, "event_only"), 6.0)
        assert s2 == s and names(acts) == ["gpu_xid"]

    def test_xid_while_backing_off_resets_before_the_next_start(self) -> None:
        s, _ = decide(ready(), Exited(100, 1), 5.0)
        assert s.phase is Phase.BACKOFF
        s, acts = decide(s, xid(48, "reset"), 5.2)
        assert s.phase is Phase.RESETTING and of_type(acts, InspectGpu) == [InspectGpu(None, "Xid 48: test")]
        assert names(acts) == ["gpu_xid", "gpu_reset_started"]
        s, acts = decide(s, Tick(), 7.0)  # the backoff timer (due at 6.0) has no say while resetting
        assert acts == [] and s.phase is Phase.RESETTING
        s, acts = run_reset(s, 8.0)
        assert s.phase is Phase.BACKOFF and names(acts) == ["gpu_reset", "server_backoff"]

    def test_xid_while_stopping_a_hung_server_upgrades_the_stop_to_a_reset(self) -> None:
        s = ready()
        for t in (5.0, 6.0):
            s, acts = decide(s, Probe(100, health_ok=False, canary_ok=None, busy=False, progressed=False), t)
        assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.FAILURE
        s, acts = decide(s, xid(48, "reset"), 6.5)
        assert but_xid(acts) == [] and s.after_stop is AfterStop.RESET
        s, acts = decide(s, Exited(100, -15), 7.0)
        assert InspectGpu(100, "Xid 48: test") in acts

    def test_second_fault_while_stopping_for_a_reset_does_not_reset_twice(self) -> None:
        s, _ = stop_for(ready(), line(100, OOM))
        s2, acts = decide(s, LOST, 5.2)
        assert acts == [] and s2.after_stop is AfterStop.RESET
        s2, acts = decide(s2, Exited(100, -6), 6.0)
        assert len(of_type(acts, InspectGpu)) == 1
        s2, acts = run_reset(s2, 7.0)
        assert len(s2.resets) == 1

    def test_fault_while_stopping_on_request_keeps_exit_0(self) -> None:
        s, _ = decide(ready(), StopRequest("SIGTERM received"), 5.0)
        s, acts = decide(s, LOST, 5.1)
        assert acts == [] and s.after_stop is AfterStop.EXIT and s.exit.code == EXIT_OK
        s, acts = decide(s, Exited(100, -15), 5.5)
        assert ExitDaemon(EXIT_OK, "SIGTERM received") in acts and not of_type(acts, InspectGpu)

    @pytest.mark.parametrize("params", [replace(P, reset_on=frozenset({ResetTrigger.OOM})),
                                        replace(P, reset_possible=False)],
                             ids=["gpu_lost-not-in-reset_on", "reset-not-possible"])
    def test_lost_gpu_without_reset_stops_and_exits_69(self, params: Params) -> None:
        s, acts = stop_for(ready(params=params), LOST)
        assert s.after_stop is AfterStop.EXIT and s.exit.code == EXIT_GPU_UNRECOVERABLE
        s, acts = decide(s, Exited(100, -15), 6.0)
        assert names(acts) == ["server_stopped"]
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason)]
        assert "no reset configured" in s.exit.reason
        assert not of_type(acts, Spawn) and not of_type(acts, InspectGpu)

    def test_lost_gpu_without_reset_while_backing_off_exits_69(self) -> None:
        s, _ = decide(ready(params=replace(P, reset_possible=False)), Exited(100, 1), 5.0)
        s, acts = decide(s, LOST, 5.1)
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason)]

    def test_lost_gpu_while_stopping_for_a_failure_without_reset_exits_69(self) -> None:
        s, _ = stop_for(ready(params=replace(P, reset_possible=False)), line(100, OOM))
        s, acts = decide(s, LOST, 5.1)
        assert acts == [] and s.after_stop is AfterStop.EXIT
        s, acts = decide(s, Exited(100, -6), 5.5)
        assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and not of_type(acts, Spawn)


# ------------------------------------------------------------------------------------------- whose Xid


XID31_OTHER = ("NVRM: Xid (PCI:0000:02:00): 31, pid={pid}, name=python3, Ch 00000008, intr 00000000. "
               "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_8 faulted @ 0x7f00_1c000000. "
               "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE")


def kernel_xid(text: str, *, nvml_first: bool = False) -> GpuFault:
    """``text`` through the real kernel-log parser and the NVML/kmsg matcher, posted as the GPU
    watcher posts it."""
    parser = KmsgParser("0000:02:00.0")
    [record] = parser.feed(text)
    assert isinstance(record, XidRecord)
    matcher = XidMatcher(window_s=2.0)
    assert record.xid is not None
    if nvml_first:
        assert matcher.nvml(record.xid, 10.0) == []  # an application Xid waits for its kernel line
    [rep] = matcher.kmsg(record, 10.5)
    info = xid_info(rep.xid)
    return GpuFault(GpuFaultKind.XID, f"Xid {rep.xid}: {info.meaning}", info.action, rep.xid, info.scope,
                    rep.pid, rep.name, rep.origin, 0, rep.text)


class TestXidOwnership:
    def test_xid_31_of_another_process_does_not_restart_our_server(self) -> None:
        # The kernel line on our GPU names a pid that is not our server.
        s = ready(pid=100)
        s2, acts = decide(s, kernel_xid(XID31_OTHER.format(pid=4711)), 5.0)
        assert s2 == s and s2.phase is Phase.READY and names(acts) == ["gpu_xid"]
        report = emitted(acts, "gpu_xid").fields
        assert report["action"] == "event_only" and report["table_action"] == "restart"
        assert report["ours"] is False and report["xid_pid"] == 4711 and report["source"] == "kmsg"

    @pytest.mark.parametrize("nvml_first", [False, True], ids=["kmsg", "nvml+kmsg"])
    def test_xid_31_of_our_server_restarts_it(self, nvml_first: bool) -> None:
        s, acts = decide(ready(pid=100), kernel_xid(XID31_OTHER.format(pid=100), nvml_first=nvml_first), 5.0)
        assert s.phase is Phase.STOPPING and Terminate(100) in acts and s.after_stop is AfterStop.FAILURE
        report = emitted(acts, "gpu_xid").fields
        assert report["ours"] is True and report["source"] == ("nvml+kmsg" if nvml_first else "kmsg")

    @pytest.mark.parametrize("n", [13, 31, 43, 45, 68, 69, 94, 109])
    def test_every_application_xid_of_another_process_is_reported_only(self, n: int) -> None:
        s = ready(pid=100)
        s2, acts = decide(s, xid(n, "restart", pid=4711), 5.0)
        assert s2 == s and names(acts) == ["gpu_xid"]

    def test_application_xid_from_nvml_alone_is_reported_only(self) -> None:
        matcher = XidMatcher(window_s=2.0)
        assert matcher.nvml(31, 10.0) == [] and matcher.next_due() == 12.0
        [rep] = matcher.due(12.0)
        assert rep.origin is XidOrigin.NVML and rep.pid is None
        info = xid_info(31)
        fault = GpuFault(GpuFaultKind.XID, "Xid 31", info.action, 31, info.scope, None, None, rep.origin, 0)
        s = ready(pid=100)
        s2, acts = decide(s, fault, 13.0)
        assert s2 == s and emitted(acts, "gpu_xid").fields["ours"] is None

    @pytest.mark.parametrize(("n", "action"), [(48, "reset"), (62, "reset"), (64, "reset"), (74, "reset"),
                                               (95, "reset"), (119, "reset"), (120, "reset")])
    def test_device_xid_acts_whoever_the_pid(self, n: int, action: str) -> None:
        s, acts = decide(ready(pid=100), xid(n, action, pid=4711), 5.0)
        assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.RESET and Terminate(100) in acts
        assert emitted(acts, "gpu_xid").fields["ours"] is False


class TestXidMatcher:
    def test_device_xid_from_nvml_is_reported_at_once_and_its_kernel_line_is_a_duplicate(self) -> None:
        m = XidMatcher(window_s=2.0)
        [rep] = m.nvml(79, 1.0)
        assert rep.origin is XidOrigin.NVML
        rec = XidRecord("0000:02:00.0", 79, None, None, "NVRM: Xid ...: 79", True)
        assert m.kmsg(rec, 1.5) == []
        assert m.kmsg(rec, 4.0) != []  # a new one, past the window

    def test_kernel_line_first_then_nvml_is_one_report(self) -> None:
        m = XidMatcher(window_s=2.0)
        rec = XidRecord("0000:02:00.0", 31, 4711, "python3", "NVRM: Xid ...: 31", False)
        [rep] = m.kmsg(rec, 1.0)
        assert (rep.origin, rep.pid, rep.name) == (XidOrigin.KMSG, 4711, "python3")
        assert m.nvml(31, 1.2) == [] and m.next_due() is None

    def test_without_the_kernel_log_nothing_waits(self) -> None:
        m = XidMatcher(window_s=2.0, kmsg_on=False)
        [rep] = m.nvml(31, 1.0)
        assert rep.origin is XidOrigin.NVML and m.next_due() is None


# ------------------------------------------------------------------------------------------- during the reset


class TestDuringReset:
    def test_gpu_lost_during_the_reset_does_not_start_a_second_reset(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        for fault in (LOST, xid(79, "reboot"), xid(48, "reset"), xid(13, "restart")):
            s2, acts = decide(s, fault, 6.0)
            assert but_xid(acts) == [] and s2.phase is Phase.RESETTING and s2.resets == s.resets
            assert s2.deadline == s.deadline
        s, acts = decide(s, LOST, 6.0)
        s, acts = run_reset(s, 8.0)
        assert len(s.resets) == 1 and names(acts) == ["gpu_reset", "server_backoff"]

    def test_gpu_lost_during_a_reset_that_is_then_skipped_does_not_restart(self) -> None:
        # An OOM reset is under way when NVML says the GPU is lost; the reset is then skipped
        # (e.g. not root): restarting onto a lost GPU cannot help, so this escalates.
        s, _ = into_reset(ready(), line(100, OOM))
        s, acts = decide(s, LOST, 6.0)
        assert acts == []
        s, acts = decide(s, ResetFacts(0, True, 0.1, (), False, "llama-guard is not root"), 7.0)
        assert "gpu_lost" in names(acts)
        assert ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason) in acts and not of_type(acts, Spawn)

    def test_sigterm_while_inspecting_runs_no_command_and_exits_0_at_once(self) -> None:
        # Nothing has been done to the GPU yet: the reset is given up, the daemon exits now.
        s, _ = into_reset(ready(), line(100, OOM))
        s, acts = decide(s, StopRequest("SIGTERM received"), 6.0)
        assert names(acts) == ["daemon_stopping", "gpu_reset"] and s.phase is Phase.EXITED
        assert not of_type(acts, RunReset) and s.resets == ()
        assert emitted(acts, "gpu_reset").fields["outcome"] == "skipped"
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_OK, "SIGTERM received")]

    def test_sigterm_during_the_reset_command_waits_for_it_then_exits_0(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        s, acts = decide(s, CLEAR, 5.8)
        assert of_type(acts, RunReset)
        s, acts = decide(s, StopRequest("SIGTERM received"), 6.0)
        assert names(acts) == ["daemon_stopping"]
        stopping = emitted(acts, "daemon_stopping").fields
        assert stopping["waiting_for"] == "gpu_reset" and stopping["wait_s"] == round(s.deadline - 6.0, 1)
        assert "never interrupted" in str(stopping["reason"])
        assert not of_type(acts, ExitDaemon) and not of_type(acts, Terminate) and not of_type(acts, Kill)
        assert s.phase is Phase.RESETTING
        s, acts = decide(s, StopRequest("SIGTERM received", immediate=True), 6.5)  # a second signal
        assert not of_type(acts, ExitDaemon) and s.phase is Phase.RESETTING
        assert "a second signal does not interrupt it" in str(emitted(acts, "daemon_stopping").fields["reason"])
        s, acts = decide(s, ResetDone(0, "nvidia-smi --gpu-reset -i 0", 0, RESET_OK, True, RESET_OK), 9.0)
        assert names(acts) == ["gpu_reset"] and emitted(acts, "gpu_reset").fields["outcome"] == "succeeded"
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_OK, "SIGTERM received")]
        assert not of_type(acts, Spawn)

    def test_sigterm_during_a_reset_that_fails_still_reports_it(self) -> None:
        s, _ = into_reset(ready(), LOST)
        s, _ = decide(s, CLEAR, 5.8)
        s, _ = decide(s, StopRequest("SIGTERM received"), 6.0)
        s, acts = decide(s, ResetDone(0, "nvidia-smi --gpu-reset -i 0", 1, "x", False, "nvidia-smi exited 1"), 9.0)
        assert emitted(acts, "gpu_reset").fields["outcome"] == "failed"
        assert len(of_type(acts, ExitDaemon)) == 1 and s.phase is Phase.EXITED

    def test_sigterm_during_a_reset_that_never_answers_ends_at_the_deadline(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        s, _ = decide(s, CLEAR, 5.8)
        s, _ = decide(s, StopRequest("SIGTERM received"), 6.0)
        s, acts = decide(s, Tick(), 5.5 + P.reset_deadline_s)
        assert emitted(acts, "gpu_reset").fields["outcome"] == "timed out"
        assert len(of_type(acts, ExitDaemon)) == 1 and s.phase is Phase.EXITED

    def test_sigterm_while_stopping_for_a_reset_never_starts_the_reset(self) -> None:
        s, _ = stop_for(ready(), line(100, OOM))
        s, acts = decide(s, StopRequest("SIGTERM received"), 5.1)
        s, acts = decide(s, Exited(100, -15), 5.5)
        assert not of_type(acts, InspectGpu) and ExitDaemon(EXIT_OK, "SIGTERM received") in acts

    def test_lines_and_exits_of_the_old_server_are_ignored_while_resetting(self) -> None:
        s, _ = into_reset(ready(), line(100, OOM))
        for event in (line(100, OOM), Exited(100, -6), HealthOk(100)):
            assert decide(s, event, 6.0) == (s, [])


class TestResetOff:
    """``[recovery].reset_on = []`` (deploy/kubernetes/: NVIDIA's operators own the GPU's remediation): no
    fault leads to a GPU reset, even where llama-guard could run one. A fault a restart can clear restarts the
    server; one that needs a reset (a lost GPU, an Xid whose action is a reset, NVML's recovery action) stops
    the server and ends the daemon (69) with the reason: the node's remediation takes it from there."""

    OFF = replace(P, reset_on=frozenset())

    @pytest.mark.parametrize("fault", [line(100, OOM), line(100, ILLEGAL), xid(13, "restart")],
                             ids=["oom", "cuda-error", "xid-13"])
    def test_a_fault_a_restart_clears_restarts_the_server_without_a_reset(self, fault: Line | GpuFault) -> None:
        s, acts = stop_for(ready(params=self.OFF), fault)
        assert s.after_stop is AfterStop.FAILURE and not of_type(acts, RunReset)
        s, acts = decide(s, Exited(100, -6), 5.5)
        assert not of_type(acts, InspectGpu) and not of_type(acts, RunReset) and s.phase is Phase.BACKOFF
        s = restart_after_backoff(s, 101, 8.0)
        assert s.resets == ()

    @pytest.mark.parametrize("fault", [LOST, xid(48, "reset"), xid(74, "reset")], ids=["gpu-lost", "xid-48", "xid-74"])
    def test_a_fault_that_needs_a_reset_stops_the_server_and_exits_69(self, fault: GpuFault) -> None:
        s, acts = stop_for(ready(params=self.OFF), fault)
        assert not of_type(acts, RunReset)
        s, acts = decide(s, Exited(100, -6), 5.5)
        assert not of_type(acts, InspectGpu) and not of_type(acts, RunReset) and not of_type(acts, Spawn)
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason)]
        assert s.exit is not None and "no reset configured" in s.exit.reason

    def test_nvml_asking_for_a_reset_before_a_start_exits_69_with_the_advice(self) -> None:
        off = replace(self.OFF, vram_admission=True)
        s, acts = decide(initial_state(off), Boot(), 0.0)
        assert acts == [CheckVram()]
        s, acts = decide(s, VramFacts(0, 100_000, 1000, recovery=RecoveryAction.GPU_RESET), 0.5)
        assert not of_type(acts, InspectGpu) and not of_type(acts, RunReset) and not of_type(acts, Spawn)
        assert of_type(acts, ExitDaemon) == [ExitDaemon(EXIT_GPU_UNRECOVERABLE, s.exit.reason)]
        assert s.exit is not None and "reset_on" in s.exit.reason


def test_a_reset_fault_while_backing_off_with_the_budget_spent_is_one_more_failure() -> None:
    """In BACKOFF (a crash at load), an Xid asking for a reset when the window's reset budget is spent:
    counted as a failure — BACKOFF again with a longer wait — never a loop crash (before: IllegalMove)."""
    p = Params(reset_possible=True, max_resets=1)
    s, _ = decide(initial_state(p), Boot(), 0.0)
    s, _ = decide(s, Spawned(100), 0.1)
    s, _ = decide(s, Exited(100, 1), 0.2)
    assert s.phase is Phase.BACKOFF and s.deadline is not None
    s = replace(s, resets=(0.0,))  # one reset already run in the window
    first_wait = s.deadline - 0.2
    after, acts = decide(s, GpuFault(GpuFaultKind.XID, "Xid 79", action=XidAction.RESET), 0.3)
    assert after.phase is Phase.BACKOFF and len(after.failures) == len(s.failures) + 1
    assert after.deadline is not None and after.deadline - 0.3 > first_wait
    assert not any(isinstance(a, Spawn) for a in acts)


def test_a_reset_fault_before_the_first_start_with_no_reset_budget_backs_off() -> None:
    """Before the first start (STOPPED), a GPU fault asking for a reset the budget does not allow
    (``max_resets = 0``): one failure, BACKOFF (before: IllegalMove stopped -> backoff)."""
    s = initial_state(Params(reset_possible=True, max_resets=0))
    after, _ = decide(s, GpuFault(GpuFaultKind.XID, "Xid 79", action=XidAction.RESET), 0.0)
    assert after.phase is Phase.BACKOFF and len(after.failures) == 1
