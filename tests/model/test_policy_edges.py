"""The pure policy's rarer rules: inputs a phase ignores, a request while loading or draining, a
stop at once, a limit said once, a port episode, a reset stopped before its command, the VRAM wait's
edges. With the other policy tests they cover every line of ``model/policy/`` (the CI floor)."""

from __future__ import annotations

from dataclasses import replace

from harness import emitted, line, names
from harness import ready as policy_ready
from harness import started as policy_started
from llama_guard.model.actions import CheckVram, ExitDaemon, FindPortHolder, Kill, Spawn, Terminate
from llama_guard.model.inputs import (
    Boot,
    Drained,
    Exited,
    GpuFault,
    GpuHolder,
    HealthOk,
    PortHolder,
    ResetFacts,
    RestartRequest,
    Spawned,
    SpawnFailed,
    StopRequest,
    Tick,
    VramFacts,
)
from llama_guard.model.phase_state import Resetting, Starting
from llama_guard.model.policy import decide
from llama_guard.model.types import AfterStop, Exit, GpuFaultKind, Params, RestartCause, State, initial_state
from llama_guard.vocab.exitcodes import EXIT_CONFIG, EXIT_OK
from llama_guard.vocab.phases import Phase

P = Params(load_timeout_s=30, hang_strikes=2, backoff_initial_s=1, max_restarts=3, restart_window_s=100,
           stable_after_s=10, stop_grace_s=4, kill_wait_s=2, drain_timeout_s=20, port=8080)
BIND = "0.00.002.798 E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 8080"
MEMLOCK = "warning: failed to mlock 73728-byte buffer (after previously locking 0 bytes): Cannot allocate memory"
THREADS = "what():  Resource temporarily unavailable"
TORCH = GpuHolder(5151, 19_000, "python3")


def started(params: Params = P) -> State:
    return policy_started(params, 100, 0.0)


def ready(params: Params = P) -> State:
    return policy_ready(params, 100, 1.0)


def booted(params: Params = P) -> State:
    return decide(initial_state(params), Boot(), 0.0)[0]


def test_an_exited_policy_ignores_every_input() -> None:
    s = replace(initial_state(P), phase=Phase.EXITED)
    assert decide(s, Tick(), 1.0) == (s, [])
    assert decide(s, GpuFault(GpuFaultKind.GPU_LOST, "GPU is lost"), 1.0) == (s, [])


def test_stopped_waits_for_boot() -> None:
    s = initial_state(P)
    assert decide(s, Tick(), 1.0) == (s, [])


def test_before_the_spawn_answers_only_the_spawn_counts() -> None:
    s = booted()
    assert s.phase is Phase.STARTING and s.pid is None
    assert decide(s, Tick(), 0.5) == (s, [])
    # A lost GPU is left to the start under way (its own checks, its server's lines).
    new, acts = decide(s, GpuFault(GpuFaultKind.GPU_LOST, "GPU is lost"), 0.5)
    assert new.phase is Phase.STARTING and acts == [] and new.gpu_lost


def test_changed_server_flags_while_loading_stop_the_load_and_restart() -> None:
    s, acts = decide(started(), RestartRequest("flags changed", cause=RestartCause.CONFIG_CHANGE), 0.5)
    assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.RESTART and Terminate(100) in acts
    assert s.failure.cause is RestartCause.CONFIG_CHANGE
    s, acts = decide(s, Exited(100, -15), 1.0)
    assert s.phase is Phase.STARTING and Spawn() in acts and s.failures == ()


def test_a_server_behind_a_wrapper_is_named_by_its_port_owner() -> None:
    _s, acts = decide(started(), HealthOk(100, port_pid=101, port_comm="llama-server"), 2.0)
    fields = emitted(acts, "server_ready").fields
    assert fields["port_pid"] == 101 and fields["port_owner"] == "descendant pid 101 (llama-server) of pid 100"


def test_an_undrained_restart_request_stops_at_once() -> None:
    s, acts = decide(ready(), RestartRequest("now", drain=False), 5.0)
    assert s.phase is Phase.STOPPING and s.after_stop is AfterStop.RESTART
    assert names(acts) == ["restart_requested"] and Terminate(100) in acts
    assert decide(s, Drained(100), 5.5) == (s, [])  # nothing is drained any more


def test_an_immediate_stop_of_a_serving_server_kills_it() -> None:
    s, acts = decide(ready(), StopRequest("SIGTERM received", immediate=True), 5.0)
    assert s.phase is Phase.STOPPING and s.killed and acts[-1] == Kill(100) and Terminate(100) not in acts


def test_a_stop_before_the_spawn_answered_ends_when_the_spawn_fails() -> None:
    s, _ = decide(booted(), StopRequest("SIGTERM received"), 0.1)
    assert s.phase is Phase.STOPPING and s.pid is None
    assert decide(s, Tick(), 0.2) == (s, [])
    s, acts = decide(s, SpawnFailed("stop requested before the server started", fatal=False), 0.3)
    assert s.phase is Phase.EXITED and ExitDaemon(EXIT_OK, "SIGTERM received") in acts


def test_a_resource_limit_is_reported_once_per_server() -> None:
    s, acts = decide(ready(), line(100, MEMLOCK), 5.0)
    assert names(acts) == ["resource_exhausted"]
    assert decide(s, line(100, MEMLOCK), 6.0) == (s, [])


def test_a_memlock_line_while_loading_is_no_boot_cause() -> None:
    s, acts = decide(started(), line(100, MEMLOCK), 0.1)
    assert names(acts) == ["resource_exhausted"] and s.phase_data == Starting()
    s, acts = decide(s, line(100, THREADS), 0.2)  # a limit that stops a start: the boot cause
    assert names(acts) == ["resource_exhausted"] and isinstance(s.phase_data, Starting)
    assert "RLIMIT_NPROC" in s.phase_data.boot_cause
    s, acts = decide(s, Exited(100, -6), 0.3)
    assert ExitDaemon(EXIT_CONFIG, s.exit.reason) in acts and "RLIMIT_NPROC" in s.exit.reason


def test_an_allocation_failure_the_server_recovers_from_while_serving_is_a_warning() -> None:
    s, acts = decide(ready(), line(100, "cudaMalloc failed: out of memory"), 5.0)
    assert acts == [] and s.alloc_failure
    s, acts = decide(s, line(100, "W sched_reserve: compute buffer allocation failed, retrying without pipeline "
                                  "parallelism"), 5.1)
    assert s.phase is Phase.READY and s.alloc_failure == "" and names(acts) == ["server_alloc_recovered"]


def test_the_port_holder_is_looked_for_once_per_server_and_only_for_our_port() -> None:
    s, acts = decide(started(), line(100, BIND), 0.1)
    assert acts == [FindPortHolder(8080)]
    again, acts = decide(s, line(100, BIND), 0.2)
    assert acts == [] and again.port_taken_since == s.port_taken_since
    assert decide(s, PortHolder(9090, 4242, "nc"), 0.3) == (s, [])
    assert decide(ready(), PortHolder(8080, 4242, "nc"), 5.0)[1] == []  # no episode: nothing to report


def test_a_reset_whose_stop_came_before_its_command_ran_exits_without_running_it() -> None:
    s = replace(ready(), phase=Phase.RESETTING, pid=None, after_stop=AfterStop.EXIT,
                exit=Exit(EXIT_OK, "SIGTERM received"), phase_data=Resetting("Xid 79"))
    s, acts = decide(s, ResetFacts(0, True, 0.0, (), True, ""), 6.0)
    skipped = emitted(acts, "gpu_reset")
    assert skipped.fields["outcome"] == "skipped" and "a stop was requested" in str(skipped.fields["reason"])
    assert s.phase is Phase.EXITED and acts[-1] == ExitDaemon(EXIT_OK, "SIGTERM received")


VRAM = replace(P, vram_admission=True, vram_wait_timeout_s=10, vram_poll_s=1)


def test_vram_held_by_others_but_enough_left_admits_the_start() -> None:
    s, acts = decide(booted(VRAM), VramFacts(0, 30_000, 20_000, (TORCH,)), 0.1)
    assert s.phase is Phase.STARTING and acts == [Spawn()]


def test_a_failed_vram_check_after_the_wait_deadline_ends_the_wait() -> None:
    s, acts = decide(booted(VRAM), VramFacts(0, 150, 20_000, (TORCH,)), 0.1)
    assert names(acts) == ["gpu_vram_wait"]
    assert decide(s, Tick(), 0.5) == (s, [])  # before the poll deadline: nothing
    s, acts = decide(s, VramFacts(None, None, None, error="NVML timed out"), 10.5)
    assert s.phase is Phase.BACKOFF and s.failure.cause is RestartCause.VRAM_WAIT
    assert "VRAM still held after 10 s" in s.failure.text and "server_backoff" in names(acts)


def test_a_vram_check_that_never_answered_goes_on_without_it() -> None:
    s = booted(VRAM)
    assert s.phase is Phase.WAITING_VRAM and s.deadline is not None
    s, acts = decide(s, Tick(), s.deadline)
    assert s.phase is Phase.STARTING and acts == [Spawn()]
    assert CheckVram() not in acts


def test_spawned_during_a_stop_before_the_spawn_answered_is_terminated() -> None:
    s, _ = decide(booted(), StopRequest("SIGTERM received"), 0.1)
    s, acts = decide(s, Spawned(100), 0.2)
    assert s.pid == 100 and acts == [Terminate(100)]
