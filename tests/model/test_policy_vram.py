"""VRAM admission in the pure policy: before each start the free VRAM is compared
with what the server needs; another process holding the shortfall makes it wait (``gpu_vram_wait``),
bounded, with no failure counted and no GPU reset; an OOM at load while another process holds the
VRAM is "waiting for VRAM", not a crash.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import emitted, names
from llama_guard.model.actions import CheckVram, ExitDaemon, InspectGpu, Spawn
from llama_guard.model.inputs import (
    Boot,
    Exited,
    GpuFault,
    GpuHolder,
    HealthOk,
    Line,
    Spawned,
    StopRequest,
    Tick,
    VramFacts,
)
from llama_guard.model.policy import decide
from llama_guard.model.server_log import classify_line
from llama_guard.model.types import GpuFaultKind, Params, State, initial_state
from llama_guard.vocab.exitcodes import EXIT_OK
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

P = Params(load_timeout_s=30, backoff_initial_s=1, max_restarts=3, restart_window_s=100, stop_grace_s=4,
           reset_possible=True, reset_on=frozenset({ResetTrigger.GPU_LOST, ResetTrigger.OOM}),
           gpu_index=0, vram_admission=True, vram_wait_timeout_s=30.0, vram_poll_s=1.0)
TORCH = GpuHolder(5151, 143_000, "python3")
SHORT = VramFacts(0, 150, 20_000, (TORCH,))         # all but 150 MiB held by another process
FITS = VramFacts(0, 140_000, 20_000, ())
OOM_AT_LOAD = ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9216.00 MiB on device 0: "
               "cudaMalloc failed: out of memory")


def booted(params: Params = P) -> State:
    s, acts = decide(initial_state(params), Boot(), 0.0)
    assert s.phase is Phase.WAITING_VRAM and acts == [CheckVram()]
    return s


def test_without_admission_boot_spawns_at_once() -> None:
    _, acts = decide(initial_state(replace(P, vram_admission=False)), Boot(), 0.0)
    assert acts == [Spawn()]


@pytest.mark.parametrize("facts", [FITS, VramFacts(None, None, None), VramFacts(0, 150, None, (TORCH,)),
                                   VramFacts(0, 150, 20_000, ())],
                         ids=["fits", "gpu-unreadable", "need-unknown", "short-but-no-other-process"])
def test_start_goes_on_when_nothing_foreign_holds_a_known_shortfall(facts: VramFacts) -> None:
    s, acts = decide(booted(), facts, 0.1)
    assert acts == [Spawn()] and s.phase is Phase.STARTING


def test_foreign_shortfall_waits_then_starts_without_a_failure() -> None:
    s, acts = decide(booted(), SHORT, 0.1)
    assert s.phase is Phase.WAITING_VRAM and names(acts) == ["gpu_vram_wait"] and not any(
        isinstance(a, Spawn) for a in acts)
    wait = emitted(acts, "gpu_vram_wait").fields
    assert wait["foreign_pid"] == 5151 and wait["foreign_mib"] == 143_000 and wait["gpu_index"] == 0
    assert "19850 MiB missing" in str(wait["missing"]) and wait["timeout_s"] == 30.0
    # It polls, without reporting again, while the other process keeps the memory.
    for _ in range(3):
        assert s.deadline is not None
        s, acts = decide(s, Tick(), s.deadline)
        assert acts == [CheckVram()]
        s, acts = decide(s, SHORT, s.deadline - P.vram_poll_s + 0.05)
        assert acts == [] and s.phase is Phase.WAITING_VRAM
    s, acts = decide(s, FITS, 4.2)
    assert acts == [Spawn()] and s.failures == () and s.resets == () and s.phase is Phase.STARTING


def test_a_stop_request_while_waiting_exits_at_once() -> None:
    s, _ = decide(booted(), SHORT, 0.1)
    s, acts = decide(s, StopRequest("SIGTERM received"), 0.5)
    assert ExitDaemon(EXIT_OK, "SIGTERM received") in acts and s.phase is Phase.EXITED


def test_the_wait_is_bounded_and_then_counts_one_failure() -> None:
    s, _ = decide(booted(), SHORT, 0.1)
    t = 0.1
    while s.phase is Phase.WAITING_VRAM:
        assert t < 40, "the wait must end"
        t = s.deadline if s.deadline is not None else t + 1
        s, acts = decide(s, Tick(), t)
        if CheckVram() in acts:
            s, acts = decide(s, SHORT, t)
    assert s.phase is Phase.BACKOFF and len(s.failures) == 1 and t >= 30.1
    assert "VRAM still held after 30 s" in s.failure.text and "pid 5151 (python3" in s.failure.text
    # The next start checks again (a fresh wait).
    s, acts = decide(s, Tick(), s.deadline or t + 1)
    assert s.phase is Phase.WAITING_VRAM and acts[-1] == CheckVram()


def test_a_check_that_never_answers_does_not_hold_the_start() -> None:
    s = booted()
    assert s.deadline is not None
    s, acts = decide(s, Tick(), s.deadline)
    assert acts == [Spawn()]


def loading(params: Params = P, pid: int = 100) -> State:
    s, acts = decide(booted(params), FITS, 0.1)
    assert acts == [Spawn()]
    s, _ = decide(s, Spawned(pid), 0.2)
    return s


def oom_at_load(s: State, pid: int = 100) -> State:
    # A failed allocation is judged by what the process does next: here it exits.
    s, acts = decide(s, Line(pid, classify_line(OOM_AT_LOAD), OOM_AT_LOAD), 1.0)
    assert acts == [] and s.phase is Phase.STARTING
    s, acts = decide(s, Exited(pid, 1), 1.2)
    assert names(acts)[:2] == ["server_oom", "server_exited"]
    assert s.phase is Phase.WAITING_VRAM and acts[-1] == CheckVram() and s.pid is None
    return s


def test_oom_at_load_while_another_process_holds_the_vram_is_a_wait_not_a_crash() -> None:
    # The H200 run (tests/fixtures/h200_vram_wait): no good start yet, so the need is unknown; the OOM at
    # load with another process on the GPU is the evidence.
    s = oom_at_load(loading())
    facts = VramFacts(0, 150, None, (TORCH,))
    s, acts = decide(s, facts, 1.3)
    assert names(acts) == ["gpu_vram_wait"] and not any(isinstance(a, InspectGpu) for a in acts)
    assert "ran out of GPU memory at load" in str(emitted(acts, "gpu_vram_wait").fields["missing"])
    s, _ = decide(s, Tick(), 2.3)
    s, acts = decide(s, VramFacts(0, 143_150, None, ()), 2.4)  # the other process is gone
    assert acts == [Spawn()]
    s, _ = decide(s, Spawned(101), 2.5)
    s, acts = decide(s, HealthOk(101), 5.0)
    assert s.phase is Phase.READY and s.failures == () and s.resets == ()


def test_oom_at_load_without_another_process_resets_as_before() -> None:
    s = oom_at_load(loading())
    s, acts = decide(s, VramFacts(0, 60_000, None, ()), 1.3)
    assert s.phase is Phase.RESETTING and any(isinstance(a, InspectGpu) for a in acts)


def test_oom_at_load_without_another_process_and_no_reset_counts_a_failure() -> None:
    s = oom_at_load(loading(replace(P, reset_possible=False)))
    s, acts = decide(s, VramFacts(0, 60_000, None, ()), 1.3)
    assert s.phase is Phase.BACKOFF and len(s.failures) == 1 and names(acts) == ["server_backoff"]


def test_gpu_lost_while_waiting_resets() -> None:
    s, _ = decide(booted(), SHORT, 0.1)
    s, acts = decide(s, GpuFault(GpuFaultKind.GPU_LOST, "GPU is lost"), 0.5)
    assert s.phase is Phase.RESETTING and any(isinstance(a, InspectGpu) for a in acts)


FAILED_CHECK = VramFacts(None, None, None, error="gpu gave no VRAM facts within 25 s")


def test_a_failed_check_during_the_wait_keeps_waiting_and_asks_again() -> None:
    # A check that failed or timed out (the daemon reported it) is no evidence that the memory is
    # free: starting would run into the other process's memory.
    s, _ = decide(booted(), SHORT, 0.1)
    s, acts = decide(s, FAILED_CHECK, 1.2)
    assert acts == [] and s.phase is Phase.WAITING_VRAM and s.deadline == pytest.approx(2.2)
    s, acts = decide(s, Tick(), 2.2)
    assert acts == [CheckVram()]
    s, acts = decide(s, FITS, 2.4)
    assert acts == [Spawn()] and s.failures == ()


def test_answers_arriving_faster_than_the_poll_do_not_postpone_the_timeout() -> None:
    s, _ = decide(booted(), SHORT, 0.1)
    later = VramFacts(0, 170, 20_000, (GpuHolder(5151, 142_980, "python3"),))
    t = 0.1
    while s.phase is Phase.WAITING_VRAM:
        assert t < 31, "the wait must end at its deadline"
        t += 0.5  # an answer every half poll: no Tick ever finds the poll's deadline passed
        s, _ = decide(s, later, t)
    assert s.phase is Phase.BACKOFF and t == pytest.approx(30.1)
    # The reason is built from the latest facts, not from those that began the wait.
    assert "142980 MiB" in s.failure.text and "170 MiB free" in s.failure.text


def test_a_timeout_after_failed_checks_says_how_old_its_facts_are() -> None:
    s, _ = decide(booted(), SHORT, 0.1)
    t = 0.1
    while s.phase is Phase.WAITING_VRAM:
        assert t < 40, "the wait must end"
        t = s.deadline if s.deadline is not None else t + 1
        s, acts = decide(s, Tick(), t)
        if CheckVram() in acts:
            s, acts = decide(s, FAILED_CHECK, t + 0.1)
    assert s.phase is Phase.BACKOFF and len(s.failures) == 1
    assert "pid 5151 (python3" in s.failure.text and "the VRAM checks since then failed" in s.failure.text
