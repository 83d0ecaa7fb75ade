"""A phase's own state (model/types.py ``PHASE_DATA``): the boot cause of a start, the reason and reset
trigger of a stop, the OOM a VRAM check judges, the trigger of a reset — each set as its phase is
entered and gone once it is left, so that no value outlives its phase or is read in another one."""

from __future__ import annotations

import pytest
from harness import line, names
from llama_guard.model.actions import Spawn
from llama_guard.model.inputs import (
    Boot,
    Drained,
    Exited,
    GpuFault,
    GpuHolder,
    HealthOk,
    ResetDone,
    ResetFacts,
    RestartRequest,
    Spawned,
    Tick,
    VramFacts,
)
from llama_guard.model.phase_state import PHASE_DATA, IllegalMove, Resetting, Starting, Stopping, WaitingVram
from llama_guard.model.policy import decide
from llama_guard.model.types import GpuFaultKind, Params, State, initial_state
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

P = Params(backoff_initial_s=1, max_restarts=5, restart_window_s=100, reset_possible=True,
           reset_on=frozenset({ResetTrigger.GPU_LOST, ResetTrigger.OOM}), gpu_index=0, vram_admission=True)
FITS = VramFacts(0, free_mib=80_000, need_mib=1_000)
OOM = "CUDA error: out of memory"


def _checking_vram_after_an_oom() -> State:
    """A start that ran out of GPU memory at load: stopped, its VRAM check under way (WaitingVram.after_oom)."""
    s, _ = decide(initial_state(P), Boot(), 0.0)
    s, acts = decide(s, FITS, 0.1)
    assert acts == [Spawn()]
    s, _ = decide(s, Spawned(100), 0.2)
    s, _ = decide(s, line(100, OOM), 0.3)
    assert s.phase is Phase.STOPPING and isinstance(s.phase_data, Stopping)
    assert s.phase_data.reset_trigger == s.failure.text and "server_oom" in s.failure.text
    s, _ = decide(s, Exited(100, 1), 0.4)
    assert s.phase is Phase.WAITING_VRAM and s.phase_data == WaitingVram(after_oom=s.failure.text)
    return s


def _reset_for_a_lost_gpu_meanwhile(s: State) -> State:
    """The GPU is lost while the VRAM check waits: reset (verified), then back off."""
    s, _ = decide(s, GpuFault(GpuFaultKind.GPU_LOST, "GPU has fallen off the bus"), 0.5)
    assert s.phase is Phase.RESETTING and s.phase_data == Resetting("GPU has fallen off the bus")
    s, _ = decide(s, ResetFacts(0, True, 0.0, (), True), 0.6)
    assert isinstance(s.phase_data, Resetting) and s.phase_data.command_at == 0.6
    s, _ = decide(s, ResetDone(0, "nvidia-smi --gpu-reset", 0, "", True, "verified"), 5.0)
    assert s.phase is Phase.BACKOFF and s.phase_data is None
    s, _ = decide(s, Tick(), 1_000.0)
    assert s.phase is Phase.WAITING_VRAM and s.phase_data == WaitingVram()  # a plain start's check
    return s


def test_a_reset_start_after_an_oom_check_spawns_when_the_vram_fits() -> None:
    """The OOM judged by the earlier VRAM check is gone with that check: once the GPU was reset the
    next start's check finds the VRAM free and spawns (before: it took the old OOM for its own and
    reset the GPU a second time)."""
    s = _reset_for_a_lost_gpu_meanwhile(_checking_vram_after_an_oom())
    s, acts = decide(s, FITS, 1_000.1)
    assert acts == [Spawn()] and s.phase is Phase.STARTING and len(s.resets) == 1, names(acts)


def test_a_reset_start_does_not_wait_for_vram_it_was_never_short_of() -> None:
    """... and with the need unknown, another process on the GPU is no reason to wait: only an OOM of
    this start's own would be (before: "ran out of GPU memory at load" was waited on, from the old OOM)."""
    s = _reset_for_a_lost_gpu_meanwhile(_checking_vram_after_an_oom())
    s, acts = decide(s, VramFacts(0, free_mib=100, need_mib=None, holders=(GpuHolder(7, 9_000, "python3"),)),
                     1_000.1)
    assert acts == [Spawn()] and "gpu_vram_wait" not in names(acts)


def test_the_stop_reason_is_gone_once_the_stop_is_over() -> None:
    """A planned restart's reason is its drain's and its stop's; the next start holds only its own state."""
    s, _ = decide(initial_state(Params()), Boot(), 0.0)
    s, _ = decide(s, Spawned(100), 0.1)
    assert s.phase_data == Starting()
    s, _ = decide(s, line(100, "error: invalid argument: --bogus"), 0.2)
    assert isinstance(s.phase_data, Starting) and "--bogus" in s.phase_data.boot_cause
    s, _ = decide(s, HealthOk(100), 0.3)
    assert s.phase is Phase.READY and s.phase_data is None and s.stop_reason == ""
    s, _ = decide(s, RestartRequest("nightly"), 1.0)
    assert s.phase is Phase.DRAINING and s.stop_reason == "nightly"
    s, _ = decide(s, Drained(100), 1.1)
    assert s.phase is Phase.STOPPING and s.phase_data == Stopping("nightly")
    s, acts = decide(s, Exited(100, 0), 1.2)
    assert "server_restart" in names(acts) and s.phase is Phase.STARTING
    assert s.phase_data == Starting() and s.stop_reason == ""


@pytest.mark.parametrize("phase", list(Phase))
def test_a_phase_holds_its_own_state_or_none_and_nothing_else(phase: Phase) -> None:
    assert State(phase=phase).phase_data is None
    for data in (Starting("x"), Stopping("x"), WaitingVram("x"), Resetting("x")):
        if PHASE_DATA.get(phase) is type(data):
            assert State(phase=phase, phase_data=data).phase_data == data
        else:
            with pytest.raises(IllegalMove, match=f"{phase.value} cannot hold {type(data).__name__}"):
                State(phase=phase, phase_data=data)
