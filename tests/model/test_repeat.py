"""Deterministic faults that would loop: the same failure on consecutive starts (before ready, or
right after it) is a verdict (exit 78 naming the line, the build and the fix) after three starts;
the same message sporadically, after the server ran stably, is a restart, never a verdict. And a
server asked to offload that runs on the CPU is reported whatever the GPU watch says. Real-format
lines through the real classifier and the real policy."""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import replace

from llama_guard.model.actions import Emit, ExitDaemon, ReadBuild
from llama_guard.model.inputs import Boot, BuildInfo, CrashesCharged, Exited, HealthOk, LoadProgress, Spawned, Tick
from llama_guard.model.policy import decide
from llama_guard.model.policy.repeat import FIX_BUILD, FIX_GPU, FIX_STALL
from llama_guard.model.types import Params, State, initial_state
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_CRASH_LOOP
from llama_guard.vocab.phases import Phase
from test_judgement import emitted, feed, names

P = Params(load_timeout_s=900, hang_strikes=3, backoff_initial_s=1, max_restarts=10, restart_window_s=600,
           stop_grace_s=4, load_stall_s=20, stable_after_s=60, offload_layers=99)
BUILD = "version: 4242 (abc1234)"
NO_DEVICE = "0.00.004.100 E ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected"
ILLEGAL = ["0.01.002.000 E CUDA error: an illegal memory access was encountered",
           "0.01.002.001 E   current device: 0, in function ggml_cuda_mul_mat at /src/ggml-cuda/ggml-cuda.cu:1974",
           "/src/ggml-cuda/ggml-cuda.cu:88: CUDA error"]
Failure = Callable[[State, int, float], tuple[State, list[object]]]


def run(failure: Failure, starts: int, params: Params = P, gap_s: float = 5.0) -> tuple[State, list[list[object]]]:
    """``starts`` servers, each failing through ``failure``; the actions of each counted failure."""
    s, _ = decide(initial_state(params), Boot(), 0.0)
    now, out = 0.0, []
    for i in range(starts):
        pid = 100 + i
        s, _ = decide(s, Spawned(pid, ("llama-server",)), now)
        s, acts = failure(s, pid, now)
        if any(isinstance(a, ReadBuild) for a in acts):  # the daemon answers with --version
            s, _ = decide(s, BuildInfo(BUILD), now + 0.1)
        out.append(acts)
        if s.phase is Phase.EXITED:
            break
        assert s.phase is Phase.BACKOFF, (i, s.phase, names(acts))
        now = max(now + gap_s, s.deadline or now)
        s, _ = decide(s, Tick(), now)
    return s, out


def exit_code(acts: list[object]) -> int | None:
    return next((a.code for a in acts if isinstance(a, ExitDaemon)), None)


def stop_then_exit(s: State, pid: int, now: float, acts: list[object]) -> tuple[State, list[object]]:
    assert s.phase is Phase.STOPPING, names(acts)
    s, more = decide(s, Exited(pid, -15), now + 0.5)
    return s, [*acts, *more]


def cuda_init_failure(s: State, pid: int, now: float) -> tuple[State, list[object]]:
    s, acts = feed(s, pid, [NO_DEVICE], now + 0.1)
    return stop_then_exit(s, pid, now, acts)


def test_no_cuda_device_on_every_start_is_a_verdict_after_three() -> None:
    s, per_start = run(cuda_init_failure, 6, replace(P, require_gpu=True))
    assert len(per_start) == 3 and s.phase is Phase.EXITED
    last = per_start[-1]
    assert exit_code(last) == EXIT_CONFIG
    failure = emitted(last, "server_boot_failure")
    assert failure.fields["consecutive_starts"] == 3
    assert "no CUDA-capable device is detected" in str(failure.fields["cause"])
    assert failure.fields["fix"] == FIX_GPU and FIX_GPU in str(failure.fields["cause"])
    assert all("server_boot_failure" not in names(acts) for acts in per_start[:2])


def stall_at(line: str) -> Failure:
    def failure(s: State, pid: int, now: float) -> tuple[State, list[object]]:
        s, _ = decide(s, LoadProgress(pid, ("lines",)), now + 1.0)
        s, acts = decide(s, Tick(), now + 1.0 + P.load_stall_s)
        assert "server_load_stalled" in names(acts)
        assert s.phase is Phase.STOPPING
        s, more = decide(s, Exited(pid, -15, last_line=line), now + 1.5 + P.load_stall_s)
        return s, [*acts, *more]
    return failure


def test_a_load_that_stalls_at_the_same_line_is_a_verdict_after_three() -> None:
    line = "0.00.120.000 I llama_model_loader: - kv  22: tokenizer.ggml.merges arr[str,48900]"
    _s, per_start = run(stall_at(line), 6)
    assert len(per_start) == 3 and exit_code(per_start[-1]) == EXIT_CONFIG
    failure = emitted(per_start[-1], "server_boot_failure")
    assert "tokenizer.ggml.merges" in str(failure.fields["line"]) and failure.fields["fix"] == FIX_STALL


def test_stalls_at_different_lines_are_restarts() -> None:
    lines = iter(["I llama_model_loader: loaded meta data with 33 key-value pairs",
                  "I print_info: file format = GGUF V3 (latest)", "I load_tensors: loading model tensors",
                  "I llama_context: constructing llama_context", "I llama_kv_cache: size = 24.00 MiB",
                  "I common_init_from_params: warming up the model with an empty run"])
    s, per_start = run(lambda s, pid, now: stall_at(next(lines))(s, pid, now), 6)
    assert s.phase is not Phase.EXITED and all(exit_code(acts) is None for acts in per_start)


def crash_on_first_request(s: State, pid: int, now: float) -> tuple[State, list[object]]:
    s, _ = decide(s, HealthOk(pid), now + 1.0)
    # Whether the rest of the block is printed before our SIGTERM lands is a race: the verdict
    # must not depend on it.
    s, acts = feed(s, pid, ILLEGAL if pid % 2 else ILLEGAL[:1], now + 2.0)
    assert "server_cuda_error" in names(acts)
    return stop_then_exit(s, pid, now + 2.0, acts)


def test_a_crash_on_the_first_request_after_every_start_is_a_verdict_naming_line_and_build() -> None:
    _s, per_start = run(crash_on_first_request, 6)
    assert len(per_start) == 3
    last = per_start[-1]
    assert exit_code(last) == EXIT_CONFIG
    verdict = emitted(last, "server_failure_repeated")
    assert "an illegal memory access was encountered" in str(verdict.fields["cause"])
    assert verdict.fields["build"] == BUILD and BUILD in str(verdict.fields["cause"])
    assert verdict.fields["fix"] == FIX_BUILD and verdict.fields["consecutive_starts"] == 3


def sporadic_crash(s: State, pid: int, now: float) -> tuple[State, list[object]]:
    s, _ = decide(s, HealthOk(pid), now + 1.0)
    s, _ = decide(s, Tick(), now + 1.0 + P.stable_after_s)  # ran stably: a day's worth, in effect
    assert s.stable
    s, acts = feed(s, pid, ILLEGAL, now + 3000.0)
    return stop_then_exit(s, pid, now + 3000.0, acts)


def test_the_same_crash_sporadically_under_load_is_a_restart_never_a_verdict() -> None:
    s, per_start = run(sporadic_crash, 8, replace(P, restart_window_s=1000.0), gap_s=3100.0)
    assert s.phase is not Phase.EXITED and len(per_start) == 8
    assert all(exit_code(acts) is None for acts in per_start)
    assert all("server_failure_repeated" not in names(acts) for acts in per_start)


def test_the_same_crash_often_within_the_window_is_a_crash_loop_not_a_verdict() -> None:
    # Stable in between, but six in the rolling window: exit 75 (systemd's policy), not 78.
    _s, per_start = run(sporadic_crash, 10, replace(P, max_restarts=5, restart_window_s=100_000.0), gap_s=3100.0)
    assert exit_code(per_start[-1]) == EXIT_CRASH_LOOP and len(per_start) == 6


def oom_at_load(s: State, pid: int, now: float) -> tuple[State, list[object]]:
    s, acts = feed(s, pid, ["E CUDA error: out of memory", "/src/ggml-cuda/common.cuh:99: CUDA error"], now + 0.1)
    return stop_then_exit(s, pid, now, acts)


def test_an_identical_oom_is_not_a_verdict_another_process_may_hold_the_memory() -> None:
    _s, per_start = run(oom_at_load, 5)
    assert all(exit_code(acts) is None for acts in per_start)


def exits_after(line: str, returncode: int) -> Failure:
    def failure(s: State, pid: int, now: float) -> tuple[State, list[object]]:
        s, acts = feed(s, pid, [line], now + 0.1)
        if s.phase is Phase.STOPPING:
            return stop_then_exit(s, pid, now, acts)
        s, more = decide(s, Exited(pid, returncode), now + 0.2)
        return s, [*acts, *more]
    return failure


def test_failures_another_process_causes_and_ends_never_chain_into_a_verdict() -> None:
    # The GPU held in exclusive-process mode, the port held, a SIGKILL from outside: five identical
    # starts each, and still restarts (the typed line class and exit signal decide, not the wording).
    for failure in (
        exits_after("0.00.004.100 E CUDA error: CUDA-capable device(s) is/are busy or unavailable", 1),
        exits_after("0.00.300.000 E couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8081", 1),
        exits_after("0.00.300.000 I srv  load_model: loading model", -signal.SIGKILL),
    ):
        s, per_start = run(failure, 5, replace(P, require_gpu=False))
        assert len(per_start) == 5 and all(exit_code(acts) is None for acts in per_start), names(per_start[-1])
        assert s.phase is not Phase.EXITED


def test_the_same_exit_status_on_every_start_still_chains() -> None:
    # The counter-case: a wording that names nothing held elsewhere, exit 1 each time: a verdict.
    s, per_start = run(exits_after("0.00.300.000 E main: error: the model's vocab is broken", 1), 5)
    assert len(per_start) == 3 and exit_code(per_start[-1]) == EXIT_CONFIG and s.phase is Phase.EXITED


def test_asked_to_offload_but_on_the_cpu_is_reported_once_whatever_the_gpu_watch() -> None:
    s, _ = decide(initial_state(P), Boot(), 0.0)  # require_gpu False: the GPU watch is off
    s, _ = decide(s, Spawned(100), 0.0)
    s, acts = feed(s, 100, ["warning: no usable GPU found, --gpu-layers option will be ignored",
                            "warning: one possible reason is that llama.cpp was compiled without GPU support",
                            NO_DEVICE], 0.1)
    assert names(acts) == ["server_on_cpu"] and s.phase is Phase.STARTING
    on_cpu = emitted(acts, "server_on_cpu")
    assert on_cpu.fields["n_gpu_layers"] == 99 and "no usable GPU" in str(on_cpu.fields["line"])
    s, acts = decide(s, HealthOk(100), 1.0)
    assert s.phase is Phase.READY  # it serves, on the CPU
    # Asked for no layer on a GPU: nothing to report.
    s, _ = decide(initial_state(replace(P, offload_layers=0)), Boot(), 0.0)
    s, _ = decide(s, Spawned(100), 0.0)
    assert feed(s, 100, ["warning: no usable GPU found, --gpu-layers option will be ignored"], 0.1)[1] == []


def test_offloaded_zero_layers_is_on_the_cpu() -> None:
    s, _ = decide(initial_state(P), Boot(), 0.0)
    s, _ = decide(s, Spawned(100), 0.0)
    _, acts = feed(s, 100, ["0.00.300.000 I load_tensors: offloaded 0/31 layers to GPU"], 0.1)
    assert names(acts) == ["server_on_cpu"]
    _, acts = feed(s, 100, ["0.00.300.000 I load_tensors: offloaded 31/31 layers to GPU"], 0.1)
    assert acts == []
    assert isinstance(acts, list) and not any(isinstance(a, Emit) for a in acts)


def die_by(*signals: int) -> Failure:
    """Each start dies by the next of ``signals`` (cycling) before ready, after a line that differs
    from start to start (where the output got to depends on timing)."""
    def failure(s: State, pid: int, now: float) -> tuple[State, list[object]]:
        sig = signals[(pid - 100) % len(signals)]
        s, _ = feed(s, pid, [f"0.00.0{pid}.000 I load_tensors: offloaded {pid % 7}/31 layers"], now + 0.1)
        return decide(s, Exited(pid, -sig), now + 0.2)
    return failure


def test_illegal_instruction_and_segfault_alternating_is_a_verdict_within_three_starts() -> None:
    # A native build on a CPU with AMX: SIGILL at tilezero, SIGSEGV at ldtilecfg, alternating.
    s, per_start = run(die_by(signal.SIGILL, signal.SIGSEGV), 8)
    assert len(per_start) == 3 and s.phase is Phase.EXITED
    assert exit_code(per_start[-1]) == EXIT_CONFIG
    verdict = emitted(per_start[-1], "server_boot_failure")
    cause = str(verdict.fields["cause"])
    assert cause.startswith("llama-server dies with an illegal instruction")
    assert "built for CPU instructions this machine cannot run" in cause and "GGML_NATIVE=OFF" in cause
    assert verdict.fields["signals"] == ["SIGILL", "SIGSEGV"]
    assert BUILD in cause


def test_segfault_on_every_start_names_the_build_fault_not_an_illegal_instruction() -> None:
    for sig in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE):
        _s, per_start = run(die_by(sig), 8)
        assert len(per_start) == 3 and exit_code(per_start[-1]) == EXIT_CONFIG, sig
        cause = str(emitted(per_start[-1], "server_boot_failure").fields["cause"])
        assert "illegal instruction" not in cause and signal.Signals(sig).name in cause
        assert "GGML_NATIVE=OFF" in cause and "another driver" in cause


def test_fault_signals_after_ready_on_each_start_are_a_verdict_too() -> None:
    def ready_then_sigill(s: State, pid: int, now: float) -> tuple[State, list[object]]:
        s, _ = decide(s, HealthOk(pid), now + 0.1)
        return decide(s, Exited(pid, -signal.SIGILL), now + 0.5)
    _s, per_start = run(ready_then_sigill, 8)
    assert len(per_start) == 3 and exit_code(per_start[-1]) == EXIT_CONFIG
    assert "illegal instruction" in str(emitted(per_start[-1], "server_failure_repeated").fields["cause"])


def test_a_fault_signal_between_other_failures_breaks_no_rule_and_sigkill_never_chains() -> None:
    _s, per_start = run(die_by(signal.SIGILL, signal.SIGKILL), 6)
    assert all(exit_code(acts) != EXIT_CONFIG for acts in per_start)


def test_a_hung_server_is_killed_one_second_after_the_verdict_not_after_stop_grace_s() -> None:
    from llama_guard.model.actions import Kill
    from llama_guard.model.inputs import Probe
    from llama_guard.model.policy.steps import HUNG_GRACE_S

    s, _ = decide(initial_state(P), Boot(), 0.0)
    s, _ = decide(s, Spawned(100, ("llama-server",)), 0.0)
    s, _ = decide(s, HealthOk(100), 0.5)
    now, acts = 1.0, []
    for _ in range(P.hang_strikes):
        now += 5.0
        s, acts = decide(s, Probe(100, False, None, False, False, "/health failed within 3.0 s"), now)
    assert "server_hang" in names(acts) and s.phase is Phase.STOPPING
    s, early = decide(s, Tick(), now + HUNG_GRACE_S - 0.1)
    assert not any(isinstance(a, Kill) for a in early)
    s, late = decide(s, Tick(), now + HUNG_GRACE_S)
    assert any(isinstance(a, Kill) for a in late) and P.stop_grace_s > HUNG_GRACE_S
    assert emitted(late, "server_stop_timeout").fields["grace_s"] == HUNG_GRACE_S  # the grace it got, said


def test_crashes_charged_to_client_requests_never_make_a_verdict() -> None:
    """A client that sends one crashing prompt after another: each prompt crashes two servers (the
    second time sent alone) and is then refused by the front door, which charges those crashes to it.
    Without the charges the third crash after ready is a build verdict (exit 78, the daemon gone for
    good under systemd's RestartPreventExitStatus); with them, six such crashes are restarts, and the
    start held back to confirm the chain goes as soon as the crashes are charged."""
    params = replace(P, repeat_confirm_s=45.0)
    s, _ = decide(initial_state(params), Boot(), 0.0)
    now = 0.0
    for i in range(6):
        pid = 100 + i
        s, _ = decide(s, Spawned(pid, ("llama-server",)), now)
        s, acts = crash_on_first_request(s, pid, now)
        assert exit_code(acts) is None, (i, names(acts))
        assert s.phase is Phase.BACKOFF
        now += 3.0
        if i % 2:  # the prompt's second crash: the front door refuses it and charges both
            assert s.identical == params.identical_failures - 1 and s.deadline is not None and s.deadline > now + 30
            s, acts = decide(s, CrashesCharged((pid - 1, pid)), now)
            assert acts == [] and s.identical == 0 and s.deadline == now
        now = max(now, s.deadline or now)
        s, _ = decide(s, Tick(), now)
        assert s.phase is not Phase.EXITED


def test_uncharged_crashes_after_ready_are_still_a_verdict_after_three() -> None:
    """The same crashes without a charge (no request was refused for them): the verdict stands, and a
    charge that comes when no chain is held changes nothing."""
    s, _ = decide(initial_state(P), Boot(), 0.0)
    charged, acts = decide(s, CrashesCharged((1, 2)), 0.5)
    assert charged == s and acts == []
    _s, per_start = run(crash_on_first_request, 6)
    assert len(per_start) == 3 and exit_code(per_start[-1]) == EXIT_CONFIG


def test_a_charge_while_the_next_server_starts_breaks_the_chain_without_touching_its_deadline() -> None:
    s, _ = decide(initial_state(P), Boot(), 0.0)
    s, _ = decide(s, Spawned(100, ("llama-server",)), 0.0)
    s, _ = crash_on_first_request(s, 100, 0.0)
    s, _ = decide(s, Tick(), s.deadline or 5.0)
    assert s.phase is Phase.STARTING and s.identical == 1
    deadline = s.deadline
    s, _ = decide(s, CrashesCharged((100,)), 6.0)
    assert s.identical == 0 and s.deadline == deadline and s.phase is Phase.STARTING


def abort_after_ready(s: State, pid: int, now: float, status: int = -signal.SIGABRT) -> tuple[State, list[object]]:
    """Server ``pid`` becomes ready and then dies (a poisoned prompt's abort: SIGABRT), at ``now + 1``."""
    s, _ = decide(s, HealthOk(pid), now + 0.5)
    return decide(s, Exited(pid, status), now + 1.0)


def test_crashes_charged_to_requests_leave_the_crash_loop_window_and_the_backoff() -> None:
    """Four variants of one poisoned prompt, each crashing two servers and then charged by the front
    door: eight crashes within the window, one more than max_restarts — restarts, never the crash loop
    (exit 75); after each charge the backoff is back at its start and the wait the crash began ends."""
    params = replace(P, max_restarts=7, backoff_initial_s=2.0, backoff_factor=2.0, backoff_max_s=60.0)
    s, _ = decide(initial_state(params), Boot(), 0.0)
    now = 0.0
    for i in range(8):
        pid = 100 + i
        s, _ = decide(s, Spawned(pid, ("llama-server",)), now)
        s, acts = abort_after_ready(s, pid, now)
        assert exit_code(acts) is None and s.phase is Phase.BACKOFF, (i, names(acts))
        now += 1.0
        if i % 2:  # the variant's second crash, sent alone: charged with both
            assert s.deadline is not None and s.deadline > now
            s, acts = decide(s, CrashesCharged((pid - 1, pid)), now)
            assert acts == [] and s.failures == () and s.next_backoff_s == 2.0 and s.deadline == now
        now = max(now, s.deadline or now)
        s, _ = decide(s, Tick(), now)
    assert s.phase is Phase.STARTING


def test_a_charge_keeps_the_other_failures_and_the_backoff_they_made() -> None:
    params = replace(P, max_restarts=10, backoff_initial_s=2.0, backoff_factor=2.0, backoff_max_s=60.0)
    s, _ = decide(initial_state(params), Boot(), 0.0)
    now = 0.0
    for i in range(5):
        pid = 100 + i
        s, _ = decide(s, Spawned(pid, ("llama-server",)), now)
        s, _ = abort_after_ready(s, pid, now, status=1 + i)  # differing exits: no chain
        now = s.deadline or now
        if i < 4:
            s, _ = decide(s, Tick(), now)
    assert s.next_backoff_s == 32.0 and s.phase is Phase.BACKOFF
    s, acts = decide(s, CrashesCharged((103, 104)), now - 10.0)
    assert acts == [] and [pid for _, pid in s.failures] == [100, 101, 102]
    assert s.next_backoff_s == 8.0 and s.deadline == now - 10.0  # as after three failures; the wait ends


def test_a_charge_of_an_earlier_crash_leaves_the_current_wait() -> None:
    s, _ = decide(initial_state(P), Boot(), 0.0)
    now = 0.0
    for i in range(2):
        s, _ = decide(s, Spawned(100 + i, ("llama-server",)), now)
        s, _ = abort_after_ready(s, 100 + i, now, status=1 + i)
        now = s.deadline or now
        if i == 0:
            s, _ = decide(s, Tick(), now)
    deadline = s.deadline
    assert s.phase is Phase.BACKOFF and deadline is not None
    s, _ = decide(s, CrashesCharged((100,)), deadline - 0.5)
    assert [pid for _, pid in s.failures] == [101] and s.deadline == deadline
