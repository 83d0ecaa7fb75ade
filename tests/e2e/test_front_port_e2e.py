"""End to end with the real llama-server: the front door's port held by another process at start
is named (pid, name) and retried within ``[recovery].port_wait_s`` as llama-server's port is — the
front door opens once the port is free, exit 78 naming the holder when it is not — and SIGTERM
during that wait stops the daemon at once."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from front_fixtures import served
from harness import DaemonRun, RunPool, free_port, hold_port

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]


@pytest.fixture
def pool() -> Iterator[RunPool]:
    runs = RunPool()
    yield runs
    assert runs.finish() == [], "a llama-server outlived its daemon"


def door(pool: RunPool, where: Path, binary: Path, model: Path, port_wait_s: float) -> tuple[DaemonRun, int]:
    front = free_port()
    run = pool.new(where, str(binary), str(model), {
        "front": {"listen": f"127.0.0.1:{front}"}, "recovery": {"port_wait_s": port_wait_s},
        "health": {"canary": False}})
    return run, front


def test_front_port_held_past_the_bound_is_78_naming_the_holder(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run, front = door(pool, tmp_path, llama_server_bin, real_model, 3.0)
    holder = hold_port(front, 120.0)
    try:
        run.start()
        assert run.wait_exit(60) == 78
        taken = run.wait_event("front_port_taken")
        assert f"pid {holder.pid}" in taken["holder"] and taken["listen"] == f"127.0.0.1:{front}", taken
        cause = run.wait_event("server_boot_failure")["cause"]
        assert f"pid {holder.pid} (python" in cause and "choose another [front].listen" in cause, cause
        assert "server_starting" not in run.names()
    finally:
        holder.kill()
        holder.wait()


def test_front_port_freed_within_the_bound_opens_the_front_door(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run, front = door(pool, tmp_path, llama_server_bin, real_model, 120.0)
    holder = hold_port(front, 120.0)
    try:
        run.start()
        run.wait_event("front_port_taken", 60)
    finally:
        holder.kill()
        holder.wait()
    run.wait_event("front_listening", 60)
    run.wait_event("server_ready", 120)
    assert served(front)


def test_sigterm_while_the_front_port_is_waited_for_stops_at_once(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run, front = door(pool, tmp_path, llama_server_bin, real_model, 600.0)
    holder = hold_port(front, 600.0)
    try:
        run.start()
        run.wait_event("front_port_taken", 60)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(30) == 0
        assert run.wait_event("daemon_exit")["exit_code"] == 0
        assert "server_starting" not in run.names()
    finally:
        holder.kill()
        holder.wait()
