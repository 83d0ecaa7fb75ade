"""End to end with the real llama-server: a port another process holds is named (pid, name) and
retried within ``[recovery].port_wait_s`` — a server that comes back once it is free, exit 78
naming the holder when it is not — and a server asked to offload that finds no GPU is reported
(``server_on_cpu``) with the GPU watch off."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import RunPool, hold_port

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]


@pytest.fixture
def pool() -> Iterator[RunPool]:
    runs = RunPool()
    yield runs
    assert runs.finish() == [], "a llama-server outlived its daemon"


def test_port_taken_after_a_kill_9_is_named_retried_and_the_server_comes_back(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run = pool.new(tmp_path, str(llama_server_bin), str(real_model),
                   {"recovery": {"port_wait_s": 60.0}, "health": {"canary": False}}).start()
    port = run.port  # type: ignore[attr-defined]
    first = int(run.wait_event("server_ready", 60)["server_pid"])
    # The daemon is frozen while its server is killed and another process takes the port.
    os.kill(run.pid, signal.SIGSTOP)
    os.kill(first, signal.SIGKILL)
    holder: subprocess.Popen[str] | None = None
    try:
        deadline = time.monotonic() + 10
        while holder is None and time.monotonic() < deadline:
            try:
                holder = hold_port(port, 6.0)
            except AssertionError:
                time.sleep(0.05)  # the killed server's socket is not gone yet
        assert holder is not None
        os.kill(run.pid, signal.SIGCONT)
        taken = run.wait_event("server_port_taken", 30)
        assert taken["holder_pid"] == holder.pid and taken["port"] == port, taken
        assert "python" in taken["holder_name"] and f"pid {holder.pid}" in taken["holder"], taken
        second = run.wait_event("server_ready", 60, skip=1)  # once the holder is gone
        assert int(second["server_pid"]) != first
        assert holder.wait(10) == 0
        names = run.names()
        assert "server_boot_failure" not in names and "crash_loop" not in names, names
    finally:
        os.kill(run.pid, signal.SIGCONT)
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait(10)
    run.signal(signal.SIGTERM)
    assert run.wait_exit(30) == 0


def test_port_held_past_the_bound_is_78_naming_the_holder(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run = pool.new(tmp_path, str(llama_server_bin), str(real_model), {"recovery": {"port_wait_s": 5.0}})
    holder = hold_port(run.port, 120.0)  # type: ignore[attr-defined]
    try:
        t0 = time.monotonic()
        run.start()
        assert run.wait_exit(60) == 78
        took = time.monotonic() - t0
        failure = run.wait_event("server_boot_failure")
        assert f"pid {holder.pid}" in failure["cause"] and "python" in failure["cause"], failure
        assert "choose another [server].port" in failure["cause"]
        assert run.wait_event("server_port_taken")["holder_pid"] == holder.pid
        starts = run.names().count("server_starting")
        assert starts >= 2, run.names()  # retried before the verdict
        assert took >= 5.0, took
        print(f"port held: {starts} starts, exit 78 after {took:.1f} s naming pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait(10)


def test_asked_to_offload_with_the_gpu_watch_off_on_a_host_without_gpu_is_reported(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run = pool.new(tmp_path, str(llama_server_bin), str(real_model),
                   {"server": {"n_gpu_layers": 99}, "gpu": {"enabled": "off"}}).start()
    on_cpu = run.wait_event("server_on_cpu", 60)
    assert on_cpu["n_gpu_layers"] == 99 and "no usable GPU" in on_cpu["line"], on_cpu
    run.wait_event("server_ready", 60)  # it serves, on the CPU
    assert run.names().count("server_on_cpu") == 1
    check = subprocess.run([sys.executable, "-m", "llama_guard", "check", "--config", str(run.config)],
                           capture_output=True, text=True, timeout=120, check=False)
    offload = [line for line in check.stdout.splitlines() if " offload " in f" {line} "]
    assert offload and offload[0].startswith("WARN"), check.stdout
    assert "n_gpu_layers = 99" in offload[0] and "CPU" in offload[0], offload
