"""End to end through the daemon with the fake server, for what a CPU cannot produce:
an HTTP loop held by one big batch, a binary whose PTX the driver refuses, a recovered CUDA
allocation failure at load."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from harness import DaemonRun, RunPool
from llama_guard.config.sections import HealthConfig

# The shipped [health] defaults (config.HealthConfig).
SHIPPED: dict[str, object] = {name: getattr(HealthConfig(), name) for name in (
    "interval_s", "timeout_s", "canary_timeout_s", "hang_strikes", "silent_limit_s", "progress_cpu_s")}


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(event["timestamp"]).timestamp()


@pytest.fixture
def fake(tmp_path: Path, fake_server: Path, real_model: Path) -> Any:
    pool = RunPool()

    def make(fault: str, extra: dict[str, dict[str, object]] | None = None,
             env: dict[str, str] | None = None) -> DaemonRun:
        return pool.new(tmp_path, str(fake_server), str(real_model),
                        {"server": {"env": {"FAKE_LLAMA_FAULT": fault, **(env or {})}}, **(extra or {})})

    yield make
    leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"server pids {leftovers} outlived their daemon")


def test_busy_http_loop_that_burns_cpu_is_not_killed(fake: Any) -> None:
    # The fake holds /slots, /metrics and completions for 20 s while it burns CPU (/health answers).
    # The harness's fast probes (0.5 s rounds, 2 s canary, 2 strikes) would have killed it in ~6 s
    # when a timed-out probe counted as "stuck".
    run = fake("busy_http", env={"FAKE_LLAMA_BUSY_S": "20"}).start()
    pid = run.wait_event("server_ready", 30)["server_pid"]
    # The first round after the batch ended answers again.
    run.wait_event("server_probe", 60, where=lambda e: e["canary_ok"] is True)
    assert "server_hang" not in run.names() and "server_stopped" not in run.names()
    rounds = [e for e in run.events() if e["event"] == "server_probe" and e["server_pid"] == pid]
    blocked = [r for r in rounds if r["detail"].startswith("/metrics gave no answer")]
    assert len(blocked) >= 2, rounds  # the probes really timed out, more than hang_strikes times in a row
    assert all(r["cpu_s"] is not None and r["cpu_s"] >= 0.05 for r in blocked), blocked
    assert all(r["canary"] == "not_sent" for r in blocked), blocked  # no canary queued behind the batch


def test_completions_that_hang_while_health_answers_are_a_hang_within_60_s(fake: Any) -> None:
    run = fake("completion_hang", {"health": SHIPPED, "recovery": {"stop_grace_s": 1.0}}).start()
    ready = run.wait_event("server_ready", 30)
    hang = run.wait_event("server_hang", 75)
    assert hang["server_pid"] == ready["server_pid"] and hang["failures"] == SHIPPED["hang_strikes"]
    assert stamp(hang) - stamp(ready) <= 60.0, stamp(hang) - stamp(ready)
    rounds = [e for e in run.events() if e["event"] == "server_probe" and e["server_pid"] == ready["server_pid"]]
    assert rounds[0]["canary"] == "timed_out" and all(r["health_ok"] for r in rounds), rounds
    assert any(r["busy"] and not r["progressed"] for r in rounds[1:]), rounds


def test_completions_answering_500_are_reported_with_the_status_and_message(fake: Any) -> None:
    # /health 200, /metrics and /slots answer, every completion answers HTTP 500 (shipped [health]).
    run = fake("completion_500", {"health": SHIPPED, "recovery": {"stop_grace_s": 1.0}}).start()
    ready = run.wait_event("server_ready", 30)
    failed = run.wait_event("server_completion_error", 75)
    assert failed["server_pid"] == ready["server_pid"] and failed["status_code"] == 500
    assert failed["error"] == "llama_decode failed: compute error (fake)"
    assert stamp(failed) - stamp(ready) <= 60.0, stamp(failed) - stamp(ready)
    assert "server_hang" not in run.names()
    restart = run.wait_event("server_restart")
    assert "completion_error: HTTP 500" in restart["reason"]


def test_ptx_unsupported_stops_with_exit_78_naming_the_fix(fake: Any) -> None:
    # The PTX reproducer: on every request (the canary is one) the three lines, then SIGABRT.
    run = fake("ptx_unsupported", {"recovery": {"max_restarts": 5}}).start()
    code = run.wait_exit(60)
    assert code == 78
    names = run.names()
    assert names.count("server_starting") == 1 and "server_restart" not in names and "gpu_reset" not in names
    event = run.wait_event("server_gpu_incompatible")
    assert "unsupported toolchain" in event["line"] and "driver" in event["fix"]
    exit_event = run.wait_event("daemon_exit")
    assert "fix:" in exit_event["reason"] and "toolchain" in exit_event["reason"]


def test_recovered_allocation_failure_at_load_is_a_warning(fake: Any) -> None:
    run = fake("alloc_recovered").start()
    ready = run.wait_event("server_ready", 30)
    warning = run.wait_event("server_alloc_recovered")
    assert warning["server_pid"] == ready["server_pid"] and "cudaMalloc failed" in warning["line"]
    run.wait_event("server_probe", 30, where=lambda e: e["canary_ok"] is True)
    names = run.names()
    assert "server_oom" not in names and "server_stopped" not in names and "gpu_reset" not in names
    assert names.count("server_starting") == 1


def test_fatal_oom_at_load_is_still_caught(fake: Any) -> None:
    run = fake("oom_at_load", {"recovery": {"max_restarts": 1}}).start()
    oom = run.wait_event("server_oom", 30)
    assert "cudaMalloc failed" in oom["line"] and oom["phase"] == "loading"
    assert "server_alloc_recovered" not in run.names()
    assert run.wait_exit(60) == 75
