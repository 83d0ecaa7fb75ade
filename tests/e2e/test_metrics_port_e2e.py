"""End to end with the real llama-server: the ``[metrics].listen`` port held by another process at start is
named (pid, name) and retried within ``[recovery].port_wait_s``, as the front door's and llama-server's ports
are — the listener opens once the port is free, exit 78 naming the holder when it is not (before: exit 78 at
once, no holder named, no wait) — and SIGTERM during that wait stops the daemon at once."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import DaemonRun, RunPool, free_port, hold_port

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]


@pytest.fixture
def pool() -> Iterator[RunPool]:
    runs = RunPool()
    yield runs
    assert runs.finish() == [], "a llama-server outlived its daemon"


def exporter(pool: RunPool, where: Path, binary: Path, model: Path, port_wait_s: float,
             front: bool = False) -> tuple[DaemonRun, int]:
    metrics = free_port()
    sections: dict[str, dict[str, object]] = {
        "metrics": {"listen": f"127.0.0.1:{metrics}"}, "recovery": {"port_wait_s": port_wait_s},
        "health": {"canary": False}}
    if front:
        sections["front"] = {"listen": f"127.0.0.1:{free_port()}"}
    return pool.new(where, str(binary), str(model), sections), metrics


def test_metrics_port_held_past_the_bound_is_78_naming_the_holder(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run, metrics = exporter(pool, tmp_path, llama_server_bin, real_model, 3.0)
    holder = hold_port(metrics, 120.0)
    try:
        run.start()
        assert run.wait_exit(60) == 78
        taken = run.wait_event("metrics_port_taken")
        assert f"pid {holder.pid}" in taken["holder"] and taken["listen"] == f"127.0.0.1:{metrics}", taken
        cause = run.wait_event("server_boot_failure")["cause"]
        assert f"pid {holder.pid} (python" in cause and "choose another [metrics].listen" in cause, cause
        assert "server_starting" not in run.names()
    finally:
        holder.kill()
        holder.wait()


def test_metrics_port_freed_within_the_bound_opens_the_listener(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    # With the front door on too (its own port free): the daemon waits for the exporter's port alone.
    run, metrics = exporter(pool, tmp_path, llama_server_bin, real_model, 120.0, front=True)
    holder = hold_port(metrics, 120.0)
    try:
        run.start()
        taken = run.wait_event("metrics_port_taken", 60)
        assert f"pid {holder.pid}" in taken["holder"], taken
    finally:
        holder.kill()
        holder.wait()
    run.wait_event("server_ready", 120)
    answer = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=10.0)
    assert answer.status_code == 200 and "llama_guard_server_ready 1.0" in answer.text


def test_sigterm_while_the_metrics_port_is_waited_for_stops_at_once(
        tmp_path: Path, pool: RunPool, llama_server_bin: Path, real_model: Path) -> None:
    run, metrics = exporter(pool, tmp_path, llama_server_bin, real_model, 600.0)
    holder = hold_port(metrics, 600.0)
    try:
        run.start()
        run.wait_event("metrics_port_taken", 60)
        run.signal(signal.SIGTERM)
        assert run.wait_exit(30) == 0
        assert run.wait_event("daemon_exit")["exit_code"] == 0
        assert "server_starting" not in run.names()
    finally:
        holder.kill()
        holder.wait()
