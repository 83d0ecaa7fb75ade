"""The front-door tests' shared pieces: a started daemon with the front door on, from a pool that
fails the test when a llama-server outlives its daemon; the bad-client tests' daemon (before the real
llama-server, canary off, slow liveness), its bounds, and "a normal client is served"."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RunPool, free_port, merge

FRONT = {"header_timeout_s": 2.0, "body_timeout_s": 2.0, "max_body_bytes": 65536,
         "max_buffered_bytes": 100_000, "hold_timeout_s": 60.0}


@contextlib.contextmanager
def daemon_pool() -> Iterator[RunPool]:
    """A :class:`RunPool` whose daemons must leave no llama-server behind (else the test fails)."""
    pool = RunPool()
    yield pool
    leftovers = pool.finish()
    if leftovers:
        pytest.fail(f"llama-server pids {leftovers} outlived their daemon")


def start_with_front(pool: RunPool, tmp_path: Path, llama_server_bin: Path, real_model: Path,
                     sections: dict[str, dict[str, object]]) -> Any:
    """A started daemon of ``pool`` with the front door on a free port (``sections``' ``[front]`` keys
    added to ``listen``) whose ``front`` is the clients' port and ``first`` the first server's pid."""
    port = free_port()
    run: Any = pool.new(tmp_path, str(llama_server_bin), str(real_model),
                        merge({"front": {"listen": f"127.0.0.1:{port}"}}, sections))
    run.front = port
    run.start()
    run.first = run.wait_event("server_ready", 60)["server_pid"]
    return run


@pytest.fixture
def door(tmp_path: Path, llama_server_bin: Path, real_model: Path) -> Iterator[Any]:
    """``make(front=None, extra=None)``: a started daemon whose ``front`` is the clients' port and
    ``first`` the first server's pid; ``extra`` sections are merged over the defaults."""
    with daemon_pool() as pool:
        def make(front: dict[str, object] | None = None, extra: dict[str, dict[str, object]] | None = None) -> Any:
            return start_with_front(pool, tmp_path, llama_server_bin, real_model, merge({
                "front": {**FRONT, **(front or {})},
                "health": {"canary": False, "interval_s": 1.0, "hang_strikes": 5, "timeout_s": 5.0}}, extra or {}))

        yield make


def metric(port: int, name: str) -> float:
    """The value of the series ``name`` (with its labels) on the exporter at ``port``; 0 when absent."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def wait_metric(port: int, name: str, value: float, timeout: float = 30.0) -> None:
    """Until the series ``name`` on the exporter at ``port`` reads ``value`` (a positive marker: the front door
    holds the requests a test just sent, or gave their places back); fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (now := metric(port, name)) != value:
        assert time.monotonic() < deadline, f"{name} = {now}, not {value}, after {timeout} s"
        time.sleep(0.05)


def served(port: int) -> bool:
    """A normal client is answered in full."""
    resp = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hi", "n_predict": 1}, timeout=120)
    return resp.status_code == 200 and resp.json()["tokens_predicted"] == 1


def read_all(sock: socket.socket) -> bytes:
    """Everything the front door sends until it closes the connection (``sock`` is closed then)."""
    out = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            out += chunk
    sock.close()
    return out
