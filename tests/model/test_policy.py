"""The pure policy: set a state, feed an observation, check the next state and the actions."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import emitted, line, names
from harness import ready as policy_ready
from harness import started as policy_started
from llama_guard.model.actions import ExitDaemon, Kill, Spawn, StartDrain, Terminate
from llama_guard.model.inputs import (
    Boot,
    Drained,
    Exited,
    HealthOk,
    ParamsChanged,
    Probe,
    RestartRequest,
    Spawned,
    SpawnFailed,
    StopRequest,
    Tick,
)
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, Params, RestartCause, State, exit_text, initial_state
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_CRASH_LOOP, EXIT_OK
from llama_guard.vocab.phases import Phase
from llama_guard.vocab.triggers import ResetTrigger

P = Params(load_timeout_s=30, hang_strikes=2, backoff_initial_s=1, backoff_factor=2, backoff_max_s=5,
           max_restarts=3, restart_window_s=100, stable_after_s=10, stop_grace_s=4, kill_wait_s=2,
           drain_timeout_s=20)


def started(pid: int = 100, now: float = 0.0, params: Params = P) -> State:
    return policy_started(params, pid, now)


def ready(pid: int = 100, now: float = 1.0, params: Params = P) -> State:
    return policy_ready(params, pid, now)


class TestStartup:
    def test_ready_only_after_health(self) -> None:
        s = started()
        s, acts = decide(s, line(100, "0.00.454.465 I srv  llama_server: listening on http://127.0.0.1:8080"), 0.5)
        assert s.phase is Phase.STARTING and acts == []
        s, acts = decide(s, HealthOk(100), 2.5)
        assert s.phase is Phase.READY
        assert emitted(acts, "server_ready").fields["load_s"] == pytest.approx(2.5)

    def test_health_of_an_old_pid_is_ignored(self) -> None:
        s, acts = decide(started(100), HealthOk(99), 1.0)
        assert s.phase is Phase.STARTING and acts == []

    def test_load_timeout_stops_and_counts_a_failure(self) -> None:
        s = started(now=0.0)
        s, acts = decide(s, Tick(), 29.9)
        assert acts == []
        s, acts = decide(s, Tick(), 30.0)
        assert s.phase is Phase.STOPPING and Terminate(100) in acts
        assert "server_load_timeout" in names(acts)
        s, acts = decide(s, Exited(100, -15), 31.0)
        assert s.phase is Phase.BACKOFF and "server_backoff" in names(acts)

    def test_invalid_argument_is_a_boot_failure_exit_78(self) -> None:
        s = started()
        s, acts = decide(s, line(100, "error: invalid argument: --no-flash-attn"), 0.1)
        assert acts == [] and s.phase is Phase.STARTING
        s, acts = decide(s, Exited(100, 1), 0.2)
        assert s.phase is Phase.EXITED
        assert ExitDaemon(EXIT_CONFIG, "llama-server rejected the argument --no-flash-attn") in acts
        failure = emitted(acts, "server_boot_failure")
        assert "--no-flash-attn" in str(failure.fields["cause"]) and failure.fields["exit_status"] == 1

    def test_oom_at_load_is_not_a_config_error(self) -> None:
        s = started()
        for text in ("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on device 0: "
                     "cudaMalloc failed: out of memory",
                     "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
                     "E srv  llama_server: exiting due to model loading error"):
            s, acts = decide(s, line(100, text), 0.3)
        # An allocation failure is judged by what the process does next: here it exits.
        assert s.phase is Phase.STARTING
        s, acts = decide(s, Exited(100, 1), 0.4)
        assert s.phase is Phase.BACKOFF
        assert not any(isinstance(a, ExitDaemon) for a in acts)
        oom = emitted(acts, "server_oom")
        assert "cudaMalloc failed" in str(oom.fields["line"]) and oom.fields["phase"] == "loading"
        assert "model loading error" in str(emitted(acts, "server_exited").fields["last_error"])

    def test_exit_while_loading_without_cause_backs_off(self) -> None:
        s, acts = decide(started(), Exited(100, -6), 0.5)
        assert s.phase is Phase.BACKOFF
        assert emitted(acts, "server_exited").fields["signal"] == 6

    def test_spawn_failure_is_a_config_error(self) -> None:
        s, _ = decide(initial_state(P), Boot(), 0.0)
        s, acts = decide(s, SpawnFailed("llama-server binary 'x' not found"), 0.0)
        assert s.phase is Phase.EXITED and ExitDaemon(EXIT_CONFIG, "llama-server binary 'x' not found") in acts

    def test_gpu_unavailable_is_a_failure_only_when_a_gpu_is_required(self) -> None:
        text = "warning: no usable GPU found, --gpu-layers option will be ignored"
        s, acts = decide(started(), line(100, text), 0.1)
        assert s.phase is Phase.STARTING and acts == []
        s, acts = decide(started(params=replace(P, require_gpu=True)), line(100, text), 0.1)
        assert s.phase is Phase.STOPPING and "server_gpu_unavailable" in names(acts)

    def test_thread_creation_failure_at_boot_ends_as_boot_failure_naming_the_limit(self) -> None:
        s = started()
        s, acts = decide(s, line(100, "what():  Resource temporarily unavailable"), 0.1)
        assert names(acts) == ["resource_exhausted"]
        s, acts = decide(s, Exited(100, -6), 0.2)
        assert s.exit.code == EXIT_CONFIG and "RLIMIT_NPROC" in s.exit.reason


class TestServingFaults:
    @pytest.mark.parametrize(("text", "event"), [
        ("E CUDA error: out of memory", "server_oom"),
        ("CUDA error: an illegal memory access was encountered", "server_cuda_error"),
    ])
    def test_fatal_gpu_line_stops_at_once(self, text: str, event: str) -> None:
        s, acts = decide(ready(), line(100, text), 5.0)
        assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.FAILURE
        assert names(acts) == [event] and Terminate(100) in acts

    def test_abort_line_first_then_message_reports_the_message(self) -> None:
        s, acts = decide(ready(), line(100, "/src/ggml-cuda.cu:88: CUDA error"), 5.0)
        assert names(acts) == [] and Terminate(100) in acts
        s, acts = decide(s, line(100, "CUDA error: out of memory"), 5.01)
        assert names(acts) == ["server_oom"]
        s, acts = decide(s, Exited(100, -6), 5.1)
        assert "server_oom" not in names(acts) and "server_cuda_error" not in names(acts)

    def test_abort_line_without_message_is_reported_at_exit(self) -> None:
        s, _ = decide(ready(), line(100, "/src/ggml-cuda.cu:88: CUDA error"), 5.0)
        s, acts = decide(s, Exited(100, -6), 5.1)
        assert names(acts)[:2] == ["server_cuda_error", "server_stopped"]

    def test_unexpected_exit_restarts_at_once_then_backs_off_with_growing_delay(self) -> None:
        """The first failure in the window restarts at once (no restart overhead after a stable
        run); the backoff starts with the second failure and then grows."""
        s = ready()
        s, acts = decide(s, Exited(100, -9), 5.0)
        assert s.phase is Phase.BACKOFF and s.deadline == pytest.approx(5.0)
        assert "OOM killer" in str(emitted(acts, "server_exited").fields["exit_text"])
        s, acts = decide(s, Tick(), 5.0)
        assert s.phase is Phase.STARTING and acts[-1] == Spawn()
        s, _ = decide(s, Spawned(101), 5.0)
        s, _ = decide(s, HealthOk(101), 5.5)
        s, _ = decide(s, Exited(101, 1), 6.0)
        assert s.deadline == pytest.approx(7.0)  # the second failure: backoff_initial_s
        s, _ = decide(s, Tick(), 7.0)
        s, _ = decide(s, Spawned(102), 7.0)
        s, _ = decide(s, Exited(102, 1), 7.5)
        assert s.deadline == pytest.approx(9.5)  # 2 s: doubled

    def test_first_failure_after_a_stable_run_restarts_at_once_despite_earlier_failures(self) -> None:
        s = replace(ready(now=1.0), failures=((0.5, 10),), next_backoff_s=4.0)
        s, _ = decide(s, Tick(), 70.0)  # stayed ready past stable_after_s
        assert s.stable
        s, acts = decide(s, Exited(100, -9), 80.0)
        assert s.phase is Phase.BACKOFF and s.deadline == pytest.approx(80.0)
        assert emitted(acts, "server_backoff").fields["backoff_s"] == 0.0
        s, _ = decide(s, Tick(), 80.0)
        s, _ = decide(s, Spawned(101), 80.0)
        s, _ = decide(s, Exited(101, 1), 80.5)  # the next one (not stable) backs off
        assert s.deadline == pytest.approx(81.5)

    def test_backoff_is_capped(self) -> None:
        s = replace(ready(), next_backoff_s=4.0)
        s, _ = decide(s, Exited(100, 1), 5.0)
        assert s.next_backoff_s == 5.0

    def test_backoff_resets_only_after_staying_ready(self) -> None:
        s = replace(ready(now=1.0), next_backoff_s=4.0)
        s, _ = decide(s, Tick(), 10.9)
        assert s.next_backoff_s == 4.0
        s, _ = decide(s, Tick(), 11.0)
        assert s.stable and s.next_backoff_s == 1.0

    def test_crash_loop_gives_up_with_distinct_code(self) -> None:
        s = ready()
        now = 2.0
        # Failures that differ (exit statuses 1..4): no repeat verdict, the window decides.
        for i in range(3):
            s, acts = decide(s, Exited(s.pid or 0, 1 + i), now)
            assert s.phase is Phase.BACKOFF, i
            now = (s.deadline or now) + 0.01
            s, _ = decide(s, Tick(), now)
            s, _ = decide(s, Spawned(200 + i), now)
            s, _ = decide(s, HealthOk(200 + i), now)
        s, acts = decide(s, Exited(s.pid or 0, 4), now + 1)
        assert s.phase is Phase.EXITED
        assert "crash_loop" in names(acts)
        assert any(isinstance(a, ExitDaemon) and a.code == EXIT_CRASH_LOOP for a in acts)

    def test_failures_outside_the_window_do_not_count(self) -> None:
        s = replace(ready(now=500.0), failures=((1.0, 10), (2.0, 11), (3.0, 12)))
        s, _acts = decide(s, Exited(100, 1), 501.0)
        assert s.phase is Phase.BACKOFF and len(s.failures) == 1

    def test_memlock_warning_is_reported_but_not_a_restart(self) -> None:
        s, acts = decide(ready(), line(100, "warning: failed to mlock 73728-byte buffer (after previously "
                                                 "locking 0 bytes): Cannot allocate memory"), 5.0)
        assert s.phase is Phase.READY and names(acts) == ["resource_exhausted"]

    def test_harmless_kv_cache_retry(self) -> None:
        s, acts = decide(ready(), line(100, "failed to find free space in the KV cache, retrying with smaller "
                                            "batch size"), 5.0)
        assert s.phase is Phase.READY and acts == []


class TestHang:
    def probe(self, pid: int = 100, **kw: object) -> Probe:
        base: dict[str, object] = {"health_ok": True, "canary_ok": True, "busy": False, "progressed": False}
        base.update(kw)
        return Probe(pid, **base)  # type: ignore[arg-type]

    def test_two_strikes(self) -> None:
        s, acts = decide(ready(), self.probe(health_ok=False, canary_ok=None), 5.0)
        assert s.phase is Phase.READY and s.strikes == 1 and acts == []
        s, acts = decide(s, self.probe(health_ok=False, canary_ok=None), 6.0)
        assert s.phase is Phase.STOPPING and "server_hang" in names(acts)

    def test_success_clears_strikes(self) -> None:
        s, _ = decide(ready(), self.probe(canary_ok=False), 5.0)
        s, _ = decide(s, self.probe(), 6.0)
        assert s.strikes == 0
        s, _ = decide(s, self.probe(canary_ok=False), 7.0)
        assert s.phase is Phase.READY

    def test_busy_and_advancing_slot_is_not_a_hang(self) -> None:
        s = ready()
        for t in range(5):
            s, acts = decide(s, self.probe(canary_ok=False, busy=True, progressed=True), 5.0 + t)
            assert s.phase is Phase.READY and acts == []

    def test_busy_but_stuck_slot_is_a_hang(self) -> None:
        s = ready()
        s, _ = decide(s, self.probe(canary_ok=False, busy=True, progressed=False), 5.0)
        s, acts = decide(s, self.probe(canary_ok=False, busy=True, progressed=False), 6.0)
        assert "server_hang" in names(acts)

    def test_probe_of_old_pid_ignored(self) -> None:
        s, acts = decide(ready(), self.probe(pid=7, health_ok=False), 5.0)
        assert s.strikes == 0 and acts == []


class TestStopping:
    def test_term_deadline_then_kill_then_give_up_waiting(self) -> None:
        s, acts = decide(ready(), StopRequest("SIGTERM received"), 5.0)
        assert Terminate(100) in acts and s.deadline == pytest.approx(9.0)
        s, acts = decide(s, Tick(), 9.0)
        assert Kill(100) in acts and "server_stop_timeout" in names(acts)
        s, acts = decide(s, Tick(), 11.0)
        assert s.phase is Phase.EXITED and ExitDaemon(EXIT_OK, "SIGTERM received") in acts

    def test_sigterm_exits_zero_after_the_server_is_gone(self) -> None:
        s, _ = decide(ready(), StopRequest("SIGTERM received"), 5.0)
        s, acts = decide(s, Exited(100, 0), 5.5)
        assert names(acts)[0] == "server_stopped" and acts[-1] == ExitDaemon(EXIT_OK, "SIGTERM received")

    def test_second_signal_kills_at_once(self) -> None:
        s, _ = decide(ready(), StopRequest("SIGTERM received"), 5.0)
        s, acts = decide(s, StopRequest("SIGINT received", immediate=True), 5.1)
        assert Kill(100) in acts

    def test_stop_during_backoff_exits_without_spawning(self) -> None:
        s, _ = decide(ready(), Exited(100, 1), 5.0)
        s, acts = decide(s, StopRequest("SIGTERM received"), 5.1)
        assert s.phase is Phase.EXITED and not any(isinstance(a, Spawn) for a in acts)

    def test_stop_while_a_failure_stop_is_running_turns_it_into_exit(self) -> None:
        s, _ = decide(ready(), line(100, "CUDA error: out of memory"), 5.0)
        s, _ = decide(s, StopRequest("SIGTERM received"), 5.1)
        s, acts = decide(s, Exited(100, -6), 5.2)
        assert s.phase is Phase.EXITED and acts[-1] == ExitDaemon(EXIT_OK, "SIGTERM received")

    def test_stop_before_spawn_answered(self) -> None:
        s, _ = decide(initial_state(P), Boot(), 0.0)
        s, acts = decide(s, StopRequest("SIGTERM received"), 0.0)
        assert s.phase is Phase.STOPPING and not any(isinstance(a, Terminate) for a in acts)
        s, acts = decide(s, Spawned(55), 0.01)
        assert acts == [Terminate(55)]
        s, acts = decide(s, Exited(55, -15), 0.1)
        assert s.phase is Phase.EXITED

    def test_nothing_after_exit(self) -> None:
        s, _ = decide(initial_state(P), StopRequest("x"), 0.0)
        assert decide(s, Boot(), 1.0) == (s, [])


class TestPlannedRestart:
    def test_drains_then_restarts_without_counting_a_failure(self) -> None:
        s, acts = decide(ready(), RestartRequest("SIGUSR1"), 5.0)
        assert s.phase is Phase.DRAINING and StartDrain(100) in acts and "restart_requested" in names(acts)
        s, acts = decide(s, Drained(100), 6.0)
        assert Terminate(100) in acts
        s, acts = decide(s, Exited(100, 0), 6.2)
        assert s.phase is Phase.STARTING and acts[-1] == Spawn() and s.failures == ()

    def test_drain_timeout_restarts_anyway(self) -> None:
        s, acts = decide(ready(), RestartRequest("nightly", cause=RestartCause.SCHEDULE), 5.0)
        assert names(acts) == ["scheduled_restart"]
        s, acts = decide(s, Tick(), 25.0)
        assert "drain_timeout" in names(acts) and Terminate(100) in acts

    def test_decay_restart_is_its_own_event(self) -> None:
        _s, acts = decide(ready(), RestartRequest("decay: rss_growth", cause=RestartCause.DECAY), 5.0)
        assert names(acts) == ["decay_restart"]

    def test_fault_while_draining_is_still_a_fault(self) -> None:
        s, _ = decide(ready(), RestartRequest("SIGUSR1"), 5.0)
        s, acts = decide(s, Exited(100, -11), 6.0)
        assert s.phase is Phase.BACKOFF and "server_exited" in names(acts)

    def test_restart_request_during_backoff_starts_now(self) -> None:
        s, _ = decide(ready(), Exited(100, 1), 5.0)
        s, acts = decide(s, RestartRequest("SIGUSR1"), 5.1)
        assert s.phase is Phase.STARTING and acts[-1] == Spawn()

    def test_reload_with_changed_server_flags_drains(self) -> None:
        s, _acts = decide(ready(), ParamsChanged(replace(P, hang_strikes=5), server_changed=True), 5.0)
        assert s.phase is Phase.DRAINING and s.params.hang_strikes == 5

    def test_reload_without_server_change_keeps_serving(self) -> None:
        s, acts = decide(ready(), ParamsChanged(replace(P, hang_strikes=5), server_changed=False), 5.0)
        assert s.phase is Phase.READY and acts == []


def test_exit_text() -> None:
    assert exit_text(1) == "exit status 1"
    assert exit_text(-6) == "killed by SIGABRT"
    assert exit_text(None) == "exit status unknown"


def test_abort_line_before_oom_message_still_leads_to_the_reset() -> None:
    # Seen on the H200: "<path>/ggml-cuda.cu:109: CUDA error" came before "CUDA error: out of memory".
    p = replace(P, reset_possible=True, reset_on=frozenset({ResetTrigger.OOM}))
    s = started(params=p)
    s, acts = decide(s, line(100, "/src/ggml/src/ggml-cuda/ggml-cuda.cu:109: CUDA error"), 1.0)
    assert s.phase is Phase.STOPPING and Terminate(100) in acts
    s, acts = decide(s, line(100, "0.01.713.707 E CUDA error: out of memory"), 1.01)
    assert names(acts) == ["server_oom"] and s.after_stop is AfterStop.RESET
    s, acts = decide(s, Exited(100, -6), 1.1)
    assert s.phase is Phase.RESETTING and any(type(a).__name__ == "InspectGpu" for a in acts)


def test_abort_line_then_other_gpu_error_does_not_reset_when_only_oom_resets() -> None:
    p = replace(P, reset_possible=True, reset_on=frozenset({ResetTrigger.OOM}))
    s = started(params=p)
    s, _ = decide(s, line(100, "/src/ggml-cuda.cu:109: CUDA error"), 1.0)
    s, acts = decide(s, line(100, "CUDA error: an illegal memory access was encountered"), 1.01)
    assert names(acts) == ["server_cuda_error"] and s.after_stop is AfterStop.FAILURE


def test_our_own_sigkill_is_not_blamed_on_the_oom_killer() -> None:
    s, _ = decide(ready(), StopRequest("SIGTERM received"), 5.0)
    s, _ = decide(s, Tick(), 9.0)  # grace over: SIGKILL sent
    s, acts = decide(s, Exited(100, -9), 9.1)
    assert "sent by llama-guard" in str(emitted(acts, "server_stopped").fields["exit_text"])


# What a default configuration sets is what Params() holds (one truth: the config package's defaults); the
# rest depends on the host (a watched GPU and its index) and defaults to "none" in Params.
# What depends on the host or names the deployment ([server] settings the policy quotes), not a policy knob.
_HOST_DEPENDENT = {"require_gpu", "reset_possible", "vram_admission", "gpu_index", "model_path", "offload_layers"}


def test_params_defaults_are_the_configuration_defaults() -> None:
    import dataclasses

    from llama_guard.config import Config
    from llama_guard.model.params import params_from

    shipped = params_from(Config())
    default = Params()
    names = {f.name for f in dataclasses.fields(Params)} - _HOST_DEPENDENT
    assert {n: getattr(default, n) for n in names} == {n: getattr(shipped, n) for n in names}
    assert (default.backoff_initial_s, default.backoff_factor) == (
        Config().recovery.backoff_initial_s, Config().recovery.backoff_factor)
