"""The policy's judgement on real failure kinds: a frozen load, liveness from
progress, recovered allocation failures, faults no restart can fix, the same failure on
consecutive starts. Inputs are real-format lines through the real classifier."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import emitted, names
from harness import ready as policy_ready
from harness import started as policy_started
from llama_guard.model.actions import ExitDaemon, InspectGpu, ReadBuild, Terminate
from llama_guard.model.inputs import BuildInfo, Exited, HealthOk, Line, LoadProgress, Probe, Spawned, Tick
from llama_guard.model.judgement import failure_signature
from llama_guard.model.phase_state import WaitingVram
from llama_guard.model.policy import decide
from llama_guard.model.server_log import Family, classify_line
from llama_guard.model.types import AfterStop, Params, State
from llama_guard.vocab.exitcodes import EXIT_CONFIG
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

P = Params(load_timeout_s=900, hang_strikes=3, backoff_initial_s=1, max_restarts=5, restart_window_s=600,
           stop_grace_s=4, load_stall_s=20)


def started(pid: int = 100, now: float = 0.0, params: Params = P, state: State | None = None) -> State:
    return policy_started(params, pid, now, state)


def ready(pid: int = 100, params: Params = P) -> State:
    return policy_ready(params, pid)


def feed(s: State, pid: int, lines: list[str], now: float) -> tuple[State, list[object]]:
    out: list[object] = []
    for text in lines:
        s, acts = decide(s, Line(pid, classify_line(text), text), now)
        out += acts
    return s, out


# ------------------------------------------------------------ 1. load stall

class TestLoadStall:
    def test_no_progress_for_load_stall_s_is_stalled_and_restarted(self) -> None:
        s = started()
        assert s.next_deadline() == pytest.approx(20.0)
        s, acts = decide(s, Tick(), 19.9)
        assert s.phase is Phase.STARTING and acts == []
        s, acts = decide(s, Tick(), 20.0)
        assert names(acts) == ["server_load_stalled"] and Terminate(100) in acts
        assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.FAILURE
        s, acts = decide(s, Exited(100, -15), 21.0)
        assert s.phase is Phase.BACKOFF

    @pytest.mark.parametrize("signals", [("lines",), ("cpu",), ("http",)])
    def test_a_progressing_load_gets_its_full_load_timeout(self, signals: tuple[str, ...]) -> None:
        s = started()
        now = 0.0
        while now < 880.0:
            now += 10.0
            s, acts = decide(s, LoadProgress(100, signals), now)
            s, acts = decide(s, Tick(), now + 0.5)
            assert acts == [] and s.phase is Phase.STARTING, now
        s, _ = decide(s, LoadProgress(100, signals), 895.0)
        s, acts = decide(s, Tick(), 900.0)
        assert names(acts) == ["server_load_timeout"]

    def test_a_server_line_is_progress(self) -> None:
        s = started()
        s, _ = feed(s, 100, ["load_tensors: failed to map, falling back"], 15.0)
        s, acts = decide(s, Tick(), 34.0)
        assert acts == [] and s.phase is Phase.STARTING

    def test_progress_of_another_pid_does_not_count(self) -> None:
        s = started()
        s, _ = decide(s, LoadProgress(999, ("cpu",)), 10.0)
        s, acts = decide(s, Tick(), 20.0)
        assert names(acts) == ["server_load_stalled"]

    def test_zero_turns_the_check_off(self) -> None:
        s = started(params=replace(P, load_stall_s=0))
        assert s.next_deadline() == pytest.approx(900.0)
        s, acts = decide(s, Tick(), 600.0)
        assert acts == []


# ------------------------------------------------------------ 2. liveness from progress

def probe(pid: int = 100, *, health: bool = True, canary: bool | None = False, cpu: float | None = 0.0,
          lines: int = 0, gpu: bool | None = None, progressed: bool = False) -> Probe:
    return Probe(pid, health, canary, False, progressed, "probe timed out", cpu_s=cpu, lines=lines, gpu_busy=gpu)


class TestLiveness:
    @pytest.mark.parametrize("p", [
        probe(cpu=12.0),                          # busy HTTP loop: canary/slots/metrics time out, CPU burns
        probe(health=False, cpu=3.0),             # even /health queued behind busy HTTP threads
        probe(lines=4),                           # it prints
        probe(gpu=True),                          # the GPU watcher sees our pid working
        probe(progressed=True),                   # token counters moved
    ], ids=["cpu", "cpu-no-health", "lines", "gpu", "counters"])
    def test_a_probe_that_times_out_while_the_server_progresses_is_no_strike(self, p: Probe) -> None:
        s = ready()
        for i in range(10):
            s, acts = decide(s, p, 10.0 + i)
            assert acts == [] and s.strikes == 0 and s.phase is Phase.READY

    @pytest.mark.parametrize("p", [
        probe(health=False, canary=None, cpu=0.0),   # SIGSTOPped: nothing answers, nothing moves
        probe(health=True, canary=False, cpu=0.01),  # wedged in a CUDA call; /health still answers
        probe(health=False, canary=None, cpu=None),  # CPU time unknown: no evidence of progress
    ], ids=["sigstop", "wedged", "unknown-cpu"])
    def test_no_answer_and_no_progress_is_a_hang_after_the_strikes(self, p: Probe) -> None:
        s = ready()
        s, acts = decide(s, p, 10.0)
        s, acts = decide(s, p, 15.0)
        assert acts == [] and s.strikes == 2
        s, acts = decide(s, p, 20.0)
        assert names(acts) == ["server_hang"] and s.phase is Phase.STOPPING
        assert "no progress" in str(emitted(acts, "server_hang").fields["reason"])

    def test_progress_in_between_clears_the_strikes(self) -> None:
        s = ready()
        s, _ = decide(s, probe(health=False, canary=None), 10.0)
        s, _ = decide(s, probe(health=False, canary=None), 15.0)
        s, _ = decide(s, probe(health=False, canary=None, cpu=1.0), 20.0)
        assert s.strikes == 0

    def test_cpu_threshold_is_the_parameter(self) -> None:
        s = ready(params=replace(P, progress_cpu_s=2.0, hang_strikes=1))
        s, acts = decide(s, probe(cpu=1.5), 10.0)
        assert names(acts) == ["server_hang"]

    def test_silence_past_the_bound_is_a_hang_whatever_the_cpu_does(self) -> None:
        # The tracked process spins (CPU, even lines and GPU use) while no HTTP request is answered.
        s = ready(params=replace(P, silent_limit_s=60.0))
        spinning = replace(probe(health=False, canary=None, cpu=5.0, lines=3, gpu=True), silent_s=55.0)
        s, acts = decide(s, spinning, 70.0)
        assert acts == [] and s.strikes == 0  # within the bound the signals still count
        s, acts = decide(s, replace(spinning, silent_s=60.0), 75.0)
        assert names(acts) == ["server_hang"] and s.phase is Phase.STOPPING
        reason = str(emitted(acts, "server_hang").fields["reason"])
        assert "no HTTP answer at all for 60 s" in reason and "cpu" in reason

    def test_a_main_loop_that_answers_no_task_is_no_answer(self) -> None:
        # /health (the HTTP thread) answers, /metrics (a main-loop task) times out, nothing moves.
        wedged = Probe(100, True, None, False, False, "/metrics gave no answer within 3.0 s", cpu_s=0.0,
                       loop_ok=False)
        s = ready()
        for t in (10.0, 15.0):
            s, acts = decide(s, wedged, t)
        s, acts = decide(s, wedged, 20.0)
        assert names(acts) == ["server_hang"]
        s = ready()  # ... while the CPU works (one big batch holds the loop): unknown, no strike
        s, acts = decide(s, replace(wedged, cpu_s=1.5), 10.0)
        assert acts == [] and s.strikes == 0

    def test_a_processing_request_whose_counters_stand_still_is_no_answer(self) -> None:
        # /health and /metrics answer, a request is processing, nothing moves (a deadlock): strikes.
        stuck = Probe(100, True, None, True, False, "a request is processing and the counters did not move",
                      cpu_s=0.0)
        s = ready()
        for t in (10.0, 15.0):
            s, acts = decide(s, stuck, t)
        s, acts = decide(s, stuck, 20.0)
        assert names(acts) == ["server_hang"]
        # ... but a decode that advances is an answer.
        s = ready()
        s, acts = decide(s, replace(stuck, progressed=True), 10.0)
        assert acts == [] and s.strikes == 0


class TestCompletionError:
    def error(self, **kw: object) -> Probe:
        base = Probe(100, True, False, False, False, "canary completion answered HTTP 500: boom", cpu_s=0.0,
                     canary_status=500, canary_error="boom")
        return replace(base, **kw)

    def test_completions_answered_500_are_their_own_event_with_the_code_and_message(self) -> None:
        s = ready()
        s, _ = decide(s, self.error(), 10.0)
        s, _ = decide(s, self.error(lines=2, cpu_s=1.0), 15.0)  # its error lines are no progress excuse
        assert s.strikes == 2
        s, acts = decide(s, self.error(), 20.0)
        assert names(acts) == ["server_completion_error"] and s.phase is Phase.STOPPING
        event = emitted(acts, "server_completion_error")
        assert event.fields["status_code"] == 500 and event.fields["error"] == "boom"
        assert "server_hang" not in names(acts)

    def test_a_4xx_answer_is_not_a_server_failure(self) -> None:
        # 401 after a key change is our request refused, not the server failing: no strike by itself
        # when the server shows progress.
        s = ready()
        s, acts = decide(s, self.error(canary_status=401, canary_error="Invalid API Key", cpu_s=1.0), 10.0)
        assert acts == [] and s.strikes == 0

    def test_one_good_round_clears_the_errors(self) -> None:
        s = ready()
        s, _ = decide(s, self.error(), 10.0)
        s, _ = decide(s, self.error(), 15.0)
        s, _ = decide(s, Probe(100, True, True, False, False), 20.0)
        assert s.strikes == 0


# ------------------------------------------------------------ 3. recovered allocation failures

REPRODUCER = [
    "E ggml_backend_cuda_buffer_type_alloc_buffer: allocating 51748.72 MiB on device 1: cudaMalloc failed: "
    "out of memory",
    "E ggml_gallocr_reserve_n_impl: failed to allocate CUDA1 buffer of size 54262464512",
    "E graph_reserve: failed to allocate compute buffers",
    "W sched_reserve: compute buffer allocation failed, retrying without pipeline parallelism",
    "I srv    load_model: initializing, n_slots = 1, n_ctx_slot = 50176, kv_unified = 'false'",
]
RESET = replace(P, reset_possible=True, reset_on=frozenset({ResetTrigger.OOM, ResetTrigger.XID, ResetTrigger.GPU_LOST}))


class TestAllocation:
    def test_a_recovered_pipeline_parallel_allocation_is_a_warning_never_a_stop_or_reset(self) -> None:
        s = started(params=RESET)
        s, acts = feed(s, 100, REPRODUCER, 5.0)
        assert names(acts) == ["server_alloc_recovered"]
        warning = emitted(acts, "server_alloc_recovered")
        assert "cudaMalloc failed" in str(warning.fields["line"])
        assert "pipeline parallelism" in str(warning.fields["recovery"])
        assert s.phase is Phase.STARTING and not any(isinstance(a, (Terminate, InspectGpu)) for a in acts)
        s, acts = decide(s, HealthOk(100), 8.0)
        assert names(acts) == ["server_ready"] and s.phase is Phase.READY

    def test_alloc_failure_then_ready_without_a_marker_is_a_warning(self) -> None:
        s = started(params=RESET)
        s, acts = feed(s, 100, REPRODUCER[:2], 5.0)
        assert acts == []
        s, acts = decide(s, HealthOk(100), 8.0)
        assert names(acts) == ["server_alloc_recovered", "server_ready"]

    def test_alloc_failure_then_exit_is_a_fatal_oom_with_the_reset(self) -> None:
        s = started(params=RESET)
        s, _ = feed(s, 100, [*REPRODUCER[:3], "E llama_init_from_model: failed to initialize the context"], 5.0)
        s, acts = decide(s, Exited(100, 1), 5.5)
        assert names(acts)[:2] == ["server_oom", "server_exited"]
        assert s.phase is Phase.RESETTING and any(isinstance(a, InspectGpu) for a in acts)

    def test_alloc_failure_then_exit_on_a_watched_gpu_first_checks_the_vram(self) -> None:
        s = started(params=RESET)
        s = replace(s, params=replace(RESET, vram_admission=True))  # as if the VRAM check had admitted it
        s, _ = feed(s, 100, REPRODUCER[:3], 5.0)
        s, acts = decide(s, Exited(100, 1), 5.5)
        assert names(acts)[:2] == ["server_oom", "server_exited"]
        assert s.phase is Phase.WAITING_VRAM and isinstance(s.phase_data, WaitingVram) and s.phase_data.after_oom

    def test_runtime_pool_oom_answered_as_http_500_is_a_warning(self) -> None:
        s = ready(params=RESET)
        s, acts = feed(s, 100, ["E ggml_backend_cuda_buffer_type_alloc_buffer: allocating 2048.00 MiB on device 0: "
                                "cudaMalloc failed: out of memory"], 10.0)
        assert acts == [] and s.phase is Phase.READY
        s, acts = decide(s, probe(canary=True), 12.0)
        assert names(acts) == ["server_alloc_recovered"] and s.phase is Phase.READY

    def test_runtime_alloc_failure_then_abort_is_a_fatal_oom(self) -> None:
        s = ready(params=RESET)
        s, _ = feed(s, 100, ["E ggml_gallocr_reserve_n_impl: failed to allocate CUDA0 buffer of size 1234"], 10.0)
        s, acts = decide(s, Exited(100, -6), 10.2)
        assert names(acts)[0] == "server_oom" and s.phase is Phase.RESETTING

    @pytest.mark.parametrize("text", ["E CUDA error: out of memory",
                                      "llama_init_from_model: failed to allocate buffer for kv cache"])
    def test_the_fatal_oom_lines_still_stop_at_once(self, text: str) -> None:
        s, acts = feed(started(params=RESET), 100, [text], 1.0)
        assert names(acts) == ["server_oom"] and s.after_stop is AfterStop.RESET


# ------------------------------------------------------------ 4. faults no restart can fix

PTX = ["/src/ggml/src/ggml-cuda/ggml-cuda.cu:97: CUDA error",
       "ggml_cuda_compute_forward: SCALE failed",
       "CUDA error: the provided PTX was compiled with an unsupported toolchain."]


class TestIncompatible:
    @pytest.mark.parametrize("params", [
        P, RESET, replace(RESET, reset_on=frozenset({ResetTrigger.CUDA_ERROR, ResetTrigger.OOM}))])
    def test_an_unsupported_ptx_toolchain_stops_with_exit_78_and_no_reset(self, params: Params) -> None:
        s, acts = feed(ready(params=params), 100, PTX, 10.0)
        assert "server_gpu_incompatible" in names(acts)
        event = emitted(acts, "server_gpu_incompatible")
        assert "toolchain" in str(event.fields["cause"]) and "driver" in str(event.fields["fix"])
        assert s.after_stop is AfterStop.EXIT and s.exit.code == EXIT_CONFIG
        s, acts = decide(s, Exited(100, -6), 10.2)
        assert s.phase is Phase.EXITED and not any(isinstance(a, InspectGpu) for a in acts)
        assert ExitDaemon(EXIT_CONFIG, s.exit.reason) in acts and "fix:" in s.exit.reason

    @pytest.mark.parametrize("text", [
        "0.00.812.004 E CUDA error: no kernel image is available for execution on the device",
        "[4242] CUDA error: CUDA driver version is insufficient for CUDA runtime version",
        "ggml_cuda_init: failed to initialize CUDA: system has unsupported display driver / cuda driver combination",
        "  current device: 0, CUDA error: no kernel image is available for execution on the device",
    ])
    def test_other_wordings_while_loading(self, text: str) -> None:
        s, acts = feed(started(params=replace(P, require_gpu=True)), 100, [text], 1.0)
        assert names(acts) == ["server_gpu_incompatible"]
        assert s.after_stop is AfterStop.EXIT and s.exit.code == EXIT_CONFIG

    def test_message_before_the_abort_line_also_stops(self) -> None:
        s, acts = feed(ready(), 100, [PTX[2], PTX[0]], 10.0)
        assert names(acts) == ["server_gpu_incompatible"] and s.exit.code == EXIT_CONFIG

    def test_init_failure_without_a_required_gpu_falls_back_to_the_cpu(self) -> None:
        text = "ggml_cuda_init: failed to initialize CUDA: CUDA driver version is insufficient for CUDA runtime version"
        s, acts = feed(started(params=replace(P, require_gpu=False)), 100, [text], 1.0)
        assert acts == [] and s.phase is Phase.STARTING


# ------------------------------------------------------------ 5. the same failure before ready

ABORT = ["llama_context: n_ctx = 1", "common_init_from_params: warming up the model with an empty run",
         "/src/llama-batch.cpp:1016: get_sub_batch: failed to add token 0 (pos 0)"]


class TestBootFailure:
    def test_the_same_abort_on_three_consecutive_starts_is_a_boot_failure_naming_it(self) -> None:
        s = started()
        s, _ = feed(s, 100, ABORT, 0.5)
        s, acts = decide(s, Exited(100, -6), 0.6)
        exited = emitted(acts, "server_exited")
        assert "get_sub_batch" in str(exited.fields["last_error"])
        assert "get_sub_batch" in str(exited.fields["exit_text"])
        assert s.phase is Phase.BACKOFF
        for i, at in ((1, 2.0), (2, 6.0)):
            when = max(at, s.deadline or at)  # the confirming start waits for repeat_confirm_s
            s, _ = decide(s, Tick(), when)
            s, _ = decide(s, Spawned(100 + i), when)
            s, _ = feed(s, 100 + i, [ABORT[0], ABORT[2].replace("token 0", f"token {7 * i}")], when + 0.5)
            s, acts = decide(s, Exited(100 + i, -6), when + 0.6)
            if i == 1:
                assert s.phase is Phase.BACKOFF, "two identical starts are not yet a verdict"
                assert ReadBuild() in acts  # the verdict to come names the build
                s, _ = decide(s, BuildInfo("version: 4242 (abc1234)"), when + 0.7)
        assert s.phase is Phase.EXITED and s.exit.code == EXIT_CONFIG
        failure = emitted(acts, "server_boot_failure")
        assert "get_sub_batch" in str(failure.fields["cause"]) and "consecutive" in str(failure.fields["cause"])
        assert failure.fields["consecutive_starts"] == 3 and "get_sub_batch" in str(failure.fields["line"])
        assert failure.fields["build"] == "version: 4242 (abc1234)" and failure.fields["fix"]

    def test_exit_status_0_before_ready_three_times_is_a_boot_failure(self) -> None:
        s = started()
        s, _ = decide(s, Exited(100, 0), 0.5)
        for i in (1, 2):
            when = max(10.0 * i, s.deadline or 0.0)
            s, _ = decide(s, Tick(), when)
            s, _ = decide(s, Spawned(100 + i), when)
            s, _ = decide(s, Exited(100 + i, 0), when + 0.5)
        assert s.exit.code == EXIT_CONFIG and "exit status 0" in s.exit.reason

    def test_the_confirming_start_waits_so_a_fault_that_goes_away_is_ridden_out(self) -> None:
        """The same line twice, then the fault is gone (a driver that came back): the third start
        waits until repeat_confirm_s after the first failure, serves, and no verdict is given."""
        s = started()
        confirm = s.params.repeat_confirm_s
        assert confirm >= 30  # the shipped default rides out a half-minute fault
        s, _ = feed(s, 100, ABORT, 0.5)
        s, _ = decide(s, Exited(100, -6), 0.6)
        s, _ = decide(s, Tick(), s.deadline or 0.6)
        s, _ = decide(s, Spawned(101), s.deadline or 0.6)
        s, _ = feed(s, 101, ABORT, 3.0)
        s, acts = decide(s, Exited(101, -6), 3.1)
        assert s.phase is Phase.BACKOFF and s.deadline == pytest.approx(0.6 + confirm)
        assert emitted(acts, "server_backoff").fields["backoff_s"] == pytest.approx(0.6 + confirm - 3.1)
        s, _ = decide(s, Tick(), 20.0)
        assert s.phase is Phase.BACKOFF, "not before the confirm time"
        s, acts = decide(s, Tick(), s.deadline)
        s, _ = decide(s, Spawned(102), s.deadline or 0.0)
        s, acts = decide(s, HealthOk(102), 0.6 + confirm + 1.0)
        assert s.phase is Phase.READY

    def test_a_third_identical_failure_too_soon_is_not_yet_a_verdict(self) -> None:
        """Whatever ran the third start early, the verdict needs repeat_confirm_s of the same fault."""
        s = started(params=replace(P, repeat_confirm_s=40.0))
        for i, at in enumerate((0.5, 2.0, 5.0)):
            if i:
                s = replace(s, deadline=at)  # an early start (the deadline moved by hand)
                s, _ = decide(s, Tick(), at)
                s, _ = decide(s, Spawned(100 + i), at)
            s, _ = feed(s, 100 + i, ABORT, at + 0.1)
            s, _ = decide(s, Exited(100 + i, -6), at + 0.2)
        assert s.phase is Phase.BACKOFF
        assert s.deadline == pytest.approx(0.7 + 40.0)  # the first failure (0.7 s) + repeat_confirm_s

    @pytest.mark.parametrize(("first", "second"), [
        ((-6, ABORT[2]), (-11, ABORT[2])),                           # another signal
        ((-6, ABORT[2]), (-6, "GGML_ASSERT(n_tokens_all <= cparams.n_batch) failed")),  # another line
        ((-9, ""), (-9, "")),                                         # SIGKILL comes from outside
    ])
    def test_different_failures_or_sigkill_are_counted_not_fatal(self, first: tuple[int, str],
                                                                  second: tuple[int, str]) -> None:
        s = started()
        for i, (code, text) in enumerate((first, second)):
            if i:
                s, _ = decide(s, Tick(), 10.0 * i)
                s, _ = decide(s, Spawned(100 + i), 10.0 * i)
            if text:
                s, _ = feed(s, 100 + i, [text], 10.0 * i + 0.1)
            s, _ = decide(s, Exited(100 + i, code), 10.0 * i + 0.2)
        assert s.phase is Phase.BACKOFF

    def test_a_ready_start_in_between_breaks_the_chain(self) -> None:
        s = started()
        s, _ = feed(s, 100, ABORT, 0.5)
        s, _ = decide(s, Exited(100, -6), 0.6)
        s, _ = decide(s, Tick(), 2.0)
        s, _ = decide(s, Spawned(101), 2.0)
        s, _ = decide(s, HealthOk(101), 3.0)
        s, _ = decide(s, Exited(101, 1), 4.0)
        s, _ = decide(s, Tick(), 10.0)
        s, _ = decide(s, Spawned(102), 10.0)
        s, _ = feed(s, 102, ABORT, 10.5)
        s, _ = decide(s, Exited(102, -6), 10.6)
        assert s.phase is Phase.BACKOFF

    def test_signature_ignores_prefixes_and_numbers(self) -> None:
        a = failure_signature("killed by SIGABRT", "0.00.450.903 E get_sub_batch: failed to add token 3 at 0x7f00")
        b = failure_signature("killed by SIGABRT", "[777] get_sub_batch: failed to add token 9 at 0x7e11")
        assert a == b != failure_signature("exit status 1", "get_sub_batch: failed to add token 3 at 0x7f00")

    def test_error_lines_are_classified_as_error(self) -> None:
        assert classify_line(ABORT[2]).family is Family.ERROR
